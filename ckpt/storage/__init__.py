"""The I/O seam: every byte a checkpoint reads or writes goes through a ``Storage``.

Format logic (``ckpt.format``) is pure; writer, reader, manager and CLI talk to a
``Storage`` for files, and :func:`resolve` is the one place that maps a path or URL to
the backend that serves it:

* a plain path (or ``file://``) -> :data:`local`, the POSIX backend
  (``ckpt.storage.posix``: O_EXCL creates, fsync, ``renameat2`` commits, ``preadv``
  straight into tensor memory);
* ``s3://bucket/prefix`` -> ``ckpt.storage.s3`` (the optional extra
  ``ckpt-replay[s3]``; imported only when such a URL is used, never by ``import ckpt``);
* any other ``scheme://`` -> :class:`~ckpt.errors.UnsupportedSchemeError` naming the
  scheme and the extra to install. A URL is never taken for a local path.

Two commit protocols sit behind the seam (spec/checkpoint-format.md §10,
spec/object-storage.md): a filesystem publishes a finished temporary directory with an
atomic rename (``ckpt.writer``); an object store, which has no rename, uploads the
parts under save-unique names and makes ``MANIFEST`` appear last with a conditional
put. A backend of the second kind has :func:`commits_by_manifest` true and implements
:class:`ManifestCommit`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ._url import BACKENDS, refuse_url, unsupported, url_scheme
from .posix import (
    LocalFile,
    LocalStorage,
    first_errno,
    is_regular_file,
    is_space_error,
    local,
    preadv_full,
    walk_files,
)

__all__ = [
    "Storage",
    "FileSink",
    "ReadHandle",
    "ManifestCommit",
    "LocalStorage",
    "LocalFile",
    "local",
    "resolve",
    "url_scheme",
    "refuse_url",
    "commits_by_manifest",
    "preadv_full",
    "first_errno",
    "is_space_error",
    "is_regular_file",
    "walk_files",
    "PendingCheckpoint",
    "Recovery",
    "FencedStorage",
]


# The records of the commit protocols (what Storage.begin and Storage.recover return): the seam's
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


class FileSink(Protocol):
    """A file being written. ``write`` may keep a reference to ``data``: the caller
    keeps that memory alive and unchanged until ``close`` (zero-copy uploads and
    hashing on a second thread rely on it).

    A sink MAY also have ``write_copy(data)``: the same bytes in the same order as
    ``write``, but consumed (copied out and hashed) before it returns, so the caller may
    reuse the memory at once. Writers look it up with ``getattr`` and use fresh memory
    where a sink has none (the local sink has it; the object-store sink queues buffers
    for upload and has not)."""

    def write(self, data: memoryview | bytes) -> None: ...
    def close(self) -> tuple[int, bytes]: ...  # (size, concatenated chunk digests)
    def discard(self) -> None: ...


class ReadHandle(Protocol):
    """One file opened for reading. A local handle holds a descriptor (immune to
    renames and deletes); an object-store handle pins the object's version (a replaced
    or deleted object fails the next read instead of returning other bytes)."""

    path: str

    def pread_into(self, offset: int, buf: memoryview) -> int: ...  # fills buf; short only at end of file
    def size(self) -> int: ...
    def close(self) -> None: ...


class Storage(Protocol):
    """What reader, writer, manager and CLI need of a backend. Paths are the backend's
    own normalised form (:meth:`normalize`): absolute paths locally, ``s3://b/k`` URLs."""

    scheme: str

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
    def exchange(self, a: str, b: str) -> bool: ...  # atomic swap; False if unsupported here
    def remove_tree(self, path: str) -> None: ...
    def fsync_dir(self, path: str) -> None: ...
    # Dedup (spec/format-2.md §V.4): give ``src``'s bytes a second name ``dst`` without
    # writing them (a hard link; an object store may do a server-side copy). False when
    # this backend or filesystem cannot: the writer then writes the bytes.
    def link(self, src: str, dst: str) -> bool: ...


class ManifestCommit(Protocol):
    """The commit protocol of a store without rename (spec/object-storage.md). ``fence``,
    where given, proves the run's lease (§O.6): called right before the MANIFEST put, and
    before any deletion; it raises ``LeaseLostError`` once the lease was taken over."""

    def begin(self, final: str, *, overwrite: bool) -> PendingCheckpoint: ...
    def publish(self, pending: PendingCheckpoint, manifest: bytes, *, fence: Callable[[], None] | None = None) -> None: ...
    def abort(self, pending: PendingCheckpoint) -> None: ...
    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None,
                fence: Callable[[], None] | None = None) -> Recovery: ...
    def remove_checkpoint(self, path: str, *, fence: Callable[[], None] | None = None) -> bool: ...


class Fence(Protocol):
    """A run lease that can prove it is still held (``ckpt.storage.s3.ObjectLock``)."""

    def fence(self) -> None: ...


class FencedStorage:
    """``storage`` as seen by the holder of a run's lease: every commit (``publish``),
    checkpoint deletion (``remove_checkpoint``) and cleanup (``recover``) passes the
    lease's ``fence``, so a writer whose lease was taken over commits and deletes nothing
    (``LeaseLostError``). Everything else is ``storage`` itself. A wrapper, not a copy:
    whatever wraps ``storage`` (a fault injector, a counter) still sees every request."""

    def __init__(self, storage: Any, lease: Fence) -> None:
        self.inner = storage
        self.lease = lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"FencedStorage({self.inner!r})"

    def publish(self, pending: PendingCheckpoint, manifest: bytes) -> None:
        self.inner.publish(pending, manifest, fence=self.lease.fence)

    def remove_checkpoint(self, path: str) -> bool:
        return bool(self.inner.remove_checkpoint(path, fence=self.lease.fence))

    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None) -> Recovery:
        return self.inner.recover(parent, names=names, fence=self.lease.fence)  # type: ignore[no-any-return]


def commits_by_manifest(storage: Any) -> bool:
    """True for a backend that commits with a conditional MANIFEST put (no rename)."""
    return callable(getattr(storage, "publish", None))


_CACHE: dict[tuple[str, str], Any] = {}


def resolve(path: str | os.PathLike[str], storage: Any = None) -> tuple[Any, str]:
    """``(backend, normalised path)`` for a path or URL: the one resolver.

    ``storage`` given: that backend normalises ``path`` (the local one refuses URLs).
    Otherwise a plain path goes to :data:`local`, a URL to the backend registered for
    its scheme (``s3://`` -> ``ckpt.storage.s3``, needing ``ckpt-replay[s3]``); an
    unknown or uninstalled scheme raises ``UnsupportedSchemeError``.
    """
    if storage is not None:
        return storage, storage.normalize(path)
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    scheme = url_scheme(p)
    if scheme is None:
        return local, local.normalize(p)
    backend = backend_for(scheme, p)
    return backend, backend.normalize(p)


def backend_for(scheme: str, url: str) -> Any:
    """The backend for ``url`` (one instance per scheme and bucket, reused)."""
    spec = BACKENDS.get(scheme)
    if spec is None:
        raise unsupported(scheme, url, "no storage backend serves this scheme")
    mod_name, attr = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise unsupported(scheme, url, f"its backend could not be imported ({e})") from None
    factory: Any = mod
    for part in attr.split("."):
        factory = getattr(factory, part)
    key = (scheme, mod.bucket_of(url)) if hasattr(mod, "bucket_of") else (scheme, "")
    backend = _CACHE.get(key)
    if backend is None:
        backend = _CACHE[key] = factory(url)
    return backend


def forget_backends() -> None:
    """Drop cached backend instances (tests that change the AWS environment call it)."""
    _CACHE.clear()
