"""``meta.sharded``, the pure codec, lives in :mod:`ckpt.format.sharded` (it is format: the
reader needs it without ``ckpt.dcp``); this path is kept one release and hands on the
same names."""

from __future__ import annotations

from ..format.sharded import (  # noqa: F401 - re-exported
    LAYOUT_VERSION, Chunk, ShardedLayout, TensorRecord, ValueRecord, box_name, decode_layout, is_sharded,
)

__all__ = ["LAYOUT_VERSION", "Chunk", "TensorRecord", "ValueRecord", "ShardedLayout", "box_name", "decode_layout", "is_sharded"]
