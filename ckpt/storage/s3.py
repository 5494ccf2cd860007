"""``S3Storage``: checkpoints in S3 and S3-compatible object stores (extra ``ckpt-replay[s3]``).

Built on ``obstore`` (Python bindings of the Rust ``object_store`` crate); why that
library and not fsspec/s3fs is measured in bench/object_store.py and written down in
spec/object-storage.md §O.1. Imported only when an ``s3://`` URL is used: ``import
ckpt`` never imports it.

Configuration comes from the standard AWS environment: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` (an
S3-compatible server; ``http://`` endpoints are allowed), and instance or web-identity
credentials where those apply (obstore reads them).

The commit protocol (spec/object-storage.md): every file of a save is uploaded under a
name unique to that save (``rank-00000.<tag>.safetensors``), large ones as parallel
multipart uploads hashed while they stream; ``MANIFEST`` is put last with
``If-None-Match: *`` (``overwrite=False``) or ``If-Match: <etag of the MANIFEST it
replaces>`` (``overwrite=True``). A prefix without ``MANIFEST`` is not a checkpoint.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError
from obstore.store import S3Store

from .. import _forksafe
from ..errors import CheckpointExistsError, CkptError, FormatError, SaveConflictError, StorageError, UnsafePathError
from ..format.digest import ChunkHasher
from ..format.manifest import MANIFEST_NAME, TMP_PREFIX, decode_manifest, manifest_file_limit
from ..knobs import aws_env, knobs
from ._objlock import LOCK_NAME, ObjectLock
from .base import Storage
from .commit import Commit, ManifestLastCommit, recoverable

__all__ = ["S3Storage", "S3File", "ObjectLock", "bucket_of", "Stats"]

MiB = 1 << 20
# The tunables (ckpt.knobs, spec/knobs.md): multipart part size and ranged-read block size,
# the in-place load's local spool of the first pass, parallel requests per file and storage.
PART_SIZE = knobs().s3_part_size
BLOCK_SIZE = knobs().s3_block_size
SPOOL = knobs().s3_spool
CONCURRENCY = knobs().s3_concurrency
#: how often an overwrite retries its If-Match put after another writer replaced MANIFEST
_CAS_TRIES = 16


def bucket_of(url: str) -> str:
    rest = url.split("://", 1)[1]
    return rest.split("/", 1)[0]


@dataclass
class Stats:
    """Requests this storage made (tests and benchmarks read it; thread-safe)."""

    gets: int = 0
    get_bytes: int = 0
    puts: int = 0
    put_bytes: int = 0
    heads: int = 0
    lists: int = 0
    deletes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: getattr(self, k) for k in ("gets", "get_bytes", "puts", "put_bytes", "heads", "lists", "deletes")}


def _store_from_env(bucket: str) -> S3Store:
    aws = aws_env()
    if aws.metadata_disabled and not aws.has_credential_source:
        # The standard switch: with instance metadata off and no other source, there is
        # nothing to ask; fail now instead of timing out against the metadata address.
        raise StorageError("no AWS credentials in the environment, and AWS_EC2_METADATA_DISABLED is set",
                           path=f"s3://{bucket}")
    config: dict[str, Any] = {}
    endpoint = aws.endpoint
    if endpoint:
        config["endpoint"] = endpoint
    if aws.region:
        config["region"] = aws.region
    client: dict[str, Any] = {}
    if endpoint and endpoint.startswith("http://"):
        client["allow_http"] = True  # a local S3-compatible server (tests, on-premises)
    # S3Store reads the rest of the AWS_* environment itself (keys, session token,
    # web identity, instance metadata); explicit values above win.
    return S3Store(bucket, config=config or None, client_options=client or None)


def _stat(mode: int, size: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, 0, 0, size, 0, 0, 0))


class S3Storage(Storage):
    """One bucket of an S3-compatible store, through the ``ckpt.storage`` seam. Its
    commit protocol is ``ManifestLastCommit`` over the requests below (``begin``,
    ``publish``, ``abort``, ``recover``, ``remove_checkpoint``, ``lock``, ``ledger_dir``)."""

    scheme = "s3"
    #: objects under a committed prefix that MANIFEST does not name are leftovers of
    #: other saves (spec/object-storage.md §O.4): readers ignore them
    strict_listing = False

    def __init__(self, bucket: str, *, store: Any = None, concurrency: int = CONCURRENCY,
                 part_size: int = PART_SIZE, block_size: int = BLOCK_SIZE) -> None:
        if part_size < 5 * MiB:
            raise ValueError(f"S3 multipart parts are at least 5 MiB, got part_size={part_size}")
        self.bucket = bucket
        self._store = store if store is not None else _store_from_env(bucket)
        self.concurrency = concurrency
        self.part_size = part_size
        self.block_size = block_size
        self.stats = Stats()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def commit(self) -> Commit:
        return ManifestLastCommit(self)

    @classmethod
    def from_url(cls, url: str) -> S3Storage:
        return cls(bucket_of(url))

    def __repr__(self) -> str:
        return f"S3Storage(bucket={self.bucket!r})"

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="ckpt-s3")
            return self._pool

    # -- paths -------------------------------------------------------------------------
    def normalize(self, path: str | os.PathLike[str]) -> str:
        """``s3://bucket/a/b`` with no trailing slash; empty, ``.`` and ``..`` segments
        are refused (an object key is a name, not a path to resolve)."""
        p = os.fspath(path)
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        if not p.lower().startswith("s3://"):
            raise UnsafePathError("not an s3:// URL", path=p)
        bucket, _, key = p[5:].partition("/")
        if bucket != self.bucket:
            raise StorageError(f"this storage serves bucket {self.bucket!r}, not {bucket!r}", path=p)
        key = key.rstrip("/")
        segs = key.split("/") if key else []
        if any(s in ("", ".", "..") for s in segs):
            raise UnsafePathError("an s3:// URL with an empty, '.' or '..' segment", path=p)
        return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"

    def key(self, path: str) -> str:
        prefix = f"s3://{self.bucket}"
        if path == prefix:
            return ""
        if not path.startswith(prefix + "/"):
            raise StorageError(f"not a path of bucket {self.bucket!r}", path=path)
        return path[len(prefix) + 1 :]

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def realpath(self, path: str) -> str:
        return path  # no symbolic links in an object store

    def readlink(self, path: str) -> str:
        raise OSError(22, "object stores have no symbolic links", path)

    # -- errors ------------------------------------------------------------------------
    def _fail(self, e: BaseException, path: str, what: str) -> BaseException:
        if isinstance(e, FileNotFoundError):
            return FileNotFoundError(2, f"no such object ({what})", path)
        if isinstance(e, PreconditionError):
            # A pinned read whose object changed: for a reader it is gone (replaced).
            return FileNotFoundError(2, f"the object changed since it was opened ({what})", path)
        if "<Code>NoSuchBucket</Code>" in str(e):
            return StorageError(f"{what} failed: the bucket {self.bucket!r} does not exist (S3 NoSuchBucket)", path=path)
        return StorageError(f"{what} failed: {type(e).__name__}: {_first_line(e)}", path=path)

    # -- metadata ----------------------------------------------------------------------
    def _head(self, key: str) -> dict[str, Any] | None:
        if not key:
            return None
        self.stats.add(heads=1)
        try:
            return obstore.head(self._store, key)
        except FileNotFoundError:
            return None
        except BaseError as e:
            raise self._fail(e, self.url(key), "HEAD") from e

    def _list(self, prefix: str) -> dict[str, Any]:
        self.stats.add(lists=1)
        try:
            return obstore.list_with_delimiter(self._store, prefix or None)
        except BaseError as e:
            raise self._fail(e, self.url(prefix), "LIST") from e

    def walk(self, path: str) -> Iterator[dict[str, Any]]:
        """Every object under a prefix (recursively), as obstore ObjectMeta dicts."""
        key = self.key(path)
        self.stats.add(lists=1)
        try:
            for batch in obstore.list(self._store, (key + "/") if key else None):
                yield from batch
        except BaseError as e:
            raise self._fail(e, path, "LIST") from e

    def _is_prefix(self, key: str) -> bool:
        got = self._list(key)
        return bool(got["objects"] or got["common_prefixes"])

    def lstat(self, path: str) -> os.stat_result:
        key = self.key(path)
        meta = self._head(key)
        if meta is not None:
            return _stat(stat.S_IFREG | 0o644, int(meta["size"]))
        if self._is_prefix(key):
            return _stat(stat.S_IFDIR | 0o755, 0)
        raise FileNotFoundError(2, "no such object or prefix", path)

    def listdir(self, path: str) -> list[str]:
        key = self.key(path)
        got = self._list(key)
        names = [o["path"].rsplit("/", 1)[-1] for o in got["objects"]]
        names += [p.rstrip("/").rsplit("/", 1)[-1] for p in got["common_prefixes"]]
        if not names and self._head(key) is None:
            raise FileNotFoundError(2, "no such prefix", path)
        return sorted(set(names))

    def exists(self, path: str) -> bool:
        key = self.key(path)
        return self._head(key) is not None or self._is_prefix(key)

    def isfile(self, path: str) -> bool:
        return self._head(self.key(path)) is not None

    def isdir(self, path: str) -> bool:
        return self._is_prefix(self.key(path))

    def etag(self, path: str) -> str | None:
        meta = self._head(self.key(path))
        return None if meta is None else meta.get("e_tag")

    # -- reads -------------------------------------------------------------------------
    def _get(self, key: str, start: int, end: int, etag: str | None = None) -> Any:
        opts: dict[str, Any] = {"range": (start, end)}
        if etag is not None:
            opts["if_match"] = etag
        try:
            data = obstore.get(self._store, key, options=opts).bytes()
        except BaseError as e:
            raise self._fail(e, self.url(key), f"GET bytes {start}..{end}") from e
        except FileNotFoundError as e:
            raise self._fail(e, self.url(key), f"GET bytes {start}..{end}") from e
        self.stats.add(gets=1, get_bytes=len(data))
        return data

    def read_all(self, path: str) -> bytes:
        key = self.key(path)
        try:
            data = obstore.get(self._store, key).bytes()
        except (BaseError, FileNotFoundError) as e:
            raise self._fail(e, path, "GET") from e
        self.stats.add(gets=1, get_bytes=len(data))
        return bytes(data)

    def open_read(self, path: str, *, reread: bool = False) -> S3File:
        """``reread``: the caller will read the same bytes again (an in-place load's two
        passes); they are spooled to a local temporary file once fetched."""
        meta = self._head(self.key(path))
        if meta is None:
            raise FileNotFoundError(2, "no such object", path)
        return S3File(self, path, int(meta["size"]), meta.get("e_tag"), spool=reread and SPOOL)

    def pread_into(self, path: str, offset: int, buf: memoryview) -> int:
        """One ranged GET (or a few, in parallel, for a large ``buf``): only these bytes."""
        f = S3File(self, path, None, None, readahead=False)
        return f.pread_into(offset, buf)

    def read(self, path: str, offset: int, size: int) -> bytes:
        buf = bytearray(size)
        got = self.pread_into(path, offset, memoryview(buf))
        return bytes(buf[:got])

    # -- writes ------------------------------------------------------------------------
    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> S3Sink:
        return S3Sink(self, self.key(path), chunk_size)

    def put(self, path: str, data: bytes, *, mode: Any = None) -> dict[str, Any]:
        try:
            res = obstore.put(self._store, self.key(path), data, mode=mode, use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            raise
        except (BaseError, FileNotFoundError) as e:
            raise self._fail(e, path, "PUT") from e
        self.stats.add(puts=1, put_bytes=len(data))
        return res

    def delete(self, paths: list[str]) -> None:
        keys = [self.key(p) for p in paths]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[i : i + 1000]
            self.stats.add(deletes=len(batch))
            try:
                obstore.delete(self._store, batch)
            except FileNotFoundError:
                pass
            except BaseError as e:
                raise self._fail(e, self.url(batch[0]), "DELETE") from e

    def link(self, src: str, dst: str) -> bool:
        """Make ``dst`` hold ``src``'s bytes without uploading them again: a server-side
        copy (CopyObject). What a filesystem does with a hard link (deduplication across
        a run's checkpoints); on S3 the copy is billed as storage, not as transfer.
        ``dst`` names are save-unique (§O.3), so the copy never replaces another save's
        object. Returns True (the copy is made) or raises."""
        try:
            obstore.copy(self._store, self.key(src), self.key(dst))
        except (BaseError, FileNotFoundError) as e:
            raise self._fail(e, src, f"COPY to {dst}") from e
        self.stats.add(puts=1)
        return True

    def mkdir(self, path: str) -> None:
        """Prefixes exist implicitly: nothing to create."""

    def makedirs(self, path: str) -> None:
        """Prefixes exist implicitly: nothing to create."""

    def fsync_dir(self, path: str) -> None:
        """An acknowledged PUT is durable; there is no directory to sync."""

    def rename_dir(self, src: str, dst: str) -> None:
        raise OSError(95, "object stores have no rename; commits use the MANIFEST protocol", src)

    rename_noreplace = rename_dir

    def exchange(self, a: str, b: str) -> bool:
        return False

    def remove_tree(self, path: str) -> None:
        self.delete([self.url(o["path"]) for o in self.walk(path)])

    def remove_file(self, path: str) -> None:
        self.delete([path])

    # -- the commit protocol (spec/object-storage.md §O.3) -------------------------------
    def begin(self, final: str, *, overwrite: bool) -> Any:
        from . import PendingCheckpoint

        if not overwrite and self.isfile(f"{final}/{MANIFEST_NAME}"):
            # Early refusal only: the conditional MANIFEST put enforces it atomically.
            raise CheckpointExistsError("a checkpoint already exists here; pass overwrite=True to replace it", path=final)
        tag = "." + secrets.token_hex(6)
        return PendingCheckpoint(final=final, tmp_dir=final, overwrite=overwrite, tag=tag)

    def publish(self, pending: Any, manifest: bytes, *, fence: Callable[[], None] | None = None) -> None:
        """Make MANIFEST appear atomically: If-None-Match without overwrite, a
        compare-and-swap on the replaced MANIFEST's ETag with it. Then remove the files
        only the replaced MANIFEST named. ``fence``: proves the run's lease (§O.6), called
        after the named files were checked, right before the put."""
        mpath = f"{pending.final}/{MANIFEST_NAME}"
        self._check_named(pending.final, manifest)
        # Last, right before the put: the run's lease, for a writer that holds one.
        if fence is not None:
            fence()
        if not pending.overwrite:
            try:
                self.put(mpath, manifest, mode="create")
            except (AlreadyExistsError, PreconditionError):
                raise CheckpointExistsError(
                    "a checkpoint already exists here (committed while this one was written); pass overwrite=True to replace it",
                    path=pending.final,
                ) from None
            return
        for _ in range(_CAS_TRIES):
            etag = self.etag(mpath)
            old: bytes | None = None
            try:
                if etag is None:
                    self.put(mpath, manifest, mode="create")
                else:
                    try:
                        old = bytes(self._get(self.key(mpath), 0, 64 * MiB + 64, etag))
                    except FileNotFoundError:
                        continue  # replaced or removed since the HEAD: look again
                    self.put(mpath, manifest, mode={"e_tag": etag})
            except (AlreadyExistsError, PreconditionError):
                continue  # another writer committed in between: compare again
            break
        else:
            raise StorageError(f"MANIFEST kept changing under {_CAS_TRIES} attempts to replace it", path=mpath)
        if old is not None:
            self._drop_replaced(pending.final, old, manifest)

    def _check_named(self, final: str, manifest: bytes) -> None:
        """Every file the MANIFEST about to be put names exists with its declared size
        (one HEAD each, in parallel): a cleanup by another process may have deleted an
        uncommitted save's objects (§O.6), and a MANIFEST naming a missing file would
        commit a checkpoint that cannot load. ``SaveConflictError`` instead."""
        named = [(f"{final}/{n}", size) for n, size, _ in decode_manifest(manifest, path=final).parts.file_sizes()]
        metas = list(self.pool().map(lambda ns: self._head(self.key(ns[0])), named))
        for (path, size), meta in zip(named, metas):
            if meta is None:
                raise SaveConflictError("a file of this save was deleted before its MANIFEST was put (another "
                                        "process cleaned the run prefix?); nothing was committed", path=path)
            if int(meta["size"]) != size:
                raise SaveConflictError(f"a file of this save is {int(meta['size'])} bytes, not the {size} it was "
                                        "written with (another process replaced it); nothing was committed", path=path)

    def _drop_replaced(self, final: str, old: bytes, new: bytes) -> None:
        try:
            old_names = {f.name for f in decode_manifest(old, path=final).files}
        except CkptError:
            return  # an undecodable old MANIFEST: recovery removes what nothing names
        keep = {f.name for f in decode_manifest(new, path=final).files}
        gone = sorted(old_names - keep)
        if gone:
            self.delete([f"{final}/{n}" for n in gone])

    def abort(self, pending: Any) -> None:
        """Remove this save's own objects (its tag is in their names), nothing else."""
        if not pending.tag:
            return
        mine = [self.url(o["path"]) for o in self.walk(pending.final) if pending.tag + "." in o["path"].rsplit("/", 1)[-1]]
        self.delete(mine)

    def lock(self, run_dir: str, *, owner: dict[str, object] | None = None) -> ObjectLock:
        """The run's lease (``ObjectLock``): commit and delete through
        ``ckpt.storage.FencedStorage(storage, lock)``, which passes its ``fence``."""
        return ObjectLock.acquire(self, run_dir, owner=owner)

    def ledger_dir(self, run_dir: str) -> str:
        """A local directory for the step ledger of a run kept here (a ledger is an
        append-only tape; an object store cannot append)."""
        import tempfile

        return os.path.join(tempfile.gettempdir(), "ckpt-ledger", "s3", self.bucket, *self.key(run_dir).split("/"))

    def remove_checkpoint(self, path: str, *, fence: Callable[[], None] | None = None) -> bool:
        """MANIFEST first (the checkpoint is uncommitted from that instant), then the rest.
        ``fence``: proves the run's lease first (§O.6)."""
        mpath = f"{path}/{MANIFEST_NAME}"
        if fence is not None:
            fence()
        had = self.isfile(mpath)
        if had:
            self.delete([mpath])
        self.remove_tree(path)
        return had

    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None,
                fence: Callable[[], None] | None = None) -> Any:
        """Orphan cleanup of a run prefix: objects of an uncommitted prefix, and objects a
        committed MANIFEST does not name (losers of a race, crashed or replaced saves),
        are deleted, unless they may belong to a save still running (§O.6).

        A save's objects share its tag (§O.3): a save whose newest object is younger than
        ``orphan_grace_s`` is left whole, since a writer without the run's lock (a plain
        ``ckpt.save``) may still commit them. Ages are read against the store's clock: the
        ``LastModified`` of the run's lock object, which the caller (the lock holder) has
        just renewed (``fence``); without a lock object, this machine's clock."""
        from . import Recovery
        from ..knobs import knobs

        if fence is not None:
            fence()
        removed: list[str] = []
        try:
            children = self.listdir(parent)
        except FileNotFoundError:
            return Recovery((), ())
        cutoff = self._store_now(parent) - knobs().orphan_grace_s
        for name in children:
            child = f"{parent}/{name}"
            if not name.startswith(TMP_PREFIX) and not recoverable(name, names):
                continue
            objs = self._orphans(child, cutoff)
            if objs:
                self.delete(objs)
                removed += [o[len(parent) + 1 :] for o in objs]
        return Recovery((), tuple(removed))

    def _store_now(self, parent: str) -> float:
        """The store's idea of now: the LastModified of the run's lock object (renewed by
        its holder at most ``lock_heartbeat_s`` ago), else this machine's clock."""
        import time

        meta = self._head(self.key(f"{parent}/{LOCK_NAME}"))
        lm = None if meta is None else meta.get("last_modified")
        return lm.timestamp() if lm is not None else time.time()

    def _orphans(self, child: str, cutoff: float) -> list[str]:
        metas = {self.url(o["path"]): o for o in self.walk(child)}
        mpath = f"{child}/{MANIFEST_NAME}"
        if child.rsplit("/", 1)[-1].startswith(TMP_PREFIX) or mpath not in metas:
            candidates = sorted(metas)  # never committed: a crashed, abandoned or running save
        elif int(metas[mpath]["size"]) > manifest_file_limit():
            return []  # above the reader's limit: leave it for a reader to report
        else:
            try:
                blob = self.read(mpath, 0, int(metas[mpath]["size"]))
                named = {f"{child}/{n}" for n, _, _ in decode_manifest(blob, path=mpath).parts.file_sizes()}
            except (CkptError, FileNotFoundError):
                return []  # corrupt or vanished: leave it for a reader to report
            candidates = [o for o in sorted(metas) if o != mpath and o not in named]
        # One save's objects stand or fall together: its newest object says whether it
        # may still be running.
        newest: dict[str, float] = {}
        for o in candidates:
            t = _tag_of(o)
            newest[t] = max(newest.get(t, 0.0), _modified(metas[o]))
        return [o for o in candidates if newest[_tag_of(o)] < cutoff]


_TAG_RE = re.compile(r"\.([0-9a-f]{12})(?=\.|$)")


def _tag_of(url: str) -> str:
    """The save tag in an object's name (§O.3), or the name itself where there is none."""
    name = url.rsplit("/", 1)[-1]
    m = _TAG_RE.search(name)
    return m.group(1) if m else "/" + name


def _modified(meta: dict[str, Any]) -> float:
    lm = meta.get("last_modified")
    return lm.timestamp() if lm is not None else float("inf")  # no date: treat as new (kept)


class S3File:
    """An object opened for reading, pinned to its ETag (``If-Match`` on every GET), with
    parallel read-ahead for sequential scans: ranged GETs of ``block_size`` bytes, up to
    ``concurrency`` in flight, memory bounded by that window."""

    mappable = False

    def __init__(self, storage: S3Storage, path: str, size: int | None, etag: str | None, *, readahead: bool = True,
                 spool: bool = False) -> None:
        self.path = path
        self._s = storage
        self._key = storage.key(path)
        self._size = size
        self._etag = etag
        self._readahead = readahead
        self._blocks: dict[int, Future[Any]] = {}
        self._next = 0  # where the last read ended: read-ahead only for sequential reads
        self._lock = threading.Lock()
        self._spool_fd = -1
        self._spooled: set[int] = set()  # blocks whose bytes are in the spool file
        if spool:
            import tempfile

            # Unlinked at once: the bytes vanish with the descriptor, whatever happens.
            fd, name = tempfile.mkstemp(prefix="ckpt-s3-spool-")
            os.unlink(name)
            self._spool_fd = fd

    def size(self) -> int:
        if self._size is None:
            meta = self._s._head(self._key)
            if meta is None:
                raise FileNotFoundError(2, "no such object", self.path)
            self._size = int(meta["size"])
        return self._size

    def _fetch(self, b: int) -> Future[Any]:
        fut = self._blocks.get(b)
        if fut is None:
            bs = self._s.block_size
            lo, hi = b * bs, min((b + 1) * bs, self.size())
            fut = self._blocks[b] = self._s.pool().submit(self._s._get, self._key, lo, hi, self._etag)
        return fut

    def pread_into(self, offset: int, buf: memoryview) -> int:
        mv = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        if len(mv) == 0:
            return 0
        if not self._readahead:
            return self._direct(offset, mv)
        # One caller at a time (a reader may split a file between threads): the block
        # window is this handle's state, and the handle parallelises its requests itself.
        with self._lock:
            return self._readahead_into(offset, mv)

    def _readahead_into(self, offset: int, mv: memoryview) -> int:
        want = len(mv)
        size = self.size()
        n = max(0, min(want, size - offset))
        if n == 0:
            return 0
        bs = self._s.block_size
        first, last = offset // bs, (offset + n - 1) // bs
        ahead = self._s.concurrency if (offset == self._next or last > first) else 0
        nblocks = (size + bs - 1) // bs
        try:
            for b in range(first, last + 1):
                for a in range(b, min(b + 1 + ahead, nblocks)):
                    if a not in self._spooled:
                        self._fetch(a)
                lo = b * bs
                if b in self._spooled:
                    data = self._from_spool(b, lo, min(lo + bs, size))
                else:
                    data = memoryview(self._fetch(b).result())
                    if self._spool_fd >= 0 and len(data) == min(lo + bs, size) - lo:
                        _pwrite_full(self._spool_fd, data, lo)
                        self._spooled.add(b)
                a, z = max(offset, lo), min(offset + n, lo + len(data))
                mv[a - offset : z - offset] = data[a - lo : z - lo]
                if z < min(offset + n, lo + bs):  # the object is shorter than its HEAD said
                    self._drop(0, nblocks)
                    return z - offset
                # Consumed: a sequential scan never comes back (a re-read fetches again).
                if z == lo + len(data):
                    self._blocks.pop(b, None)
        except BaseException:
            self._drop(0, nblocks)
            raise
        # Blocks before this read will not be asked for again by a forward scan.
        self._drop(0, first)
        self._next = offset + n
        return n

    def _direct(self, offset: int, mv: memoryview) -> int:
        """Exactly the requested range, in parallel pieces for a large buffer."""
        want = len(mv)
        piece = self._s.block_size
        starts = list(range(offset, offset + want, piece))
        futs = [self._s.pool().submit(self._get_or_empty, s, min(s + piece, offset + want)) for s in starts]
        got = 0
        for s, fut in zip(starts, futs):
            data = memoryview(fut.result())
            mv[s - offset : s - offset + len(data)] = data
            got += len(data)
            if len(data) < min(piece, offset + want - s):
                break  # end of object
        return got

    def _get_or_empty(self, start: int, end: int) -> Any:
        try:
            return self._s._get(self._key, start, end, self._etag)
        except StorageError:
            # A range that starts at or past the end: S3 answers 416. Confirm by size.
            if self.size() <= start:
                return b""
            raise

    def _from_spool(self, b: int, lo: int, hi: int) -> memoryview:
        from .posix import preadv_full

        buf = memoryview(bytearray(hi - lo))
        if preadv_full(self._spool_fd, buf, lo) != hi - lo:
            raise StorageError("the local spool file is shorter than what was written to it", path=self.path)
        return buf

    def _drop(self, lo: int, hi: int) -> None:
        for b in [b for b in self._blocks if lo <= b < hi]:
            fut = self._blocks.pop(b)
            fut.cancel()

    def map_private(self, size: int, *, require_lease: bool = True) -> None:
        return None  # an object is not a file to map: loads read through pread_into

    def close(self) -> None:
        self._drop(0, 1 << 62)
        if self._spool_fd >= 0:
            os.close(self._spool_fd)
            self._spool_fd = -1
            self._spooled.clear()


def _pwrite_full(fd: int, data: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(data):
        pos += os.pwrite(fd, data[pos:], offset + pos)


_END = object()
_ABORT = object()


class S3Sink:
    """A file uploaded as it is written, hashed in the writer's thread as the bytes pass.

    Up to ``part_size`` bytes are held; a file that ends there is one PUT. A larger one
    becomes a multipart upload (obstore, ``concurrency`` parts in flight) fed from a
    queue of the caller's own memory (kept alive until ``close``, per ``FileSink``):
    hashing, and the upload of earlier parts, overlap. ``discard`` aborts the upload
    (no object appears); a process killed mid-upload leaves no object either, only an
    incomplete multipart upload that a bucket lifecycle rule expires.
    """

    def __init__(self, storage: S3Storage, key: str, chunk_size: int) -> None:
        self._s = storage
        self._key = key
        self._hasher = ChunkHasher(chunk_size)
        self._head: list[memoryview] = []
        self._held = 0
        self._q: Any = None
        self._thread: threading.Thread | None = None
        self._err: list[BaseException] = []
        self._done = False

    @property
    def path(self) -> str:
        return self._s.url(self._key)

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" or data.ndim != 1 else data
        if not len(mv):
            return
        self._hasher.update(mv)
        if self._q is None:
            self._head.append(mv)
            self._held += len(mv)
            if self._held > self._s.part_size:
                self._start()
            return
        if self._err:
            raise self._s._fail(self._err[0], self.path, "multipart upload")
        self._q.put(mv)

    def write_copy(self, data: memoryview | bytes) -> None:
        # the upload queue keeps what it is given until its part is sent: a copy of its own
        self.write(bytes(memoryview(data).cast("B")))

    def seal(self) -> None:
        return None  # an object exists only once its upload completes: close does all

    def _start(self) -> None:
        import queue

        self._q = queue.Queue(maxsize=4 * self._s.concurrency)
        for mv in self._head:
            self._q.put(mv)
        self._head = []

        def chunks() -> Iterator[memoryview]:
            while True:
                item = self._q.get()
                if item is _END:
                    return
                if item is _ABORT:
                    raise RuntimeError("upload discarded")  # obstore aborts the multipart upload
                yield item

        def run() -> None:
            try:
                obstore.put(self._s._store, self._key, chunks(), chunk_size=self._s.part_size,
                            max_concurrency=self._s.concurrency)
            except BaseException as e:  # re-raised on the writer's thread
                self._err.append(e)
                # Keep consuming until the writer ends (close/discard always follow an
                # error, FileSink contract), so a writer blocked on a full queue wakes.
                while self._q.get() not in (_END, _ABORT):
                    pass

        self._thread = _forksafe.start(threading.Thread(target=run, name="ckpt-s3-upload", daemon=True))

    def close(self) -> tuple[int, bytes]:
        if self._q is None:
            data = b"".join(self._head) if len(self._head) != 1 else self._head[0]
            self._s.put(self.path, data)
            self._head = []
        else:
            self._q.put(_END)
            assert self._thread is not None
            self._thread.join()
            if self._err:
                raise self._s._fail(self._err[0], self.path, "multipart upload") from self._err[0]
            self._s.stats.add(puts=1, put_bytes=self._hasher.size)
        self._done = True
        return self._hasher.size, self._hasher.finish()

    def flush(self) -> None:
        pass  # an object exists only once its upload completes, at close

    def discard(self) -> None:
        self._head = []
        if self._q is not None and self._thread is not None and not self._done:
            self._done = True
            self._q.put(_ABORT)
            self._thread.join()


def _first_line(e: BaseException) -> str:
    """An obstore error's own sentence, without the multi-line debug dump it appends
    ("Debug source: Generic { ... }"): an error is one line (spec/cli.md §1)."""
    text = str(e).split("\n\nDebug source:", 1)[0].split("<?xml", 1)[0].strip()
    return " ".join(text.split()) if text else type(e).__name__
