"""The bytes of a CPU tensor, zero-copy (no numpy needed): what writers hash and write."""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["tensor_memoryview"]


def tensor_memoryview(t: Any) -> memoryview:
    """Zero-copy view of a CPU contiguous tensor's bytes (no numpy needed)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
