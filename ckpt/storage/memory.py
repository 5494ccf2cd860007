"""``MemoryStorage``: a whole filesystem in this process's memory, behind the same seam.

For the fault simulator and for fast tests: a save, a load, ``verify``, a manager's
retention and crash recovery run on it exactly as on a disk, because it honours the
contracts the POSIX backend does and commits with the same protocol
(:class:`~ckpt.storage.commit.RenameCommit`):

* ``create`` is exclusive (``FileExistsError``), in an existing directory;
* ``rename_noreplace`` and ``exchange`` are atomic (one lock over the tree);
  ``rename_dir`` refuses a non-empty target directory, as rename(2) does;
* an open handle keeps reading its file after a rename or a delete, as a descriptor does;
* ``link`` shares one file under two names (a hard link: same inode, dedup works);
* every file has an inode number, a device number and a modification time, so the
  dedup checks that key files by identity (``ckpt._linkcheck``) work unchanged;
* the part lock and the run lock are in-process locks over directories of this storage
  (:class:`MemoryCommit`), bounded like the ``flock`` waits they stand for.

What it does not model: durability. Every operation is durable when it returns (there is
no power to lose); the fault simulator's power-loss model is ``tests/sim/faultfs.py``.
Paths are absolute POSIX paths (``/run/step-00000010``); a ``memory://`` prefix is
accepted and dropped. It is never chosen by ``resolve``: pass it as ``storage=``.
"""

from __future__ import annotations

import errno
import itertools
import os
import posixpath
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import RunDirLockedError, WaitTimeoutError
from ..format.digest import ChunkHasher
from ..knobs import knobs
from ._url import refuse_url
from .base import Storage
from .commit import Commit, PendingCheckpoint, RenameCommit, RunLockHandle, _gone

__all__ = ["MemoryStorage", "MemoryCommit"]

_PREFIX = "memory://"


@dataclass(eq=False)
class _File:
    ino: int
    data: bytearray = field(default_factory=bytearray)
    mtime_ns: int = field(default_factory=time.time_ns)
    nlink: int = 1


@dataclass(eq=False)
class _Dir:
    ino: int
    entries: dict[str, _File | _Dir] = field(default_factory=dict)
    mtime_ns: int = field(default_factory=time.time_ns)


class _Sink:
    """A file being written: its bytes appended and hashed as they come (``FileSink``)."""

    def __init__(self, owner: MemoryStorage, path: str, node: _File, chunk_size: int) -> None:
        self.path = path
        self._owner = owner
        self._node = node
        self._hasher = ChunkHasher(chunk_size)
        self._open = True

    def write(self, data: memoryview | bytes) -> None:
        if not self._open:
            raise ValueError(f"write to a closed file: {self.path}")
        mv = memoryview(data).cast("B")
        self._hasher.update(mv)
        with self._owner._lock:
            self._node.data += mv
            self._node.mtime_ns = time.time_ns()

    def write_copy(self, data: memoryview | bytes) -> None:
        self.write(data)  # the bytes are copied before this returns

    def flush(self) -> None:
        pass  # every write is in the file already

    def seal(self) -> None:
        return None  # nothing to make durable: close finishes the file

    def close(self) -> tuple[int, bytes]:
        self._open = False
        return self._hasher.size, self._hasher.finish()

    def discard(self) -> None:
        self._open = False  # like a closed descriptor: what was written stays


class _Handle:
    """An open file: the file itself, not its name (``ReadHandle``)."""

    mappable = False

    def __init__(self, owner: MemoryStorage, path: str, node: _File) -> None:
        self.path = path
        self._owner = owner
        self._node = node

    def pread_into(self, offset: int, buf: memoryview) -> int:
        mv = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        with self._owner._lock:
            chunk = self._node.data[offset : offset + len(mv)]
        mv[: len(chunk)] = chunk
        return len(chunk)

    def size(self) -> int:
        with self._owner._lock:
            return len(self._node.data)

    def map_private(self, size: int, *, require_lease: bool = True) -> None:
        return None  # no file to map: loads read through pread_into

    def close(self) -> None:
        pass


class MemoryStorage(Storage):
    """A filesystem in memory (see the module docstring). Thread-safe: one lock over the
    tree makes every rename atomic."""

    scheme = "memory"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._inos = itertools.count(2)
        self._root = _Dir(1)
        self._dev = id(self) & 0xFFFF_FFFF
        # the in-process locks of MemoryCommit: directory inode -> its lock, run dir -> holder
        self._dir_locks: dict[int, _RWLock] = {}
        self._run_locks: dict[str, dict[str, object]] = {}
        self._run_cond = threading.Condition(self._lock)

    def __repr__(self) -> str:
        return f"MemoryStorage(0x{id(self):x})"

    @property
    def commit(self) -> Commit:
        return MemoryCommit(self, self)

    # -- paths ------------------------------------------------------------------------
    def normalize(self, path: str | os.PathLike[str]) -> str:
        p = os.fspath(path)
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        if p.startswith(_PREFIX):
            p = "/" + p[len(_PREFIX) :].lstrip("/")
        refuse_url(p)
        return posixpath.normpath(posixpath.join("/", p))

    def realpath(self, path: str) -> str:
        return self.normalize(path)  # no symbolic links here

    def readlink(self, path: str) -> str:
        raise OSError(errno.EINVAL, "not a symbolic link (a memory storage has none)", path)

    def _walk(self, path: str) -> tuple[_Dir, str]:
        """(the parent directory of ``path``, its last name)."""
        parts = [s for s in self.normalize(path).split("/") if s]
        node: _File | _Dir = self._root
        for i, name in enumerate(parts[:-1]):
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, "a parent is a file", "/" + "/".join(parts[: i + 1]))
            nxt = node.entries.get(name)
            if nxt is None:
                raise FileNotFoundError(errno.ENOENT, "no such directory", "/" + "/".join(parts[: i + 1]))
            node = nxt
        if not isinstance(node, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, "a parent is a file", path)
        return node, parts[-1] if parts else ""

    def _get(self, path: str) -> _File | _Dir:
        parent, name = self._walk(path)
        if not name:
            return self._root
        node = parent.entries.get(name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
        return node

    def _find(self, path: str) -> _File | _Dir | None:
        try:
            return self._get(path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _file(self, path: str) -> _File:
        node = self._get(path)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        return node

    # -- files ------------------------------------------------------------------------
    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> _Sink:
        with self._lock:
            parent, name = self._walk(path)
            if name in parent.entries:
                raise FileExistsError(errno.EEXIST, "file exists", path)
            node = parent.entries[name] = _File(next(self._inos))
            parent.mtime_ns = time.time_ns()
        return _Sink(self, path, node, chunk_size)

    def open_read(self, path: str, *, reread: bool = False) -> _Handle:
        with self._lock:
            return _Handle(self, path, self._file(path))

    def pread_into(self, path: str, offset: int, buf: memoryview) -> int:
        return self.open_read(path).pread_into(offset, buf)

    def read(self, path: str, offset: int, size: int) -> bytes:
        with self._lock:
            return bytes(self._file(path).data[offset : offset + size])

    def lstat(self, path: str) -> os.stat_result:
        with self._lock:
            node = self._get(path)
            if isinstance(node, _Dir):
                mode, size, nlink = stat.S_IFDIR | 0o755, 0, 2
            else:
                mode, size, nlink = stat.S_IFREG | 0o644, len(node.data), node.nlink
            ns = node.mtime_ns
        s = ns / 1e9
        return os.stat_result((mode, node.ino, self._dev, nlink, 0, 0, size, int(s), int(s), int(s),
                               s, s, s, ns, ns, ns))

    def listdir(self, path: str) -> list[str]:
        with self._lock:
            node = self._get(path)
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
            return sorted(node.entries)

    def exists(self, path: str) -> bool:
        with self._lock:
            return self._find(path) is not None

    def isfile(self, path: str) -> bool:
        with self._lock:
            return isinstance(self._find(path), _File)

    def isdir(self, path: str) -> bool:
        with self._lock:
            return isinstance(self._find(path), _Dir)

    def mkdir(self, path: str) -> None:
        with self._lock:
            parent, name = self._walk(path)
            if not name or name in parent.entries:
                raise FileExistsError(errno.EEXIST, "file exists", path)
            parent.entries[name] = _Dir(next(self._inos))
            parent.mtime_ns = time.time_ns()

    def makedirs(self, path: str) -> None:
        with self._lock:
            node: _File | _Dir = self._root
            for name in [s for s in self.normalize(path).split("/") if s]:
                if not isinstance(node, _Dir):
                    raise NotADirectoryError(errno.ENOTDIR, "a parent is a file", path)
                nxt = node.entries.get(name)
                if nxt is None:
                    nxt = node.entries[name] = _Dir(next(self._inos))
                node = nxt
            if not isinstance(node, _Dir):
                raise FileExistsError(errno.EEXIST, "a file has this name", path)

    def _detach(self, path: str) -> tuple[_Dir, str, _File | _Dir]:
        parent, name = self._walk(path)
        node = parent.entries.get(name) if name else None
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
        return parent, name, node

    def rename_dir(self, src: str, dst: str) -> None:
        with self._lock:
            sp, sn, node = self._detach(src)
            dp, dn = self._walk(dst)
            old = dp.entries.get(dn)
            if old is node:
                return
            if isinstance(old, _Dir) and old.entries:
                raise OSError(errno.ENOTEMPTY, "directory not empty", dst)
            if old is not None and isinstance(old, _Dir) != isinstance(node, _Dir):
                raise OSError(errno.EISDIR if isinstance(old, _Dir) else errno.ENOTDIR, "not the same kind", dst)
            self._check_not_inside(node, dst)
            del sp.entries[sn]
            dp.entries[dn] = node
            sp.mtime_ns = dp.mtime_ns = time.time_ns()

    def rename_noreplace(self, src: str, dst: str) -> None:
        with self._lock:
            sp, sn, node = self._detach(src)
            dp, dn = self._walk(dst)
            if dn in dp.entries:
                raise FileExistsError(errno.EEXIST, "target exists", dst)
            self._check_not_inside(node, dst)
            del sp.entries[sn]
            dp.entries[dn] = node
            sp.mtime_ns = dp.mtime_ns = time.time_ns()

    def _check_not_inside(self, node: _File | _Dir, dst: str) -> None:
        if not isinstance(node, _Dir):
            return
        probe: _File | _Dir = self._root
        for name in [s for s in self.normalize(dst).split("/") if s][:-1]:
            assert isinstance(probe, _Dir)
            probe = probe.entries[name]
            if probe is node:
                raise OSError(errno.EINVAL, "cannot move a directory into itself", dst)

    def exchange(self, a: str, b: str) -> bool:
        with self._lock:
            ap, an, anode = self._detach(a)
            bp, bn, bnode = self._detach(b)
            ap.entries[an], bp.entries[bn] = bnode, anode
            ap.mtime_ns = bp.mtime_ns = time.time_ns()
        return True

    def remove_tree(self, path: str) -> None:
        with self._lock:
            try:
                parent, name, node = self._detach(path)
            except (FileNotFoundError, NotADirectoryError):
                return  # as shutil.rmtree(ignore_errors=True)
            del parent.entries[name]
            self._unlinked(node)

    def remove_file(self, path: str) -> None:
        with self._lock:
            parent, name, node = self._detach(path)
            if isinstance(node, _Dir):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            del parent.entries[name]
            self._unlinked(node)

    def _unlinked(self, node: _File | _Dir) -> None:
        if isinstance(node, _File):
            node.nlink -= 1
            return
        for child in node.entries.values():
            self._unlinked(child)

    def link(self, src: str, dst: str) -> bool:
        with self._lock:
            node = self._find(src)
            if not isinstance(node, _File):
                return False  # as ENOENT locally: the writer writes the bytes instead
            parent, name = self._walk(dst)
            if name in parent.entries:
                raise FileExistsError(errno.EEXIST, "file exists", dst)
            parent.entries[name] = node
            node.nlink += 1
        return True

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            if not isinstance(self._get(path), _Dir):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)


class _RWLock:
    """Shared/exclusive, with bounded waits (what ``flock`` on a directory is locally)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def acquire(self, *, exclusive: bool, timeout_s: float, what: str, path: str) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._writer or (exclusive and self._readers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"could not take {'an exclusive' if exclusive else 'a shared'} lock on {what} within "
                        f"{timeout_s:g} s; raise CKPT_LOCK_TIMEOUT_S if the holder is only slow",
                        path=path, waited_on=what, timeout_s=timeout_s)
                self._cond.wait(left)
            if exclusive:
                self._writer = True
            else:
                self._readers += 1

    def try_exclusive(self) -> bool:
        with self._cond:
            if self._writer or self._readers:
                return False
            self._writer = True
            return True

    def idle(self) -> bool:
        with self._cond:
            return not self._writer and not self._readers

    def release(self, *, exclusive: bool) -> None:
        with self._cond:
            if exclusive:
                self._writer = False
            else:
                self._readers -= 1
            self._cond.notify_all()


class _RunLock:
    def __init__(self, owner: MemoryStorage, run_dir: str) -> None:
        self._owner = owner
        self._run_dir = run_dir
        self.held = True

    def release(self) -> None:
        with self._owner._run_cond:
            if self.held:
                self.held = False
                self._owner._run_locks.pop(self._run_dir, None)
                self._owner._run_cond.notify_all()


class MemoryCommit(RenameCommit):
    """The rename commit on a :class:`MemoryStorage` (possibly seen through a wrapper,
    ``storage``): the renames are the storage's; the part lock and the run lock are kept
    by ``mem``, the memory storage itself, since its directories are not local files."""

    def __init__(self, storage: Any, mem: MemoryStorage) -> None:
        super().__init__(storage)
        self.mem = mem

    def over(self, storage: Any) -> Commit:
        return MemoryCommit(storage, self.mem)

    def _dir_lock(self, pending: PendingCheckpoint, *, exclusive: bool) -> Callable[[], None]:
        mem = self.mem
        with mem._lock:
            node = mem._find(pending.tmp_dir)
            if not isinstance(node, _Dir):
                raise _gone(pending, exclusive=exclusive)
            lock = mem._dir_locks.setdefault(node.ino, _RWLock())
        what = ("the temporary directory, for the part writers still in flight" if exclusive
                else "the temporary directory, for the commit in progress")
        lock.acquire(exclusive=exclusive, timeout_s=knobs().lock_timeout_s, what=what, path=pending.tmp_dir)
        with mem._lock:
            same = mem._find(pending.tmp_dir) is node

        def release() -> None:
            lock.release(exclusive=exclusive)
            with mem._lock:  # forget the lock of a directory that is gone (committed or removed)
                if lock.idle() and mem._find(pending.tmp_dir) is not node:
                    mem._dir_locks.pop(node.ino, None)

        if not same:  # renamed into place (committed) or removed while we waited
            release()
            raise _gone(pending, exclusive=exclusive)
        return release

    def _claim(self, path: str) -> tuple[Callable[[], None] | None, float]:
        mem = self.mem
        with mem._lock:
            node = mem._find(path)
            if not isinstance(node, _Dir):
                return None, 0.0
            lock = mem._dir_locks.setdefault(node.ino, _RWLock())
            if not lock.try_exclusive():
                return None, 0.0  # a writer holds it
            mtime = node.mtime_ns / 1e9

        def release() -> None:
            lock.release(exclusive=True)
            with mem._lock:
                if lock.idle():
                    mem._dir_locks.pop(node.ino, None)

        return release, mtime

    def run_lock(self, run_dir: str, *, owner: dict[str, object] | None = None, wait: bool = False) -> RunLockHandle:
        mem = self.mem
        key = mem.normalize(run_dir)
        timeout_s = knobs().lock_timeout_s
        deadline = time.monotonic() + timeout_s
        with mem._run_cond:
            while key in mem._run_locks:
                holder = mem._run_locks[key]
                left = deadline - time.monotonic()
                if not wait:
                    raise RunDirLockedError(
                        f"another CheckpointManager writes this run directory (in this process, {holder}); one "
                        "writer per run directory (close it, or use another directory)", path=key, holder=holder)
                if left <= 0:
                    raise WaitTimeoutError(f"the run directory's writer lock stayed held for {timeout_s:g} s",
                                           path=key, waited_on="the run lock", timeout_s=timeout_s)
                mem._run_cond.wait(left)
            mem._run_locks[key] = {"pid": os.getpid(), **(owner or {})}
        return _RunLock(mem, key)

    def holding(self, lock: RunLockHandle) -> Any:
        return self.storage  # held until released: nothing to prove

    def ledger_dir(self, run_dir: str) -> str:
        # The ledger is an append-only local tape: kept beside, in a local temporary directory.
        import tempfile

        return os.path.join(tempfile.gettempdir(), "ckpt-ledger", "memory", f"{id(self.mem):x}",
                            *[s for s in self.mem.normalize(run_dir).split("/") if s])

    def record_path(self, given: str, normal: str) -> str:
        return normal
