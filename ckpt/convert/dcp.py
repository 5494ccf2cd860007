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

import bisect
import io
import math
import os
import pickle  # restricted to the allowlist below; see spec §S.6
import stat
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import FormatError, LimitExceededError, UnsafePathError
from ..format.dtypes import dtype_name, itemsize
from ..knobs import knobs
from ..format.manifest import is_sharded

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
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open below
        raise FormatError(".metadata is not a regular file", path=path)
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


# A chunk layout is checked on a grid of the chunks' own boundaries (one cell per distinct
# interval per dimension); above this many cells the layout is refused rather than checked
# slowly. DCP's planners cut tensors into per-rank boxes, so real layouts have about one
# cell per chunk.
_MAX_GRID_CELLS = 1 << 22


@dataclass(frozen=True, slots=True)
class _Item:
    """One stored value: the byte range ``[offset, offset + length)`` of a ``.distcp`` file."""

    fqn: str
    path: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: _Item


@dataclass(frozen=True, slots=True)
class _TensorPlan:
    fqn: str
    dtype: Any  # torch.dtype
    size: tuple[int, ...]
    chunks: tuple[_Chunk, ...]


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``import_dcp`` reads, checked whole before any tensor is allocated."""

    values: dict[str, _Item]
    tensors: dict[str, _TensorPlan]
    paths: dict[str, tuple[Any, ...]]
    order: tuple[str, ...]


def _dims(v: tuple[int, ...]) -> str:
    """A shape for a message: a 64-dimension one is not worth 64 numbers."""
    return str(list(v)) if len(v) <= 8 else f"[{', '.join(map(str, v[:6]))}, ... ({len(v)} dims)]"


def _ints(v: Any, what: str, md_path: str, fqn: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list, torch.Size)) or not all(type(x) is int for x in v):
        raise FormatError(f"{what} of {fqn!r} is {type(v).__name__} {v!r:.80}, not a sequence of integers",
                          path=md_path, key=fqn)
    return tuple(v)


def _storage_index(md: Any, md_path: str) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """``storage_data`` keyed by (fqn, chunk offsets), checked for shape before use: its keys
    are DCP ``MetadataIndex`` records whose fields the file chose."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    raw = md.storage_data
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise FormatError(f"DCP metadata storage_data is a {type(raw).__name__}, not a dict", path=md_path)
    out: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for k, info in raw.items():
        if not isinstance(k, MetadataIndex) or not isinstance(k.fqn, str):
            raise FormatError(f"DCP metadata storage_data has key {k!r:.80}, not a MetadataIndex", path=md_path)
        off = None if k.offset is None else _ints(k.offset, "storage offset", md_path, k.fqn)
        out[(k.fqn, off)] = info
    return out


def _item(src: str, md_path: str, info: Any, fqn: str, sizes: dict[str, int]) -> _Item:
    rel = getattr(info, "relative_path", None)
    if not isinstance(rel, str) or os.path.basename(rel) != rel or rel.startswith(".") or not rel:
        raise UnsafePathError(f"item {fqn!r} names file {rel!r:.80}", path=md_path, key=fqn)
    if getattr(info, "transform_descriptors", None):
        raise FormatError(f"item {fqn!r} uses storage transforms {info.transform_descriptors!r:.80}, not supported",
                          path=md_path, key=fqn)
    off, n = getattr(info, "offset", None), getattr(info, "length", None)
    if type(off) is not int or type(n) is not int:
        raise FormatError(f"item {fqn!r} has offset {off!r:.40} and length {n!r:.40}, not integers", path=md_path, key=fqn)
    fp = os.path.join(src, rel)
    if rel not in sizes:
        try:
            st = os.stat(fp)
        except OSError as e:
            raise FormatError(f"item {fqn!r} is in {rel}, which cannot be read: {e.strerror}", path=fp, key=fqn) from None
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"item {fqn!r} is in {rel}, which is not a regular file", path=fp, key=fqn)
        sizes[rel] = st.st_size
    size = sizes[rel]
    if off < 0 or n < 0 or off + n > size:
        raise FormatError(f"item {fqn!r} at [{off}, {off + n}) is outside {rel} ({size} bytes)", path=fp, key=fqn)
    return _Item(fqn, fp, off, n)


def _plan(src: str, md: Any) -> _Plan:
    """Check the whole of DCP's ``Metadata`` against the data files before anything is
    allocated: every field's type, every tensor's chunks in bounds, covering it exactly
    once (no gap, no overlap), each chunk's stored item at least as long as its elements,
    and no two items sharing bytes. Together these bound what the import allocates by
    the size of the ``.distcp`` files: a ``.metadata`` cannot declare more than the data holds."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md_path = os.path.join(src, ".metadata")
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        raise FormatError(f"DCP metadata state_dict_metadata is a {type(sdm).__name__}, not a dict", path=md_path)
    storage = _storage_index(md, md_path)
    planner = md.planner_data if md.planner_data is not None else {}
    if not isinstance(planner, dict):
        raise FormatError(f"DCP metadata planner_data is a {type(planner).__name__}, not a dict", path=md_path)
    sizes: dict[str, int] = {}
    values: dict[str, _Item] = {}
    tensors: dict[str, _TensorPlan] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    limits = knobs()
    for fqn, sm in sdm.items():
        if not isinstance(fqn, str):
            raise FormatError(f"DCP metadata names a value {fqn!r:.80}, not a string", path=md_path)
        kp = planner.get(fqn, (fqn,))
        if not isinstance(kp, (tuple, list)) or not kp or not all(type(x) in (str, int) for x in kp):
            raise FormatError(f"planner_data path of {fqn!r} is {kp!r:.80}, not a sequence of str/int keys",
                              path=md_path, key=fqn)
        paths[fqn] = tuple(kp)
        if isinstance(sm, BytesStorageMetadata):
            info = storage.get((fqn, None))
            if info is None:
                raise FormatError(f"value {fqn!r} has no storage entry", path=md_path, key=fqn)
            values[fqn] = _item(src, md_path, info, fqn, sizes)
            continue
        if not isinstance(sm, TensorStorageMetadata):
            raise FormatError(f"{fqn!r} is described by a {type(sm).__name__}, not tensor or bytes metadata",
                              path=md_path, key=fqn)
        dtype = getattr(sm.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise FormatError(f"tensor {fqn!r} has dtype {dtype!r:.80}, not a torch.dtype", path=md_path, key=fqn)
        try:
            elem = itemsize(dtype_name(dtype))
        except KeyError:
            raise FormatError(f"tensor {fqn!r} has dtype {dtype}, which a checkpoint cannot store",
                              path=md_path, key=fqn) from None
        size = _ints(sm.size, "size", md_path, fqn)
        if len(size) > limits.max_tensor_rank:
            raise LimitExceededError(f"tensor {fqn!r} has {len(size)} dimensions, above {limits.max_tensor_rank}",
                                     path=md_path, key=fqn)
        if any(d < 0 for d in size):
            raise FormatError(f"tensor {fqn!r} has size {_dims(size)}: negative", path=md_path, key=fqn)
        if not isinstance(sm.chunks, list):
            raise FormatError(f"chunks of {fqn!r} are a {type(sm.chunks).__name__}, not a list", path=md_path, key=fqn)
        chunks = []
        for c in sm.chunks:
            off = _ints(getattr(c, "offsets", None), "chunk offsets", md_path, fqn)
            ext = _ints(getattr(c, "sizes", None), "chunk sizes", md_path, fqn)
            if len(off) != len(size) or len(ext) != len(size) or any(
                    o < 0 or n < 0 or o + n > d for o, n, d in zip(off, ext, size)):
                raise FormatError(f"chunk at {_dims(off)} (sizes {_dims(ext)}) of {fqn!r} is outside its size {_dims(size)}",
                                  path=md_path, key=fqn)
            info = storage.get((fqn, off))
            if info is None:
                raise FormatError(f"chunk {_dims(off)} of {fqn!r} has no storage entry", path=md_path, key=fqn)
            item = _item(src, md_path, info, fqn, sizes)
            need = math.prod(ext) * elem
            if item.length < need:  # torch.save stores a tensor's elements uncompressed
                raise FormatError(f"chunk {_dims(off)} of {fqn!r} declares {need} bytes of elements; its item holds "
                                  f"{item.length}", path=item.path, key=fqn)
            chunks.append(_Chunk(off, ext, item))
        _check_cover(fqn, size, chunks, md_path)
        tensors[fqn] = _TensorPlan(fqn, dtype, size, tuple(chunks))
    _check_disjoint([*values.values(), *(c.item for t in tensors.values() for c in t.chunks)])
    return _Plan(values, tensors, paths, tuple(sdm))


def _check_cover(fqn: str, size: tuple[int, ...], chunks: list[_Chunk], md_path: str) -> None:
    """Every element of the tensor lies in exactly one chunk, else a FormatError naming the
    tensor and the offsets of the first cell left out or held twice."""
    if math.prod(size) == 0:
        return  # no element to cover; chunks were checked to lie inside
    bounds = [sorted({0, d, *(c.offsets[i] for c in chunks), *(c.offsets[i] + c.sizes[i] for c in chunks)})
              for i, d in enumerate(size)]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > _MAX_GRID_CELLS:
        raise LimitExceededError(f"chunk layout of {fqn!r} has {cells} cells to check, above {_MAX_GRID_CELLS}",
                                 path=md_path, key=fqn)
    count = torch.zeros([len(b) - 1 for b in bounds], dtype=torch.int32)
    for c in chunks:
        if math.prod(c.sizes) == 0:
            continue
        sel = tuple(slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + n)) for b, o, n in zip(bounds, c.offsets, c.sizes))
        count[sel] += 1

    def corner(cell: list[int]) -> tuple[list[int], list[int]]:
        return [b[i] for b, i in zip(bounds, cell)], [b[i + 1] - b[i] for b, i in zip(bounds, cell)]

    twice = (count > 1).nonzero()
    if len(twice):
        at, ext = corner(twice[0].tolist())
        holders = [list(c.offsets) for c in chunks
                   if all(o <= a < o + n for o, n, a in zip(c.offsets, c.sizes, at))]
        raise FormatError(f"chunks {holders[0]} and {holders[1]} of {fqn!r} overlap at offsets {at} (extent {ext})",
                          path=md_path, key=fqn)
    gap = (count == 0).nonzero()
    if len(gap):
        at, ext = corner(gap[0].tolist())
        raise FormatError(f"no chunk of {fqn!r} covers offsets {at} (extent {ext}); the import would write "
                          f"uninitialised memory there", path=md_path, key=fqn)


def _check_disjoint(items: list[_Item]) -> None:
    """No two stored values share bytes: otherwise one small file could be declared as
    many values, and the import would write more than the source holds."""
    last: _Item | None = None
    for it in sorted((i for i in items if i.length), key=lambda i: (i.path, i.offset)):
        if last is not None and last.path == it.path and it.offset < last.offset + last.length:
            raise FormatError(f"items {last.fqn!r} at [{last.offset}, {last.offset + last.length}) and {it.fqn!r} at "
                              f"[{it.offset}, {it.offset + it.length}) share bytes of {os.path.basename(it.path)}",
                              path=it.path, key=it.fqn)
        last = it


def _load_item(item: _Item) -> Any:
    with open(item.path, "rb") as f:
        f.seek(item.offset)
        data = f.read(item.length)
    if len(data) != item.length:
        raise FormatError(f"item {item.fqn!r} at [{item.offset}, {item.offset + item.length}) was cut short while read",
                          path=item.path, key=item.fqn)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's restricted loader raises many types on bad bytes
        raise FormatError(f"item {item.fqn!r} does not load: {type(e).__name__}: {str(e)[:200]}",
                          path=item.path, key=item.fqn) from None


def _nest(flat: dict[str, Any], paths: dict[str, Any]) -> dict[str, Any]:
    from .._unshard import _set

    out: dict[Any, Any] = {}
    for fqn, v in flat.items():
        _set(out, tuple(paths.get(fqn, (fqn,))), v, fqn)
    return out


def import_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
               progress: Callable[[int, int], None] | None = None) -> Any:
    """Convert a DCP checkpoint into ours (one part, global tensors). Returns CheckpointInfo.

    The whole ``.metadata`` is checked against the data files first (``_plan``): a gap or
    an overlap in a tensor's chunks, or a size the data files cannot hold, is a
    ``FormatError`` naming the tensor, before anything is allocated or written.
    ``progress(done, total)`` counts the values read (then one more for the write)."""
    import torch.distributed.checkpoint as dcp

    from ..dcp.planner import SavePlanner
    from ..dcp.storage import StorageWriter

    src = os.path.abspath(os.fspath(src))
    plan = _plan(src, read_dcp_metadata(src))
    flat: dict[str, Any] = {}
    n_items = len(plan.order) + 1
    for i, fqn in enumerate(plan.order):
        if progress is not None:
            progress(i, n_items)
        if fqn in plan.values:
            flat[fqn] = _load_item(plan.values[fqn])
            continue
        tp = plan.tensors[fqn]
        out = torch.empty(tp.size, dtype=tp.dtype)  # every element is written below: _check_cover
        for c in tp.chunks:
            t = _load_item(c.item)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != c.sizes or t.dtype != tp.dtype:
                got = f"a {t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
                raise FormatError(f"chunk {list(c.offsets)} of {fqn!r} is {got}, not {tp.dtype} of shape {list(c.sizes)}",
                                  path=c.item.path, key=fqn)
            dst_view = out
            for dim, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                dst_view = dst_view.narrow(dim, o, n)
            dst_view.copy_(t)
        flat[fqn] = out
    writer = StorageWriter(dst, overwrite=overwrite, rng=False, meta={"imported_from": {"format": "dcp", "path": src}})
    dcp.save(_nest(flat, plan.paths), storage_writer=writer, planner=SavePlanner(), no_dist=True)
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
