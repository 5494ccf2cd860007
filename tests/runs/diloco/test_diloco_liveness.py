"""Liveness under any interleaving: the orders of events that deadlocked the threads run,
forced with gates on the in-process network (events, not sleeps), and a failed syncer
that leaves no learner thread blocked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

import runs.diloco.run as diloco_run
from replay.channel import Message
from replay.replayer import replay
from runs.diloco import record
from runs.diloco.chaos import make_schedule

from tests.hangs import hang_s
from tests.runs.diloco._kit import Gate, gated_network, tiny


def _frag(src: str, p: int, t: int) -> Callable[[Message], bool]:
    return lambda m: m.src == src and m.dst == "syncer" and m.meta.get("kind") == "frag" and \
        m.meta.get("p") == p and m.meta.get("t") == t


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 32])
def test_a_replacement_that_skipped_a_fragment_is_not_waited_for(tmp_path: Path, bits: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The schedule: learner-2 dies at its step 4 (learner-2~1 replaces it, from learner-0,
    # the only learner that never dies), learners 1 and 3 at their step 8. Forced here:
    # learner-0 serves the replacement's state request after its round-2 send of fragment
    # 0 (step 9) and before that of fragment 1 (step 11), so learner-2~1 starts at 11: it
    # never sends fragment 0 of round 2, and its next one waits for that merge. With only
    # learners 0 and 2~1 alive, the syncer waited for a quorum of 2 that could never come
    # while the spares waited for their activation: the deadlock seen under load.
    cfg = tiny(steps=16, comm_bits=bits)
    sched = make_schedule(cfg)
    assert [(f.kind, f.targets, f.step) for f in sched.faults if f.kind in ("kill", "loss")] == \
        [("kill", ("learner-2",), 4), ("loss", ("learner-1", "learner-3"), 8)]
    gates = [
        # learner-2's death is detected by syncer step 2 (its replacement comes by step 4)
        Gate(lambda m: m.dst == "syncer" and m.meta.get("kind") == "frag" and int(m.meta.get("t", 0)) >= 5,
             until_killed="learner-2"),
        # learner-0 does not pass step 8 before the replacement's request exists ...
        Gate(lambda m: m.src == "syncer" and m.dst == "learner-0" and m.meta.get("kind") == "merged"
             and m.meta.get("s") == 3, until=lambda m: m.meta.get("kind") == "state_req"),
        # ... which it takes right after its step 9 send (it serves at step 10's boundary) ...
        Gate(lambda m: m.meta.get("kind") == "state_req", until=_frag("learner-0", 0, 9)),
        # ... and the syncer sees that send only once the replacement has sent at step 11
        Gate(_frag("learner-0", 0, 9), until=_frag("learner-2~1", 1, 11)),
    ]
    monkeypatch.setattr(diloco_run, "InProcessNetwork", gated_network(gates))
    res = record(tmp_path / "tape", cfg)
    assert all(g.open and not g.held for g in gates)
    sy = res.syncer
    assert [(j["endpoint"], j["started"]) for j in sy.joins if j["endpoint"] == "learner-2~1"] == [("learner-2~1", 11)]
    step4 = sy.plans[4]  # round 2, fragment 0: merged without the replacement that skipped it
    # (a contribution of round 1 that came after its merge may join learner-0's as stale)
    assert "learner-0" in step4["members"] and "learner-2" not in step4["members"] and step4["minimum"] == 1
    assert sy.steps == cfg.syncer_steps and [o.final_t for o in res.learners if o.state] == [cfg.steps] * 4
    monkeypatch.undo()
    rr = replay(res.tape, mode="force")
    assert rr.identical, rr.format()
    assert rr.value.syncer.plans == sy.plans


def test_a_failed_syncer_ends_every_learner_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The hot spares wait for their activation without a clock of their own (and every
    # other wait's clock is made far longer than the bound below): a syncer that fails
    # must still end every learner thread at once, not leave them blocked.
    runs: list[Any] = []

    class Recorded(diloco_run.Threads):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            runs.append(self)

    def boom(s: int, core: object) -> None:
        if s == 1:
            raise RuntimeError("syncer fault injected by the test")

    monkeypatch.setattr(diloco_run, "Threads", Recorded)
    with pytest.raises(RuntimeError, match="syncer fault injected"):
        record(tmp_path / "tape", tiny(steps=16, io_timeout_s=3600.0), after_step=boom)
    threads = list(runs[0].threads)
    assert sorted(t.name for t in threads) == ["learner-0", "learner-1", "learner-1~1", "learner-2", "learner-2~1",
                                               "learner-3", "learner-3~1"]
    for t in threads:
        t.join(hang_s(5))  # a hang bound: each ends at once
    assert [t.name for t in threads if t.is_alive()] == []
