"""Conversions between checkpoints and other layouts (``ckpt.interop.hf``: the Hugging
Face layout that ``transformers``' ``from_pretrained`` reads). DCP interop lives in
``ckpt.dcp.interop``. Nothing here imports torch or transformers at import time."""

from __future__ import annotations

__all__ = ["hf"]
