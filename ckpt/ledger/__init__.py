"""The step ledger: every step of a run on its tape, and every resume verified against it.

Per optimizer step the ledger records, as ``ledger_step`` events in the tape format
(spec/tape-format.md §6.2): the step number, a digest of the batch the step consumed
(every tensor in it), the loss bits, the digest of each captured RNG stream, and every
``params_every`` steps a digest of the parameters. ``CheckpointManager`` keeps one in
``<run_dir>/ledger`` by default; ``Ledger`` is the same for a plain ``ckpt.save`` /
``ckpt.load`` script, and a script that only calls ``ckpt.save``/``ckpt.load`` gets one
without a line of code (``ckpt.ledger.auto``). After a resume, the re-executed steps are compared with what the
ledger recorded before the crash (``ResumeReport``).
"""

from __future__ import annotations

from typing import Any

from .compare import CAUSES, ResumeReport, StepDiff, compare_runs, used_streams
from .ledger import (ENV_DIR, ENV_VERIFY, Ledger, ResumeNotice, ResumeVerificationWarning, ResumeVerified,
                     announce)
from .record import LedgerOpen, LedgerStep, LedgerValues, ResumeCheck
from .tapefile import LedgerTape, ledger_tapes, read_ledger_dir, read_ledger_tape

__all__ = [
    "Ledger", "ResumeReport", "ResumeVerificationWarning", "ResumeVerified", "ResumeNotice", "announce", "StepDiff", "CAUSES", "compare_runs", "used_streams",
    "LedgerOpen", "LedgerStep", "LedgerValues", "ResumeCheck", "LedgerTape", "ledger_tapes", "read_ledger_dir", "read_ledger_tape",
    "ENV_DIR", "ENV_VERIFY",
]


def __getattr__(name: str) -> Any:
    # one-release shims: the kill switch and the command check belong to the harness
    if name == "ENV_KILL_AT":
        import warnings

        from ..testing.kill_switch import ENV_KILL_AT

        warnings.warn("ckpt.ledger.ENV_KILL_AT moved to ckpt.testing.kill_switch.ENV_KILL_AT", DeprecationWarning,
                      stacklevel=2)
        return ENV_KILL_AT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
