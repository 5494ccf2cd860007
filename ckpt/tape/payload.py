"""Event payload fields, pure: the wire forms of spec/tape-format.md §6.1.1 for the kinds
``ckpt`` writes itself (the step ledger, 22-24, and the loss-spike guard, 48-53).

``replay.events`` holds the one event table and a generic codec for every kind; ``ckpt``
cannot import it, so the kinds ``ckpt`` owns are encoded here, field by field, with
these two classes (tests check the bytes equal what ``replay``'s table encodes). A
decoder enforces the same bounds as ``replay``'s: no trailing bytes, no count the
remaining bytes cannot hold, no msgpack extension values or ambiguous map keys.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import msgpack

from ..errors import TapeFormatError, TapeLimitError
from ..format.codec import ContainerLimitError, bounded, foreign_value
from .format import strict_pairs

__all__ = ["PayloadWriter", "PayloadReader", "pack_msgpack", "unpack_msgpack", "MAX_LIST", "MAX_MSGPACK"]

MAX_LIST = 1 << 20
MAX_MSGPACK = 1 << 20

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


def _ext_refused(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed on a tape")


def unpack_msgpack(data: bytes) -> Any:
    """Decode one msgpack object under the tape rules; ``ValueError`` says what is wrong."""
    try:
        v = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_refused,
                            **bounded(len(data), pairs=strict_pairs))
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError, RecursionError) as e:
        raise ValueError(f"bad msgpack: {e}") from None
    bad = foreign_value(v)
    if bad is not None:  # msgpack decodes ext -1 (Timestamp) without asking ext_hook
        raise ValueError(f"msgpack extension value at {bad} is not allowed on a tape")
    return v


def pack_msgpack(v: Any) -> bytes:
    """The msgpack image a ``msgpack`` field carries (binary64 floats, bin for bytes)."""
    return msgpack.packb(v, use_bin_type=True, use_single_float=False, strict_types=False)


class PayloadWriter:
    """Appends typed fields to a payload; ``bytes(w)`` is the result."""

    def __init__(self) -> None:
        self.out = bytearray()

    def __bytes__(self) -> bytes:
        return bytes(self.out)

    def str(self, s: str, *, cut: bool = False) -> PayloadWriter:
        b = s.encode()
        if len(b) > 0xFFFF:
            if not cut:
                raise ValueError("string longer than 65535 bytes")
            b = b[:0xFFFF].decode(errors="ignore").encode()  # a report longer than a str field is cut
        self.out += _U16.pack(len(b))
        self.out += b
        return self

    def u32(self, v: int) -> PayloadWriter:
        self.out += _U32.pack(v)
        return self

    def u64(self, v: int) -> PayloadWriter:
        self.out += _U64.pack(v)
        return self

    def i64(self, v: int) -> PayloadWriter:
        self.out += _I64.pack(v)
        return self

    def f64(self, v: float) -> PayloadWriter:
        self.out += _F64.pack(v)
        return self

    def d128(self, d: bytes) -> PayloadWriter:
        if len(d) != 16:
            raise ValueError(f"a digest is 16 bytes, got {len(d)}")
        self.out += d
        return self

    def strs(self, items: Sequence[str]) -> PayloadWriter:
        self.out += _U16.pack(len(items))
        for s in items:
            self.str(s)
        return self

    def digests(self, items: Sequence[tuple[str, bytes]]) -> PayloadWriter:
        self.out += _U32.pack(len(items))
        for name, d in items:
            self.str(name, cut=True)
            self.d128(d)
        return self

    def msgpack(self, v: Any) -> PayloadWriter:
        raw = pack_msgpack(v)
        unpack_msgpack(raw)  # a writer never writes what a reader refuses
        if len(raw) > MAX_MSGPACK:
            raise ValueError(f"msgpack value of {len(raw)} bytes above the {MAX_MSGPACK} byte limit")
        self.out += _U32.pack(len(raw))
        self.out += raw
        return self


class PayloadReader:
    """Reads typed fields off a payload; every failure is ``TapeFormatError`` + ``where``
    (``TapeLimitError`` for a count or length above spec/tape-format.md §12)."""

    def __init__(self, body: bytes | memoryview, where: str = "", what: str = "event") -> None:
        self.mv = memoryview(body)
        self.pos = 0
        self.where = where
        self.what = what

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.mv):
            raise TapeFormatError(f"{self.what} runs past its body{self.where}")
        v = self.mv[self.pos : self.pos + n]
        self.pos += n
        return v

    def unpack(self, s: struct.Struct) -> tuple:
        return s.unpack(self.take(s.size))

    def str(self) -> str:
        (n,) = self.unpack(_U16)
        try:
            return bytes(self.take(n)).decode()
        except UnicodeDecodeError:
            raise TapeFormatError(f"{self.what} string is not UTF-8{self.where}") from None

    def u32(self) -> int:
        return int(self.unpack(_U32)[0])

    def u64(self) -> int:
        return int(self.unpack(_U64)[0])

    def i64(self) -> int:
        return int(self.unpack(_I64)[0])

    def f64(self) -> float:
        return float(self.unpack(_F64)[0])

    def d128(self) -> bytes:
        return bytes(self.take(16))

    def _count(self, s: struct.Struct, each_min: int) -> int:
        (n,) = self.unpack(s)
        if n > MAX_LIST:  # spec/tape-format.md §12, §15a
            raise TapeLimitError(f"{self.what} count {n} above the {MAX_LIST} limit{self.where}")
        if n * each_min > len(self.mv) - self.pos:
            raise TapeFormatError(f"{self.what} count {n} does not fit the body{self.where}")
        return int(n)

    def strs(self) -> tuple[str, ...]:
        return tuple(self.str() for _ in range(self._count(_U16, 2)))

    def digests(self) -> tuple[tuple[str, bytes], ...]:
        return tuple((self.str(), self.d128()) for _ in range(self._count(_U32, 18)))

    def msgpack(self) -> Any:
        (n,) = self.unpack(_U32)
        if n > MAX_MSGPACK:
            raise TapeLimitError(f"{self.what} msgpack length {n} above the {MAX_MSGPACK} limit{self.where}")
        try:
            return unpack_msgpack(bytes(self.take(n)))
        except ContainerLimitError as e:
            raise TapeLimitError(f"{self.what}: {e}{self.where}") from None
        except ValueError as e:
            raise TapeFormatError(f"{self.what}: {e}{self.where}") from None

    def done(self) -> None:
        if self.pos != len(self.mv):
            raise TapeFormatError(f"{self.what} has {len(self.mv) - self.pos} trailing bytes{self.where}")
