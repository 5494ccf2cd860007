"""Check a file's bytes before a dedup save shares them (spec/format-2.md §V.4.6).

A shared file's MANIFEST entry is copied from the checkpoint that holds it, digests
included: nothing in a save reads the shared bytes. A file changed in place since it was
written (a media fault, ``rsync --inplace``, an editor) would then be committed into
every later checkpoint, none of which verifies. So each file is checked after it is
linked into the new checkpoint, on a budget:

- its size against the MANIFEST's, always;
- its identity and signature against what this process recorded when it last wrote or
  fully checked it: on a filesystem the inode (device, inode) and (size, mtime); on an
  object store, where an object never changes in place, (ETag, size): an ETag is
  derived from the content, so a matching one needs no re-hash there;
- on a filesystem, the chunk digests of a rotating window of ``ceil(chunks / K)`` chunks
  (``K = knobs().dedup_rehash_every``), so that every chunk is re-hashed in any ``K``
  consecutive links of a file; all of them when there is no record (the first link
  after the process started) or the signature differs. ``K = 1`` re-hashes every linked
  byte at every save.

ctime is not part of the signature: the run's own links and retention's unlinks change
it at every save, and a signature that changes at every save would force a full re-hash
at every save. An in-place write that restores mtime (``os.utime``) is therefore caught
by the window, within ``K`` saves.

The records are per process (a restarted job re-hashes in full at its first dedup save)
and bounded (least recently used go first: a forgotten file is re-hashed in full).
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

from .format.digest import DIGEST_SIZE, chunk_count, digest_bytes
from .format.manifest import FileEntry
from .knobs import knobs

__all__ = ["SharedFileDamagedWarning", "Identity", "identity", "record_written", "check_linked", "is_damaged",
           "damaged_count", "forget"]

#: records kept per process (a few per part and save: far above what a run links at once)
_MAX_RECORDS = 4096


class SharedFileDamagedWarning(RuntimeWarning):
    """A file a dedup save would have shared does not hold the bytes its checkpoint's
    MANIFEST declares: the save wrote the tensors again from memory, so the new
    checkpoint is whole; every earlier checkpoint that links the file fails
    ``verify``. The message names the file, the checkpoint and what differed."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What a record is filed under (``key``) and what must not have changed (``sig``).
    ``by_content``: the signature identifies the bytes (an object store's ETag)."""

    key: Hashable
    sig: tuple[Any, ...]
    size: int
    by_content: bool


@dataclass(slots=True)
class _Record:
    sig: tuple[Any, ...]
    cursor: int = 0  # the next chunk the window re-hashes
    damaged: bool = False


_LOCK = threading.Lock()
_RECORDS: "OrderedDict[Hashable, _Record]" = OrderedDict()
_DAMAGED = [0]  # files found damaged so far (never decreases: see damaged_count)


def identity(storage: Any, path: str) -> Identity | None:
    """The identity of the regular file at ``path``; None when it is not one, or when
    this backend gives no identity that a record could be filed under (every check of
    such a file is then a full re-hash)."""
    st = storage.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return None
    etag = storage.etag(path)
    if etag:  # an object store: known by its bucket (the URL's authority) and ETag
        where = path.split("/", 3)[2] if "://" in path else ""
        return Identity(("etag", storage.scheme, where, etag, st.st_size), (etag, st.st_size), st.st_size, True)
    if not st.st_ino:
        return None
    return Identity(("inode", st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns), st.st_size, False)


def _put(ident: Identity, record: _Record) -> None:
    with _LOCK:
        _RECORDS[ident.key] = record
        _RECORDS.move_to_end(ident.key)
        while len(_RECORDS) > _MAX_RECORDS:
            _RECORDS.popitem(last=False)


def record_written(storage: Any, path: str) -> None:
    """``path`` was just written and closed by this process, its digests computed from
    the bytes written: a later save may share it without a full re-hash."""
    try:
        ident = identity(storage, path)
    except OSError:
        return
    if ident is not None:
        _put(ident, _Record(ident.sig))


def is_damaged(storage: Any, path: str) -> bool:
    """Whether this process found the bytes of the file at ``path`` damaged."""
    try:
        ident = identity(storage, path)
    except OSError:
        return False
    if ident is None:
        return False
    with _LOCK:
        rec = _RECORDS.get(ident.key)
        return rec is not None and rec.damaged and rec.sig == ident.sig


def forget() -> None:
    """Drop every record, as a restarted process starts (tests use it)."""
    with _LOCK:
        _RECORDS.clear()


def damaged_count() -> int:
    """How many files this process found damaged (0: no scan for them is needed; a
    change of it: the results of an earlier scan are stale)."""
    with _LOCK:
        return _DAMAGED[0]


def check_linked(storage: Any, path: str, entry: FileEntry) -> str | None:
    """Check the file just linked (or copied) to ``path`` against ``entry``, the MANIFEST
    entry the new checkpoint will copy. None: it may be committed; otherwise why not."""
    try:
        before = identity(storage, path)
    except OSError as e:
        return f"cannot be examined ({type(e).__name__}: {e})"
    if before is None:
        return _rehash(storage, path, entry, None)
    if before.size != entry.size:
        return f"is {before.size} bytes, the MANIFEST declares {entry.size}"
    with _LOCK:
        rec = _RECORDS.get(before.key)
        if rec is not None:
            _RECORDS.move_to_end(before.key)
    if rec is not None and rec.sig == before.sig and rec.damaged:
        return "was found damaged by an earlier save"
    if rec is not None and rec.sig == before.sig:
        if before.by_content:
            return None  # the same ETag: the same bytes as when they were checked or written
        n = chunk_count(entry.size, entry.chunk_size)
        every = max(1, knobs().dedup_rehash_every)
        take = -(-n // every)
        window = [(rec.cursor + i) % n for i in range(take)] if n else []
        why = _rehash(storage, path, entry, window)
        cursor = (rec.cursor + take) % n if n else 0
    else:
        why = _rehash(storage, path, entry, None)
        cursor = 0
    try:
        after = identity(storage, path)
    except OSError as e:
        return f"cannot be examined ({type(e).__name__}: {e})"
    if why is None and (after is None or after.sig != before.sig):
        return "changed while it was being checked"
    if why is not None:
        _put(before, _Record(before.sig, 0, True))
        with _LOCK:
            _DAMAGED[0] += 1
        return why
    _put(before, _Record(before.sig, cursor))
    return None


def _rehash(storage: Any, path: str, entry: FileEntry, chunks: list[int] | None) -> str | None:
    """Re-hash ``chunks`` of the file (all when None) against ``entry``'s digests."""
    cs, size = entry.chunk_size, entry.size
    n = chunk_count(size, cs)
    if len(entry.digests) != n * DIGEST_SIZE:
        return "has a MANIFEST entry whose digests do not cover it"
    try:
        handle = storage.open_read(path)
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    try:
        if handle.size() != size:
            return f"is {handle.size()} bytes, the MANIFEST declares {size}"
        buf = memoryview(bytearray(min(cs, size) if size else 0))
        for i in range(n) if chunks is None else chunks:
            lo = i * cs
            want = min(cs, size - lo)
            got = handle.pread_into(lo, buf[:want])
            if got != want:
                return f"ends at byte {lo + got}, the MANIFEST declares {size}"
            if digest_bytes(buf[:want]) != entry.digests[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE]:
                return f"chunk {i} (bytes {lo}..{lo + want}) does not match its digest"
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    finally:
        handle.close()
    return None
