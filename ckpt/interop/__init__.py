"""Deprecated name of :mod:`ckpt.convert` (kept for one release): ``ckpt.interop.hf`` is
``ckpt.convert.hf``."""

from __future__ import annotations

import warnings

warnings.warn("ckpt.interop is deprecated: import ckpt.convert (ckpt.convert.hf)", DeprecationWarning, stacklevel=2)

__all__ = ["hf"]
