"""The manager's two declared seams: ``ManagerOptions`` (every option in one validated record)
and ``StepHook`` (what an attached hook, a ``LossGuard`` say, is asked; nothing else)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Mapping

import pytest
import torch

import ckpt
from ckpt.errors import CkptError
from ckpt.manager import CheckpointManager, ManagerOptions, RetentionPolicy, StepHook

ROOT = Path(__file__).resolve().parents[2]


def test_options_are_one_record_given_as_keywords_or_whole(tmp_path: Path) -> None:
    opts = ManagerOptions(every_steps=3, signals=(), ledger=False)
    a = CheckpointManager(tmp_path / "a", {"m": torch.nn.Linear(2, 2)}, options=opts)
    assert a.options is opts and a.every_steps == 3 and a.retention == RetentionPolicy()
    b = CheckpointManager(tmp_path / "b", {"m": torch.nn.Linear(2, 2)}, options=opts, every_steps=5)
    assert b.options.every_steps == 5 and b.every_steps == 5 and opts.every_steps == 3
    c = CheckpointManager(tmp_path / "c", {"m": torch.nn.Linear(2, 2)}, every_steps=3, signals=(), ledger=False)
    assert c.options == opts
    with pytest.raises(TypeError, match="CheckpointManager.__init__.. got an unexpected keyword argument 'every_step'"):
        CheckpointManager(tmp_path / "d", {"m": torch.nn.Linear(2, 2)}, every_step=3)
    with pytest.raises(ValueError, match="every_steps must be >= 1"):
        ManagerOptions(every_steps=0)
    with pytest.raises(ValueError, match="dedup_full_every must be >= 0"):
        CheckpointManager(tmp_path / "e", {"m": torch.nn.Linear(2, 2)}, options=opts, dedup_full_every=-1)
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()
    for mgr in (a, b, c):
        mgr.close()


class _Hook:
    def __init__(self, floor: int | None) -> None:
        self.floor = floor
        self.restored: list[int] = []

    def retention_floor(self) -> int | None:
        return self.floor

    def before_save(self, step: int) -> Mapping[str, Any]:
        return {"hook": {"step": step}}

    def on_restore(self, result: Any) -> None:
        self.restored.append(int(result.step))


def test_a_step_hook_is_asked_for_its_floor_and_meta_and_told_of_a_resume(tmp_path: Path) -> None:
    m = torch.nn.Linear(2, 2)
    mgr = CheckpointManager(tmp_path, {"m": m}, every_steps=1, retention=RetentionPolicy(keep_last=1), signals=(),
                            ledger=False)
    hook: StepHook = _Hook(floor=1)
    call = mgr.attach(hook)
    assert mgr.hook is hook
    with pytest.raises(CkptError, match="call guard.after_step"):
        mgr.after_step(1)
    with pytest.raises(CkptError, match="already has a step hook"):
        mgr.attach(_Hook(None))
    assert all(call(step) for step in (1, 2, 3))
    # the floor keeps step 1 (the newest at or below it that verifies) and all above it, whatever keep_last says
    assert [r.step for r in mgr.checkpoints()] == [1, 2, 3]
    assert ckpt.open(tmp_path / "step-00000003").manifest.meta["hook"] == {"step": 3}
    mgr.detach(hook)
    assert mgr.hook is None and mgr.after_step(4)
    assert [r.step for r in mgr.checkpoints()] == [4]
    assert "hook" not in ckpt.open(tmp_path / "step-00000004").manifest.meta
    mgr.close()

    again = CheckpointManager(tmp_path, {"m": m}, signals=(), ledger=False)
    told = _Hook(None)
    again.attach(told)
    again.resume()
    assert told.restored == [4]
    again.close()


def _private_attributes_of(tree: ast.AST, owner: str) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and not n.attr.startswith("__") and isinstance(n.value, ast.Attribute) and n.value.attr == owner}


def test_the_guard_uses_no_private_member_of_the_manager() -> None:
    """``LossGuard`` drives its manager through public methods and the step call ``attach``
    returned; ``self.manager._x`` (or ``mgr._x``, ``manager._x``) is nowhere in it."""
    src = (ROOT / "ckpt" / "guard" / "guard.py").read_text(encoding="utf-8")
    tree = ast.parse(src)
    used = _private_attributes_of(tree, "manager")
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
             and not n.attr.startswith("__") and isinstance(n.value, ast.Name) and n.value.id in ("mgr", "manager")}
    assert not used, f"the guard reaches into the manager: {sorted(used)}"
    manager_src = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "ckpt" / "manager").glob("*.py"))
    assert "_guard" not in manager_src and "_state()" not in manager_src
