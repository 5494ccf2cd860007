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
from ._tensorbytes import tensor_memoryview

__all__ = ["read_tensor", "materialize_state", "materialize_entry", "resolve_lazily", "resolve", "empty_for", "place", "TensorSource"]


class TensorSource(PartSource, Protocol):
    """The reading half of ``CheckpointReader`` that materialisation uses."""

    def read_tensor_bytes_into(
        self, pe: PartEntry, t: TensorEntry, dst: memoryview, *, verify: bool = True, fd: int | None = None
    ) -> None: ...

    def read_tensors_into(self, pe: PartEntry, items: list[tuple[TensorEntry, memoryview]], *, verify: bool = True) -> None: ...

    def stream_part_into(self, pe: PartEntry, destinations: Any, *, verify: bool = True, handle: Any = None) -> None: ...

    def stream_file_into(
        self, pe: PartEntry, index: int, destinations: Any, *, verify: bool = True, handle: Any = None
    ) -> None: ...

    def open_data_file(self, pe: PartEntry, index: int, *, reread: bool = False) -> Any: ...

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


def _stream_fresh(reader: TensorSource, pe: PartEntry, verify: bool, index: int | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the part (or of its data file ``index``) read into fresh memory."""
    fresh: dict[str, torch.Tensor] = {}

    def dest(t: TensorEntry) -> memoryview:
        out = empty_for(t)
        fresh[t.key] = out
        return tensor_memoryview(out)

    if index is None:
        reader.stream_part_into(pe, dest, verify=verify)
    else:
        reader.stream_file_into(pe, index, dest, verify=verify)
    return fresh


def _mmap_fresh(reader: TensorSource, pe: PartEntry, verify: bool) -> dict[str, torch.Tensor]:
    """Tensors backed by a private (copy-on-write) mapping of each safetensors file.

    No copy and no first-touch of anonymous memory: pages come from the page cache as
    they are used. Verification still hashes every byte before anything is returned.
    Writes to the tensors stay private to this process. The caller must not truncate
    or rewrite the file while the tensors live (ckpt never rewrites a committed file);
    a truncated mapping faults with SIGBUS, which is why this path is opt-in. Packed
    tensors (format 2.0) are decoded into fresh memory: there are no values to map.
    """
    out: dict[str, torch.Tensor] = {}
    for index in pe.data_files():
        f = pe.files[index]
        entries = pe.tensors_in(index)
        if f.role == "packed":
            for t in entries:
                out[t.key] = read_tensor(reader, pe, t, map_location=None, verify=verify)
            continue
        handle = reader.open_data_file(pe, index)  # checks the safetensors header against the manifest
        fileno = getattr(handle, "fileno", None)
        if fileno is None:
            # Not a local file (an object store): nothing to map; read it into memory.
            handle.close()
            out.update(_stream_fresh(reader, pe, verify, index))
            continue
        try:
            fd = fileno()
            size = os.fstat(fd).st_size
            if size != f.size:
                raise SizeMismatchError(
                    f"file is {size} bytes, manifest says {f.size}", path=os.path.join(reader.path, f.name),
                    offset=min(size, f.size)
                )
            mm = mmap.mmap(fd, f.size, access=mmap.ACCESS_COPY) if f.size else None
        finally:
            handle.close()
        if mm is None:
            out.update({t.key: empty_for(t) for t in entries})
            continue
        if verify:
            reader.verify_bytes(f, memoryview(mm))
        base = torch.frombuffer(mm, dtype=torch.uint8)
        for t in entries:
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


def _refs(obj: Any) -> list[str]:
    """The tensor keys a saved subtree refers to, in document order (duplicates once)."""
    seen: dict[str, None] = {}
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, TensorRef):
            seen.setdefault(v.key)
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
    return list(seen)


def resolve_lazily(reader: TensorSource, pe: PartEntry, saved: Any, *, map_location: Any = None, verify: bool = True) -> Any:
    """``saved`` with its tensors read one by one (only the chunks each overlaps)."""
    by_key = {t.key: t for t in pe.tensors}
    tensors: dict[str, torch.Tensor] = {}
    items = []
    for key in _refs(saved):
        t = by_key.get(key)
        if t is None:
            raise FormatError("structure refers to a tensor the manifest does not list", path=reader.path, key=key)
        tensors[key] = empty_for(t)
        items.append((t, tensor_memoryview(tensors[key])))
    reader.read_tensors_into(pe, items, verify=verify)  # each chunk read and hashed once
    return resolve(saved, {k: place(v, map_location) for k, v in tensors.items()}, reader.path)


def materialize_entry(
    reader: TensorSource, pe: PartEntry, name: str, *, map_location: Any, verify: bool, mmap: bool = False
) -> Any:
    """One top-level entry as saved (a module's plain ``state_dict``): only its tensors are read."""
    state = reader.tree(pe.name, verify=verify)["state"]
    if name not in state:
        raise FormatError(f"no entry {name!r} in this checkpoint (it has {sorted(state)})", path=reader.path, key=name)
    src, saved = replica_target(reader, pe, name, state[name], verify=verify)
    keys = _refs(saved)
    if mmap or (keys and len(keys) == len(src.tensors)):
        # the entry is the whole tensor file (or a mapping was asked for): one pass
        fetch = _mmap_fresh if mmap else _stream_fresh
        return resolve(saved, {k: place(v, map_location) for k, v in fetch(reader, src, verify).items()}, reader.path)
    return resolve_lazily(reader, src, saved, map_location=map_location, verify=verify)
