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
    """The base of every error ``replay`` raises on purpose; ``str()`` names the context it knows
    (path, offset, seq, channel), and ``exit_code`` is what the ``ckpt`` command exits with."""

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
    """Tape bytes that do not decode (exit code 3)."""

    exit_code = 3


class TapeCorruptError(TapeError):
    """A bad record followed by valid ones: the tape is damaged in the middle, not torn."""


class TapeTruncatedError(TapeError):
    """A torn tail where a whole tape is required (``ckpt tape repair`` truncates it)."""


class TapeFormatError(TapeError):
    """Bad magic, an unknown version or a bad header."""


class TapeLimitError(TapeError):
    """A length above the documented bound (spec/tape-format.md)."""


class DivergenceError(ReplayError, AssertionError):
    """A replay produced an event other than the tape's (exit code 6)."""

    exit_code = 6


class ChannelError(ReplayError, RuntimeError):
    """A transport failure on a channel."""


class PeerDiedError(ChannelError):
    """The peer went away mid-message."""


class MessageTooLargeError(ChannelError):
    """A message above the channel's declared bound."""


class ReceiveTimeoutError(ChannelError, TimeoutError):
    """No message arrived within the receive's timeout."""


class SnapshotError(ReplayError, RuntimeError):
    """A snapshot aborted, or cannot be restored."""


class HangError(ReplayError, TimeoutError):
    """A watched run made no progress for its hang bound (``replay.watchdog``): its
    ``report`` file names each worker's last heartbeat and where it waits; every
    process's Python stacks lie beside it."""
