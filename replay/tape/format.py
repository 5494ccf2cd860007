"""Tape framing: ``ckpt.tape.format`` (the one implementation) with ``replay.errors``.

The pure framing moved down into ``ckpt`` so that the step ledger, which
``CheckpointManager`` writes without importing ``replay``, uses the same bytes rules.
Every name is re-exported; the functions that decode raise the ``replay.errors``
class of each failure (``TapeCorruptError``, ...), as they always did.
"""

from __future__ import annotations

from typing import Any, Iterator

from ckpt import errors as _ce
from ckpt.tape import format as _low
from ckpt.tape.format import (  # noqa: F401 - re-exported
    BLOCK_KIND, CLOSE_KIND, FLAG_CHAIN, FLAG_ZSTD, HEADER_FIXED, MAGIC, MAX_BLOCK_RAW, MAX_BLOCK_RECORDS, MAX_META, MAX_RECORD,
    RECORD_HEADER, VERSION_MAJOR, VERSION_MINOR, Frame, Scan, SegmentHeader, checksum, encode_block,
    pack_record_into, strict_pairs,
)
from replay.errors import TapeCorruptError, TapeError, TapeFormatError, TapeLimitError, TapeTruncatedError

__all__ = list(_low.__all__)

_CLASS: dict[str, type[TapeError]] = {
    "corrupt": TapeCorruptError, "truncated": TapeTruncatedError, "format": TapeFormatError, "limit": TapeLimitError,
}


def translate(e: _ce.TapeDataError) -> TapeError:
    """The ``replay.errors`` twin of a ``ckpt`` tape error (same message and context)."""
    ctx: dict[str, Any] = {}
    if e.path is not None:
        ctx["path"] = e.path
    if e.offset is not None:
        ctx["offset"] = e.offset
    ctx.update(e.context)
    return _CLASS[e.reason](e.message, **ctx)


def encode_segment_header(**kw: Any) -> bytes:
    try:
        return _low.encode_segment_header(**kw)
    except _ce.TapeDataError as e:
        raise translate(e) from None


def decode_segment_header(buf: bytes | memoryview) -> SegmentHeader:
    try:
        return _low.decode_segment_header(buf)
    except _ce.TapeDataError as e:
        raise translate(e) from None


def encode_record(seq: int, kind: int, body: bytes, salt: int, prev: int = 0) -> tuple[bytes, int]:
    try:
        return _low.encode_record(seq, kind, body, salt, prev)
    except _ce.TapeDataError as e:
        raise translate(e) from None


def scan_segment(*args: Any, **kw: Any) -> Iterator[Frame]:
    try:
        yield from _low.scan_segment(*args, **kw)
    except _ce.TapeDataError as e:
        raise translate(e) from None
