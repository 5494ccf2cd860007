"""The outer-gradient merges: the plain weighted mean and radial-directional averaging."""

from __future__ import annotations

import math

import pytest
import torch

from runs.diloco import DiLoCoConfig
from runs.diloco.merge import average, mean_average, model_update, rda_average


def _vec(g):
    return torch.cat([t.reshape(-1) for t in g])


def test_rda_norm_is_the_mean_norm_and_direction_the_normalised_mean_direction() -> None:
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
             for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    out = rda_average(grads, weights)
    norms = [float(_vec(g).norm()) for g in grads]
    want_norm = sum(w * n for w, n in zip(weights, norms)) / sum(weights)
    assert math.isclose(float(_vec(out).norm()), want_norm, rel_tol=1e-12)
    dirs = sum(w * _vec(g) / n for w, g, n in zip(weights, grads, norms)) / sum(weights)
    assert torch.allclose(_vec(out) / _vec(out).norm(), dirs / dirs.norm(), rtol=0, atol=1e-12)
    # disagreeing directions: the plain mean shrinks, RDA keeps the mean norm
    assert float(_vec(mean_average(grads, weights)).norm()) < float(_vec(out).norm())


def test_rda_equals_mean_when_learners_agree_and_handles_zero() -> None:
    g = [torch.tensor([3.0, 4.0], dtype=torch.float64)]
    assert torch.equal(rda_average([g, g], [1.0, 3.0])[0], mean_average([g, g], [1.0, 3.0])[0])
    z = [torch.zeros(2, dtype=torch.float64)]
    assert torch.equal(rda_average([z, z], [1.0, 1.0])[0], z[0])
    opposite = [[torch.tensor([1.0, 0.0], dtype=torch.float64)], [torch.tensor([-1.0, 0.0], dtype=torch.float64)]]
    assert torch.equal(rda_average(opposite, [1.0, 1.0])[0], torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown merge"):
        average("median", [g], [1.0])


def test_config_refuses_an_unknown_merge() -> None:
    with pytest.raises(ValueError, match="merge must be one of"):
        DiLoCoConfig.from_dict({**DiLoCoConfig().to_dict(), "merge": "median"})
    assert DiLoCoConfig.from_dict({**DiLoCoConfig().to_dict(), "merge": "rda"}).merge == "rda"


# -- the model update (a learner adopting a merged fragment) -----------------------------------


def test_model_update_mean_is_the_mix_and_rda_keeps_the_mean_norm() -> None:
    base = [torch.zeros(2)]
    local, merged = [torch.tensor([2.0, 0.0])], [torch.tensor([0.0, 2.0])]  # orthogonal updates, norm 2 each
    new, norm = model_update("replace", 0.5, base, local, merged)
    assert torch.equal(new[0], merged[0]) and norm == 2.0
    new, norm = model_update("mean", 0.25, base, local, merged)
    assert torch.equal(new[0], 0.25 * local[0] + 0.75 * merged[0]) and new[0].dtype == torch.float32
    assert norm == pytest.approx(math.sqrt(0.5 ** 2 + 1.5 ** 2))  # the mix shortens the step
    new, norm = model_update("rda", 0.25, base, local, merged)
    assert norm == pytest.approx(2.0) and float(new[0].norm()) == pytest.approx(2.0)  # RDA keeps it
    direction = (0.25 * local[0] + 0.75 * merged[0]) / (0.25 * local[0] + 0.75 * merged[0]).norm()
    assert torch.allclose(new[0] / new[0].norm(), direction)
    # from a base that is not the origin: both updates are taken from it
    b = [torch.tensor([1.0, 1.0])]
    new, _ = model_update("rda", 0.5, b, [b[0] + local[0]], [b[0] + merged[0]])
    assert torch.allclose(new[0] - b[0], torch.tensor([math.sqrt(2.0), math.sqrt(2.0)]))
    # alpha 0: the learner's own update has no weight, any kind adopts the merged fragment
    for kind in ("mean", "rda"):
        new, _ = model_update(kind, 0.0, b, [b[0] + local[0]], [b[0] + merged[0]])
        assert torch.equal(new[0], b[0] + merged[0])


def test_config_refuses_an_unknown_model_update() -> None:
    with pytest.raises(ValueError, match="model_update must be one of"):
        DiLoCoConfig(model_update="median")
    with pytest.raises(ValueError, match="update_alpha must be in"):
        DiLoCoConfig(model_update="rda", update_alpha=1.5)
    cfg = DiLoCoConfig.from_dict({**DiLoCoConfig().to_dict(), "model_update": "rda", "update_alpha": 0.25})
    assert (cfg.model_update, cfg.update_alpha) == ("rda", 0.25)


@pytest.mark.slow
def test_rda_model_update_replays_bit_for_bit_and_snapshots_carry_the_bases(tmp_path) -> None:
    """RDA in the merge and in the model update, under chaos (it replaces the merge-only
    run's test, whose assertions it keeps): the tape pins every model
    update (a metric per adopted fragment), a force replay reproduces it, and a snapshot's
    learner parts hold the bases a restore continues from, bit for bit."""
    from replay import check_tape, replay
    from replay.tape import TapeReader
    from runs.diloco import list_snapshots, record, restore_run
    from runs.diloco.restore import read_snapshot
    from tests.runs.diloco._kit import tiny

    cfg = tiny(merge="rda", model_update="rda", steps=24, snapshot_every=1, snapshot_keep=50, snapshot_wait=True,
               transport="threads")
    res = record(tmp_path / "tape", cfg)
    assert all(math.isfinite(v) for _, v in res.syncer.val)
    assert check_tape(res.tape) == []
    updates = [e for e in TapeReader(res.tape).events()
               if e.kind.name == "metric" and e.payload["name"].startswith("update_norm.p")]
    assert updates and all(e.actor.startswith("learner-") and e.payload["value"] > 0 for e in updates)
    rr = replay(res.tape, mode="force")
    assert rr.identical, rr.format()
    again = rr.value
    assert [n for n, _ in again.syncer.state] == [n for n, _ in res.syncer.state]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(again.syncer.state, res.syncer.state))
    snaps = [k for k in list_snapshots(tmp_path / "checkpoints") if k["meta"]["exact"] and 0 < k["step"]]
    assert snaps
    snap = snaps[len(snaps) // 2]
    _meta, trees = read_snapshot(snap["path"])
    learners = [a for a in trees if a != "syncer"]
    assert learners and all(any(n.startswith("update_base.") for n in trees[a]["diloco"]["core"]["meta"]["names"])
                            for a in learners)
    rs = restore_run(res.tape, snap["path"])
    assert rs.identical, rs.divergence
    mine, theirs = res.final_learner_states(), rs.run.final_learner_states()
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(x, y) for a in mine for (_, x), (_, y) in zip(mine[a], theirs[a]))
