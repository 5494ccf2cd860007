"""Tape framing: ``ckpt.tape.format``, the one implementation, under ``replay``'s name.

The pure framing lives in ``ckpt`` so that the step ledger, which ``CheckpointManager``
writes without importing ``replay``, uses the same bytes rules; its errors are the
tape errors that ``replay.errors`` names (one set of classes, ``ckpt.errors``).
"""

from __future__ import annotations

from ckpt.tape import format as _low
from ckpt.tape.format import (  # noqa: F401 - re-exported
    BLOCK_KIND, CLOSE_KIND, FLAG_CHAIN, FLAG_ZSTD, HEADER_FIXED, MAGIC, MAX_BLOCK_RAW, MAX_BLOCK_RECORDS, MAX_META, MAX_RECORD,
    RECORD_HEADER, VERSION_MAJOR, VERSION_MINOR, Frame, Scan, SegmentHeader, checksum, decode_segment_header, encode_block,
    encode_record, encode_segment_header, pack_record_into, scan_segment, strict_pairs,
)

__all__ = list(_low.__all__)
