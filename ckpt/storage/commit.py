"""The commit protocols behind the storage seam: how a save becomes a checkpoint.

Every backend exposes its :class:`Commit` as ``storage.commit``; the writer, the manager
and the integrations call only that, never a backend's own methods, so a change to
committing is made here (or in a backend) and nowhere else. Two implementations:

* :class:`RenameCommit` (a filesystem, spec/checkpoint-format.md §10): the parts are
  written into a temporary sibling directory ``.tmp-<name>-<hex>``, MANIFEST last, then
  the directory is renamed to its final name (``renameat2(RENAME_NOREPLACE)``; with
  ``overwrite``, ``RENAME_EXCHANGE`` or a two-rename fallback that :meth:`recover`
  completes after a crash). Part writers hold the directory's ``flock`` shared, the
  committer exclusively; the run lock is an ``flock`` on ``<run>/.ckpt-writer.lock``
  (``ckpt.runlock``). Those two locks and the step ledger are local side files: they are
  the only things here that do not go through ``Storage``.
* :class:`ManifestLastCommit` (an object store, spec/object-storage.md): the parts are
  uploaded under save-unique names and MANIFEST appears last with a conditional put; the
  backend supplies those requests (:class:`ObjectStore`, implemented by
  ``ckpt.storage.s3.S3Storage``).

A storage that wraps another (a fault injector, a fenced view) exposes
``inner.commit.over(self)``: the same protocol, with every file operation it makes going
through the wrapper, so that the wrapper sees all of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence

from .._locks import flock_bounded, unlock_and_close
from .. import _helpers
from ..errors import CheckpointExistsError, CkptError, DistributedUsageError, SaveConflictError
from ..format.digest import digest_bytes
from ..format.manifest import (
    MANIFEST_NAME,
    TMP_PREFIX,
    Manifest,
    PartEntry,
    PartList,
    PartRef,
    check_name,
)
from ..knobs import knobs

__all__ = [
    "Commit",
    "RunLockHandle",
    "ObjectStore",
    "RenameCommit",
    "ManifestLastCommit",
    "PendingCheckpoint",
    "Recovery",
    "tmp_name",
    "is_complete",
    "recoverable",
    "files_total",
    "FUSED_COMMIT_MAX",
    "OLD_SUFFIX",
    "DEL_SUFFIX",
]

#: suffix of a replaced checkpoint moved aside (fallback overwrite, §10)
OLD_SUFFIX = ".old"
#: suffix of a checkpoint being deleted on purpose (retention)
DEL_SUFFIX = ".del"

#: A checkpoint whose files total at most this many bytes may be committed *fused*
#: (spec §10.7): its part files sealed, not yet fsynced, when MANIFEST is created, and
#: every fsync of the commit issued together. The writer decides which saves are fused
#: (``ckpt.save`` of a part this small); recovery re-hashes a temporary copy this small
#: before publishing it (§10.3), since its MANIFEST may be durable before its files.
FUSED_COMMIT_MAX = 64 << 20

_TMP_RE = re.compile(r"^\.tmp-(?P<name>.+)-[0-9a-f]{12}(?P<suffix>\.old|\.del)?$")


def tmp_name(name: str, suffix: str = "") -> str:
    """``.tmp-<name>-<12 hex>[suffix]``: a sibling no reader accepts (§3)."""
    return f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}{suffix}"


# The records of the commit protocols (what Commit.begin and Commit.recover return): the seam's
# own types, so that a backend needs nothing from the writer (ckpt.writer re-exports them).


@dataclass(frozen=True, slots=True)
class PendingCheckpoint:
    """A checkpoint being written. Rebuild it in another process from the two paths
    and ``tag`` (and the same ``overwrite``: the commit, not ``begin``, enforces it).

    ``tmp_dir`` is where the part files are created: a temporary sibling directory on
    a filesystem, the final prefix itself on an object store, where ``tag`` (``.`` and
    12 hex digits, empty on a filesystem) makes every file name unique to this save so
    that racing or replacing writers never overwrite each other's objects
    (spec/object-storage.md)."""

    final: str
    tmp_dir: str
    overwrite: bool = False
    tag: str = ""
    #: format 2.0: each part writes a part manifest and returns a PartRef (many ranks)
    part_manifests: bool = False

    def file_name(self, part: str, suffix: str) -> str:
        """The name of a part's file in this save: ``<part><tag><suffix>``."""
        return f"{part}{self.tag}{suffix}"


@dataclass(frozen=True, slots=True)
class Recovery:
    """What :func:`ckpt.writer.recover` did: temporary dirs renamed back to a final name, and removed."""

    restored: tuple[tuple[str, str], ...]  # (temporary name, final name)
    removed: tuple[str, ...]


class RunLockHandle(Protocol):
    """A held run lock (one writing job per run directory). ``release()`` is idempotent."""

    def release(self) -> None: ...


class Commit(Protocol):
    """How a save is published on one backend, and everything that must agree with it:
    the lock part writers hold against a commit, crash recovery, deleting a checkpoint,
    the run lock, and where a run's local side files live.

    A backend that needs less inherits the defaults below (no part lock, the ledger
    beside the run, records named as the caller spelled the path)."""

    def over(self, storage: Any) -> Commit:
        """This protocol for ``storage``, a wrapper of the backend it was made for: every
        file operation then goes through the wrapper."""
        ...

    def begin(self, final: str, *, overwrite: bool) -> PendingCheckpoint:
        """Prepare a save of ``final`` (a temporary directory, or a save tag); refuse an
        existing checkpoint early without ``overwrite`` (``CheckpointExistsError``)."""
        ...

    def part_lock(self, pending: PendingCheckpoint, *, exclusive: bool) -> ContextManager[None]:
        """Held by each part writer (shared) and by the commit (exclusive), so that no part
        adds a file after the commit. Where nothing can be added after a commit (an object
        store names every file in MANIFEST): nothing to hold."""
        return contextlib.nullcontext()

    def publish(self, pending: PendingCheckpoint, manifest: bytes, parts: Sequence[PartEntry | PartRef], *,
                unsynced: Sequence[Any] = ()) -> None:
        """Make ``manifest`` (the encoded MANIFEST naming ``parts``) and the files it names
        appear as the checkpoint ``pending.final``, atomically. ``unsynced``: sealed sinks
        of part files not yet durable (a fused commit, spec §10.7, files totalling at most
        ``FUSED_COMMIT_MAX``): closed (fsynced) by the commit before the checkpoint appears,
        together with MANIFEST's fsync where the protocol allows it."""
        ...

    def abort(self, pending: PendingCheckpoint) -> None:
        """Remove what this save wrote, nothing else."""
        ...

    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None) -> Recovery:
        """Clean ``parent`` after a crash without losing a complete copy (the run lock's
        holder only)."""
        ...

    def remove_checkpoints(self, parent: str, paths: Sequence[str], *, durable: bool) -> tuple[str, ...]:
        """Delete these committed checkpoints of ``parent`` so that a crash never leaves a
        torn one; returns the paths deleted (one that was already gone is left out).
        ``durable``: no crash can bring a deleted one back."""
        ...

    def run_lock(self, run_dir: str, *, owner: dict[str, object] | None = None, wait: bool = False) -> RunLockHandle:
        """Take the run's writer lock (``RunDirLockedError`` while another holds it; with
        ``wait``, block until it is free where the backend can wait)."""
        ...

    def holding(self, lock: RunLockHandle) -> Any:
        """The storage the holder of ``lock`` (what :meth:`run_lock` returned) writes the run
        through: the storage itself where the lock is the kernel's, a fenced view where it is
        a lease that can be taken over (every commit and deletion proves it first)."""
        ...

    def ledger_dir(self, run_dir: str) -> str:
        """The local directory of the run's step ledger (an append-only tape)."""
        return os.path.join(run_dir, "ledger")

    def record_path(self, given: str, normal: str) -> str:
        """The run directory as checkpoint records name it: as the caller spelled it
        (``given``), or in the backend's normal form."""
        return given


# --- the rename commit (a filesystem) --------------------------------------------------


class RenameCommit(Commit):
    """The commit protocol of a filesystem (spec/checkpoint-format.md §10), on any
    ``Storage`` whose ``rename_noreplace`` is atomic. The part lock and the run lock are
    ``flock``s on local paths (:meth:`_dir_lock`, ``ckpt.runlock``); a backend whose
    paths are not local files overrides those two (``ckpt.storage.memory``)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage

    def over(self, storage: Any) -> Commit:
        return type(self)(storage)

    def begin(self, final: str, *, overwrite: bool) -> PendingCheckpoint:
        storage = self.storage
        parent, name = os.path.split(final)
        storage.makedirs(parent)
        if storage.exists(final) and not overwrite:
            # Early refusal only; publish() enforces it atomically (another writer may
            # commit this name while we write).
            raise CheckpointExistsError("a checkpoint already exists here; pass overwrite=True to replace it", path=final)
        tmp = os.path.join(parent, tmp_name(name))
        storage.mkdir(tmp)
        return PendingCheckpoint(final=final, tmp_dir=tmp, overwrite=overwrite)

    def abort(self, pending: PendingCheckpoint) -> None:
        self.storage.remove_tree(pending.tmp_dir)

    @contextlib.contextmanager
    def part_lock(self, pending: PendingCheckpoint, *, exclusive: bool) -> Iterator[None]:
        release = self._dir_lock(pending, exclusive=exclusive)
        try:
            yield
        finally:
            release()

    def _dir_lock(self, pending: PendingCheckpoint, *, exclusive: bool) -> Callable[[], None]:
        """Lock the temporary directory of ``pending`` (``flock`` on the directory itself): part
        writers hold it shared, the committer exclusively. Returns what releases it (an unlock
        before the close: a close alone would leave the lock to any DataLoader worker forked
        while it was held, ckpt._locks; a dead process's lock goes with it). The wait is
        bounded (``knobs().lock_timeout_s``, WaitTimeoutError). A directory gone raises
        ``DistributedUsageError`` for a part writer, ``SaveConflictError`` for the commit.

        Why: a part's files are written through open descriptors, which follow the directory
        when the commit renames it. A writer still running when a commit went ahead without its
        part (a snapshot that left a participant out) would add files that the committed MANIFEST
        does not name, and the committed checkpoint would no longer open (UnexpectedFileError)."""
        gone = _gone(pending, exclusive=exclusive)
        try:
            fd = os.open(pending.tmp_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise gone from None
        try:
            what = ("the temporary directory, for the part writers still in flight" if exclusive
                    else "the temporary directory, for the commit in progress")
            flock_bounded(fd, exclusive=exclusive, timeout_s=knobs().lock_timeout_s, what=what, path=pending.tmp_dir)
            try:
                st = os.stat(pending.tmp_dir)
            except FileNotFoundError:
                st = None
            held = os.fstat(fd)
            if st is None or (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino):
                raise gone
        except BaseException:
            unlock_and_close(fd)
            raise
        return lambda: unlock_and_close(fd)

    def _claim(self, path: str) -> tuple[Callable[[], None] | None, float]:
        """Lock a temporary directory exclusively without waiting (recovery): (what releases
        it, its mtime), or (None, 0) while a writer holds it (or it cannot be locked)."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None, 0.0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mtime = os.fstat(fd).st_mtime
        except OSError:
            os.close(fd)  # never locked by us: nothing to release
            return None, 0.0
        return (lambda: unlock_and_close(fd)), mtime

    def publish(self, pending: PendingCheckpoint, manifest: bytes, parts: Sequence[PartEntry | PartRef], *,
                unsynced: Sequence[Any] = ()) -> None:
        # exclusive: waits for part writers still in flight, so none adds a file after the rename
        release = self._dir_lock(pending, exclusive=True)
        try:
            self._drop_unnamed(pending, parts)
            self._check_named(pending, parts)
            self._write_manifest_and_rename(pending, manifest, unsynced)
        finally:
            release()

    def _check_named(self, pending: PendingCheckpoint, parts: Sequence[PartEntry | PartRef]) -> None:
        """Before a commit: every file the MANIFEST will name is a regular file of its
        declared size (one lstat each). Another process may have removed a file of this save
        (a cleanup of the run directory); committing would name a file that is not there."""
        for fname, fsize, _ in PartList(parts).file_sizes():
            path = os.path.join(pending.tmp_dir, fname)
            try:
                st = self.storage.lstat(path)
            except FileNotFoundError:
                raise SaveConflictError("a file of this save was removed before its commit (another process "
                                        "cleaned the run directory?); nothing was committed", path=path) from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != fsize:
                raise SaveConflictError(f"a file of this save is not the regular file of {fsize} bytes it was written "
                                        "as (another process replaced it); nothing was committed", path=path)

    def _drop_unnamed(self, pending: PendingCheckpoint, parts: Sequence[PartEntry | PartRef]) -> None:
        """Before a commit: remove what the parts being committed do not name (a part left
        out of this commit: its writer died mid-write, or was left out while writing). The
        directory must hold exactly the files the MANIFEST names (spec §10.3)."""
        storage = self.storage
        named = {n for n, _, _ in PartList(parts).file_sizes()} | {MANIFEST_NAME}
        for entry in storage.listdir(pending.tmp_dir):
            if entry not in named:
                path = os.path.join(pending.tmp_dir, entry)
                if stat.S_ISDIR(storage.lstat(path).st_mode):
                    storage.remove_tree(path)
                else:
                    storage.remove_file(path)

    def _write_manifest_and_rename(self, pending: PendingCheckpoint, blob: bytes, unsynced: Sequence[Any] = ()) -> None:
        storage = self.storage
        sink = storage.create(os.path.join(pending.tmp_dir, MANIFEST_NAME), max(knobs().chunk_size, 4096))
        try:
            sink.write(blob)
            # Hand MANIFEST's bytes to the kernel now (a local sink gathers small writes
            # until close): from here on, a process killed at any point leaves a complete
            # temporary copy that recovery can publish (§10.3).
            sink.flush()
            # MANIFEST's fsync and the directory's (which now lists every file, MANIFEST
            # included) have no order between them, only both before the rename (§10.7);
            # in a fused commit neither have the part files' fsyncs (recovery re-hashes a
            # copy that small before publishing it): all are issued together and cost one
            # journal commit, not one each.
            _helpers.together([*(u.close for u in unsynced), sink.close,
                               lambda: storage.fsync_dir(pending.tmp_dir)])
        except BaseException:
            sink.discard()
            raise
        self._rename_into_place(pending)

    def _rename_into_place(self, pending: PendingCheckpoint) -> None:
        """Give the complete temporary directory its final name (§10 steps 5-6)."""
        storage = self.storage
        final, tmp = pending.final, pending.tmp_dir
        parent = os.path.dirname(final)
        try:
            storage.rename_noreplace(tmp, final)
        except FileExistsError:
            if not pending.overwrite:
                raise CheckpointExistsError(
                    "a checkpoint already exists here (committed while this one was written); pass overwrite=True to replace it",
                    path=final,
                ) from None
        else:
            storage.fsync_dir(parent)
            return
        # overwrite: the final name holds the old checkpoint.
        if storage.exchange(tmp, final):
            # One atomic swap: the final name always holds a complete copy (old, then new).
            storage.fsync_dir(parent)
            # The removal needs no fsync of its own (§10.7): if a crash undoes it, the old
            # copy is back under a temporary name, beside a committed final name, and
            # recovery removes it as redundant.
            storage.remove_tree(tmp)  # now the old checkpoint
            return
        # No exchange on this filesystem: move the old aside, then the new into place. A
        # crash in between leaves both complete under temporary names; recover() renames
        # one back (spec §10), so cleanup never deletes the only complete copy.
        aside = os.path.join(parent, tmp_name(os.path.basename(final), OLD_SUFFIX))
        storage.rename_dir(final, aside)
        try:
            storage.rename_noreplace(tmp, final)
        except BaseException:
            # Someone took the name in between: put the old one back if we still can.
            try:
                storage.rename_noreplace(aside, final)
            except OSError:
                pass
            raise
        storage.fsync_dir(parent)
        storage.remove_tree(aside)  # no fsync needed: see the exchange case above

    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None) -> Recovery:
        """See ``ckpt.writer.recover``. A temporary directory a live writer may still commit
        is left alone (spec §10.4): one whose lock is held (a part being written, a commit in
        progress: the kernel drops an ``flock`` when its holder dies) is neither restored nor
        removed, and one changed within ``orphan_grace_s`` is not removed (a save between its
        steps holds no lock). The directories acted on stay locked meanwhile, so a writer that
        comes back finds them gone and fails with a documented error."""
        try:
            entries = sorted(self.storage.listdir(parent))
        except FileNotFoundError:
            return Recovery((), ())
        held: list[Callable[[], None]] = []  # temporary directories this call locked (none is in use)
        try:
            return self._recover(parent, entries, names, held)
        finally:
            for release in held:
                release()  # explicit unlock: a worker forked meanwhile shares the lock

    def _recover(self, root: str, entries: list[str], names: Callable[[str], bool] | None,
                 held: list[Callable[[], None]]) -> Recovery:
        storage = self.storage
        cutoff = time.time() - knobs().orphan_grace_s
        tmps: list[str] = []
        young: set[str] = set()
        for t in (n for n in entries if n.startswith(TMP_PREFIX)):
            path = os.path.join(root, t)
            try:
                is_dir = stat.S_ISDIR(storage.lstat(path).st_mode)
            except FileNotFoundError:
                continue
            if not is_dir:
                tmps.append(t)  # not a directory: nothing writes into it
                continue
            release, mtime = self._claim(path)
            if release is None:
                continue  # a live writer's: not ours to touch
            held.append(release)
            tmps.append(t)
            if mtime >= cutoff:
                young.add(t)
        by_name: dict[str, list[tuple[int, str]]] = {}
        for t in tmps:
            m = _TMP_RE.match(t)
            if not m or m.group("suffix") == DEL_SUFFIX:
                continue
            name = m.group("name")
            if not recoverable(name, names):
                continue
            # Preference: the new copy (its save had finished writing) before the old one.
            by_name.setdefault(name, []).append((1 if m.group("suffix") == OLD_SUFFIX else 0, t))
        restored: list[tuple[str, str]] = []
        keep: set[str] = set()
        for name, cands in sorted(by_name.items()):
            final = os.path.join(root, name)
            if storage.isfile(os.path.join(final, MANIFEST_NAME)):
                continue  # committed under its final name: the copies are redundant
            for _, t in sorted(cands):
                if not is_complete(storage, os.path.join(root, t)):
                    continue
                try:
                    storage.rename_noreplace(os.path.join(root, t), final)
                except OSError:
                    # Something else sits under the final name: touch none of the copies.
                    keep.update(c for _, c in cands)
                    break
                storage.fsync_dir(root)
                restored.append((t, name))
                break
        removed = []
        done = {t for t, _ in restored}
        for t in tmps:
            if t in done or t in keep or t in young:
                continue
            storage.remove_tree(os.path.join(root, t))
            removed.append(t)
        # No fsync for the removals (§10.7): a removal a crash undoes leaves a temporary
        # name, which no reader accepts and the next recovery removes again.
        return Recovery(tuple(restored), tuple(removed))

    def remove_checkpoints(self, parent: str, paths: Sequence[str], *, durable: bool) -> tuple[str, ...]:
        # Each is renamed into a ``.tmp-`` name first, so a crash mid-delete leaves a
        # directory no reader accepts, never a torn checkpoint.
        storage = self.storage
        deleted: list[str] = []
        trashed: list[str] = []
        for path in paths:
            trash = os.path.join(parent, tmp_name(os.path.basename(path), DEL_SUFFIX))
            try:
                storage.rename_dir(path, trash)
            except FileNotFoundError:
                continue
            trashed.append(trash)
            deleted.append(path)
        if durable and trashed:
            storage.fsync_dir(parent)  # the renames: the removals below need no durability
        for trash in trashed:
            storage.remove_tree(trash)
        return tuple(deleted)

    def run_lock(self, run_dir: str, *, owner: dict[str, object] | None = None, wait: bool = False) -> RunLockHandle:
        from ..runlock import RunLock

        return RunLock.acquire(run_dir, owner=owner, wait=wait)

    def holding(self, lock: RunLockHandle) -> Any:
        return self.storage  # a kernel lock: held until its holder dies, nothing to prove


def _gone(pending: PendingCheckpoint, *, exclusive: bool) -> CkptError:
    if exclusive:
        return SaveConflictError(
            "the checkpoint's temporary directory is gone before its commit: another process removed it "
            "(a cleanup of the run directory), or it was already committed or aborted; nothing was committed",
            path=pending.tmp_dir)
    return DistributedUsageError(
        "the checkpoint's temporary directory is gone: it was committed or aborted before this "
        "part was written (a part written after the commit is not part of it), or another process's "
        "cleanup removed it", path=pending.final)


def recoverable(name: str, names: Callable[[str], bool] | None) -> bool:
    """Whether recovery may act on the checkpoint name ``name``: a valid name that
    ``names`` (the caller's filter, such as the manager's ``step-*``) accepts."""
    try:
        check_name(name, what="checkpoint directory")
    except CkptError:
        return False
    return names is None or bool(names(name))


def files_total(parts: Sequence[PartEntry | PartRef]) -> int:
    """Bytes of every file the parts name (MANIFEST itself not counted): what decides
    whether a checkpoint may be committed fused, and whether recovery re-hashes a copy."""
    return sum(size for _, size, _ in PartList(parts).file_sizes())


def is_complete(storage: Any, path: str) -> bool:
    """A committed copy whatever its name: its MANIFEST decodes (own digest included)
    and every file it names is a regular file of the declared size; this tells a whole
    copy from a torn save. A copy whose files total at most ``FUSED_COMMIT_MAX`` may have
    been committed fused, its MANIFEST durable before its files (§10.7), so its files'
    chunks are re-hashed too (cheap at that size); a larger copy's files were durable
    before its MANIFEST existed, and its digests are left to the load that verifies them."""
    from .base import read_manifest  # base names Commit for its annotations: read at call time

    try:
        man, _ = read_manifest(storage, path)
        for fname, fsize, _ in man.parts.file_sizes():
            fst = storage.lstat(os.path.join(path, fname))
            if not stat.S_ISREG(fst.st_mode) or fst.st_size != fsize:
                return False
        if files_total(man.parts.listed()) <= FUSED_COMMIT_MAX:
            return _content_intact(storage, path, man)
    except (OSError, CkptError):
        return False
    return True


def _content_intact(storage: Any, path: str, man: Manifest) -> bool:
    """Every chunk of every file listed in ``man`` matches its digest (a part listed by
    reference: its part manifest's digest; its files were durable before it, §10.7).
    Through the one range walker, in bounded pieces; raises CkptError on a mismatch."""
    from .._ranges import RangeWalker  # the reader's walker; loaded only when recovery re-hashes

    for part in man.parts.listed():
        if isinstance(part, PartRef):
            blob = storage.read(os.path.join(path, part.manifest), 0, part.manifest_size)
            if digest_bytes(blob) != part.manifest_digest:
                return False
            continue
        for f in part.files:
            fpath = os.path.join(path, f.name)
            handle = storage.open_read(fpath)
            try:
                RangeWalker(fpath, f, handle.pread_into, verify=True).walk([], whole=True)
            finally:
                handle.close()
    return True


# --- the manifest-last commit (an object store) -----------------------------------------


class ObjectStore(Protocol):
    """The requests an object store makes for :class:`ManifestLastCommit`
    (spec/object-storage.md §O.3-§O.6): conditional puts and deletes only it can make.
    ``fence``, where given, proves the run's lease (§O.6): called right before the
    MANIFEST put and before any deletion; it raises ``LeaseLostError`` once the lease was
    taken over."""

    def begin(self, final: str, *, overwrite: bool) -> PendingCheckpoint: ...
    def publish(self, pending: PendingCheckpoint, manifest: bytes, *, fence: Callable[[], None] | None = None) -> None: ...
    def abort(self, pending: PendingCheckpoint) -> None: ...
    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None,
                fence: Callable[[], None] | None = None) -> Recovery: ...
    def remove_checkpoint(self, path: str, *, fence: Callable[[], None] | None = None) -> bool: ...
    def lock(self, run_dir: str, *, owner: dict[str, object] | None = None) -> RunLockHandle: ...
    def ledger_dir(self, run_dir: str) -> str: ...


class ManifestLastCommit(Commit):
    """The commit protocol of a store without rename: parts under save-unique names,
    MANIFEST last with a conditional put. ``store`` makes the requests (a wrapper of the
    store that implements :class:`ObjectStore` sees each of them)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def over(self, storage: Any) -> Commit:
        return ManifestLastCommit(storage)

    def begin(self, final: str, *, overwrite: bool) -> PendingCheckpoint:
        return self.store.begin(final, overwrite=overwrite)

    def publish(self, pending: PendingCheckpoint, manifest: bytes, parts: Sequence[PartEntry | PartRef], *,
                unsynced: Sequence[Any] = ()) -> None:
        # MANIFEST's put makes the checkpoint visible at once: nothing can be made durable
        # beside it, so every part file is first.
        _helpers.together([u.close for u in unsynced])
        # Objects MANIFEST does not name are ignored by readers (§O.4): nothing to drop first.
        self.store.publish(pending, manifest)

    def abort(self, pending: PendingCheckpoint) -> None:
        self.store.abort(pending)

    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None) -> Recovery:
        return self.store.recover(parent, names=names)

    def remove_checkpoints(self, parent: str, paths: Sequence[str], *, durable: bool) -> tuple[str, ...]:
        # MANIFEST first (uncommitted from that instant), then the rest; an acknowledged
        # delete is durable.
        return tuple(p for p in paths if self.store.remove_checkpoint(p))

    def run_lock(self, run_dir: str, *, owner: dict[str, object] | None = None, wait: bool = False) -> RunLockHandle:
        if wait:
            raise CkptError("set_writer(wait=True) needs a local run directory (an object store's lock "
                            "object cannot be waited for)", path=run_dir)
        return self.store.lock(run_dir, owner=owner)

    def holding(self, lock: RunLockHandle) -> Any:
        # A lease, not a kernel lock: every commit and deletion proves it first
        # (LeaseLostError once another writer took the run over after it expired).
        from . import FencedStorage

        return FencedStorage(self.store, lock)  # type: ignore[arg-type]

    def ledger_dir(self, run_dir: str) -> str:
        return self.store.ledger_dir(run_dir)

    def record_path(self, given: str, normal: str) -> str:
        return normal
