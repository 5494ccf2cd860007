"""One-release shim: the command harness is ``ckpt.testing.resume_command``; importing
``ckpt.ledger.check`` warns and gives that module."""

import sys
import warnings

from ..testing import resume_command

warnings.warn("ckpt.ledger.check moved to ckpt.testing (check_command, CommandCheck: ckpt.testing.resume_command)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = resume_command
