"""ckpt bisect: a divergence planted at a known step, module and phase is named exactly."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ckpt.bisect import compare_traces, diff_runs, load_target, load_trace, make_capsule, save_trace, trace_capsule
from ckpt.errors import FormatError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plant_script  # noqa: E402


def _run(tmp_path, name: str, plant: str, plant_step: int, monkeypatch, steps: int = 9) -> str:
    out = str(tmp_path / name)
    monkeypatch.setenv("PLANT", plant)
    monkeypatch.setenv("PLANT_STEP", str(plant_step))
    plant_script.train(out, steps)
    return out


def _trace(capsule: str, plant: str, monkeypatch):
    monkeypatch.setenv("PLANT", plant)
    return trace_capsule(capsule, load_target("plant_script:target", cwd=HERE))


# plant -> (module, phase) that bisect must name
PLANTS = {
    "noise": ("blocks.1.mix", "forward"),
    "stream": ("drop", "forward"),
    "layer": ("blocks.0.act", "forward"),
    "backward": ("blocks.1.gate", "backward"),
    "optimizer": ("emb.weight", "optimizer"),
}


@pytest.mark.slow
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_bisect_names_the_planted_step_module_and_phase(plant: str, tmp_path, monkeypatch) -> None:
    a = _run(tmp_path, "a", "", 5, monkeypatch)
    b = _run(tmp_path, "b", plant, 5, monkeypatch)
    rd = diff_runs(a, b)
    assert rd.first is not None and rd.first.step == 5, rd.summary()
    assert rd.equal_through == 4
    # the last checkpoint before step 5 is step 3: the capsule re-executes step 4 (env A)
    monkeypatch.setenv("PLANT", "")
    cap = str(tmp_path / "step5.capsule")
    got = make_capsule(os.path.join(a, "step-00000003"), load_target("plant_script:target", cwd=HERE), cap, step=5)
    assert got.step == 5
    ta = _trace(cap, "", monkeypatch)
    tb = _trace(cap, plant, monkeypatch)
    ta_again = _trace(cap, "", monkeypatch)
    assert compare_traces(ta, ta_again).identical  # a deterministic step traces the same twice
    cmp = compare_traces(ta, tb)
    assert cmp.first is not None, cmp.summary()
    module, phase = PLANTS[plant]
    assert (cmp.first.entry.module, cmp.first.entry.phase) == (module, phase), cmp.summary()
    if phase != "forward" or plant != "layer":
        assert cmp.first.count and cmp.first.max_abs is not None and cmp.first.max_abs > 0


@pytest.mark.slow
def test_capsule_reproduces_the_runs_step_exactly(tmp_path, monkeypatch) -> None:
    """The traced step from a capsule computes the loss the run recorded for that step."""
    a = _run(tmp_path, "a", "", 99, monkeypatch)
    from ckpt.ledger import read_ledger_dir

    tapes, _ = read_ledger_dir(os.path.join(a, "ledger"))
    loss5 = {s.step: s.loss for t in tapes for s in t.steps}[5]
    cap = str(tmp_path / "c")
    make_capsule(os.path.join(a, "step-00000003"), load_target("plant_script:target", cwd=HERE), cap, step=5)
    t = _trace(cap, "", monkeypatch)
    loss = [t.tensors[e.index] for e in t.entries if e.phase == "loss"][0]
    assert float(loss) == loss5


@pytest.mark.slow
def test_trace_file_round_trip_and_ulp(tmp_path, monkeypatch) -> None:
    a = _run(tmp_path, "a", "", 99, monkeypatch, steps=3)
    cap = str(tmp_path / "c")
    make_capsule(os.path.join(a, "step-00000003"), load_target("plant_script:target", cwd=HERE), cap)
    t = _trace(cap, "", monkeypatch)
    p = str(tmp_path / "t.trace")
    save_trace(t, p)
    back = load_trace(p)
    assert [e.key for e in back.entries] == [e.key for e in t.entries]
    assert all(torch.equal(back.tensors[i], t.tensors[i]) for i in t.tensors)
    assert compare_traces(t, back).identical
    # one element moved by exactly one ULP is measured as such
    i = next(e.index for e in back.entries if e.phase == "forward" and back.tensors[e.index].dtype == torch.float32)
    x = back.tensors[i].clone().reshape(-1)
    x[0] = torch.nextafter(x[0], torch.tensor(float("inf")))
    back.tensors[i] = x.reshape(back.tensors[i].shape)
    from ckpt.ledger.digest import tensor_digest
    from ckpt.bisect.trace import TraceEntry

    e = back.entries[i]
    back.entries[i] = TraceEntry(e.index, e.module, e.phase, e.occurrence, tensor_digest(back.tensors[i]), e.dtype, e.shape)
    d = compare_traces(t, back).first
    assert d is not None and d.count == 1 and d.max_ulp == 1


def test_not_a_trace_is_refused_by_name(tmp_path) -> None:
    p = tmp_path / "x.trace"
    p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(FormatError) as e:
        load_trace(str(p))
    assert str(p) in str(e.value)
