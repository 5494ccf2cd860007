"""Saved tensors as fresh torch tensors: lazy reads, whole parts, mmap-backed parts.

The torch side of ``CheckpointReader.tensor`` and ``CheckpointReader.state``. It takes
the reader as an argument and imports nothing from ``reader``, so the reader can import
it lazily without an import cycle; the in-place load (``_load``) builds on it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Protocol, Sequence

import torch

from ._gc import paused as gc_paused
from ._ranges import verify_view
from ._statecheck import PartSource, replica_target
from .errors import FormatError, SizeMismatchError, UnprotectedMappingError
from .format import dtypes
from .format.manifest import FileEntry, PartEntry, TensorEntry
from .format.tree import DeviceRef, DtypeRef, TensorRef
from ._tensorbytes import tensor_memoryview

__all__ = ["read_tensor", "materialize_state", "materialize_entry", "fresh_tensors", "resolve_lazily", "resolve", "empty_for", "place", "TensorSource"]


class TensorSource(PartSource, Protocol):
    """The reading half of ``CheckpointReader`` that materialisation uses."""

    def read_tensor_bytes_into(
        self, pe: PartEntry, t: TensorEntry, dst: memoryview, *, verify: bool = True, handle: Any = None
    ) -> None: ...

    def check_file(
        self, pe: PartEntry, index: int, keys: set[str] | None = None, *, verify: bool = True, handle: Any = None
    ) -> int: ...

    def read_tensors_into(self, pe: PartEntry, items: list[tuple[TensorEntry, memoryview]], *, verify: bool = True) -> None: ...

    def stream_part_into(self, pe: PartEntry, destinations: Any, *, verify: bool = True, handle: Any = None) -> None: ...

    def stream_file_into(
        self, pe: PartEntry, index: int, destinations: Any, *, verify: bool = True, handle: Any = None
    ) -> None: ...

    def open_data_file(self, pe: PartEntry, index: int, *, reread: bool = False) -> Any: ...

    def open_tensor_file(self, pe: PartEntry, *, reread: bool = False) -> tuple[Any, FileEntry] | None: ...

    def verify_bytes(self, f: FileEntry, data: Any, *, first: int = 0) -> None: ...


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
        return _device(obj.device, path)
    if isinstance(obj, dict):
        # keys too: a dtype, a device or a tensor may be a map key (spec §7.3), and must
        # reach the caller as itself, never as the decoder's placeholder
        return {resolve(k, tensors, path): resolve(v, tensors, path) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v, tensors, path) for v in obj]
    if isinstance(obj, tuple):
        return tuple(resolve(v, tensors, path) for v in obj)
    return obj


def _device(text: str, path: str) -> torch.device:
    """``torch.device(text)``, refusing what torch would not give back as written: its
    index is a signed 8-bit integer, so ``cuda:128`` became ``cuda:-128`` and a larger
    index was dropped (spec §7.3 bounds the index to 0..127)."""
    try:
        dev = torch.device(text)
    except RuntimeError as e:
        raise FormatError(f"invalid device string {text[:80]!r}: {e}", path=path) from None
    want = int(text.partition(":")[2]) if ":" in text else None
    if dev.index != want:
        raise FormatError(f"device {text[:80]!r} reads back as {str(dev)!r}: torch cannot hold its index", path=path)
    return dev


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


def _mapped_fresh(reader: TensorSource, pe: PartEntry, verify: bool, mode: bool | None, unsafe: bool) -> dict[str, torch.Tensor]:
    """Tensors backed by private (copy-on-write) mappings of the part's safetensors files.

    No copy and no first touch of anonymous memory: the tensors use the page-cache
    pages that already hold the bytes, and a page is copied only when it is written.
    Verification hashes every byte, on two threads, before anything is returned.

    A file is mapped only under a read lease, which keeps an in-place overwrite or a
    truncation of the file from ever reaching the tensors (``ckpt.storage._lease``,
    spec §11.1). Where no lease can be taken: ``mode=None`` (the default load) reads the
    file into fresh memory instead, ``mode=True`` refuses (``UnprotectedMappingError``),
    and ``unsafe`` maps it unprotected (the caller's promise: nobody writes or truncates
    the file while the tensors live). Packed tensors (format 2.0) are decoded into fresh
    memory: there are no values to map; so is a file that is not local (an object
    store), where nothing can change under the tensors.
    """
    out: dict[str, torch.Tensor] = {}
    for index in pe.data_files():
        f = pe.files[index]
        entries = pe.tensors_in(index)
        if f.role == "packed":
            # One pass over the file (each byte read and hashed once, decoded on the
            # hashing thread while the next piece is read; read ahead on an object
            # store), not a ranged read and a decode per tensor one after the other.
            out.update(_stream_fresh(reader, pe, verify, index))
            continue
        handle = reader.open_data_file(pe, index)  # checks the safetensors header against the manifest
        path = os.path.join(reader.path, f.name)
        mm = None
        try:
            if handle.mappable and f.size:
                size = handle.size()
                if size != f.size:
                    raise SizeMismatchError(f"file is {size} bytes, manifest says {f.size}", path=path, offset=min(size, f.size))
                mm = handle.map_private(f.size, require_lease=not unsafe)
                if mm is None and mode is True:
                    raise UnprotectedMappingError(
                        "mmap=True, but no read lease can be taken on this file (another user's file, a filesystem "
                        "without leases, the file open for writing, the lease signal in use, or a first load off the "
                        "main thread): a mapping would change with an in-place overwrite and fault on a truncation. "
                        "Use mmap=None to read into fresh memory here, or unsafe_mmap=True to map it anyway",
                        path=path,
                    )
        finally:
            handle.close()
        if mm is None:
            out.update(_stream_fresh(reader, pe, verify, index))
            continue
        mv = memoryview(mm)
        if verify:
            _verify_parallel(reader, f, mv, entries)
        for t in entries:
            dt = dtypes.torch_dtype(t.dtype)
            item = dtypes.itemsize(t.dtype)
            if t.nbytes and t.offset % item == 0:
                # Each tensor gets its own storage of exactly its bytes (torch.save of one
                # of them writes that tensor, not the whole file); all keep the mapping alive.
                out[t.key] = torch.frombuffer(mm, dtype=dt, count=t.nbytes // item, offset=t.offset).view(t.shape)
                continue
            view = empty_for(t)
            if t.nbytes:  # not aligned for its dtype (not written by us): a copy
                tensor_memoryview(view)[:] = mv[t.offset : t.offset + t.nbytes]
            out[t.key] = view
    return out


_PARALLEL_VERIFY_MIN = 32 << 20


def _verify_parallel(reader: TensorSource, f: FileEntry, mv: memoryview, entries: Sequence[TensorEntry]) -> None:
    """Check every chunk of the mapped file ``mv`` and the recorded digests of ``entries``
    (``ckpt._ranges.verify_view``)."""
    verify_view(os.path.join(reader.path, f.name), f, mv, entries, parallel_min=_PARALLEL_VERIFY_MIN)


def check_mmap_options(mmap: bool | None, unsafe_mmap: bool) -> None:
    if unsafe_mmap and mmap is False:
        raise ValueError("unsafe_mmap=True maps the file; it contradicts mmap=False")


def fresh_tensors(
    reader: TensorSource, pe: PartEntry, *, verify: bool, mmap: bool | None = None, unsafe_mmap: bool = False
) -> dict[str, torch.Tensor]:
    """Every tensor of part ``pe`` in new memory of this process, by key.

    ``mmap``: ``None`` (default) a lease-protected private mapping where one can be
    taken, else a read into fresh tensors; ``False`` always the read; ``True`` the
    lease-protected mapping or ``UnprotectedMappingError``. ``unsafe_mmap``: a mapping
    even without a lease. Either way every chunk is verified unless ``verify`` is false,
    and nothing is returned before it is.
    """
    check_mmap_options(mmap, unsafe_mmap)
    if mmap is False:
        return _stream_fresh(reader, pe, verify)
    return _mapped_fresh(reader, pe, verify, mmap, unsafe_mmap)


def materialize_state(
    reader: TensorSource, pe: PartEntry, *, map_location: Any, verify: bool, mmap: bool | None = None, unsafe_mmap: bool = False
) -> dict[str, Any]:
    check_mmap_options(mmap, unsafe_mmap)
    with gc_paused():  # thousands of small objects, no cycles (ckpt._gc)
        return _materialize_state(reader, pe, map_location=map_location, verify=verify, mmap=mmap, unsafe_mmap=unsafe_mmap)


def _materialize_state(
    reader: TensorSource, pe: PartEntry, *, map_location: Any, verify: bool, mmap: bool | None, unsafe_mmap: bool
) -> dict[str, Any]:
    tree = reader.tree(pe.name, verify=verify)
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def tensors_of(p: PartEntry) -> dict[str, torch.Tensor]:
        # (A mapping is also the cheapest source for a map_location that copies the
        # tensors elsewhere: the copy reads the page cache, allocating nothing here.)
        if p.name not in cache:
            got = fresh_tensors(reader, p, verify=verify, mmap=mmap, unsafe_mmap=unsafe_mmap)
            cache[p.name] = {k: place(v, map_location) for k, v in got.items()}
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
            for k, x in reversed(list(v.items())):
                stack.append(x)
                stack.append(k)  # a tensor may be a key
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
    reader: TensorSource, pe: PartEntry, name: str, *, map_location: Any, verify: bool, mmap: bool | None = None,
    unsafe_mmap: bool = False,
) -> Any:
    """One top-level entry as saved (a module's plain ``state_dict``): only its tensors are read."""
    check_mmap_options(mmap, unsafe_mmap)
    state = reader.tree(pe.name, verify=verify)["state"]
    if name not in state:
        raise FormatError(f"no entry {name!r} in this checkpoint (it has {sorted(state)})", path=reader.path, key=name)
    src, saved = replica_target(reader, pe, name, state[name], verify=verify)
    keys = _refs(saved)
    if mmap or unsafe_mmap or (keys and len(keys) == len(src.tensors)):
        # the entry is the whole tensor file (or a mapping was asked for): one pass
        got = fresh_tensors(reader, src, verify=verify, mmap=mmap, unsafe_mmap=unsafe_mmap)
        return resolve(saved, {k: place(v, map_location) for k, v in got.items()}, reader.path)
    return resolve_lazily(reader, src, saved, map_location=map_location, verify=verify)
