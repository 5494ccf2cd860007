"""runs.common: the pieces every reference run shares (schedule, report helpers, plot)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import msgpack
import pytest

from replay import Recorder, TapeReader, replay
from runs.common.config import Record
from runs.common.chaos import DEATHS, FAULT_CLASSES, Fault, Schedule, describe, place_faults, taped_schedule
from runs.common.plot import Curve, fault_marks, loss_plot
from runs.common.report import Checks, fault_tally, gap_words, verify_checkpoints

NAMES = [f"w{i}" for i in range(5)]


def _sched(seed: int = 3) -> Schedule:
    return place_faults(NAMES, steps=96, period=8, lost=2, shards=4, seed=seed, jitter_s=0.01)


def test_place_faults_is_seeded_and_spares_the_first_worker() -> None:
    s = _sched()
    assert s == _sched() and s != _sched(4)
    assert [f.kind for f in s.faults] == list(FAULT_CLASSES)
    assert NAMES[0] not in s.mortal()
    kill, jitter, loss, nan = s.faults
    assert 8 <= kill.step < 24 and 4 <= jitter.step < 32 and 48 <= loss.step < 64
    assert jitter.targets[0] not in kill.targets and len(loss.targets) == 2 and 0 <= nan.detail["shard"] < 4
    assert Schedule.from_json(s.to_json()) == s
    for a in NAMES:
        assert s.deaths(a) == len(s.death_kinds(a)) == sum(1 for f in s.for_target(a) if f.kind in DEATHS)
    one = place_faults(["solo"], steps=16, period=4, lost=0, shards=2, seed=1, jitter_s=0.0)
    assert [f.kind for f in one.faults] == ["nan"]  # nobody can die or jitter alone
    lines = describe(s, worker="tick")
    assert len(lines) == 4 and lines[0].startswith("kill ") and "at its tick" in lines[0]
    assert "odd" in describe(Schedule((Fault("odd", ("w1",), 3, {"x": 1}),), 2))[0]


def test_taped_schedule_is_drawn_once_and_read_back_in_a_replay(tmp_path: Path) -> None:
    draws = []

    def make() -> Schedule:
        draws.append(1)
        return _sched()

    def entry(rec: Recorder) -> Schedule:
        return taped_schedule(rec.actor("chaos"), make)

    with Recorder.open(str(tmp_path / "t"), entry_point="x:y", actor="chaos") as rec:
        first = entry(rec)
    r = replay(tmp_path / "t", mode="force", entry=entry)
    assert r.identical and r.value == first and len(draws) == 1  # the replay read the tape, drew nothing
    assert [e.payload["what"] for e in TapeReader(tmp_path / "t").events() if e.kind.name == "decision"] == ["schedule"]


def test_checks_keep_order_and_skip_what_was_not_run() -> None:
    c = Checks().add("a", True).add("skipped", None).add("b", False).add("c", 1)  # type: ignore[arg-type]
    assert c.items() == [("a", True), ("b", False), ("c", True)]
    assert c.failed() == ["b"] and not c.ok() and Checks().ok()
    assert gap_words(0.031) == "chaos worse by 3.1%" and gap_words(-0.079, subject="x") == "x better by 7.9%"


def test_fault_tally_and_marks_read_the_tape(tmp_path: Path) -> None:
    with Recorder.open(str(tmp_path / "t"), entry_point="x:y", actor="w1") as rec:
        a = rec.actor("w1")
        a.maybe_inject("kill", "w1", lambda: {"step": 7})
        a.maybe_inject("nan", "w1", lambda: {"shards": [1]})
        a.fault_detected("nan", "w1", {"sample": 3})
        a.fault_detected("other", "w1", None)
    events = list(TapeReader(tmp_path / "t").events())
    t = fault_tally(events, FAULT_CLASSES)
    assert (t["kill"].injected, t["kill"].targets, t["nan"].detected, t["loss"].injected) == (1, ["w1"], 1, 0)
    assert fault_marks(events) == [(7.0, "kill"), (0.0, "nan")]
    png = loss_plot(str(tmp_path / "p.png"), [Curve("x", [1, 2], [3.0, 2.0])], marks=fault_marks(events),
                    spans=[(1, 1.5)], title="t")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verify_checkpoints_reports_each_path(tmp_path: Path) -> None:
    import torch

    import ckpt

    good = tmp_path / "good"
    ckpt.save(good, {"x": torch.zeros(2)}, step=1)
    assert verify_checkpoints([str(good), str(tmp_path / "missing")]) == [(str(good), True),
                                                                           (str(tmp_path / "missing"), False)]


@pytest.mark.parametrize("bad", [{"kind": "kill"}, {"faults": [{"kind": "kill"}], "rejoin_after": 1}])
def test_schedule_from_json_refuses_incomplete_records(bad) -> None:
    with pytest.raises(KeyError):
        Schedule.from_json(bad)



@dataclass(frozen=True)
class _Kid:
    name: str
    step: int


@dataclass(frozen=True)
class _Cfg(Record):
    what = "test config"
    pairs: tuple[tuple[str, int], ...] = ()
    kids: tuple[_Kid, ...] = ()
    speeds: tuple[float, ...] = ()
    opt: Mapping[str, Any] | None = None
    lr: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=dict)


def test_config_records_round_trip_through_msgpack_and_refuse_unknown_keys() -> None:
    cfg = _Cfg(pairs=(("g0", 2),), kids=(_Kid("a", 3),), speeds=(1.0, 0.5), opt={"z": 6}, lr=1, extra={"k": [1]})
    d = cfg.to_dict()
    assert d == {"pairs": [["g0", 2]], "kids": [{"name": "a", "step": 3}], "speeds": [1.0, 0.5], "opt": {"z": 6},
                 "lr": 1, "extra": {"k": [1]}}
    back = _Cfg.from_dict(msgpack.unpackb(msgpack.packb(d), raw=False))
    assert back == cfg and type(back.lr) is int  # a field's own scalar reads back as written
    assert _Cfg.from_dict({"speeds": [1, 2]}).speeds == (1.0, 2.0)  # inside a tuple: the element type
    with pytest.raises(ValueError, match=r"unknown test config keys: \['bogus'\]"):
        _Cfg.from_dict({"bogus": 1})
    assert cfg.with_(lr=2.0).lr == 2.0 and cfg.lr == 1
