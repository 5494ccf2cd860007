"""The harnesses' kill switch: a process SIGKILLs itself right after step K and its save.

Production ledgers hold no kill logic: every ``ckpt.ledger.Ledger`` calls the step hooks
registered in ``ckpt.ledger.ledger.STEP_HOOKS`` once a step is done (recorded, and under a
manager or an integration, its save started), and a harness registers this switch there.

An unmodified command (``ckpt check-resume -- COMMAND``) gets it without a line of code:
the attempt told to die at step K runs with :func:`kill_env` ``(K)``, that is
``CKPT_LEDGER_KILL_AT=K`` and, first on ``PYTHONPATH``, ``SITE_DIR``, whose
``sitecustomize`` calls :func:`install_from_env` in each of the command's Python processes
when ckpt's ledger module is first imported (before that it imports neither ckpt nor torch)
and then runs the ``sitecustomize`` it shadows. In-process, :func:`install_kill_switch` does
the same directly.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ENV_KILL_AT", "SITE_DIR", "KillSwitch", "install_kill_switch", "uninstall_kill_switch",
           "install_from_env", "kill_env"]

#: the step the attempt dies at; read (through ckpt.knobs) only once the switch's site hook runs
ENV_KILL_AT = "CKPT_LEDGER_KILL_AT"
#: the directory whose sitecustomize installs the switch in a command's Python processes
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


@dataclass(frozen=True, slots=True)
class KillSwitch:
    """A step hook: at step ``step`` the ledger's tape is made durable, then SIGKILL (no
    cleanup runs, no ``finally``, no atexit: a crash, with a save of that step maybe in flight)."""

    step: int

    def __call__(self, ledger: Any, step: int) -> None:
        if step == self.step:
            ledger.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def install_kill_switch(step: int) -> KillSwitch:
    """Register a :class:`KillSwitch` at ``step`` with every ledger of this process (one
    switch at a time: a new one replaces the old)."""
    if step < 1:
        raise ValueError(f"kill step must be >= 1, got {step}")
    uninstall_kill_switch()
    from ..ledger.ledger import STEP_HOOKS

    switch = KillSwitch(step)
    STEP_HOOKS.append(switch)
    return switch


def uninstall_kill_switch() -> None:
    from ..ledger.ledger import STEP_HOOKS

    STEP_HOOKS[:] = [h for h in STEP_HOOKS if not isinstance(h, KillSwitch)]


def install_from_env() -> KillSwitch | None:
    """The site hook's call: install the switch ``CKPT_LEDGER_KILL_AT`` asks for, if any."""
    from ..knobs import knobs

    step = knobs().ledger_kill_at
    return install_kill_switch(step) if step else None


def kill_env(step: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make an unmodified command die right after step ``step``: set
    them over ``env`` (default ``os.environ``) for the attempt's process."""
    if step < 1:
        raise ValueError(f"kill step must be >= 1, got {step}")
    base = os.environ if env is None else env
    path = [SITE_DIR, *(p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR)]
    return {ENV_KILL_AT: str(step), "PYTHONPATH": os.pathsep.join(path)}
