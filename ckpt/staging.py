"""One reused staging copy of a training state, for asynchronous saves.

An async save must freeze the state at a step boundary and let the loop go on while
the bytes are written. ``Staging.snapshot`` walks the state trees, copies every tensor
into a slot of one flat, pre-faulted buffer (pinned host memory when a source lives on
CUDA, so the device-to-host copy is a DMA), and returns the same trees with containers
rebuilt and tensors replaced by their slots. The loop blocks only for that copy.

The buffer is allocated on the first snapshot and reused for every later one; it is
reallocated only when the layout (the ordered list of dtypes and shapes) changes, which
``allocations`` counts. Memory is therefore exactly one staging copy of the state.
Tensors reached twice through the same view (tied weights) share one slot, exactly as
the writer de-duplicates them, so aliasing survives the copy.

The caller must not take a new snapshot while a write still reads the previous one; the
manager guarantees this by allowing at most one save in flight.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from . import _forksafe
from .writer import tensor_view_key

__all__ = ["Staging", "SnapshotStats", "frozen_stateful"]

_ALIGN = 64  # slot alignment: any dtype may view its slot, and slots never share a cache line


@dataclass(frozen=True, slots=True)
class SnapshotStats:
    tensors: int
    nbytes: int
    reallocated: bool


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    # The writer's de-duplication key, so staging keeps exactly the aliases it will keep.
    return tensor_view_key(t)


class Staging:
    """A flat host buffer holding one copy of a state's tensors, reused across saves."""

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self._pin = pin_memory
        self._layout: tuple[tuple[torch.dtype, tuple[int, ...]], ...] | None = None
        self._buffer: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []
        #: how many times the buffer was (re)allocated; 1 for a state of fixed layout
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.numel())

    @property
    def pinned(self) -> bool:
        return self._buffer is not None and self._buffer.is_pinned()

    def snapshot(self, tree: Any) -> tuple[Any, SnapshotStats]:
        """Copy every tensor in ``tree`` into staging; returns the frozen tree."""
        found: list[torch.Tensor] = []
        slot_of: dict[tuple[Any, ...], int] = {}
        _collect(tree, found, slot_of)
        layout = tuple((t.dtype, tuple(t.shape)) for t in found)
        reallocated = layout != self._layout
        if reallocated:
            self._allocate(layout, any(t.device.type == "cuda" for t in found))
        slots = self._slots
        cuda = False
        plain: list[tuple[int, int, int]] = []  # (dst, src, nbytes) for memmove
        with torch.no_grad():
            for src, dst in zip(found, slots):
                if src.device.type == "cpu" and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
                    # A plain memcpy (ctypes releases the GIL): torch's copy_ wakes its
                    # intra-op pool per tensor, which costs milliseconds per call on a
                    # busy 2-core machine.
                    n = src.numel() * src.element_size()
                    if n:
                        plain.append((dst.data_ptr(), src.data_ptr(), n))
                elif src.device.type == "cpu":
                    dst.copy_(src)
                else:
                    cuda = True
                    dst.copy_(src, non_blocking=dst.is_pinned())
            _copy_all(plain)
        if cuda:
            # The copies are queued on each source's current stream; the snapshot is
            # consistent only once they have landed.
            torch.cuda.synchronize()
        frozen = _rebuild(tree, slot_of, slots)
        return frozen, SnapshotStats(len(found), sum(s.numel() * s.element_size() for s in slots), reallocated)

    def _allocate(self, layout: tuple[tuple[torch.dtype, tuple[int, ...]], ...], has_cuda: bool) -> None:
        # Drop the old buffer first so two copies never coexist.
        self._buffer = None
        self._slots = []
        offsets = []
        total = 0
        for dtype, shape in layout:
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            offsets.append((total, n))
            total += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        pin = self._pin if self._pin is not None else (has_cuda and torch.cuda.is_available())
        buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=bool(pin))
        # Pre-fault every page now, so the first save does not pay for page faults
        # inside the loop's blocking window.
        buf.zero_()
        slots = []
        for (dtype, shape), (off, n) in zip(layout, offsets):
            slots.append(buf[off : off + n].view(dtype).view(shape))
        self._buffer = buf
        self._slots = slots
        self._layout = layout
        self.allocations += 1

    def release(self) -> None:
        self._buffer = None
        self._slots = []
        self._layout = None


#: below this many bytes one thread copies (a thread start costs more than it saves)
_PARALLEL_COPY_MIN = 32 << 20


def _memmove_all(jobs: list[tuple[int, int, int]]) -> None:
    for dst, src, n in jobs:
        ctypes.memmove(dst, src, n)


def _copy_all(jobs: list[tuple[int, int, int]]) -> None:
    """The staging copy, split in two halves of equal bytes for two threads.

    The loop is blocked for exactly this copy, and nothing else runs then, so both cores
    may copy: two streams reach more of the memory bandwidth than one (bench/async_save.py
    measures the stall against one memmove of the same bytes).
    """
    total = sum(n for _, _, n in jobs)
    if total < _PARALLEL_COPY_MIN:
        _memmove_all(jobs)
        return
    first: list[tuple[int, int, int]] = []
    second: list[tuple[int, int, int]] = []
    left = total // 2
    for dst, src, n in jobs:
        if left >= n:
            first.append((dst, src, n))
            left -= n
        elif left > 0:  # this tensor straddles the halves: split it
            first.append((dst, src, left))
            second.append((dst + left, src + left, n - left))
            left = 0
        else:
            second.append((dst, src, n))
    exit_ = _forksafe.Exit()  # it ends only when let: no fork may begin meanwhile

    def copy_second() -> None:
        try:
            _memmove_all(second)
        finally:
            exit_.wait()

    helper = _forksafe.start(threading.Thread(target=copy_second, name="ckpt-stage", daemon=True))
    try:
        _memmove_all(first)
    finally:
        exit_.join_thread(helper)  # a memmove of known bytes: nothing it could wait on


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _collect(obj: Any, found: list[torch.Tensor], slot_of: dict[tuple[Any, ...], int]) -> None:
    if isinstance(obj, torch.Tensor):
        key = _view_key(obj)
        if obj.numel() > 0 and key in slot_of:
            return
        if obj.numel() > 0:
            slot_of[key] = len(found)
        else:
            slot_of[("empty", id(obj))] = len(found)
        found.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _collect(v, found, slot_of)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, found, slot_of)
    elif isinstance(obj, _FrozenStateful):
        _collect(obj._sd, found, slot_of)


def _rebuild(obj: Any, slot_of: Mapping[tuple[Any, ...], int], slots: list[torch.Tensor]) -> Any:
    # Containers are rebuilt, so the loop may mutate its own dicts and lists (optimizer
    # param_groups, scheduler fields) while the write reads the frozen ones.
    if isinstance(obj, torch.Tensor):
        key = _view_key(obj) if obj.numel() > 0 else ("empty", id(obj))
        return slots[slot_of[key]]
    if isinstance(obj, Mapping):
        return {k: _rebuild(v, slot_of, slots) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, slot_of, slots) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, slot_of, slots) for v in obj)
    if isinstance(obj, _FrozenStateful):
        return type(obj)(_rebuild(obj._sd, slot_of, slots))
    return obj  # scalars, strings, dtypes, devices: immutable


class _FrozenStateful:
    """A state_dict captured at a step boundary, standing in for its live object."""

    __slots__ = ("_sd",)

    def __init__(self, sd: Any) -> None:
        self._sd = sd

    def state_dict(self) -> Any:
        return self._sd

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - never loaded into
        raise TypeError("a frozen snapshot is written, never loaded into")


_FROZEN_TYPES: dict[type, type] = {}


def frozen_stateful(obj: Any, sd: Any) -> _FrozenStateful:
    """Wrap ``sd`` so the writer records ``type(obj)``'s name, as a direct save would."""
    cls = type(obj)
    t = _FROZEN_TYPES.get(cls)
    if t is None:
        t = type(cls.__name__, (_FrozenStateful,), {"__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _FROZEN_TYPES[cls] = t
    return t(sd)
