"""One background thread that applies a function to items in submission order.

Used to overlap hashing with I/O: xxh3, preadv and write all release the GIL, so on
two cores the digest of one piece is computed while the next piece is read or
written. The first exception is kept and re-raised on the caller's thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from . import _forksafe

__all__ = ["OrderedFeeder"]


class OrderedFeeder:
    def __init__(self, fn: Callable[[Any], None], name: str) -> None:
        self._fn = fn
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._err: BaseException | None = None
        # the thread ends only when let (no fork may begin meanwhile: ckpt._forksafe)
        self._drained = threading.Event()
        self._exit = _forksafe.Exit()
        self._thread = _forksafe.start(threading.Thread(target=self._run, name=name, daemon=True))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._drained.set()
                self._exit.wait()
                return
            if self._err is None:
                try:
                    self._fn(item)
                except BaseException as e:  # handed to the submitting thread
                    self._err = e

    def feed(self, item: Any) -> None:
        if self._err is not None:
            raise self._err
        self._q.put(item)

    def finish(self) -> None:
        """Wait until every item is processed; re-raise the first failure."""
        self._end()
        if self._err is not None:
            raise self._err

    def abort(self) -> None:
        self._end()

    def _end(self) -> None:
        self._q.put(None)
        # Unbounded on purpose: the thread only runs ``fn`` on items already handed to it
        # (hashing, local reads), takes no lock and waits on no other process.
        if self._thread.is_alive():  # not in a forked child, where the thread does not exist
            self._drained.wait()
        self._exit.join_thread(self._thread)
