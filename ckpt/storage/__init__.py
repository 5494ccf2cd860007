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
spec/object-storage.md), and every backend names its own as ``storage.commit``
(``ckpt.storage.commit``): a filesystem publishes a finished temporary directory with an
atomic rename (:class:`RenameCommit`); an object store, which has no rename, uploads the
parts under save-unique names and makes ``MANIFEST`` appear last with a conditional put
(:class:`ManifestLastCommit` over the store's :class:`ObjectStore` requests).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Protocol

from ._url import BACKENDS, refuse_url, unsupported, url_scheme
from .base import FileSink, ReadHandle, Storage
from .commit import Commit, ManifestLastCommit, ObjectStore, PendingCheckpoint, Recovery, RenameCommit
from .posix import (
    LocalFile,
    LocalStorage,
    first_errno,
    is_space_error,
    local,
    preadv_full,
)

__all__ = [
    "Storage",
    "FileSink",
    "ReadHandle",
    "ManifestCommit",
    "Commit",
    "RenameCommit",
    "ManifestLastCommit",
    "ObjectStore",
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
    "PendingCheckpoint",
    "Recovery",
    "FencedStorage",
    "install_lease_handler",
]


# The records and protocols of the seam live in .base and .commit; re-exported here.
ManifestCommit = ObjectStore  # the earlier name of the object-store protocol (one release)


def commits_by_manifest(storage: Storage) -> bool:
    """True for a backend that commits with a conditional MANIFEST put (no rename).

    Deprecated: call ``storage.commit`` instead of branching on the protocol (kept one
    release for code outside the package)."""
    import warnings

    warnings.warn("ckpt.storage.commits_by_manifest is deprecated: call storage.commit's methods instead",
                  DeprecationWarning, stacklevel=2)
    return isinstance(storage.commit, ManifestLastCommit)


class Fence(Protocol):
    """A run lease that can prove it is still held (``ckpt.storage.s3.ObjectLock``)."""

    def fence(self) -> None: ...


class FencedStorage:
    """``storage`` as seen by the holder of a run's lease (``ManifestLastCommit.holding``):
    every commit (``publish``), checkpoint deletion (``remove_checkpoint``) and cleanup
    (``recover``) passes the lease's ``fence``, so a writer whose lease was taken over
    commits and deletes nothing (``LeaseLostError``). Everything else is ``storage``
    itself. A wrapper, not a copy: whatever wraps ``storage`` (a fault injector, a
    counter) still sees every request, and its commit protocol is bound to this wrapper."""

    def __init__(self, storage: Any, lease: Fence) -> None:
        self.inner = storage
        self.lease = lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"FencedStorage({self.inner!r})"

    @property
    def commit(self) -> Commit:
        return self.inner.commit.over(self)  # type: ignore[no-any-return]

    def publish(self, pending: PendingCheckpoint, manifest: bytes) -> None:
        self.inner.publish(pending, manifest, fence=self.lease.fence)

    def remove_checkpoint(self, path: str) -> bool:
        return bool(self.inner.remove_checkpoint(path, fence=self.lease.fence))

    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None) -> Recovery:
        return self.inner.recover(parent, names=names, fence=self.lease.fence)  # type: ignore[no-any-return]


_CACHE: dict[tuple[str, str], Any] = {}


def resolve(path: str | os.PathLike[str], storage: Any = None) -> tuple[Storage, str]:
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


def install_lease_handler() -> None:
    """Install the read lease's signal handler now (spec/checkpoint-format.md §11.1).

    A fresh load maps a local checkpoint file only under a read lease, whose breaks (a
    writer or a truncation of the file) are signalled to the main thread; a handler then
    moves the mapped bytes off the file. That handler is process-wide: by default the
    first protected mapping installs it, from the main thread only (a first load off the
    main thread reads into fresh memory instead). Call this at start-up, from the main
    thread, to choose the moment yourself (and so let loads in any thread map), or with
    ``CKPT_LEASE_HANDLER=off``, which stops the implicit installation. Idempotent.
    Raises ``UnprotectedMappingError`` (naming why) where it cannot be installed: off
    the main thread, the signal (``CKPT_LEASE_SIGNAL``) already handled by the program,
    or a platform without leases."""
    from ..errors import UnprotectedMappingError
    from . import _lease

    try:
        _lease.install_handler()
    except _lease.LeaseUnavailable as e:
        raise UnprotectedMappingError(f"no lease-break handler: {e}") from None
