"""Tape framing: golden layout, round trips, torn tails at every offset, bit flips everywhere."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import msgpack
import pytest
import xxhash

from replay.errors import TapeCorruptError, TapeError, TapeFormatError, TapeLimitError, TapeTruncatedError
from replay.tape import TapeReader, TapeWriter
from replay.tape import format as fmt

META = {"entry_point": "m:f", "config_hash": "00"}


def _write(path: Path, n: int, *, closed: bool = False, **opts) -> list[tuple[int, bytes]]:
    """``n`` records; left unclosed by default (as a crash leaves a tape), since the torn-tail
    tests below append or cut bytes at the end, where a closed tape has its close record."""
    recs = [(100 + i % 7, bytes([i % 251]) * (i % 13 + 1)) for i in range(n)]
    w = TapeWriter(path, META, **opts)
    for kind, body in recs:
        w.append(kind, body)
    w.close() if closed else w.abandon()
    return recs


def _frames(data: bytes, **kw) -> tuple[list[tuple[int, int, bytes]], fmt.Scan]:
    hdr = fmt.decode_segment_header(data)
    scan = fmt.Scan()
    out = [(f.seq, f.kind, bytes(f.body)) for f in fmt.scan_segment(data, hdr, final=True, scan=scan, **kw)]
    return out, scan


def _offsets(data: bytes) -> list[int]:
    hdr = fmt.decode_segment_header(data)
    return [f.offset for f in fmt.scan_segment(data, hdr, final=True)]


# -- golden layout -----------------------------------------------------------------------------
def test_record_golden_layout() -> None:
    raw, c = fmt.encode_record(7, 0x0102, b"hello", salt=0x1122334455667788, prev=0)
    assert len(raw) == 40 + 5
    checksum, length, kind, flags, seq, salt, prev = struct.unpack_from("<QIHHQQQ", raw, 0)
    assert (length, kind, flags, seq, salt, prev) == (5, 0x0102, 0, 7, 0x1122334455667788, 0)
    assert checksum == c == xxhash.xxh3_64_intdigest(raw[8:], 0x1122334455667788)
    assert raw[40:] == b"hello"
    assert raw[24:32] == bytes.fromhex("8877665544332211")  # the salt, little-endian, in every record


def test_segment_header_golden_layout() -> None:
    h = fmt.encode_segment_header(run_id=bytes(range(16)), salt=5, segment=2, first_seq=9, chain_prev=3,
                                  flags=fmt.FLAG_CHAIN, meta={"a": 1})
    assert h[:8] == b"CKPTTAPE"
    assert struct.unpack_from("<HHI", h, 8) == (1, 1, 1)  # format 1.1
    assert h[16:32] == bytes(range(16))
    assert struct.unpack_from("<QIIQQ", h, 32) == (5, 2, 4, 9, 3)  # meta {"a": 1} is 4 msgpack bytes
    assert h[64:68] == bytes.fromhex("81a16101")
    assert struct.unpack_from("<Q", h, 68)[0] == xxhash.xxh3_64_intdigest(h[:68], 0)
    d = fmt.decode_segment_header(h)
    assert (d.salt, d.segment, d.first_seq, d.chain_prev, d.chain, d.zstd, d.meta, d.size) == (
        5, 2, 9, 3, True, False, {"a": 1}, 76)


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [{}, {"chain": True}, {"zstd": True}, {"chain": True, "zstd": True},
                                  {"segment_bytes": 600}, {"segment_bytes": 600, "chain": True, "zstd": True,
                                                           "buffer_bytes": 4096}])
def test_roundtrip_modes(tmp_path: Path, opts: dict) -> None:
    path = tmp_path / "t.tape"
    recs = _write(path, 300, **opts)
    r = TapeReader(path)
    got = [(f.kind, bytes(f.body)) for _, f in r.frames()]
    assert got == recs
    assert r.dropped_bytes == 0 and r.last_seq == 299 and r.records == 300
    if "segment_bytes" in opts:
        assert path.is_dir() and len(r.segment_paths) > 1
        assert [p.name for p in r.segment_paths][:2] == ["00000000.seg", "00000001.seg"]


def test_large_record_bypasses_the_buffer(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    big = os.urandom(20000)
    with TapeWriter(path, META, buffer_bytes=4096) as w:
        w.append(1, b"a")
        w.append(2, big)
        w.append(3, b"c")
    assert [(f.kind, bytes(f.body)) for _, f in TapeReader(path).frames()] == [(1, b"a"), (2, big), (3, b"c")]


def test_writer_memory_is_bounded(tmp_path: Path) -> None:
    with TapeWriter(tmp_path / "t.tape", META, buffer_bytes=8192) as w:
        buf = w._buf
        for i in range(50_000):
            w.note_step(i)
            w.append(2, b"x" * 20)
        assert w._buf is buf and len(buf) == 8192
        assert len(w._pending_index) <= 8192 // 40
    assert (tmp_path / "t.tape").stat().st_size > 50_000 * 60


def test_writer_refuses_overwrite_and_closed_append(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    w = TapeWriter(path, META)
    w.close()
    with pytest.raises(FileExistsError):
        TapeWriter(path, META)
    with pytest.raises(Exception, match="closed"):
        w.append(1, b"x")
    with pytest.raises(TapeLimitError, match="above limit"):
        TapeWriter(tmp_path / "u.tape", META).append(1, b"\0" * (fmt.MAX_RECORD + 1))


# -- torn tails -----------------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [{}, {"chain": True}])
def test_truncate_at_every_offset_of_the_last_records(tmp_path: Path, opts: dict) -> None:
    path = tmp_path / "t.tape"
    recs = _write(path, 40, **opts)
    data = path.read_bytes()
    offs = _offsets(data) + [len(data)]
    start = offs[-4]  # the last three records, every byte
    for cut in range(start, len(data) + 1):
        got, scan = _frames(data[:cut])
        complete = max(i for i, o in enumerate(offs) if o <= cut)  # records wholly before cut
        assert [(k, b) for _, k, b in got] == recs[:complete], cut
        assert scan.end == offs[complete] and scan.dropped == cut - offs[complete]
    with pytest.raises(TapeTruncatedError, match="torn tail") as ei:
        _frames(data[: offs[-2] + 3], torn_ok=False)
    assert ei.value.offset == offs[-2] and ei.value.seq == 39


def test_truncated_zstd_block_is_dropped_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    w = TapeWriter(path, META, zstd=True)
    for i in range(10):
        w.append(5, b"a" * i)
    w.flush()
    for i in range(10):
        w.append(6, b"b" * i)
    w.abandon()
    data = path.read_bytes()
    offs = _offsets(data)
    second_block = max(offs)
    for cut in range(second_block, len(data)):
        got, scan = _frames(data[:cut])
        assert len(got) == 10 and scan.dropped == cut - second_block


def test_file_reader_reports_dropped_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    _write(path, 10)
    with open(path, "ab") as f:
        f.write(b"\x07" * 13)
    r = TapeReader(path)
    assert len(list(r.frames())) == 10
    assert r.dropped_bytes == 13 and r.records == 10 and r.torn_reason == "short record header (13 of 40 bytes)"


def test_stale_record_from_another_tape_does_not_validate(tmp_path: Path) -> None:
    a, b = tmp_path / "a.tape", tmp_path / "b.tape"
    _write(a, 5)
    _write(b, 6)
    da, db = a.read_bytes(), b.read_bytes()
    stale = db[_offsets(db)[5]:]  # b's record seq 5: the next seq a would expect, wrong salt
    got, scan = _frames(da + stale)
    assert len(got) == 5 and scan.dropped == len(stale) and "salt" in scan.torn_reason
    offs = _offsets(da)
    spliced = da[: offs[2]] + db[_offsets(db)[2] : _offsets(db)[3]] + da[offs[3] :]
    with pytest.raises(TapeCorruptError, match="salt mismatch") as ei:
        _frames(spliced)
    assert ei.value.offset == offs[2] and ei.value.seq == 2


# -- bit flips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [{}, {"chain": True}])
def test_bit_flips_throughout(tmp_path: Path, opts: dict) -> None:
    path = tmp_path / "t.tape"
    recs = _write(path, 12, **opts)
    data = path.read_bytes()
    offs = _offsets(data)
    hsize = offs[0]
    last = offs[-1]
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 1 << (pos % 8)
        bad_b = bytes(bad)
        if pos < hsize:
            with pytest.raises(TapeError):
                _frames(bad_b)
            continue
        k = max(i for i, o in enumerate(offs) if o <= pos)
        if pos >= last:
            try:
                got, scan = _frames(bad_b)
            except TapeLimitError as e:  # a flipped length bit claiming > 16 MiB
                assert e.offset == last
                continue
            assert [(kk, b) for _, kk, b in got] == recs[:-1], pos  # the damaged last record is dropped
            assert scan.dropped == len(data) - last
        else:
            with pytest.raises((TapeCorruptError, TapeLimitError)) as ei:
                _frames(bad_b)
            assert ei.value.offset == offs[k] and ei.value.seq == k, pos


def test_length_field_of_2_pow_32_minus_1_is_refused_not_allocated(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    _write(path, 5)
    data = bytearray(path.read_bytes())
    offs = _offsets(bytes(data))
    for at in (offs[1], offs[-1]):  # middle and tail
        bad = bytearray(data)
        struct.pack_into("<I", bad, at + 8, 0xFFFFFFFF)
        with pytest.raises(TapeLimitError, match="record length 4294967295 above limit 16777216") as ei:
            _frames(bytes(bad))
        assert ei.value.offset == at
    hdr = bytearray(data)
    struct.pack_into("<I", hdr, 44, 0xFFFFFFFF)
    with pytest.raises(TapeLimitError, match="metadata length"):
        fmt.decode_segment_header(bytes(hdr))


def test_sequence_gap_and_broken_chain_fail_closed(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    _write(path, 6, chain=True)
    data = path.read_bytes()
    hdr = fmt.decode_segment_header(data)
    offs = _offsets(data)
    gap = data[: offs[2]] + data[offs[3] :]  # record 2 cut out cleanly
    with pytest.raises(TapeCorruptError, match="sequence number 3 where 2 was expected") as ei:
        _frames(gap)
    assert ei.value.offset == offs[2]
    # re-frame record 3 with a valid checksum but a wrong link: only the chain can tell
    body = data[offs[3] + 40 : offs[4]]
    kind = struct.unpack_from("<H", data, offs[3] + 12)[0]
    forged, _ = fmt.encode_record(3, kind, body, hdr.salt, prev=12345)
    with pytest.raises(TapeCorruptError, match="hash chain broken"):
        _frames(data[: offs[3]] + forged + data[offs[4] :])


def test_header_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    _write(path, 2)
    data = bytearray(path.read_bytes())
    with pytest.raises(TapeFormatError, match="bad magic"):
        fmt.decode_segment_header(b"NOTATAPE" + bytes(data[8:]))
    v2 = bytearray(data)
    struct.pack_into("<H", v2, 8, 2)
    with pytest.raises(TapeFormatError, match=r"unsupported tape format version 2\.\d"):
        fmt.decode_segment_header(bytes(v2))
    meta_flip = bytearray(data)
    meta_flip[70] ^= 0x40
    with pytest.raises(TapeCorruptError, match="header checksum mismatch"):
        fmt.decode_segment_header(bytes(meta_flip))
    with pytest.raises(TapeTruncatedError, match="segment header truncated"):
        fmt.decode_segment_header(bytes(data[:40]))
    flags = fmt.encode_segment_header(run_id=b"r" * 16, salt=1, segment=0, first_seq=0, chain_prev=0, flags=0,
                                      meta={})
    fl = bytearray(flags)
    struct.pack_into("<I", fl, 12, 8)
    struct.pack_into("<Q", fl, len(fl) - 8, xxhash.xxh3_64_intdigest(bytes(fl[:-8]), 0))
    with pytest.raises(TapeFormatError, match="reserved header flag bits"):
        fmt.decode_segment_header(bytes(fl))
    notmap = fmt.encode_segment_header(run_id=b"r" * 16, salt=1, segment=0, first_seq=0, chain_prev=0, flags=0,
                                       meta={})
    # replace the metadata with a msgpack list, re-checksummed: still refused
    raw = bytearray(notmap[:64]) + b"\x90"
    struct.pack_into("<I", raw, 44, 1)
    raw += struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(raw), 0))
    with pytest.raises(TapeFormatError, match="map with string keys"):
        fmt.decode_segment_header(bytes(raw))
    # ext -1 (Timestamp) is decoded by msgpack without asking the ext hook: refused too
    stamped = fmt.encode_segment_header(run_id=b"r" * 16, salt=1, segment=0, first_seq=0, chain_prev=0, flags=0,
                                        meta={"at": msgpack.Timestamp(3, 0)})
    with pytest.raises(TapeFormatError, match="extension value at /at"):
        fmt.decode_segment_header(stamped)


# -- segments ----------------------------------------------------------------------------------
def test_segment_directory_rules(tmp_path: Path) -> None:
    path = tmp_path / "run.tape"
    recs = _write(path, 200, segment_bytes=800, buffer_bytes=4096)
    segs = sorted(path.glob("*.seg"))
    assert len(segs) >= 3
    # a torn tail is allowed only in the last segment
    last = segs[-1]
    last.write_bytes(last.read_bytes()[:-5])
    r = TapeReader(path)
    got = [(f.kind, bytes(f.body)) for _, f in r.frames()]
    assert got == recs[: len(got)] and r.dropped_bytes > 0
    mid = segs[1]
    mid.write_bytes(mid.read_bytes()[:-5])
    with pytest.raises(TapeCorruptError, match="non-final segment"):
        list(TapeReader(path).frames())
    segs[1].unlink()
    with pytest.raises(TapeCorruptError, match="segment 00000001.seg missing"):
        TapeReader(path)


def test_torn_final_segment_header_is_never_written(tmp_path: Path) -> None:
    path = tmp_path / "run.tape"
    recs = _write(path, 50, segment_bytes=10**9)
    (path / "00000001.seg").write_bytes(b"CKPTTAPE\x01\x00")
    r = TapeReader(path)
    assert [(f.kind, bytes(f.body)) for _, f in r.frames()] == recs
    assert r.dropped_bytes == 10 and r.torn_reason == "truncated segment header"


def test_segments_of_another_tape_are_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a.tape", tmp_path / "b.tape"
    _write(a, 100, segment_bytes=800, buffer_bytes=4096)
    _write(b, 100, segment_bytes=800, buffer_bytes=4096)
    (a / "00000001.seg").write_bytes((b / "00000001.seg").read_bytes())
    with pytest.raises(TapeCorruptError, match="another tape"):
        list(TapeReader(a).frames())


# -- durability knobs ------------------------------------------------------------------------
def test_fsync_every_n_records_and_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    w = TapeWriter(tmp_path / "t.tape", META, fsync_every=10)
    base = len(calls)
    for _ in range(35):
        w.append(1, b"x")
    assert len(calls) - base == 3
    w.close()
    import replay.tape.writer as wmod

    now = [1000.0]
    monkeypatch.setattr(wmod.time, "monotonic", lambda: now[0])
    w = TapeWriter(tmp_path / "u.tape", META, fsync_interval=2.0)
    base = len(calls)
    w.append(1, b"x")
    assert len(calls) == base
    now[0] += 2.5
    w.append(1, b"x")
    assert len(calls) == base + 1
    w.close()
    assert len(list(TapeReader(tmp_path / "u.tape").frames())) == 2
