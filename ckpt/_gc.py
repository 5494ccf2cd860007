"""Pause Python's cyclic garbage collector around bulk decoding and encoding.

Decoding a manifest or a structure file with thousands of tensors allocates tens of
thousands of small containers; every 700 allocations the collector runs, and each
time a generation fills it walks everything the process holds (a model's worth of
objects), not only what the decoder made. Measured on 4,000 small tensors: the fresh
load took 0.69x as long with the collector paused (bench/save_load.py, ``small``).
What is built here holds no reference cycles (dicts, lists, strings, frozen records),
so nothing is left for the collector to find afterwards; it resumes where it was.

Only CPU-bound stretches without I/O are wrapped: a background save that paused the
collector for its whole write would pause it for the training loop as well.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from typing import Iterator

__all__ = ["paused"]

_lock = threading.Lock()
_depth = 0
_resume = False


def _after_fork_in_child() -> None:
    """A child forked while a save thread was pausing (a DataLoader worker) has none of
    the parent's threads: a lock held by one would stay held for ever, and a pause it
    began would never end. Start over, with the collector as it was before that pause."""
    global _lock, _depth, _resume
    _lock = threading.Lock()
    if _depth and _resume:
        gc.enable()
    _depth, _resume = 0, False


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside; nests and may be entered from several threads."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
