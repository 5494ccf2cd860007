"""Deprecated name of :mod:`ckpt.convert.hf` (kept for one release)."""

from __future__ import annotations

from ..convert.hf import DEFAULT_MAX_SHARD_SIZE, HFExport, export_hf, parse_size

__all__ = ["export_hf", "HFExport", "DEFAULT_MAX_SHARD_SIZE", "parse_size"]
