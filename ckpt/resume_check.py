"""One-release shim: the entry-point harness is ``ckpt.testing.resume_entry`` (its public
names also in ``ckpt.testing``); importing this name warns and gives that module."""

import sys
import warnings

from .testing import resume_entry

warnings.warn("ckpt.resume_check moved to ckpt.testing (check_resume, RunContext, ...: ckpt.testing.resume_entry)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = resume_entry
