"""Test helpers for users' own suites (pytest or plain asserts)."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["assert_resume_exact"]


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
    """Assert that ``entry`` (``module:function``, contract in ``ckpt.resume_check``)
    resumes bit-exactly after SIGKILL at each of ``kill_at``; returns the result.

    Fails with the check's full report: the first differing step, tensor and field, or
    why an exactness claim was refused. Extra keywords go to ``check_resume``::

        def test_resume(tmp_path):
            assert_resume_exact("mypkg.train:main", steps=8, kill_at=[3, 5], tmp_path=tmp_path)
    """
    from .resume_check import check_resume

    result = check_resume(
        entry,
        steps=steps,
        kill_at=kill_at,
        world_size=world_size,
        save_every=save_every,
        work_dir=None if tmp_path is None else str(tmp_path),
        **kwargs,
    )
    if not result.identical:
        raise AssertionError("resume is not bit-exact:\n" + result.summary())
    return result
