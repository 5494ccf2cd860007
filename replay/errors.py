"""The exception hierarchy of the ``replay`` package (one base class, shallow tree)::

    ReplayError
    ├── TapeError                    (ValueError)    tape bytes
    │   ├── TapeCorruptError                          bad record followed by valid ones
    │   ├── TapeTruncatedError                        torn tail where a whole tape is required
    │   ├── TapeFormatError                           bad magic, unknown version, bad header
    │   └── TapeLimitError                            a length above the documented bound
    ├── DivergenceError              (AssertionError) replay produced a different event
    ├── ChannelError                 (RuntimeError)   transport failures
    │   ├── PeerDiedError                             the peer went away mid-message
    │   ├── MessageTooLargeError                      above the channel's declared bound
    │   └── ReceiveTimeoutError      (TimeoutError)
    ├── SnapshotError                (RuntimeError)   a snapshot aborted or cannot restore
    └── HangError                    (TimeoutError)   a watched run made no progress

Each carries the context it knows (path, offset, seq, channel) and names it in str().
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ReplayError",
    "TapeError",
    "TapeCorruptError",
    "TapeTruncatedError",
    "TapeFormatError",
    "TapeLimitError",
    "DivergenceError",
    "ChannelError",
    "PeerDiedError",
    "MessageTooLargeError",
    "ReceiveTimeoutError",
    "SnapshotError",
    "HangError",
]


class ReplayError(Exception):
    exit_code: int = 1

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.context = {k: v for k, v in context.items() if v is not None}
        for k, v in context.items():
            setattr(self, k, v)
        where = ", ".join(f"{k} {v}" for k, v in self.context.items())
        super().__init__(f"{message} ({where})" if where else message)

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.context))


def _rebuild(cls, message, context):  # pragma: no cover - trivial
    return cls(message, **context)


class TapeError(ReplayError, ValueError):
    exit_code = 3


class TapeCorruptError(TapeError):
    pass


class TapeTruncatedError(TapeError):
    pass


class TapeFormatError(TapeError):
    pass


class TapeLimitError(TapeError):
    pass


class DivergenceError(ReplayError, AssertionError):
    exit_code = 6


class ChannelError(ReplayError, RuntimeError):
    pass


class PeerDiedError(ChannelError):
    pass


class MessageTooLargeError(ChannelError):
    pass


class ReceiveTimeoutError(ChannelError, TimeoutError):
    pass


class SnapshotError(ReplayError, RuntimeError):
    pass


class HangError(ReplayError, TimeoutError):
    """A watched run made no progress for its hang bound (``replay.watchdog``): its
    ``report`` file names each worker's last heartbeat and where it waits; every
    process's Python stacks lie beside it."""
