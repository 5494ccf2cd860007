"""A checkpoint removed while it is read raises CheckpointVanishedError (exit 5), never a
raw FileNotFoundError and never a corruption error.

Retention removes a checkpoint by renaming it to a ``.tmp-`` name and deleting that
(spec §10, §11 "Removed while reading"). The removal is injected at exact points of a
read (deterministic), and once more by a real process deleting checkpoints while this
one reads them (no timing assertion: only that nothing but documented errors escape).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointNotFoundError, CheckpointVanishedError, CkptError
from ckpt.knobs import override
from ckpt.storage import local
import hangs

REPO = Path(__file__).resolve().parents[2]


def _save(path: Path) -> None:
    with override(chunk_size=4096):
        ckpt.save(path, {"m": {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(3)}, "n": 5}, step=1)


def _retire(path: Path) -> None:
    """What retention does: rename away, then delete."""
    trash = path.parent / f".tmp-old-{path.name}-000000000000"
    os.rename(path, trash)
    shutil.rmtree(trash)


@pytest.mark.parametrize("action", ["verify", "state", "tensor", "tree", "verify-quick"])
def test_removed_after_open(tmp_path: Path, action: str) -> None:
    ck = tmp_path / "step-1"
    _save(ck)
    r = ckpt.open(ck)
    _retire(ck)
    with pytest.raises(CheckpointVanishedError) as ei:
        if action == "verify":
            r.verify()
        elif action == "verify-quick":
            r.verify(quick=True)
        elif action == "state":
            r.state()
        elif action == "tensor":
            r.tensor("m/w")
        else:
            r.tree()
    assert isinstance(ei.value, CheckpointNotFoundError) and ei.value.exit_code == 5
    assert str(ck) in str(ei.value)


class _DeletingStorage:
    """Local storage that retires the checkpoint just before the n-th call of ``method``."""

    def __init__(self, ck: Path, method: str, n: int) -> None:
        self.ck, self.method, self.n = ck, method, n

    def __getattr__(self, name: str) -> Any:
        real = getattr(local, name)
        if name != self.method:
            return real

        def call(*a: Any, **k: Any) -> Any:
            self.n -= 1
            if self.n == 0 and self.ck.exists():
                _retire(self.ck)
            return real(*a, **k)

        return call


@pytest.mark.parametrize("method, n", [("read", 1), ("lstat", 2), ("lstat", 3), ("listdir", 1)])
def test_removed_during_open(tmp_path: Path, method: str, n: int) -> None:
    ck = tmp_path / "step-1"
    _save(ck)
    with pytest.raises(CheckpointNotFoundError) as ei:
        ckpt.open(ck, storage=_DeletingStorage(ck, method, n))
    assert type(ei.value) in (CheckpointVanishedError, CheckpointNotFoundError), repr(ei.value)


def test_cli_exit_code_for_a_vanished_checkpoint(tmp_path: Path) -> None:
    from ckpt_cli.main import exit_code_for

    assert exit_code_for(CheckpointVanishedError("gone", path=str(tmp_path))) == 5


_DELETER = textwrap.dedent(
    """
    import os, shutil, sys
    root = sys.argv[1]
    for name in sorted(os.listdir(root)):
        if name.startswith("step-"):
            trash = os.path.join(root, ".tmp-old-" + name + "-000000000000")
            os.rename(os.path.join(root, name), trash)
            shutil.rmtree(trash)
    """
)


@pytest.mark.timeout(120)
def test_concurrent_retention_raises_only_documented_errors(tmp_path: Path) -> None:
    for rnd in range(2):
        root = tmp_path / f"run{rnd}"
        root.mkdir()
        names = [f"step-{i:08d}" for i in range(30)]
        for name in names:
            _save(root / name)
        proc = subprocess.Popen([sys.executable, "-c", _DELETER, str(root)])
        outcomes: dict[str, int] = {}
        try:
            while proc.poll() is None or any((root / n).exists() for n in names):
                for name in names:
                    try:
                        r = ckpt.open(root / name)
                        r.verify()
                        r.state()
                        kind = "ok"
                    except CkptError as e:
                        kind = type(e).__name__
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                if proc.poll() is not None:
                    break
        finally:
            hangs.communicate(proc, bound_s=hangs.hang_s(6))
        # every outcome is a success or a not-found kind: never corruption, never a raw OSError
        assert set(outcomes) <= {"ok", "CheckpointNotFoundError", "CheckpointVanishedError"}, outcomes
