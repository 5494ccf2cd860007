"""Converting between DCP's own checkpoints (``.metadata`` + ``*.distcp``) and ours.

``import_dcp``: DCP's ``.metadata`` is a pickle. It is read by a restricted unpickler
that resolves only DCP's metadata classes, ``torch.Size``, dtypes and a few builtins
(spec/sharded-format.md §S.6); anything else is a ``FormatError`` and no code from the
file runs. The ``.distcp`` items DCP's writer produced with ``torch.save`` (one per
tensor chunk or value) are read with ``torch.load(weights_only=True)``, torch's own
restricted loader. The result is written as a one-part sharded checkpoint of ours
(global tensors whole), which any world size loads with resharding.

``export_dcp``: writes the global state of one of our checkpoints with DCP's default
``FileSystemWriter``, so ``dcp.load`` with its default reader reads it.
"""

from __future__ import annotations

import io
import os
import pickle  # restricted to the allowlist below; see spec §S.6
from typing import Any, Callable

import torch

from ..errors import FormatError, LimitExceededError, UnsafePathError
from .layout import is_sharded

__all__ = ["read_dcp_metadata", "import_dcp", "export_dcp", "ALLOWED_GLOBALS"]

_MAX_METADATA = 256 << 20

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [(m, n) for m in ("torch.distributed.checkpoint.metadata",) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch", "strided"),
       ("torch", "contiguous_format"), ("collections", "OrderedDict"), ("builtins", "set"),
       ("builtins", "frozenset"), ("builtins", "slice"), ("copyreg", "_reconstructor"), ("builtins", "object"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")]
)


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as torch.<name>
        raise FormatError(f"DCP metadata refers to {module}.{name}, which the restricted reader does not allow", path=self._path)

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError("DCP metadata holds a persistent reference; refused", path=self._path)


def read_dcp_metadata(src: str | os.PathLike[str]) -> Any:
    """DCP's ``Metadata`` from ``src/.metadata``, through the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(os.fspath(src), ".metadata")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FormatError("not a DCP checkpoint: no .metadata", path=path) from None
    if st.st_size > _MAX_METADATA:
        raise LimitExceededError(f".metadata is {st.st_size} bytes, above {_MAX_METADATA}", path=path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        md = _Restricted(data, path).load()
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle
        raise FormatError(f"DCP metadata does not decode: {type(e).__name__}: {e}", path=path) from None
    if not isinstance(md, Metadata):
        raise FormatError(f"DCP metadata is a {type(md).__name__}, not Metadata", path=path)
    return md


def _item_bytes(src: str, info: Any, fqn: str) -> bytes:
    rel = getattr(info, "relative_path", None)
    if not isinstance(rel, str) or os.path.basename(rel) != rel or rel.startswith(".") or not rel:
        raise UnsafePathError(f"item {fqn!r} names file {rel!r}", path=src, key=fqn)
    if getattr(info, "transform_descriptors", None):
        raise FormatError(f"item {fqn!r} uses storage transforms {info.transform_descriptors}, not supported", path=src, key=fqn)
    fp = os.path.join(src, rel)
    size = os.path.getsize(fp)
    off, n = int(info.offset), int(info.length)
    if off < 0 or n < 0 or off + n > size:
        raise FormatError(f"item {fqn!r} at [{off}, {off + n}) is outside {rel} ({size} bytes)", path=fp, key=fqn)
    with open(fp, "rb") as f:
        f.seek(off)
        return f.read(n)


def _nest(flat: dict[str, Any], paths: dict[str, Any]) -> dict[str, Any]:
    from .full import _set

    out: dict[Any, Any] = {}
    for fqn, v in flat.items():
        _set(out, tuple(paths.get(fqn, (fqn,))), v, fqn)
    return out


def import_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
               progress: Callable[[int, int], None] | None = None) -> Any:
    """Convert a DCP checkpoint into ours (one part, global tensors). Returns CheckpointInfo.

    ``progress(done, total)`` counts the values read (then one more for the write)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from .planner import SavePlanner
    from .storage import StorageWriter

    src = os.path.abspath(os.fspath(src))
    md = read_dcp_metadata(src)
    storage = md.storage_data or {}
    flat: dict[str, Any] = {}
    n_items = len(md.state_dict_metadata) + 1
    for i, (fqn, sm) in enumerate(md.state_dict_metadata.items()):
        if progress is not None:
            progress(i, n_items)
        if isinstance(sm, BytesStorageMetadata):
            info = storage.get(MetadataIndex(fqn))
            if info is None:
                raise FormatError(f"value {fqn!r} has no storage entry", path=src, key=fqn)
            flat[fqn] = torch.load(io.BytesIO(_item_bytes(src, info, fqn)), weights_only=True)
            continue
        out = torch.empty(tuple(sm.size), dtype=sm.properties.dtype)
        for c in sm.chunks:
            info = storage.get(MetadataIndex(fqn, c.offsets))
            if info is None:
                raise FormatError(f"chunk {list(c.offsets)} of {fqn!r} has no storage entry", path=src, key=fqn)
            t = torch.load(io.BytesIO(_item_bytes(src, info, fqn)), weights_only=True)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(c.sizes):
                raise FormatError(f"chunk {list(c.offsets)} of {fqn!r} is not a tensor of shape {list(c.sizes)}", path=src, key=fqn)
            dst_view = out
            for dim, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                dst_view = dst_view.narrow(dim, o, n)
            dst_view.copy_(t)
        flat[fqn] = out
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    writer = StorageWriter(dst, overwrite=overwrite, rng=False, meta={"imported_from": {"format": "dcp", "path": src}})
    dcp.save(_nest(flat, paths), storage_writer=writer, planner=SavePlanner(), no_dist=True)
    if progress is not None:
        progress(n_items, n_items)
    from ..reader import CheckpointReader
    from ..writer import CheckpointInfo

    r = CheckpointReader(writer.path)
    return CheckpointInfo(r.path, r.manifest.id, r.manifest.step, r.manifest.total_bytes, r.manifest)


def export_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
               progress: Callable[[int, int], None] | None = None) -> None:
    """Write the global state of our checkpoint ``src`` as a DCP checkpoint at ``dst``.

    ``progress(done, total)``: entries read, then one more for the write."""
    import torch.distributed.checkpoint as dcp

    from ..reader import CheckpointReader

    if os.path.exists(dst) and os.listdir(dst):
        from ..errors import CheckpointExistsError

        raise CheckpointExistsError("the destination exists and is not empty", path=os.fspath(dst))
    r = CheckpointReader(src)
    if progress is None or is_sharded(r.manifest) or len(r.parts) > 1:
        state = r.state()  # sharded: one global read
    else:
        names = r.entries()
        state = {}
        for i, name in enumerate(names):  # entry by entry, so that a bar moves
            progress(i, len(names) + 1)
            state[name] = r.state(name)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(dst)), no_dist=True)
    if progress is not None:
        progress(1, 1)
