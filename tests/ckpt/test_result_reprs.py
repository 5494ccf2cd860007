"""The result records print short: ``print(ckpt.load(...))`` used to dump ~30 KB of RNG state."""

from __future__ import annotations

from pathlib import Path

import torch

import ckpt


def test_result_records_have_short_reprs(tmp_path: Path) -> None:
    from replay import record, replay

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    info = ckpt.save(tmp_path / "step-00000003", {"model": model, "optim": opt}, config={"lr": 1.0}, step=3,
                     extra={"big": torch.zeros(10_000)})
    res = ckpt.load(tmp_path / "step-00000003", {"model": model, "optim": opt})
    for obj, name in ((info, "CheckpointInfo"), (res, "LoadResult"), (ckpt.open(info.path).verify(), "VerifyReport")):
        text = repr(obj)
        assert text.startswith(f"{name}(path='{info.path}'") and len(text) < 400, text
    assert "restored_rng=('python'" in repr(res) and "step=3" in repr(res)
    assert len(res.context["rng"]["python"]["state"]) > 600  # still all there, only not in the repr
    entry = Path(__file__).resolve().parents[1] / "replay" / "replay_entry.py"
    record(f"{entry}:train", tmp_path / "t.tape", config={"steps": 2})
    rr = replay(tmp_path / "t.tape")
    assert repr(rr).startswith("ReplayResult(tape=") and len(repr(rr)) < 400
