"""Moved to ``ckpt.testing`` (the harness in ``ckpt.testing.resume_entry``); this name
resolves for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

from .testing import resume_entry as _moved

__all__ = list(_moved.__all__)

warnings.warn("ckpt.resume_check moved to ckpt.testing (check_resume, RunContext, ...: "
              "ckpt.testing.resume_entry)", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
