"""``LocalStorage``: the POSIX backend of the storage seam (``ckpt.storage``).

O_EXCL creates, fsync of files and of directories after renames, positional reads
straight into caller memory (``preadv``), and the two atomic renames a commit needs
(spec/checkpoint-format.md §10): rename-unless-the-target-exists
(``renameat2(RENAME_NOREPLACE)``) and swap-two-names (``renameat2(RENAME_EXCHANGE)``),
through ctypes on Linux. The commit protocol built on these renames is
``ckpt.storage.commit.RenameCommit``; object stores, which have no rename, commit
differently (``ManifestLastCommit``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
from typing import Callable

from .._pipeline import OrderedFeeder
from ..errors import CkptError
from ..format.digest import ChunkHasher
from ..knobs import knobs
from ._url import refuse_url
from .base import Storage
from .commit import Commit, RenameCommit

__all__ = ["LocalStorage", "LocalFile", "local", "preadv_full", "first_errno", "is_space_error"]


_OVERLAP_MIN = 8 << 20
#: writes below this size are gathered and handed to the kernel together (writev)
_GATHER_MAX = 256 << 10
#: at most this many buffers or bytes wait for one writev (IOV_MAX is 1024 on Linux)
_GATHER_BUFFERS = 512
_GATHER_BYTES = 8 << 20


def _load_sync_file_range() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class _LocalSink:
    """One file being written: hashed as it is written, fsynced by ``close``.

    Three things keep it at the speed of the disk (measured in bench/save_load.py
    against ``safetensors.save_file`` + fsync):

    * small pieces (a state of thousands of small tensors) are gathered and written
      with one ``writev`` per up to 512 buffers or 8 MiB: one system call each, not one
      per tensor, with no copy into a bounce buffer;
    * large pieces are hashed on a second thread while this one writes them;
    * a durable file starts writeback of what it has written every ``writeback_bytes``
      (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which only queues the I/O), so the
      disk works while later bytes are still being copied in and the closing
      ``fsync`` waits for the tail only, instead of the whole file after the last
      write. The fsync is still what makes the file durable; the early kicks change
      when the writes are issued, not what is guaranteed.

    ``seal`` ends the writing without the fsync (every byte handed to the kernel, the
    digests final); ``close`` then only waits for durability. A small save seals its
    files, writes MANIFEST from their digests, and closes all of them together (spec
    §10.7, the fused commit), so their fsyncs are one wait instead of two.
    """

    __slots__ = ("path", "_fd", "_hasher", "_durable", "_feeder", "_iov", "_iov_bytes", "_pos", "_kicked", "_kick_every",
                 "_sealed")

    def __init__(self, path: str, chunk_size: int, durable: bool) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._hasher = ChunkHasher(chunk_size)
        self._durable = durable
        self._feeder: OrderedFeeder | None = None
        self._iov: list[memoryview] = []
        self._iov_bytes = 0
        self._pos = 0  # bytes handed to the kernel
        self._kicked = 0  # bytes whose writeback was started
        every = knobs().writeback_bytes
        self._kick_every = every if durable and every > 0 and _sync_file_range is not None else 0
        self._sealed: tuple[int, bytes] | None = None

    def write(self, data: memoryview | bytes) -> None:
        mv = data if type(data) is memoryview and data.format == "B" and data.ndim == 1 else memoryview(data).cast("B")
        n = len(mv)
        # The digest is computed from the same memory the kernel copies from, so there
        # is no second read pass and what is hashed is what is handed to write().
        # Large pieces are hashed on a second thread while this one writes them (the
        # caller keeps the memory alive and unchanged until close()).
        if n >= _OVERLAP_MIN:
            if self._feeder is None:
                self._feeder = OrderedFeeder(self._hasher.update, "ckpt-digest")
            self._feeder.feed(mv)
        elif self._feeder is not None:
            self._feeder.feed(mv)  # keep digest order once the thread is in use
        else:
            self._hasher.update(mv)
        if n < _GATHER_MAX:
            self._iov.append(mv)
            self._iov_bytes += n
            if len(self._iov) >= _GATHER_BUFFERS or self._iov_bytes >= _GATHER_BYTES:
                self._flush()
            return
        if self._iov:
            self._flush()
        # In writeback-sized pieces, so the disk starts on each piece as the next is copied.
        step = self._kick_every or (1 << 30)
        pos = 0
        while pos < n:
            got = os.write(self._fd, mv[pos : pos + step])
            pos += got
            self._pos += got
            self._kick()

    def write_copy(self, data: memoryview | bytes) -> None:
        """``write``, but ``data`` is copied into the file and hashed before this returns,
        so the caller may overwrite it at once (the packed-file encoder recycles its block
        buffers: fresh memory costs a page fault per 4 KiB here). Pieces gathered earlier
        go out in the same ``writev``."""
        if self._feeder is not None:
            self.write(bytes(data))  # keep the digest order of the hashing thread: the sink owns a copy
            return
        mv = data if type(data) is memoryview and data.format == "B" and data.ndim == 1 else memoryview(data).cast("B")
        self._hasher.update(mv)
        self._iov.append(mv)
        self._iov_bytes += len(mv)
        self._flush()

    def flush(self) -> None:
        """Hand every byte written so far to the kernel (not a durability point: see close)."""
        if self._iov:
            self._flush()

    def _flush(self) -> None:
        iov, self._iov, self._iov_bytes = self._iov, [], 0
        while iov:
            done = os.writev(self._fd, iov)
            self._pos += done
            # A short writev (rare: signals, a full disk reports ENOSPC instead) leaves
            # the rest of the buffers to write.
            while iov and done >= len(iov[0]):
                done -= len(iov[0])
                iov.pop(0)
            if iov and done:
                iov[0] = iov[0][done:]
        self._kick()

    def _kick(self) -> None:
        if self._kick_every and self._pos - self._kicked >= self._kick_every:
            # Failure here is harmless (the fsync in close() is what counts): ignore it.
            _sync_file_range(self._fd, self._kicked, self._pos - self._kicked, _SYNC_FILE_RANGE_WRITE)
            self._kicked = self._pos

    def seal(self) -> tuple[int, bytes]:
        """Hand every byte written to the kernel and finish the digests: (size, chunk
        digests), what ``close`` will return. Nothing may be written after it, and the
        file is not durable until ``close`` returns."""
        if self._sealed is None:
            if self._iov:
                self._flush()
            if self._feeder is not None:
                feeder, self._feeder = self._feeder, None
                feeder.finish()
            self._sealed = (self._hasher.size, self._hasher.finish())
        return self._sealed

    def close(self) -> tuple[int, bytes]:
        try:
            sealed = self.seal()
            if self._durable:
                os.fsync(self._fd)
        finally:
            if self._feeder is not None:
                self._feeder.abort()
                self._feeder = None
            self._iov = []
            os.close(self._fd)
            self._fd = -1
        return sealed

    def discard(self) -> None:
        if self._feeder is not None:
            self._feeder.abort()
            self._feeder = None
        self._iov = []
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# renameat2(2) flags (linux/fs.h).
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _load_renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28 / not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


class LocalFile:
    """An open descriptor of one file (``LocalStorage.open_read``).

    A held descriptor keeps reading the same bytes even if the file is renamed or
    deleted meanwhile (retention renames before it deletes). ``fd`` is public: the
    local fast paths (parallel ``preadv``, ``mmap``) use it directly.
    """

    __slots__ = ("path", "fd")
    mappable = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))

    def pread_into(self, offset: int, buf: memoryview) -> int:
        return preadv_full(self.fd, buf, offset, knobs().read_request)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def fileno(self) -> int:
        return self.fd

    def map_private(self, size: int, *, require_lease: bool = True) -> "mmap.mmap | None":
        """A private (copy-on-write) mapping of the first ``size`` bytes, kept alive by
        the tensors that view it. With ``require_lease`` (the default fresh load), only
        under a read lease that keeps a truncation from ever reaching it
        (``ckpt.storage._lease``, spec §11.1): ``None`` when no lease can be taken."""
        from . import _lease

        try:
            return _lease.map_leased(self.fd, size, self.path)
        except _lease.LeaseUnavailable:
            return None if require_lease else _lease.map_private(self.fd, size)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalStorage(Storage):
    """POSIX files. ``renameat2=False`` forces the portable fallbacks (tests use it to
    exercise the commit protocol a filesystem without ``renameat2`` gets)."""

    #: URL scheme this backend serves (``file://`` URLs and plain paths)
    scheme = "file"
    # A class default, so subclasses that do not call __init__ still work.
    _use_renameat2: bool = True

    def __init__(self, *, renameat2: bool = True) -> None:
        self._use_renameat2 = renameat2

    @property
    def commit(self) -> Commit:
        # Bound to self on each use: a subclass's overridden operations are the ones used.
        return RenameCommit(self)

    def _rename2(self, src: str, dst: str, flags: int) -> bool:
        """``renameat2``; False when the kernel or filesystem does not support ``flags``."""
        if _renameat2 is None or not self._use_renameat2:
            return False
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return False  # e.g. an old kernel, or a filesystem without the flag
        raise OSError(err, os.strerror(err), src, None, dst)

    # -- paths -----------------------------------------------------------------------
    def normalize(self, path: str | os.PathLike[str]) -> str:
        """The absolute path. A URL (``s3://...``) is refused, never made a folder."""
        p = os.fspath(path)
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        if p.startswith("file://"):
            p = p[len("file://") :]
        refuse_url(p)
        return os.path.abspath(p)

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def readlink(self, path: str) -> str:
        return os.readlink(path)

    # -- files ------------------------------------------------------------------------
    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> _LocalSink:
        return _LocalSink(path, chunk_size, durable)

    def open_read(self, path: str, *, reread: bool = False) -> LocalFile:
        # ``reread`` (an in-place load's two passes) needs nothing here: the page cache.
        return LocalFile(path)

    def pread_into(self, path: str, offset: int, buf: memoryview) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        try:
            return preadv_full(fd, buf, offset)
        finally:
            os.close(fd)

    def read(self, path: str, offset: int, size: int) -> bytes:
        buf = bytearray(size)
        got = self.pread_into(path, offset, memoryview(buf))
        return bytes(buf[:got])

    def lstat(self, path: str) -> os.stat_result:
        return os.lstat(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def exists(self, path: str) -> bool:
        """Whether anything (a dangling symlink included) has this name."""
        return os.path.lexists(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o755)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename_dir(self, src: str, dst: str) -> None:
        # os.rename onto an existing non-empty directory fails (ENOTEMPTY), which is
        # exactly the no-clobber behaviour a commit needs.
        os.rename(src, dst)

    def rename_noreplace(self, src: str, dst: str) -> None:
        # Atomic "rename unless dst exists": two writers racing for one name cannot
        # both win, and there is no check-then-rename window.
        if self._rename2(src, dst, _RENAME_NOREPLACE):
            return
        # Fallback: rename(2) of a directory fails onto a non-empty directory
        # (ENOTEMPTY/EEXIST) or a file (ENOTDIR). A committed checkpoint always holds a
        # MANIFEST, so only an empty directory could be replaced here, never a checkpoint.
        try:
            os.rename(src, dst)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise FileExistsError(errno.EEXIST, "target exists", dst) from e
            raise

    def exchange(self, a: str, b: str) -> bool:
        return self._rename2(a, b, _RENAME_EXCHANGE)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_file(self, path: str) -> None:
        os.unlink(path)

    def link(self, src: str, dst: str) -> bool:
        try:
            # follow_symlinks=False: link the file itself, never a symlink's target
            os.link(src, dst, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError:
            # EXDEV (another filesystem), EMLINK (link limit), EPERM/EOPNOTSUPP (no hard
            # links here), ENOENT (the source was removed): write the bytes instead.
            return False
        return True

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def first_errno(e: BaseException | None) -> int | None:
    """The OS error number behind ``e`` (its causes included), if any."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        if isinstance(e, CkptError) and isinstance(e.context.get("errno"), int):
            return e.context["errno"]
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def is_space_error(e: BaseException | None) -> bool:
    """The filesystem is full (or the quota spent): ENOSPC / EDQUOT."""
    return first_errno(e) in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def preadv_full(fd: int, buf: memoryview, offset: int, request: int = 16 << 20) -> int:
    """Fill ``buf`` from ``offset``; returns bytes read (short only at end of file)."""
    mv = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    pos, n = 0, len(mv)
    while pos < n:
        got = os.preadv(fd, [mv[pos : pos + request]], offset + pos)
        if got == 0:
            break
        pos += got
    return pos


#: the process-wide local backend (what a plain path resolves to)
local = LocalStorage()
