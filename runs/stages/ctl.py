"""The controller: the chaos schedule, one plan per worker per step, the losses, and the
step-boundary snapshots (spec/stages.md §3, §5, §8)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from replay import Actor
from replay.channel import Endpoint
from runs.stages.chaos import Schedule, make_schedule, plans_at
from runs.stages.config import StagesConfig
from runs.stages.worker import ProtocolError

__all__ = ["Controller", "CtlState", "CtlResult", "snapshot_name"]


def snapshot_name(step: int) -> str:
    return f"step-{step:05d}"


class CtlState:
    """ctl's snapshot entry (Stateful): where it is, the schedule, what it has seen."""

    def __init__(self) -> None:
        self.next_step = 0
        self.schedule: list[dict[str, Any]] = []
        self.loss: list[list[float]] = []  # [step, replica, value]
        self.val: list[list[float]] = []
        self.busy: list[list[int]] = []  # [step, stage-steps computed]

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step, "schedule": self.schedule, "loss": self.loss, "val": self.val,
                "busy": self.busy}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.next_step = int(d["next_step"])
        self.schedule = [dict(o) for o in d["schedule"]]
        self.loss = [list(x) for x in d["loss"]]
        self.val = [list(x) for x in d["val"]]
        self.busy = [list(x) for x in d["busy"]]


@dataclass
class CtlResult:
    cfg: StagesConfig
    schedule: Schedule
    loss: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> replica -> training loss
    val: dict[int, dict[int, float]] = field(default_factory=dict)  # eval step -> replica -> validation loss
    busy: dict[int, int] = field(default_factory=dict)  # step -> stage-steps computed
    snapshots: list[Any] = field(default_factory=list)  # replay.snapshot.Outcome of each snapshot taken
    start_step: int = 0

    @classmethod
    def of(cls, cfg: StagesConfig, st: CtlState, snapshots: list[Any], start: int) -> "CtlResult":
        r = cls(cfg, Schedule.from_json(st.schedule), snapshots=snapshots, start_step=start)
        for t, i, v in st.loss:
            r.loss.setdefault(int(t), {})[int(i)] = float(v)
        for t, i, v in st.val:
            r.val.setdefault(int(t), {})[int(i)] = float(v)
        r.busy = {int(t): int(n) for t, n in st.busy}
        return r


class Controller:
    def __init__(self, cfg: StagesConfig, ep: Endpoint, actor: Actor, *, agent: Any = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.ep = ep
        self.actor = actor
        self.agent = agent
        self.on_step = on_step
        self.state = CtlState()
        self.timeout = cfg.io_timeout_s
        self.snapshots: list[Any] = []

    def run(self, *, restored: bool = False) -> CtlResult:
        cfg, a, st = self.cfg, self.actor, self.state
        start = st.next_step
        if not restored:
            st.schedule = list(a.decide("stages.schedule", f"seed={cfg.seed}", lambda: make_schedule(cfg).to_json()))
        sched = Schedule.from_json(st.schedule)
        for t in range(start, cfg.steps):
            a.current_step = t
            st.next_step = t
            if t in cfg.snapshot_at and not (restored and t == start):
                self.snapshot(t)
            a.begin_step(t)
            for o in sched.outages:
                if o.first == t:
                    a.maybe_inject("stage-outage", cfg.worker(o.replica, o.stage),
                                   lambda o=o: {"step": o.first, "until": o.until, "stage": o.stage, "edge": o.edge,
                                                "source": o.source})
            plans = plans_at(cfg, sched, t)
            for name in sorted(plans):
                self.ep.send(name, plans[name])
            busy = 0
            for name in sorted(plans):
                if plans[name]["role"] == "down":
                    continue
                msg = self.ep.recv_from(name, timeout=self.timeout)
                m = msg.meta
                if m.get("kind") != "done" or m.get("step") != t:
                    raise ProtocolError(f"ctl: expected done step {t} from {name}, got {dict(m)}")
                busy += int(bool(m["busy"]))
                r = int(name[1:].split("s")[0])
                if "loss" in m:
                    st.loss.append([t, r, float(m["loss"])])
                    a.metric(f"loss/r{r}", float(m["loss"]))
                if "val" in m:
                    st.val.append([t, r, float(m["val"])])
                    a.metric(f"val/r{r}", float(m["val"]))
            st.busy.append([t, busy])
            a.end_step()
            st.next_step = t + 1
            if self.on_step is not None:
                self.on_step(t)
        a.current_step = cfg.steps
        for name in cfg.workers:
            self.ep.send(name, {"kind": "stop", "step": cfg.steps})
        return CtlResult.of(cfg, st, self.snapshots, start)

    def snapshot(self, t: int) -> None:
        """A Chandy-Lamport snapshot at the step boundary (spec/stages.md §8): every worker
        is waiting for its next plan, so every cut lands at the same point of its history."""
        if self.agent is None:
            raise ProtocolError("a snapshot is due but this controller has no snapshot agent")
        h = self.agent.initiate(snapshot_name(t))
        deadline = time.monotonic() + self.timeout
        while not h.done():
            self.agent.poll()
            if time.monotonic() > deadline:
                raise ProtocolError(f"snapshot {snapshot_name(t)} did not finish within {self.timeout} s")
            time.sleep(0.002)  # waiting for the parts: polling cadence only, nothing depends on it
        outcome = h.wait(0)
        if not outcome.committed:
            raise ProtocolError(f"snapshot {snapshot_name(t)} aborted: {outcome.reason}")
        self.snapshots.append(outcome)
