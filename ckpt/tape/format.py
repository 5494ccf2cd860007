"""Tape framing, pure: bytes in, bytes out. No file I/O here (writer/reader do that).

It lives in ``ckpt`` (not ``replay``) because the step ledger (``ckpt.ledger``) writes
and reads tapes from inside ``CheckpointManager``, and ``ckpt`` must not import
``replay``. ``replay.tape.format`` re-exports it; its errors (``ckpt.errors.TapeDataError``)
are the ones ``replay.errors`` names.

Layout (spec/tape-format.md §3-§5 is normative; this is the implementation):

* segment header: 64 fixed bytes, ``meta_len`` bytes of msgpack metadata, an 8-byte
  xxh3-64 checksum of everything before it;
* then records, each a 40-byte header and a body::

      0  u64 checksum   xxh3_64(record[8 : 40+len], seed=salt)
      8  u32 len        body length, <= MAX_RECORD
      12 u16 kind       event kind code; 0xFFFF frames a zstd block of records
      14 u16 flags      reserved, 0
      16 u64 seq        0, 1, 2, ... across the whole tape, no gaps
      24 u64 salt       the segment's random salt (also seeds the checksum)
      32 u64 prev       hash chain: the previous record's checksum; 0 when chaining is off

Why xxh3-64 and not CRC32C: xxhash is already a dependency, it is faster than a
pure-Python-bound CRC32C (``zlib.crc32`` is CRC32, not C, and has no seed), and
64 bits leave a 2^-64 rather than 2^-32 chance that a damaged record validates.

Why the salt sits in every record as well as seeding the checksum (SQLite WAL salts,
RocksDB's recyclable log number): a record left over from another tape, or from an
earlier life of this file, never validates; and because the 8 salt bytes are random,
they also serve as a sync marker, so the reader can search *forward* past a bad
record for a later valid one. That search is what separates a torn tail (nothing
valid follows: the write never finished, drop it) from a corrupt middle record
(something valid follows: media damage, fail closed).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack
import xxhash
import zstandard

from ckpt.format.codec import ContainerLimitError, bounded, foreign_value
from ckpt.errors import TapeCorruptError, TapeFormatError, TapeLimitError, TapeTruncatedError

__all__ = [
    "MAGIC", "VERSION_MAJOR", "VERSION_MINOR", "HEADER_FIXED", "RECORD_HEADER", "MAX_RECORD", "MAX_META",
    "MAX_BLOCK_RAW", "BLOCK_KIND", "CLOSE_KIND", "FLAG_CHAIN", "FLAG_ZSTD", "SegmentHeader", "Frame", "Scan",
    "encode_segment_header", "decode_segment_header", "encode_record", "pack_record_into", "encode_block",
    "scan_segment", "checksum", "strict_pairs",
]

MAGIC = b"CKPTTAPE"
VERSION_MAJOR = 1
VERSION_MINOR = 1  # 1.1 added the close record (spec §5.5)
HEADER_FIXED = 64
RECORD_HEADER = 40
MAX_RECORD = 16 << 20  # 16 MiB per record body (and per compressed block body)
MAX_META = 1 << 20  # 1 MiB of header metadata
MAX_BLOCK_RAW = 16 << 20  # decompressed size of one block
MAX_BLOCK_RECORDS = 1 << 20
BLOCK_KIND = 0xFFFF
CLOSE_KIND = 0xFFFE  # the close record: a cleanly closed tape ends with it (spec §5.5)
FLAG_CHAIN = 1
FLAG_ZSTD = 2
_KNOWN_FLAGS = FLAG_CHAIN | FLAG_ZSTD

_HDR = struct.Struct("<8sHHI16sQIIQQ")  # magic, major, minor, flags, run_id, salt, segment, meta_len, first_seq, chain_prev
assert _HDR.size == HEADER_FIXED
_REC = struct.Struct("<QIHHQQQ")  # checksum, len, kind, flags, seq, salt, prev
assert _REC.size == RECORD_HEADER
_REC_TAIL = struct.Struct("<IHHQQQ")  # the checksummed part of the header
_U64 = struct.Struct("<Q")
_BLK = struct.Struct("<II")  # count, raw_len

_xxh64 = xxhash.xxh3_64_intdigest


def strict_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack ``object_pairs_hook`` for tape payloads and metadata (spec §6.1.1 "Map keys").

    A plain decode lets the last of two equal keys win, merges ``true``/``1`` and
    ``1``/``1.0``, and raises a bare ``TypeError`` on a list or map key; two readers
    could then disagree on what the tape says. Keys MUST be strings or integers (not
    booleans), and a key MUST NOT repeat."""
    out: dict[Any, Any] = {}
    for k, v in pairs:
        if type(k) is not str and type(k) is not int:
            raise ValueError(f"map key {k!r} of type {type(k).__name__} (keys must be str or int)")
        if k in out:
            raise ValueError(f"map repeats the key {k!r}")
        out[k] = v
    return out


def checksum(data: bytes | bytearray | memoryview, seed: int) -> int:
    return _xxh64(data, seed)


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    run_id: bytes
    salt: int
    segment: int
    first_seq: int
    chain_prev: int
    flags: int
    meta: dict[str, Any]
    minor: int
    size: int  # bytes the header occupies, records start here

    @property
    def chain(self) -> bool:
        return bool(self.flags & FLAG_CHAIN)

    @property
    def zstd(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)


def _ext_refused(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} not allowed in tape metadata")


def encode_segment_header(*, run_id: bytes, salt: int, segment: int, first_seq: int, chain_prev: int,
                          flags: int, meta: dict[str, Any]) -> bytes:
    if len(run_id) != 16:
        raise ValueError("run_id must be 16 bytes")
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown tape flags {flags:#x}")
    raw_meta = msgpack.packb(meta, use_bin_type=True, use_single_float=False)
    if len(raw_meta) > MAX_META:
        raise TapeLimitError(f"tape metadata is {len(raw_meta)} bytes, limit {MAX_META}")
    fixed = _HDR.pack(MAGIC, VERSION_MAJOR, VERSION_MINOR, flags, run_id, salt, segment, len(raw_meta), first_seq,
                      chain_prev)
    body = fixed + raw_meta
    return body + _U64.pack(_xxh64(body, 0))


def decode_segment_header(buf: bytes | memoryview) -> SegmentHeader:
    mv = memoryview(buf)
    if len(mv) < HEADER_FIXED:
        if bytes(mv[: min(len(mv), 8)]) != MAGIC[: min(len(mv), 8)]:
            raise TapeFormatError("not a tape: bad magic", offset=0)
        raise TapeTruncatedError(f"segment header truncated: {len(mv)} of {HEADER_FIXED} bytes", offset=0)
    magic, major, minor, flags, run_id, salt, segment, meta_len, first_seq, chain_prev = _HDR.unpack_from(mv, 0)
    if magic != MAGIC:
        raise TapeFormatError(f"not a tape: bad magic {bytes(magic)!r}", offset=0)
    if major != VERSION_MAJOR:
        raise TapeFormatError(f"unsupported tape format version {major}.{minor} (this reader reads {VERSION_MAJOR}.x)",
                              offset=8)
    if meta_len > MAX_META:
        raise TapeLimitError(f"tape metadata length {meta_len} above limit {MAX_META}", offset=44)
    end = HEADER_FIXED + meta_len
    if len(mv) < end + 8:
        raise TapeTruncatedError(f"segment header truncated: {len(mv)} of {end + 8} bytes", offset=len(mv))
    (stored,) = _U64.unpack_from(mv, end)
    if _xxh64(mv[:end], 0) != stored:
        raise TapeCorruptError("segment header checksum mismatch", offset=end)
    if flags & ~_KNOWN_FLAGS:
        raise TapeFormatError(f"reserved header flag bits set: {flags:#x}", offset=12)
    raw_meta = bytes(mv[HEADER_FIXED:end])
    try:
        meta = msgpack.unpackb(raw_meta, raw=False, strict_map_key=False, ext_hook=_ext_refused,
                               **bounded(len(raw_meta), pairs=strict_pairs))
    except ContainerLimitError as e:
        raise TapeLimitError(f"segment metadata: {e}", offset=HEADER_FIXED) from None
    except Exception as e:  # msgpack raises several unrelated types; all mean "bad metadata"
        raise TapeFormatError(f"segment metadata is not valid msgpack: {e}", offset=HEADER_FIXED) from None
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise TapeFormatError("segment metadata must be a map with string keys", offset=HEADER_FIXED)
    bad = foreign_value(meta)
    if bad is not None:  # msgpack decodes ext -1 (Timestamp) without asking ext_hook
        raise TapeFormatError(f"segment metadata holds a msgpack extension value at {bad}", offset=HEADER_FIXED)
    return SegmentHeader(run_id=bytes(run_id), salt=salt, segment=segment, first_seq=first_seq,
                         chain_prev=chain_prev, flags=flags, meta=meta, minor=minor, size=end + 8)


def pack_record_into(buf: bytearray, pos: int, seq: int, kind: int, body: bytes | memoryview, salt: int,
                     prev: int) -> int:
    """Frame one record into ``buf`` at ``pos`` (caller ensures room); returns its checksum."""
    n = len(body)
    _REC_TAIL.pack_into(buf, pos + 8, n, kind, 0, seq, salt, prev)
    end = pos + RECORD_HEADER + n
    buf[pos + RECORD_HEADER : end] = body
    c = _xxh64(memoryview(buf)[pos + 8 : end], salt)
    _U64.pack_into(buf, pos, c)
    return c


def encode_record(seq: int, kind: int, body: bytes, salt: int, prev: int = 0) -> tuple[bytes, int]:
    if len(body) > MAX_RECORD:
        raise TapeLimitError(f"record body of {len(body)} bytes above limit {MAX_RECORD}", seq=seq)
    buf = bytearray(RECORD_HEADER + len(body))
    c = pack_record_into(buf, 0, seq, kind, body, salt, prev)
    return bytes(buf), c


def encode_block(raw_records: bytes | memoryview, count: int, level: int = 3) -> bytes:
    """Body of a block frame: u32 count | u32 raw_len | zstd frame of the framed records."""
    comp = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(bytes(raw_records))
    return _BLK.pack(count, len(raw_records)) + comp


@dataclass(frozen=True, slots=True)
class Frame:
    """One logical record. ``offset`` is the record's (or its block's) offset in the segment."""

    offset: int
    seq: int
    kind: int
    body: memoryview
    checksum: int
    in_block: bool = False


@dataclass(slots=True)
class Scan:
    """Outcome of scanning a segment, filled in as :func:`scan_segment` iterates."""

    end: int = 0  # offset just past the last valid record
    size: int = 0
    next_seq: int = 0
    last_checksum: int = 0
    records: int = 0
    torn_reason: str = ""
    closed: bool = False  # the segment ends with a close record (§5.5)

    @property
    def dropped(self) -> int:
        return self.size - self.end


def _valid_at(mv: memoryview, pos: int, salt: int) -> bool:
    if pos + RECORD_HEADER > len(mv):
        return False
    c, n, _k, _f, _s, s, _p = _REC.unpack_from(mv, pos)
    if s != salt or n > MAX_RECORD or pos + RECORD_HEADER + n > len(mv):
        return False
    return _xxh64(mv[pos + 8 : pos + RECORD_HEADER + n], salt) == c


def _later_valid(mv: memoryview, after: int, salt: int) -> int | None:
    """Offset of a valid record starting after ``after``, found via the salt sync marker."""
    needle = _U64.pack(salt)
    q = after + 1 + 24
    obj = mv.obj
    # ``find`` runs at C speed on the underlying object, but only if the view spans all of it.
    if not (isinstance(obj, (bytes, bytearray, mmap.mmap)) and len(obj) == mv.nbytes):
        obj = bytes(mv)
    while True:
        q = obj.find(needle, q)
        if q < 0:
            return None
        if _valid_at(mv, q - 24, salt):
            return q - 24
        q += 1


def scan_segment(buf: bytes | memoryview, hdr: SegmentHeader, *, final: bool, scan: Scan | None = None,
                 where: str = "", torn_ok: bool = True, salvage: bool = False) -> Iterator[Frame]:
    """Yield the valid records of one segment, enforcing the torn-tail / corrupt-middle rule.

    ``final``: this is the tape's last segment, the only place a torn tail may be.
    ``torn_ok=False`` turns a torn tail into :class:`TapeTruncatedError`.
    ``salvage=True`` stops at the first bad record instead of raising (``tape repair
    --salvage``: point-in-time recovery that knowingly drops later records).
    The caller's ``scan`` object ends up holding the valid end and dropped bytes.
    """
    mv = memoryview(buf)
    st = scan if scan is not None else Scan()
    st.size = len(mv)
    st.next_seq = hdr.first_seq
    st.last_checksum = hdr.chain_prev
    pos = st.end = hdr.size
    salt = hdr.salt
    size = len(mv)
    unpack = _REC.unpack_from
    while pos < size:
        problem = ""
        if pos + RECORD_HEADER > size:
            problem = f"short record header ({size - pos} of {RECORD_HEADER} bytes)"
        else:
            c, n, kind, flags, seq, s, prev = unpack(mv, pos)
            if s != salt:
                problem = "salt mismatch (stale or foreign bytes)"
            elif n > MAX_RECORD:
                # A record carrying our salt that claims an absurd length is refused
                # before anything is allocated or read, wherever it sits.
                if not salvage:
                    raise TapeLimitError(f"record length {n} above limit {MAX_RECORD}{where}", offset=pos,
                                         seq=st.next_seq)
                problem = f"length field {n} above limit"
            elif pos + RECORD_HEADER + n > size:
                problem = f"short record body ({size - pos - RECORD_HEADER} of {n} bytes)"
            elif _xxh64(mv[pos + 8 : pos + RECORD_HEADER + n], salt) != c:
                problem = "checksum mismatch"
        if problem:
            if salvage:
                st.torn_reason = problem
                return
            later = _later_valid(mv, pos, salt)
            if later is not None:
                raise TapeCorruptError(f"corrupt record ({problem}) followed by a valid record at offset {later}"
                                       f"{where}", offset=pos, seq=st.next_seq)
            if not final:
                raise TapeCorruptError(f"bad record ({problem}) at the end of a non-final segment{where}",
                                       offset=pos, seq=st.next_seq)
            if not torn_ok:
                raise TapeTruncatedError(f"torn tail ({problem}): {size - pos} bytes{where}", offset=pos,
                                         seq=st.next_seq)
            st.torn_reason = problem
            return
        # From here the record's bytes are exactly what the writer wrote (checksum ok);
        # anything wrong now is a writer bug or tampering, never a torn write.
        if salvage and (flags != 0 or seq != st.next_seq or (hdr.chain and kind != BLOCK_KIND
                                                             and prev != st.last_checksum)):
            st.torn_reason = f"record at offset {pos} out of sequence or off the hash chain"
            return
        if flags != 0:
            raise TapeFormatError(f"reserved record flags {flags:#x} set{where}", offset=pos, seq=seq)
        if seq != st.next_seq:
            raise TapeCorruptError(f"sequence number {seq} where {st.next_seq} was expected (record lost, "
                                   f"duplicated or reordered){where}", offset=pos, seq=seq)
        body = mv[pos + RECORD_HEADER : pos + RECORD_HEADER + n]
        if kind == CLOSE_KIND:
            # The close record says "the writer finished and nothing follows": it carries
            # no body, ends the tape's last segment, and nothing may come after it.
            if hdr.chain and prev != st.last_checksum:
                raise TapeCorruptError(f"hash chain broken at the close record{where}", offset=pos, seq=seq)
            if not hdr.chain and prev != 0:
                raise TapeFormatError(f"prev field set on an unchained tape{where}", offset=pos, seq=seq)
            if n != 0:
                raise TapeFormatError(f"close record with a {n}-byte body (must be empty){where}", offset=pos,
                                      seq=seq)
            if not final:
                raise TapeCorruptError(f"close record in a non-final segment{where}", offset=pos, seq=seq)
            if pos + RECORD_HEADER != size:
                raise TapeCorruptError(f"{size - pos - RECORD_HEADER} bytes after the close record{where}",
                                       offset=pos + RECORD_HEADER, seq=seq + 1)
            st.closed = True
            st.end = pos + RECORD_HEADER
            return
        if kind == BLOCK_KIND:
            if not hdr.zstd:  # §5.4: blocks exist only on a tape whose header says ZSTD
                raise TapeFormatError(f"zstd block on a tape without the ZSTD flag{where}", offset=pos, seq=seq)
            if prev != 0:
                raise TapeFormatError(f"block frame with non-zero prev{where}", offset=pos, seq=seq)
            yield from _expand_block(body, pos, seq, hdr, st, where)
        else:
            if hdr.chain and prev != st.last_checksum:
                raise TapeCorruptError(f"hash chain broken: prev {prev:#018x}, previous record's checksum "
                                       f"{st.last_checksum:#018x}{where}", offset=pos, seq=seq)
            if not hdr.chain and prev != 0:
                raise TapeFormatError(f"prev field set on an unchained tape{where}", offset=pos, seq=seq)
            st.last_checksum = c
            st.next_seq = seq + 1
            st.records += 1
            yield Frame(pos, seq, kind, body, c)
        pos += RECORD_HEADER + n
        st.end = pos


def _expand_block(body: memoryview, offset: int, seq: int, hdr: SegmentHeader, st: Scan, where: str) -> Iterator[Frame]:
    if len(body) < _BLK.size:
        raise TapeFormatError(f"block body too short{where}", offset=offset, seq=seq)
    count, raw_len = _BLK.unpack_from(body, 0)
    if raw_len > MAX_BLOCK_RAW or count > MAX_BLOCK_RECORDS:
        raise TapeLimitError(f"block of {count} records / {raw_len} bytes above limits{where}", offset=offset, seq=seq)
    comp = body[_BLK.size :]
    try:
        declared = zstandard.frame_content_size(comp)
        if declared != raw_len:
            raise TapeFormatError(f"block declares {raw_len} bytes, zstd frame {declared}{where}", offset=offset,
                                  seq=seq)
        raw = zstandard.ZstdDecompressor().decompress(bytes(comp), max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise TapeFormatError(f"block does not decompress: {e}{where}", offset=offset, seq=seq) from None
    if len(raw) != raw_len:
        raise TapeFormatError(f"block decompressed to {len(raw)} bytes, declared {raw_len}{where}", offset=offset,
                              seq=seq)
    rmv = memoryview(raw)
    pos = 0
    got = 0
    while pos < raw_len:
        if not _valid_at(rmv, pos, hdr.salt):
            # The block frame's checksum was fine, so its contents cannot be torn.
            raise TapeCorruptError(f"bad record inside a valid block at inner offset {pos}{where}", offset=offset,
                                   seq=st.next_seq)
        c, n, kind, flags, s, _salt, prev = _REC.unpack_from(rmv, pos)
        if flags != 0 or kind == BLOCK_KIND or kind == CLOSE_KIND:
            raise TapeFormatError(f"bad inner record header{where}", offset=offset, seq=s)
        if s != st.next_seq:
            raise TapeCorruptError(f"sequence number {s} where {st.next_seq} was expected{where}", offset=offset,
                                   seq=s)
        if hdr.chain and prev != st.last_checksum:
            raise TapeCorruptError(f"hash chain broken inside block{where}", offset=offset, seq=s)
        st.last_checksum = c
        st.next_seq = s + 1
        st.records += 1
        got += 1
        yield Frame(offset, s, kind, rmv[pos + RECORD_HEADER : pos + RECORD_HEADER + n], c, in_block=True)
        pos += RECORD_HEADER + n
    if got != count or seq + count != st.next_seq:
        raise TapeFormatError(f"block declares {count} records, holds {got}{where}", offset=offset, seq=seq)
