"""The outer-gradient merges: the plain weighted mean and radial-directional averaging."""

from __future__ import annotations

import math

import pytest
import torch

from runs.diloco import DiLoCoConfig
from runs.diloco.merge import average, mean_average, rda_average


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


def test_an_rda_run_under_chaos_replays_bit_for_bit(tmp_path) -> None:
    from replay import check_tape, replay
    from runs.diloco import record
    from tests.runs.diloco._kit import tiny

    res = record(tmp_path / "tape", tiny(merge="rda", steps=16, transport="threads"))
    assert all(math.isfinite(v) for _, v in res.syncer.val)
    assert check_tape(res.tape) == []
    rr = replay(res.tape, mode="force")
    assert rr.identical, rr.format()
    again = rr.value
    assert [n for n, _ in again.syncer.state] == [n for n, _ in res.syncer.state]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(again.syncer.state, res.syncer.state))
