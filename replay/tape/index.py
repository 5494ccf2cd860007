"""The step index: a sidecar that says where each new highest step starts.

The index is a hint, never the authority. An entry ``(step, seq, segment, offset)``
is written when the tape's highest step so far first reaches ``step``, which gives
the one guarantee seeking needs: *no record before ``seq`` has a step >= ``step``*
(true for interleaved multi-actor tapes as well). A reader checks the record the
entry points at (its seq) and falls back to a scan on any mismatch; a missing or
damaged index is rebuilt from the tape by :func:`rebuild`.

File: 32-byte header (``CKPTTIDX``, u16 version, u16 0, u32 0, 16-byte run id),
then 32-byte entries ``i64 step | u64 seq | u64 offset | u32 segment | u32 check``
where ``check`` is the low 32 bits of xxh3-64 of the first 28 bytes, seeded with
the run id's first 8 bytes. A torn last entry is ignored.
"""

from __future__ import annotations

import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

__all__ = ["IndexEntry", "INDEX_MAGIC", "create_exclusive", "encode_index_header", "encode_entry", "read_index", "write_index"]

INDEX_MAGIC = b"CKPTTIDX"
_HDR = struct.Struct("<8sHHI16s")
_ENT = struct.Struct("<qQQI")
_U32 = struct.Struct("<I")
ENTRY_SIZE = 32


@dataclass(frozen=True, slots=True)
class IndexEntry:
    step: int
    seq: int
    segment: int
    offset: int


def _seed(run_id: bytes) -> int:
    return int.from_bytes(run_id[:8], "little")


def encode_index_header(run_id: bytes) -> bytes:
    return _HDR.pack(INDEX_MAGIC, 1, 0, 0, run_id)


def encode_entry(e: IndexEntry, run_id: bytes) -> bytes:
    head = _ENT.pack(e.step, e.seq, e.offset, e.segment)
    return head + _U32.pack(xxhash.xxh3_64_intdigest(head, _seed(run_id)) & 0xFFFFFFFF)


def read_index(path: Path, run_id: bytes) -> list[IndexEntry] | None:
    """Entries of a valid index for ``run_id``; None when missing, foreign or damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _HDR.size:
        return None
    magic, version, r1, r2, rid = _HDR.unpack_from(data, 0)
    if magic != INDEX_MAGIC or version != 1 or r1 or r2 or rid != run_id:
        return None
    seed = _seed(run_id)
    out: list[IndexEntry] = []
    last_seq = -1
    for pos in range(_HDR.size, len(data) - ENTRY_SIZE + 1, ENTRY_SIZE):
        head = data[pos : pos + 28]
        (check,) = _U32.unpack_from(data, pos + 28)
        if xxhash.xxh3_64_intdigest(head, seed) & 0xFFFFFFFF != check:
            return None  # a damaged index is ignored whole; the tape rebuilds it
        step, seq, offset, segment = _ENT.unpack(head)
        if seq <= last_seq or (out and step <= out[-1].step):
            return None
        last_seq = seq
        out.append(IndexEntry(step, seq, segment, offset))
    return out


def create_exclusive(path: Path) -> int:
    """Create ``path`` for writing; fail if anything (a file, a symlink, even a dangling
    one) is already there. O_EXCL|O_CREAT never follows a final symlink; O_NOFOLLOW says
    so twice, for platforms that read the flags loosely. Every file a tape tool creates
    goes through here."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    return os.open(path, flags, 0o644)


def write_index(path: Path, run_id: bytes, entries: list[IndexEntry]) -> None:
    """Replace the sidecar atomically (tmp + rename)."""
    # Exclusive create under a random name in the tape's directory, then rename: a
    # symlink planted at the index or at a temporary name is never followed (issue: a
    # fixed ``.tmp`` name opened with O_TRUNC wrote through a link).
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = create_exclusive(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode_index_header(run_id))
            for e in entries:
                f.write(encode_entry(e, run_id))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
