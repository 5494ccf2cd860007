"""The seam's protocols: ``Storage`` (a backend), ``FileSink`` (a file being written) and
``ReadHandle`` (a file open for reading).

A backend subclasses :class:`Storage` to inherit the defaults of its optional
capabilities (no hard links, no ETags, a strict listing); callers use every member
directly, never ``getattr`` with a fallback, so a wrapper that forgets one fails loudly
instead of silently turning a capability off.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Protocol

from .._gc import paused as gc_paused
from ..errors import CheckpointVanishedError, LimitExceededError, UnsafePathError
from ..format.manifest import MANIFEST_NAME, Manifest, decode_manifest, manifest_file_limit

if TYPE_CHECKING:  # pragma: no cover
    import mmap

    from .commit import Commit

__all__ = ["Storage", "FileSink", "ReadHandle", "read_manifest"]


class FileSink(Protocol):
    """A file being written. ``write`` may keep a reference to ``data``: the caller
    keeps that memory alive and unchanged until ``close`` (zero-copy uploads and
    hashing on a second thread rely on it).

    Every member is required: a wrapper forwards each one, so that forgetting one fails
    loudly instead of silently turning a fast path off."""

    def write(self, data: memoryview | bytes) -> None: ...
    # The same bytes in the same order as ``write``, but consumed (copied out and hashed)
    # before it returns, so the caller may reuse the memory at once (the compressor
    # recycles its block buffers through it). A sink that keeps buffers (an upload
    # queue) copies them here.
    def write_copy(self, data: memoryview | bytes) -> None: ...
    # Hand every byte written so far to the store's own buffers (a local sink: to the
    # kernel), so that a process killed from here on leaves them in the file; not a
    # durability point (``close`` is). Every sink has it, wrappers forward it: a wrapper
    # that dropped it would leave a commit's MANIFEST empty on a kill (spec §10.3). A
    # sink that writes nothing until close (an object upload) does nothing.
    def flush(self) -> None: ...
    # Finish the digests and hand every byte to the store without making the file durable:
    # ``(size, chunk digests)``, what ``close`` will return; nothing may be written after
    # it. A small save seals its files and makes them durable in one batch at commit
    # (spec §10.7). ``None``: this sink has no separate durability step, ``close`` does all.
    def seal(self) -> tuple[int, bytes] | None: ...
    def close(self) -> tuple[int, bytes]: ...  # (size, concatenated chunk digests)
    def discard(self) -> None: ...


class ReadHandle(Protocol):
    """One file opened for reading. A local handle holds a descriptor (immune to
    renames and deletes); an object-store handle pins the object's version (a replaced
    or deleted object fails the next read instead of returning other bytes)."""

    path: str
    #: a local file that :meth:`map_private` can map (under a lease); False for an object,
    #: memory or a mapping: loads read it through ``pread_into``, and ``mmap=True`` has
    #: nothing to insist on there (nothing can change under the tensors)
    mappable: bool

    def pread_into(self, offset: int, buf: memoryview) -> int: ...  # fills buf; short only at end of file
    def size(self) -> int: ...
    # A private (copy-on-write) mapping of the first ``size`` bytes, for the in-place and
    # mapped loads; with ``require_lease``, only under a read lease that keeps a
    # truncation from reaching it (spec §11.1). ``None`` where no lease can be taken, and
    # always where the handle is not ``mappable``: the caller reads with ``pread_into``.
    def map_private(self, size: int, *, require_lease: bool = True) -> "mmap.mmap | None": ...
    def close(self) -> None: ...


class Storage(Protocol):
    """What reader, writer, manager and CLI need of a backend. Paths are the backend's
    own normalised form (:meth:`normalize`): absolute paths locally, ``s3://b/k`` URLs.

    ``commit`` is the backend's commit protocol (``ckpt.storage.commit``): how a save is
    published, locked, recovered and deleted. A storage that wraps another exposes
    ``inner.commit.over(self)`` so that the commit's own file operations pass through it."""

    #: URL scheme served (``file`` for local paths); for messages and URL routing only:
    #: what a backend can do is decided by its members, never by its scheme
    scheme: str
    #: False where objects a committed MANIFEST does not name are leftovers readers
    #: ignore (an object store, spec/object-storage.md §O.4); True: they are an error
    strict_listing: bool = True

    @property
    def commit(self) -> Commit: ...

    def normalize(self, path: str | os.PathLike[str]) -> str: ...
    def realpath(self, path: str) -> str: ...
    def readlink(self, path: str) -> str: ...
    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> FileSink: ...
    def open_read(self, path: str, *, reread: bool = False) -> ReadHandle: ...  # reread: read twice (keep a local copy)
    def pread_into(self, path: str, offset: int, buf: memoryview) -> int: ...
    def read(self, path: str, offset: int, size: int) -> bytes: ...
    def lstat(self, path: str) -> os.stat_result: ...
    def listdir(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...
    def isfile(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def mkdir(self, path: str) -> None: ...
    def makedirs(self, path: str) -> None: ...
    def rename_dir(self, src: str, dst: str) -> None: ...
    def rename_noreplace(self, src: str, dst: str) -> None: ...  # FileExistsError if dst exists
    def remove_tree(self, path: str) -> None: ...
    def remove_file(self, path: str) -> None: ...  # FileNotFoundError if absent
    def fsync_dir(self, path: str) -> None: ...

    def exchange(self, a: str, b: str) -> bool:
        """Swap two names atomically; False where this backend cannot (the rename commit
        then moves the old copy aside first)."""
        return False

    def link(self, src: str, dst: str) -> bool:
        """Dedup (spec/format-2.md §V.4): give ``src``'s bytes a second name ``dst``
        without writing them (a hard link; an object store may do a server-side copy).
        False when this backend or filesystem cannot: the writer then writes the bytes."""
        return False

    def etag(self, path: str) -> str | None:
        """The version tag of the object at ``path`` (an object store's ETag), or None
        where the backend has none: files are then known by device and inode."""
        return None


def read_manifest(storage: "Storage", directory: str) -> tuple[Manifest, bytes]:
    """The one safe read of ``<directory>/MANIFEST`` through ``storage``: the decoded
    manifest (its own digest checked) and its bytes.

    It never reads more than :func:`~ckpt.format.manifest.manifest_file_limit` bytes and
    never follows a link. ``FileNotFoundError``: there is no MANIFEST (not committed);
    ``CheckpointVanishedError``: it was removed between its ``lstat`` and its read;
    ``UnsafePathError``: not a regular file; ``LimitExceededError``: above the limit;
    a ``FormatError``/``IntegrityError`` from decoding. Every error names the file."""
    mpath = os.path.join(directory, MANIFEST_NAME)
    st = storage.lstat(mpath)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError("MANIFEST is not a regular file", path=mpath)
    if st.st_size > manifest_file_limit():
        raise LimitExceededError(f"MANIFEST is {st.st_size} bytes, above the limit", path=mpath)
    try:
        data = storage.read(mpath, 0, st.st_size)
    except FileNotFoundError:
        raise CheckpointVanishedError("MANIFEST was removed while the checkpoint was being opened",
                                      path=mpath) from None
    with gc_paused():  # thousands of entries, no cycles: see ckpt/_gc.py
        return decode_manifest(data, path=mpath), data
