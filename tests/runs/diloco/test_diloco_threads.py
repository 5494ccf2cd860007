"""The reference run with its actors as threads: chaos absorbed, replay bit-identical."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_cli.main import cli
from replay.check import check_tape
from runs.diloco import DiLoCoConfig, pack_fragments, record
from runs.diloco.chaos import make_schedule
from runs.diloco.model import build_model
from runs.diloco.run import DELAY_ENV
from replay.events import Event
from replay.replayer import replay
from replay.tape import TapeReader

from tests.runs.diloco._kit import copy_with_duplicate_merge, tiny


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("chaos")
    return record(d / "tape", tiny())


def _events(tape: str, kind: str) -> list[Event]:
    return [e for e in TapeReader(tape).events() if e.kind.name == kind]


def _assert_same_states(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), n


def test_fragments_are_balanced_and_deterministic() -> None:
    m = build_model(tiny(layers=2, dim=64))
    frags = pack_fragments(m.named_parameters(), 3)
    assert frags == pack_fragments(m.named_parameters(), 3)
    names = [n for f in frags for n in f.names]
    assert sorted(names) == sorted(n for n, _ in m.named_parameters())
    sizes = [f.nbytes for f in frags]
    biggest = max(p.numel() * p.element_size() for p in m.parameters())
    assert max(sizes) - min(sizes) <= biggest  # LPT: within one tensor of each other
    with pytest.raises(ValueError, match="cannot make 99 non-empty fragments"):
        pack_fragments(m.named_parameters(), 99)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="quorum"):
        DiLoCoConfig(learners=2, quorum=3)
    with pytest.raises(ValueError, match="multiple of inner_h"):
        DiLoCoConfig(steps=30, inner_h=8)
    with pytest.raises(ValueError, match="unknown DiLoCo config keys"):
        DiLoCoConfig.from_dict({"learners": 2, "nope": 1})
    assert DiLoCoConfig.from_dict(tiny().to_dict()) == tiny()


def test_schedule_covers_four_fault_classes_and_is_seeded() -> None:
    s = make_schedule(tiny())
    assert {f.kind for f in s.faults} == {"kill", "jitter", "loss", "nan"}
    assert s == make_schedule(tiny())
    loss = next(f for f in s.faults if f.kind == "loss")
    assert len(loss.targets) == tiny().learners - tiny().quorum  # down to the quorum minimum
    assert "learner-0" not in s.mortal()


@pytest.mark.slow
def test_chaos_is_absorbed_without_downtime(chaos_run) -> None:
    res, cfg = chaos_run, tiny()
    sy = res.syncer
    assert sy.steps == cfg.syncer_steps  # never restarted, never stopped
    # every death was detected and every dead learner came back, while the syncer advanced
    dead = {a for _, a in sy.deaths}
    assert dead == {a for f in res.schedule.faults if f.kind in ("kill", "loss") for a in f.targets}
    for s_dead, a in sy.deaths:
        s_back = min(s for s, b in sy.activations if b == a and s >= s_dead)
        assert s_back > s_dead
        for s in range(s_dead, s_back):  # merges kept happening with the learner down
            assert len(sy.plans[s]["members"]) >= cfg.quorum
    # recovered incarnations started from a peer's step and ran to the end
    reborn = [o for o in res.learners if o.incarnation > 0]
    assert len(reborn) == len(sy.deaths) and all(o.final_t == cfg.steps for o in reborn)
    # the NaN shard was quarantined and no NaN reached the merged model
    assert any(e.payload["fault"] == "nan" for e in _events(res.tape, "fault_detected"))
    assert all(torch.isfinite(t).all() for _, t in sy.state)
    assert all(math.isfinite(v) for _, v in sy.val)
    kinds = {e.payload["fault"] for e in _events(res.tape, "fault_injected")}
    assert kinds == {"kill", "jitter", "loss", "nan"}
    assert len(_events(res.tape, "fault_recovered")) == len(reborn)


@pytest.mark.slow
def test_tape_check_clean_and_duplicate_merge_caught(chaos_run, tmp_path: Path) -> None:
    assert check_tape(chaos_run.tape) == []
    bad = tmp_path / "bad.tape"
    copy_with_duplicate_merge(chaos_run.tape, bad)
    v = check_tape(bad)
    assert [x.rule for x in v] and {x.rule for x in v} == {"merge-applied-twice"}
    assert "already applied by merge" in v[0].message
    r = CliRunner().invoke(cli, ["tape", "check", str(bad)])
    assert r.exit_code == 6 and "merge-applied-twice" in r.output
    assert CliRunner().invoke(cli, ["tape", "check", chaos_run.tape]).exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.004])
def test_force_replay_is_bit_identical(chaos_run, delay: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DELAY_ENV, str(delay))
    r = replay(chaos_run.tape, mode="force")
    assert r.identical, r.format()
    assert r.events_compared == sum(1 for e in TapeReader(chaos_run.tape).events() if e.kind.name != "actor")
    again = r.value
    _assert_same_states(again.syncer.state, chaos_run.syncer.state)
    mine, theirs = chaos_run.final_learner_states(), again.final_learner_states()
    assert sorted(mine) == sorted(theirs) == [f"learner-{i}" for i in range(tiny().learners)]
    for a in mine:
        _assert_same_states(theirs[a], mine[a])
    assert [o.losses for o in again.learners] == [o.losses for o in chaos_run.learners]
    assert again.syncer.val == chaos_run.syncer.val
    assert again.syncer.plans == chaos_run.syncer.plans


@pytest.mark.slow
def test_force_replay_cli(chaos_run) -> None:
    r = CliRunner().invoke(cli, ["replay", chaos_run.tape, "--mode", "force", "--trust"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("IDENTICAL:"), r.output  # stderr names the entry point it trusted


@pytest.mark.slow
def test_slow_replacements_still_finish_every_step(tmp_path: Path) -> None:
    # Replacement learners made much slower than everyone else: under a wall-clock rule
    # the syncer would end the run while they are still catching up. The last round is
    # a barrier, so they end at cfg.steps whatever the machine load.
    cfg = tiny()
    res = record(tmp_path / "tape", cfg, delay_of=lambda actor, inc: 0.03 if inc > 0 else 0.0)
    reborn = [o for o in res.learners if o.incarnation > 0]
    assert len(reborn) == len(res.syncer.deaths) >= 2
    assert [o.final_t for o in reborn] == [cfg.steps] * len(reborn)
    last_round = [m for m in res.syncer.merged if m["t"] // cfg.inner_h == cfg.rounds - 1]
    assert {m["actor"] for m in last_round} == {f"learner-{i}" for i in range(cfg.learners)}
