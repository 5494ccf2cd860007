"""Preemption signals (SIGTERM/SIGUSR1): the handler only sets a flag, which the manager
reads at the next step boundary; handlers chain to the ones installed before them and are
put back on close."""

from __future__ import annotations

import signal
import threading
import warnings
from typing import Any, Sequence

__all__ = ["SignalFlag"]


class SignalFlag:
    """The signal handlers of one manager and the signal they last received."""

    def __init__(self) -> None:
        #: the last signal received since the manager last saved for one (``None``: none)
        self.received: int | None = None
        self.closed = False
        self._old_handlers: dict[int, Any] = {}

    def install(self, signals: Sequence[int], *, stacklevel: int) -> None:
        """Install the handlers (only the main thread may; elsewhere warn, at ``stacklevel``
        counted from the caller)."""
        if signals and threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._old_handlers[sig] = signal.signal(sig, self.on_signal)
        elif signals:
            warnings.warn("CheckpointManager created off the main thread: no signal handlers installed", RuntimeWarning,
                          stacklevel=stacklevel + 1)

    def on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens at the next step boundary, in the loop's thread.
        if not self.closed:
            self.received = signum
        # Chain: the handler installed before ours still runs (a user's logging, a
        # launcher's cleanup). SIG_DFL/SIG_IGN are not called: the default action of
        # SIGTERM would kill the process before the save this handler exists for.
        prev = self._old_handlers.get(signum)
        if callable(prev):
            prev(signum, frame)

    def close(self) -> None:
        """Stop taking signals: from now on the handlers only forward to the previous ones."""
        self.closed = True

    def restore(self) -> None:
        """Put back the handlers this one replaced, where ours is still installed."""
        for sig in self._old_handlers:
            try:
                # Only if ours is still installed: a handler installed after ours
                # (which may chain to ours) is not overwritten. Ours stays in its
                # chain, closed: it only forwards to the previous handler.
                if signal.getsignal(sig) == self.on_signal:
                    signal.signal(sig, _first_open_handler(self, sig))
            except (ValueError, TypeError):  # pragma: no cover - not main thread
                pass


def _first_open_handler(closed: SignalFlag, sig: int) -> Any:
    """The handler to restore when ``closed`` leaves the top of ``sig``'s chain: the one it
    replaced, skipping every manager closed meanwhile. Managers closed in creation order
    leave the older ones in the chain (each was under a newer one then); restoring the
    newest one's predecessor as such would install a closed manager's handler, which
    never calls SIG_DFL, and SIGTERM would be ignored for the rest of the process."""
    handler = closed._old_handlers[sig]
    for _ in range(1024):  # one hop per manager ever created; bounded against a cycle
        owner = getattr(handler, "__self__", None)
        if not (isinstance(owner, SignalFlag) and getattr(handler, "__func__", None) is SignalFlag.on_signal
                and owner.closed and sig in owner._old_handlers):
            break
        handler = owner._old_handlers[sig]
    return handler
