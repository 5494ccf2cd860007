"""Kill-and-resume harnesses, and test helpers for users' own suites (pytest or plain asserts).

Two harnesses with one verdict model (``Verdict``, ``EXIT_CODES``; ``ckpt check-resume``
exits with the code of its verdict in both modes):

* ``check_resume`` (``resume_entry``): an entry point ``train(ctx: RunContext)``, killed
  by its own ``ctx.report`` and resumed, compared state by state;
* ``check_command`` (``resume_command``): an unmodified command, killed by the kill switch
  the harness installs in its step ledger (``kill_switch``), compared ledger by ledger.

The harness modules load on first use: this package is imported inside a command's
processes by the kill switch's site hook, where only the switch is needed.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

from .kill_switch import install_kill_switch, kill_env
from .verdict import EXIT_CODES, Verdict

__all__ = ["assert_resume_exact", "check_resume", "RunContext", "ResumeCheckResult", "ResumeCheckError",
           "check_command", "CommandCheck", "Verdict", "EXIT_CODES", "install_kill_switch", "kill_env"]

_LAZY = {"check_resume": "resume_entry", "RunContext": "resume_entry", "ResumeCheckResult": "resume_entry",
         "ResumeCheckError": "resume_entry", "check_command": "resume_command", "CommandCheck": "resume_command"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def assert_resume_exact(
    entry: str,
    *,
    steps: int = 12,
    kill_at: Sequence[int] = (),
    world_size: int = 1,
    save_every: int = 3,
    tmp_path: Any = None,
    **kwargs: Any,
) -> Any:
    """Assert that ``entry`` (``module:function``, contract in ``ckpt.testing.resume_entry``)
    resumes bit-exactly after SIGKILL at each of ``kill_at``; returns the result.

    Fails with the check's full report: the first differing step, tensor and field, or
    why an exactness claim was refused. Extra keywords go to ``check_resume``::

        def test_resume(tmp_path):
            assert_resume_exact("mypkg.train:main", steps=8, kill_at=[3, 5], tmp_path=tmp_path)
    """
    from .resume_entry import check_resume

    result = check_resume(
        entry,
        steps=steps,
        kill_at=kill_at,
        world_size=world_size,
        save_every=save_every,
        work_dir=None if tmp_path is None else str(tmp_path),
        **kwargs,
    )
    if not result.verdict.passed:
        raise AssertionError("resume is not bit-exact:\n" + result.summary())
    return result
