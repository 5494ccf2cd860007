"""Saved tensors as fresh torch tensors: lazy reads, whole parts, mmap-backed parts.

The torch side of ``CheckpointReader.tensor`` and ``CheckpointReader.state``. It takes
the reader as an argument and imports nothing from ``reader``, so the reader can import
it lazily without an import cycle; the in-place load (``_torchio``) builds on it.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Mapping, Protocol

import torch

from ._statecheck import PartSource, replica_target
from .errors import FormatError, SizeMismatchError
from .format import dtypes
from .format.manifest import FileEntry, PartEntry, TensorEntry
from .format.tree import DeviceRef, DtypeRef, TensorRef
from .writer import tensor_memoryview

__all__ = ["read_tensor", "materialize_state", "resolve", "empty_for", "place", "TensorSource"]


class TensorSource(PartSource, Protocol):
    """The reading half of ``CheckpointReader`` that materialisation uses."""

    def read_tensor_bytes_into(self, pe: PartEntry, t: TensorEntry, dst: memoryview, *, verify: bool = True) -> None: ...

    def stream_part_into(self, pe: PartEntry, destinations: Any, *, verify: bool = True, handle: Any = None) -> None: ...

    def open_tensor_file(self, pe: PartEntry, *, reread: bool = False) -> tuple[Any, FileEntry] | None: ...

    def verify_bytes(self, f: FileEntry, data: Any) -> None: ...


def empty_for(t: TensorEntry) -> torch.Tensor:
    # Plain allocation. Advising transparent huge pages was tried and measured: in a
    # fresh process it made loads 3-4x slower (THP allocation and compaction cost).
    return torch.empty(t.shape, dtype=dtypes.torch_dtype(t.dtype))


def place(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    if map_location is None:
        return t
    if callable(map_location):
        return map_location(t)
    return t.to(map_location)


def read_tensor(reader: TensorSource, pe: PartEntry, t: TensorEntry, *, map_location: Any, verify: bool) -> torch.Tensor:
    out = empty_for(t)
    reader.read_tensor_bytes_into(pe, t, tensor_memoryview(out), verify=verify)
    return place(out, map_location)


def resolve(obj: Any, tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    """Replace the decoded placeholders of a saved tree with tensors, dtypes and devices."""
    if isinstance(obj, TensorRef):
        try:
            return tensors[obj.key]
        except KeyError:
            raise FormatError("structure refers to a tensor the manifest does not list", path=path, key=obj.key) from None
    if isinstance(obj, DtypeRef):
        try:
            return dtypes.torch_dtype(obj.name)
        except KeyError:
            raise FormatError(f"unknown dtype {obj.name!r}", path=path) from None
    if isinstance(obj, DeviceRef):
        try:
            return torch.device(obj.device)
        except RuntimeError as e:
            raise FormatError(f"invalid device string {obj.device[:80]!r}: {e}", path=path) from None
    if isinstance(obj, dict):
        return {k: resolve(v, tensors, path) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v, tensors, path) for v in obj]
    if isinstance(obj, tuple):
        return tuple(resolve(v, tensors, path) for v in obj)
    return obj


def _stream_fresh(reader: TensorSource, pe: PartEntry, verify: bool) -> dict[str, torch.Tensor]:
    fresh: dict[str, torch.Tensor] = {}

    def dest(t: TensorEntry) -> memoryview:
        out = empty_for(t)
        fresh[t.key] = out
        return tensor_memoryview(out)

    reader.stream_part_into(pe, dest, verify=verify)
    return fresh


def _mmap_fresh(reader: TensorSource, pe: PartEntry, verify: bool) -> dict[str, torch.Tensor]:
    """Tensors backed by a private (copy-on-write) mapping of the tensor file.

    No copy and no first-touch of anonymous memory: pages come from the page cache as
    they are used. Verification still hashes every byte before anything is returned.
    Writes to the tensors stay private to this process. The caller must not truncate
    or rewrite the file while the tensors live (ckpt never rewrites a committed file);
    a truncated mapping faults with SIGBUS, which is why this path is opt-in.
    """
    opened = reader.open_tensor_file(pe)  # checks the safetensors header against the manifest
    if opened is None:
        return {}
    handle, f = opened
    fileno = getattr(handle, "fileno", None)
    if fileno is None:
        # Not a local file (an object store): nothing to map; read it into memory.
        handle.close()
        return _stream_fresh(reader, pe, verify)
    try:
        fd = fileno()
        size = os.fstat(fd).st_size
        if size != f.size:
            raise SizeMismatchError(
                f"file is {size} bytes, manifest says {f.size}", path=os.path.join(reader.path, f.name), offset=min(size, f.size)
            )
        mm = mmap.mmap(fd, f.size, access=mmap.ACCESS_COPY) if f.size else None
    finally:
        handle.close()
    if mm is None:
        return {t.key: empty_for(t) for t in pe.tensors}
    if verify:
        reader.verify_bytes(f, memoryview(mm))
    base = torch.frombuffer(mm, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for t in pe.tensors:
        dt = dtypes.torch_dtype(t.dtype)
        size_ = dtypes.itemsize(t.dtype)
        view = None
        if t.nbytes and t.offset % size_ == 0:
            try:
                view = base[t.offset : t.offset + t.nbytes].view(dt).view(t.shape)
            except RuntimeError:
                view = None  # a dtype torch cannot view bytes as: copy instead
        if view is None:
            view = empty_for(t)
            if t.nbytes:
                tensor_memoryview(view)[:] = memoryview(mm)[t.offset : t.offset + t.nbytes]
        out[t.key] = view
    return out


def materialize_state(
    reader: TensorSource, pe: PartEntry, *, map_location: Any, verify: bool, mmap: bool = False
) -> dict[str, Any]:
    tree = reader.tree(pe.name, verify=verify)
    cache: dict[str, dict[str, torch.Tensor]] = {}
    fetch = _mmap_fresh if mmap else _stream_fresh

    def tensors_of(p: PartEntry) -> dict[str, torch.Tensor]:
        if p.name not in cache:
            cache[p.name] = {k: place(v, map_location) for k, v in fetch(reader, p, verify).items()}
        return cache[p.name]

    out = {}
    for name, saved in tree["state"].items():
        src, saved = replica_target(reader, pe, name, saved, verify=verify)
        out[name] = resolve(saved, tensors_of(src), reader.path)
    return out
