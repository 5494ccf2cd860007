"""The I/O seam: everything that touches the filesystem goes through a ``Storage``.

Format logic (``ckpt.format``) is pure; writer and reader talk to a ``Storage`` for
files. ``LocalStorage`` is the POSIX implementation: O_EXCL creates, fsync of files
and of directories after renames, positional reads straight into caller memory.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Iterator, Protocol

from ._pipeline import OrderedFeeder
from .format.digest import ChunkHasher

__all__ = ["Storage", "LocalStorage", "FileSink", "local"]


class FileSink(Protocol):
    def write(self, data: memoryview | bytes) -> None: ...
    def close(self) -> tuple[int, bytes]: ...  # (size, concatenated chunk digests)
    def discard(self) -> None: ...


class Storage(Protocol):
    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> FileSink: ...
    def pread_into(self, path: str, offset: int, buf: memoryview) -> int: ...
    def read(self, path: str, offset: int, size: int) -> bytes: ...
    def lstat(self, path: str) -> os.stat_result: ...
    def listdir(self, path: str) -> list[str]: ...
    def mkdir(self, path: str) -> None: ...
    def rename_dir(self, src: str, dst: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def fsync_dir(self, path: str) -> None: ...


_OVERLAP_MIN = 8 << 20


class _LocalSink:
    __slots__ = ("path", "_fd", "_hasher", "_durable", "_feeder")

    def __init__(self, path: str, chunk_size: int, durable: bool) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._hasher = ChunkHasher(chunk_size)
        self._durable = durable
        self._feeder: OrderedFeeder | None = None

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        # The digest is computed from the same memory the kernel copies from, so there
        # is no second read pass and what is hashed is what is handed to write().
        # Large pieces are hashed on a second thread while this one writes them (the
        # caller keeps the memory alive and unchanged until close()).
        if len(mv) >= _OVERLAP_MIN:
            if self._feeder is None:
                self._feeder = OrderedFeeder(self._hasher.update, "ckpt-digest")
            self._feeder.feed(mv)
        elif self._feeder is not None:
            self._feeder.feed(mv)  # keep digest order once the thread is in use
        else:
            self._hasher.update(mv)
        pos, n = 0, len(mv)
        while pos < n:
            pos += os.write(self._fd, mv[pos : pos + (1 << 30)])

    def close(self) -> tuple[int, bytes]:
        try:
            if self._feeder is not None:
                feeder, self._feeder = self._feeder, None
                feeder.finish()
            if self._durable:
                os.fsync(self._fd)
        finally:
            if self._feeder is not None:
                self._feeder.abort()
                self._feeder = None
            os.close(self._fd)
            self._fd = -1
        return self._hasher.size, self._hasher.finish()

    def discard(self) -> None:
        if self._feeder is not None:
            self._feeder.abort()
            self._feeder = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalStorage:
    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> _LocalSink:
        return _LocalSink(path, chunk_size, durable)

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

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o755)

    def rename_dir(self, src: str, dst: str) -> None:
        # os.rename onto an existing non-empty directory fails (ENOTEMPTY), which is
        # exactly the no-clobber behaviour a commit needs.
        os.rename(src, dst)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


def is_regular_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def walk_files(path: str) -> Iterator[str]:
    for name in sorted(os.listdir(path)):
        yield name


local = LocalStorage()
