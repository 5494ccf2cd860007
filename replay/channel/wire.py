"""The channel wire format (pure: bytes in, bytes out). Normative text:
spec/snapshot-protocol.md, section "Wire format".

A message on the wire is a fixed 64-byte header, then a stream of segments: the msgpack
metadata blob, then each tensor's raw bytes (native little-endian layout, C order).
Every segment travels in chunks of at most ``chunk_bytes``; a chunk is one point-to-point
send of a uint8 tensor. Because the header declares every length before any payload
moves, a receiver checks its bound before it allocates, and can drain an oversize
message through one chunk-sized scratch buffer and keep the channel usable.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import msgpack
import torch

from ckpt.format.codec import bounded, foreign_value
from replay.channel.base import MessageKind
from replay.clock import VectorClock
from replay.errors import ChannelError

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "WIRE_VERSION",
    "MAX_META_BYTES",
    "MAX_TENSORS",
    "MAX_DIMS",
    "MAX_CHUNK_BYTES",
    "Header",
    "TensorDesc",
    "MetaBlob",
    "encode_header",
    "decode_header",
    "encode_meta",
    "decode_meta",
    "DTYPE_NAMES",
    "dtype_from_name",
    "dtype_name",
    "chunk_spans",
]

MAGIC = b"RPCH"
WIRE_VERSION = 1
HEADER_SIZE = 64
MAX_META_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 4096
MAX_DIMS = 32
MAX_CHUNK_BYTES = 1 << 30
MIN_CHUNK_BYTES = 4096

# magic, version, kind, flags, seq, meta_len, n_tensors, payload_len, chunk_bytes, 24 reserved, crc32
_HEADER = struct.Struct("<4sBBHQIIQI24sI")
assert _HEADER.size == HEADER_SIZE

# Explicit dtype <-> name table (never str(dtype)); names match safetensors where it has them.
DTYPE_NAMES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in [
        ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"), ("I32", "int32"),
        ("I64", "int64"), ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F16", "float16"),
        ("BF16", "bfloat16"), ("F32", "float32"), ("F64", "float64"), ("C64", "complex64"),
        ("C128", "complex128"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ]
    if hasattr(torch, attr)
}
_NAME_OF = {dt: name for name, dt in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise ChannelError(f"dtype {dtype} has no wire name") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ChannelError(f"unknown wire dtype {name!r}") from None


@dataclass(frozen=True, slots=True)
class Header:
    kind: MessageKind
    seq: int
    meta_len: int
    n_tensors: int
    payload_len: int
    chunk_bytes: int


@dataclass(frozen=True, slots=True)
class TensorDesc:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class MetaBlob:
    src: str
    dst: str
    clock: VectorClock
    meta: Mapping[str, Any]
    tensors: tuple[TensorDesc, ...]


def encode_header(h: Header) -> bytes:
    body = _HEADER.pack(MAGIC, WIRE_VERSION, int(h.kind), 0, h.seq, h.meta_len, h.n_tensors, h.payload_len,
                        h.chunk_bytes, b"\0" * 24, 0)
    crc = zlib.crc32(body[: HEADER_SIZE - 4])
    return body[: HEADER_SIZE - 4] + struct.pack("<I", crc)


def decode_header(data: bytes | memoryview) -> Header:
    if len(data) != HEADER_SIZE:
        raise ChannelError(f"channel header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, kind, flags, seq, meta_len, n_tensors, payload_len, chunk, reserved, crc = _HEADER.unpack(data)
    if magic != MAGIC:
        raise ChannelError(f"bad channel header magic {magic!r}")
    if zlib.crc32(bytes(data[: HEADER_SIZE - 4])) != crc:
        raise ChannelError("channel header checksum mismatch", seq=seq)
    if version != WIRE_VERSION:
        raise ChannelError(f"unsupported channel wire version {version} (this reader knows {WIRE_VERSION})", seq=seq)
    if flags != 0 or reserved != b"\0" * 24:
        raise ChannelError("reserved channel header fields must be zero", seq=seq)
    try:
        k = MessageKind(kind)
    except ValueError:
        raise ChannelError(f"unknown message kind {kind}", seq=seq) from None
    if meta_len > MAX_META_BYTES:
        raise ChannelError(f"metadata length {meta_len} above the format limit {MAX_META_BYTES}", seq=seq)
    if n_tensors > MAX_TENSORS:
        raise ChannelError(f"{n_tensors} tensors above the format limit {MAX_TENSORS}", seq=seq)
    if not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
        raise ChannelError(f"chunk size {chunk} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]", seq=seq)
    return Header(k, seq, meta_len, n_tensors, payload_len, chunk)


def encode_meta(src: str, dst: str, clock: VectorClock, meta: Mapping[str, Any],
                tensors: Sequence[torch.Tensor]) -> bytes:
    descs = [[dtype_name(t.dtype), list(t.shape)] for t in tensors]
    try:
        return msgpack.packb({"v": 1, "src": src, "dst": dst, "clock": clock.encode(), "meta": dict(meta),
                              "tensors": descs}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ChannelError(f"message metadata is not msgpack-able: {exc}") from exc


def decode_meta(data: bytes, *, n_tensors: int, payload_len: int) -> MetaBlob:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, **bounded(len(data)))
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ChannelError(f"undecodable message metadata: {exc}") from exc
    bad = foreign_value(obj)
    if bad is not None:  # Timestamp or an unknown ext type: nothing a sender of ours writes
        raise ChannelError(f"message metadata holds a msgpack extension value at {bad}")
    if not isinstance(obj, dict) or obj.get("v") != 1:
        raise ChannelError("message metadata is not a version-1 map")
    try:
        src, dst, clock_raw, meta, descs = obj["src"], obj["dst"], obj["clock"], obj["meta"], obj["tensors"]
    except KeyError as exc:
        raise ChannelError(f"message metadata lacks key {exc.args[0]!r}") from None
    if not (isinstance(src, str) and isinstance(dst, str) and isinstance(clock_raw, bytes)
            and isinstance(meta, dict) and isinstance(descs, list)):
        raise ChannelError("message metadata has a field of the wrong type")
    if len(descs) != n_tensors:
        raise ChannelError(f"header declares {n_tensors} tensors, metadata describes {len(descs)}")
    out: list[TensorDesc] = []
    total = 0
    for d in descs:
        if not (isinstance(d, list) and len(d) == 2 and isinstance(d[0], str) and isinstance(d[1], list)):
            raise ChannelError("bad tensor descriptor in message metadata")
        shape = d[1]
        if len(shape) > MAX_DIMS or not all(isinstance(x, int) and 0 <= x < 2**48 for x in shape):
            raise ChannelError(f"bad tensor shape {shape!r} in message metadata")
        td = TensorDesc(dtype_from_name(d[0]), tuple(shape))
        total += td.nbytes
        out.append(td)
    if total != payload_len:
        raise ChannelError(f"header declares {payload_len} payload bytes, descriptors sum to {total}")
    try:
        clock = VectorClock.decode(clock_raw)
    except ValueError as exc:
        raise ChannelError(f"bad vector clock in message metadata: {exc}") from exc
    return MetaBlob(src, dst, clock, meta, tuple(out))


def chunk_spans(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` byte spans a segment of ``nbytes`` travels in."""
    return [(i, min(i + chunk_bytes, nbytes)) for i in range(0, nbytes, chunk_bytes)]
