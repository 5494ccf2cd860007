"""The exception hierarchy of the ``ckpt`` package.

Every error a reader or writer raises on purpose derives from :class:`CkptError`.
Each leaf also subclasses the builtin it naturally is, so ``except ValueError``
keeps working for callers who do not know this package::

    CkptError
    ├── CheckpointNotFoundError      (FileNotFoundError)  no such checkpoint
    │   └── CheckpointVanishedError                      removed (e.g. by retention) while read
    ├── IncompleteCheckpointError    (CkptError)          uncommitted / temporary dir
    ├── FormatError                  (ValueError)         bytes that do not parse
    │   ├── NotACheckpointError                           a file, run directory, tape, DCP or HF
    │   │                                                 directory where a checkpoint was expected
    │   ├── UnsupportedVersionError                       unknown major version
    │   ├── LimitExceededError                            a size above a documented limit
    │   └── UnsafePathError                               ../, absolute path, symlink escape
    ├── IntegrityError               (ValueError)         bytes parse but do not match
    │   ├── ChecksumMismatchError                         a chunk or manifest digest differs
    │   ├── SizeMismatchError                             truncated or extended file
    │   ├── MissingFileError                              a file the manifest names is absent
    │   ├── CheckpointChangedError                        a file changed between the two passes
    │   │                                                 of an in-place load (targets may be mixed)
    │   └── UnexpectedFileError                           a file the manifest does not name
    ├── CheckpointExistsError        (FileExistsError)    refusing to replace a checkpoint
    ├── StateMismatchError           (KeyError-free ValueError)  saved keys/shapes vs target
    │   └── ResumeMismatchError                           a resume refused: the model or world does not
    │                                                     fit the run's checkpoint (nothing changed)
    ├── EnvironmentMismatchError     (RuntimeError)       strict exactness gate refused
    ├── UnsupportedValueError        (TypeError)          a value that cannot be stored
    ├── SaveOptionError              (TypeError)          a save option this save path does not
    │                                                     support (named), or given twice, differently
    ├── BackgroundSaveError          (RuntimeError)       an async save failed earlier
    ├── RunDirLockedError            (BlockingIOError)    another manager writes this run dir
    │   └── LeaseLostError                               this writer's lease on the run was taken over
    ├── SaveConflictError            (RuntimeError)       another process removed this save's files
    ├── WaitTimeoutError             (TimeoutError)       a lock or a save in flight passed its hang
    │                                                     detector bound (names what it waited on)
    ├── DistributedUsageError        (RuntimeError)       single-process API under a process group
    ├── UnsupportedSchemeError       (ValueError)         a URL no installed storage backend serves
    ├── StorageError                 (OSError)            an object store refused or failed a request
    ├── TapeDataError                (FormatError)        tape bytes (ckpt.tape framing)
    │   ├── TapeCorruptError / TapeTruncatedError / TapeFormatError / TapeLimitError
    ├── ResumeDivergedError          (RuntimeError)       a resumed step differs from the ledger (strict)
    ├── GuardError                   (RuntimeError)       the loss-spike guard could not roll back
    │   ├── NoRollbackTargetError                        no checkpoint before the anomaly
    │   └── RollbackLimitError                           the rollback budget is spent
    └── GuardConfigError             (ValueError)         a GuardConfig field breaks its rule

Every instance carries ``path`` (the file), and where known ``offset`` (a byte offset
in that file) or ``key`` (a key path in the state tree); ``str(err)`` names them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CkptError",
    "CheckpointNotFoundError",
    "CheckpointVanishedError",
    "IncompleteCheckpointError",
    "FormatError",
    "NotACheckpointError",
    "UnsupportedVersionError",
    "LimitExceededError",
    "UnsafePathError",
    "IntegrityError",
    "ChecksumMismatchError",
    "SizeMismatchError",
    "MissingFileError",
    "CheckpointChangedError",
    "UnexpectedFileError",
    "CheckpointExistsError",
    "StateMismatchError",
    "ResumeMismatchError",
    "EnvironmentMismatchError",
    "UnsupportedValueError",
    "SaveOptionError",
    "BackgroundSaveError",
    "TapeDataError",
    "TapeCorruptError",
    "TapeTruncatedError",
    "TapeFormatError",
    "TapeLimitError",
    "ResumeDivergedError",
    "RunDirLockedError",
    "WaitTimeoutError",
    "LeaseLostError",
    "SaveConflictError",
    "DistributedUsageError",
    "UnsupportedSchemeError",
    "StorageError",
    "UnprotectedMappingError",
    "GuardError",
    "NoRollbackTargetError",
    "RollbackLimitError",
    "GuardConfigError",
]


class CkptError(Exception):
    """Base class of every error raised on purpose by ``ckpt``."""

    #: exit code the CLI maps this class to (see ``ckpt_cli.main``)
    exit_code: int = 1

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        key: str | None = None,
        **context: Any,
    ) -> None:
        self.message = message
        self.path = path
        self.offset = offset
        self.key = key
        self.context = context
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"file {self.path!s}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        if self.key is not None:
            where.append(f"key {self.key!r}")
        return f"{self.message} ({', '.join(where)})" if where else self.message

    def __reduce__(self):  # keeps errors picklable for multiprocessing result queues
        return (_rebuild, (type(self), self.message, self.path, self.offset, self.key, self.context))


def _rebuild(cls, message, path, offset, key, context):  # pragma: no cover - trivial
    return cls(message, path=path, offset=offset, key=key, **context)


class CheckpointNotFoundError(CkptError, FileNotFoundError):
    """No checkpoint at this path (exit code 5)."""

    exit_code = 5


class CheckpointVanishedError(CheckpointNotFoundError):
    """The checkpoint was there when opened and is gone now: another process (retention,
    a user) removed it while this reader was reading. Not corruption: the bytes read so
    far were valid; a resume falls back to an older checkpoint."""


class IncompleteCheckpointError(CkptError):
    """The directory is not a committed checkpoint (no MANIFEST, or a temporary dir)."""

    exit_code = 4


class FormatError(CkptError, ValueError):
    """The bytes do not follow the format (bad magic, malformed header, bad msgpack)."""

    exit_code = 3


class NotACheckpointError(FormatError):
    """The path holds something else: a file, a run directory, a step ledger, a tape, a
    DCP checkpoint or a Hugging Face directory. ``kind`` says which (``ckpt.probe``
    kinds) and the message names the command that reads it. Exit code 7 in the CLI."""

    exit_code = 7

    @property
    def kind(self) -> str:
        return str(self.context.get("kind", "file"))


class UnsupportedVersionError(FormatError):
    """A format version this reader does not know: a newer major version is refused, never misread."""


class LimitExceededError(FormatError):
    """A declared size is above a documented limit; nothing was allocated for it."""


class UnsafePathError(FormatError):
    """A name in the manifest escapes the checkpoint directory."""


class IntegrityError(CkptError, ValueError):
    """The bytes parse but are not the bytes that were written."""

    exit_code = 3


class ChecksumMismatchError(IntegrityError):
    """A chunk's or the MANIFEST's digest does not match its bytes (exit code 3)."""


class SizeMismatchError(IntegrityError):
    """A file is shorter or longer than the MANIFEST says (truncated or extended)."""


class MissingFileError(IntegrityError):
    """A file the MANIFEST names is absent."""


class UnexpectedFileError(IntegrityError):
    """A file in the checkpoint that the MANIFEST does not name."""


class CheckpointChangedError(IntegrityError):
    """A committed file changed under an in-place load after its verifying pass.

    Every chunk had matched in the first pass, so the file was modified in place while
    the load copied it (the format forbids that; a media fault can do it). Unlike every
    other load error, the targets may now hold a mix of old and new values: load a
    checkpoint again (``CheckpointManager.resume`` does) before using them.
    """


class CheckpointExistsError(CkptError, FileExistsError):
    """Refusing to replace an existing checkpoint: pass ``overwrite=True`` to replace it."""


class StateMismatchError(CkptError, ValueError):
    """The checkpoint does not fit the objects it is being loaded into."""


class ResumeMismatchError(StateMismatchError):
    """A resume refused: the live state or world does not fit the run's checkpoint.

    Raised by ``CheckpointManager.resume()`` (and the trainer integrations) when a
    checkpoint that is intact does not fit what is being resumed: other keys, shapes or
    dtypes (a changed model), or another world size (no part for this rank). That is not
    damage, so the resume does not fall back past it: every older checkpoint of the run
    would be as wrong, and starting afresh would overwrite the run. ``path`` is the
    checkpoint, ``key`` the first entry that does not fit; ``context`` carries
    ``saved_shape``/``target_shape`` (and dtypes) where a tensor differs. Nothing in the
    run directory was changed, and the manager that raised it refuses to save.
    """


class EnvironmentMismatchError(CkptError, RuntimeError):
    """Under ``strict`` exactness, the environment differs from the one that saved."""

    exit_code = 6


class UnsupportedValueError(CkptError, TypeError):
    """A value in the state cannot be represented without pickle."""


class SaveOptionError(CkptError, TypeError):
    """A save option (``ckpt.SaveOptions``) that this save path does not support, such as
    ``compress=`` for a sharded (DCP) save, or one given both as a keyword and in
    ``options=`` with different values. Raised before anything is written; ``options``
    names the refused options and ``supports`` what this path takes."""


class BackgroundSaveError(CkptError, RuntimeError):
    """An asynchronous save failed; raised at the next call into the manager."""


class RunDirLockedError(CkptError, BlockingIOError):
    """Another live process holds the run directory's writer lock (its pid and host named)."""


class LeaseLostError(RunDirLockedError):
    """This writer's lease on an object-store run expired and another writer took the run
    over (spec/object-storage.md §O.6): nothing more is committed or deleted through it.
    Raised by the commit or deletion that found out; the run now belongs to the new holder."""


class SaveConflictError(CkptError, RuntimeError):
    """A file of a save in progress was removed or changed by another process (a cleanup
    of the run directory, another writer) before the save committed: nothing was committed.
    The file is named; saving again is safe."""


class WaitTimeoutError(CkptError, TimeoutError):
    """A wait inside a save (a lock on a checkpoint's temporary directory, the save in
    flight) passed its hang-detector bound (``ckpt.knobs``: ``lock_timeout_s``,
    ``save_timeout_s``). The message names what was waited on and, for a lock, which
    processes hold it; ``waited_on`` and ``timeout_s`` carry the same."""


class DistributedUsageError(CkptError, RuntimeError):
    """A single-process API called under a multi-rank process group; use the distributed one."""


class UnsupportedSchemeError(CkptError, ValueError):
    """A URL whose scheme no installed storage backend serves (``scheme`` and the
    ``extra`` to install are in the message). A URL is never taken for a local path."""

    exit_code = 2


class StorageError(CkptError, OSError):
    """An object store refused or failed a request (credentials, network, throttling):
    the URL and the store's own message are named. Not a statement about the bytes."""


class UnprotectedMappingError(CkptError, OSError):
    """``state(mmap=True)`` on a file no read lease can be taken on (spec §11.1): a mapping
    would change under the returned tensors if the file were overwritten in place, and
    fault them if it were truncated. Pass ``mmap=None`` (read into fresh memory where no
    lease is granted) or, knowingly, ``unsafe_mmap=True``. Also raised by
    ``ckpt.storage.install_lease_handler()`` where the lease-break handler cannot be
    installed. Not a statement about the bytes."""


class TapeDataError(FormatError):
    """Tape bytes (spec/tape-format.md) that do not decode. ``reason`` is one of
    ``corrupt``, ``truncated``, ``format``, ``limit`` (§7); ``replay`` raises its own
    ``TapeError`` subclass for each, this class is what the pure framing in
    ``ckpt.tape`` raises so that ``ckpt`` can read a ledger tape without ``replay``."""

    reason = "format"


class TapeCorruptError(TapeDataError):
    """Tape framing read by ``ckpt`` (a ledger tape): a bad record followed by valid ones."""

    reason = "corrupt"


class TapeTruncatedError(TapeDataError):
    """Tape framing read by ``ckpt`` (a ledger tape): a torn tail where a whole tape is required."""

    reason = "truncated"


class TapeFormatError(TapeDataError):
    """Tape framing read by ``ckpt`` (a ledger tape): bad magic, an unknown version or a bad header."""

    reason = "format"


class TapeLimitError(TapeDataError):
    """Tape framing read by ``ckpt`` (a ledger tape): a length above the documented bound."""

    reason = "limit"


class ResumeDivergedError(CkptError, RuntimeError):
    """A resumed run re-executed a step differently from the step ledger (policy ``strict``)."""

    exit_code = 6


class GuardError(CkptError, RuntimeError):
    """The loss-spike guard (``ckpt.guard``) detected an anomaly it could not handle."""


class NoRollbackTargetError(GuardError):
    """A spike was detected but no committed checkpoint precedes it (``on_no_checkpoint="raise"``)."""


class RollbackLimitError(GuardError):
    """A spike was detected after ``max_rollbacks`` episodes: the run stops rather than loop."""


class GuardConfigError(CkptError, ValueError):
    """A ``GuardConfig`` field breaks its rule (the message names the field and the rule)."""
