"""Deprecated name of :mod:`ckpt.convert.dcp` (kept for one release)."""

from __future__ import annotations

import warnings

from ..convert.dcp import ALLOWED_GLOBALS, export_dcp, import_dcp, read_dcp_metadata

warnings.warn("ckpt.dcp.interop is deprecated: import ckpt.convert.dcp", DeprecationWarning, stacklevel=2)

__all__ = ["read_dcp_metadata", "import_dcp", "export_dcp", "ALLOWED_GLOBALS"]
