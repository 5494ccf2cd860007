"""Accelerate: ``load_state`` refuses a checkpoint the prepared model does not fit (nothing
written, ``ResumeMismatchError``), names a changed config, and ``save_state`` never replaces
a checkpoint unless asked (issue 25 item 3)."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from ckpt.errors import CheckpointExistsError, ResumeMismatchError  # noqa: E402
from ckpt.integrations.accelerate import CkptAccelerator  # noqa: E402
from ckpt.manager import ConfigChangedWarning  # noqa: E402


def _prepared(width: int) -> tuple[CkptAccelerator, torch.nn.Module]:
    acc = CkptAccelerator(cpu=True)
    model = torch.nn.Linear(width, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model


def _tree(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_a_model_that_does_not_fit_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    acc, _ = _prepared(4)
    path = tmp_path / "step-00000003"
    acc.save_state(str(path), step=3, config={"width": 4, "lr": 0.1})
    before = _tree(path)
    with pytest.raises(CheckpointExistsError):
        acc.save_state(str(path), step=3)  # never replaced unless asked
    assert _tree(path) == before
    acc2, model2 = _prepared(6)
    kept = model2.weight.detach().clone()
    with pytest.raises(ResumeMismatchError) as ei:
        acc2.load_state(str(path))
    e = ei.value
    assert e.path == str(path) and e.key == "model_0/weight"
    assert e.context["saved_shape"] == [2, 4] and e.context["target_shape"] == [2, 6]
    assert torch.equal(model2.weight, kept) and _tree(path) == before


def test_a_changed_config_is_named(tmp_path: Path) -> None:
    acc, _ = _prepared(4)
    path = tmp_path / "step-00000003"
    acc.save_state(str(path), step=3, config={"width": 4, "lr": 0.1})
    acc2, _ = _prepared(4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        acc2.load_state(str(path), config={"width": 4, "lr": 0.3})
    msgs = [str(w.message) for w in rec if issubclass(w.category, ConfigChangedWarning)]
    assert len(msgs) == 1 and msgs[0].endswith("lr: 0.1 -> 0.3"), msgs
