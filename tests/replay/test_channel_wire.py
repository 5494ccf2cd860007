"""The channel wire format: golden bytes, round trips, and every decoder refusal."""

from __future__ import annotations

import struct
import zlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.channel import MessageKind
from replay.channel import wire
from replay.clock import VectorClock
from replay.errors import ChannelError

GOLDEN = wire.Header(MessageKind.DATA, 7, 40, 2, 96, 1 << 20)


def test_header_golden_bytes() -> None:
    raw = wire.encode_header(GOLDEN)
    assert len(raw) == wire.HEADER_SIZE == 64
    assert raw[:4] == b"RPCH" and raw[4] == 1 and raw[5] == 1 and raw[6:8] == b"\0\0"
    assert struct.unpack_from("<QIIQI", raw, 8) == (7, 40, 2, 96, 1 << 20)
    assert raw[36:60] == b"\0" * 24
    assert struct.unpack_from("<I", raw, 60)[0] == zlib.crc32(raw[:60])
    assert raw.hex() == (
        "5250434801010000" "0700000000000000" "2800000002000000" "6000000000000000" "00001000"
        + "00" * 24 + raw[60:].hex()
    )
    assert wire.decode_header(raw) == GOLDEN


def _recrc(b: bytearray) -> bytes:
    b[60:64] = struct.pack("<I", zlib.crc32(bytes(b[:60])))
    return bytes(b)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.__setitem__(slice(0, 4), b"XXXX"), "bad channel header magic"),
        (lambda b: b.__setitem__(4, 2), "unsupported channel wire version 2"),
        (lambda b: b.__setitem__(5, 9), "unknown message kind 9"),
        (lambda b: b.__setitem__(6, 1), "reserved channel header fields must be zero"),
        (lambda b: b.__setitem__(40, 1), "reserved channel header fields must be zero"),
        (lambda b: b.__setitem__(slice(16, 20), struct.pack("<I", wire.MAX_META_BYTES + 1)),
         "metadata length 16777217 above the format limit"),
        (lambda b: b.__setitem__(slice(20, 24), struct.pack("<I", wire.MAX_TENSORS + 1)), "above the format limit 4096"),
        (lambda b: b.__setitem__(slice(32, 36), struct.pack("<I", 16)), "chunk size 16 outside"),
    ],
)
def test_header_refusals(mutate, message) -> None:
    b = bytearray(wire.encode_header(GOLDEN))
    mutate(b)
    with pytest.raises(ChannelError, match=message):
        wire.decode_header(_recrc(b))


def test_header_checksum_bit_flips_and_truncation() -> None:
    raw = wire.encode_header(GOLDEN)
    for i in range(60 * 8):
        b = bytearray(raw)
        b[i // 8] ^= 1 << (i % 8)
        with pytest.raises(ChannelError):
            wire.decode_header(bytes(b))
    for n in range(64):
        with pytest.raises(ChannelError, match="channel header must be 64 bytes"):
            wire.decode_header(raw[:n])


def test_meta_round_trip_and_dtype_table() -> None:
    ts = [torch.zeros(2, 3, dtype=dt) for dt in wire.DTYPE_NAMES.values()]
    blob = wire.encode_meta("a", "b", VectorClock.of(a=3), {"k": [1, b"x"]}, ts)
    total = sum(t.numel() * t.element_size() for t in ts)
    m = wire.decode_meta(blob, n_tensors=len(ts), payload_len=total)
    assert (m.src, m.dst, m.clock, m.meta) == ("a", "b", VectorClock.of(a=3), {"k": [1, b"x"]})
    assert [(d.dtype, d.shape) for d in m.tensors] == [(t.dtype, (2, 3)) for t in ts]
    assert wire.dtype_name(torch.bfloat16) == "BF16" and wire.dtype_from_name("F8_E4M3") == torch.float8_e4m3fn
    with pytest.raises(ChannelError, match="unknown wire dtype 'Q7'"):
        wire.dtype_from_name("Q7")


def _meta(**over):
    d = {"v": 1, "src": "a", "dst": "b", "clock": VectorClock().encode(), "meta": {}, "tensors": [["F32", [4]]]}
    d.update(over)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    "blob, n, payload, message",
    [
        (b"\xc1", 1, 16, "undecodable message metadata"),
        (msgpack.packb([1, 2]), 1, 16, "not a version-1 map"),
        (_meta(v=2), 1, 16, "not a version-1 map"),
        (msgpack.packb({"v": 1}), 1, 16, "lacks key 'src'"),
        (_meta(src=5), 1, 16, "wrong type"),
        (_meta(), 2, 16, "header declares 2 tensors, metadata describes 1"),
        (_meta(), 1, 17, "header declares 17 payload bytes, descriptors sum to 16"),
        (_meta(tensors=[["F32", [-1]]]), 1, 16, "bad tensor shape"),
        (_meta(tensors=[["F32", [1] * 33]]), 1, 4, "bad tensor shape"),
        (_meta(tensors=[["F32"]]), 1, 16, "bad tensor descriptor"),
        (_meta(clock=b"\x01\x00"), 1, 16, "bad vector clock"),
        (_meta(meta={"at": msgpack.Timestamp(1, 0)}), 1, 16, "extension value at /meta/at"),
        (_meta(meta={"x": msgpack.ExtType(7, b"")}), 1, 16, "extension value at /meta/x"),
    ],
)
def test_meta_refusals(blob, n, payload, message) -> None:
    with pytest.raises(ChannelError, match=message):
        wire.decode_meta(blob, n_tensors=n, payload_len=payload)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from([MessageKind.DATA, MessageKind.MARKER, MessageKind.BYE]), seq=st.integers(0, 2**64 - 1),
       meta_len=st.integers(0, wire.MAX_META_BYTES), n=st.integers(0, wire.MAX_TENSORS),
       payload=st.integers(0, 2**64 - 1), chunk=st.integers(wire.MIN_CHUNK_BYTES, wire.MAX_CHUNK_BYTES))
def test_header_round_trip(kind, seq, meta_len, n, payload, chunk) -> None:
    h = wire.Header(kind, seq, meta_len, n, payload, chunk)
    assert wire.decode_header(wire.encode_header(h)) == h


def test_chunk_spans() -> None:
    assert wire.chunk_spans(0, 4096) == []
    assert wire.chunk_spans(10_000, 4096) == [(0, 4096), (4096, 8192), (8192, 10_000)]
