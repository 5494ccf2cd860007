"""Moved to ``ckpt.testing`` (the harness in ``ckpt.testing.resume_command``); this name
resolves for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

from ..testing import resume_command as _moved

__all__ = list(_moved.__all__)

warnings.warn("ckpt.ledger.check moved to ckpt.testing (check_command, CommandCheck: "
              "ckpt.testing.resume_command)", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
