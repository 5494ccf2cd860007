"""The seeded failure process and the per-step plans ctl sends (spec/stages.md §3, §5).

Both are pure functions of the config: ctl tapes the schedule once as a decision (force
mode takes it from the tape), and every plan follows from it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from runs.stages.config import StagesConfig

__all__ = ["Outage", "Schedule", "make_schedule", "plans_at", "describe"]


@dataclass(frozen=True)
class Outage:
    replica: int
    stage: int
    first: int
    until: int  # the stage is offline for steps first..until-1 and rejoins at until (if < steps)
    source: int  # the replica it recovers from at until (-1: the run ends first)
    edge: bool  # the first or last stage: its replica stalls

    def covers(self, t: int) -> bool:
        return self.first <= t < self.until


@dataclass(frozen=True)
class Schedule:
    outages: tuple[Outage, ...]

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(o) for o in self.outages]

    @classmethod
    def from_json(cls, items: Any) -> "Schedule":
        return cls(tuple(Outage(**{k: (bool(v) if k == "edge" else int(v)) for k, v in dict(o).items()})
                         for o in items))

    def down(self, replica: int, stage: int, t: int) -> bool:
        return any(o.replica == replica and o.stage == stage and o.covers(t) for o in self.outages)

    def rejoining(self, replica: int, stage: int, t: int) -> bool:
        return any(o.replica == replica and o.stage == stage and o.until == t for o in self.outages)

    def active(self, replica: int, t: int) -> Outage | None:
        return next((o for o in self.outages if o.replica == replica and o.covers(t)), None)


def make_schedule(cfg: StagesConfig) -> Schedule:
    """Per step, per replica in order: two uniform draws (always both); an outage when the
    replica has none in progress (or rejoining) at that step, unless it would leave the stage
    with no steady live copy in another replica (spec/stages.md §5)."""
    if not cfg.chaos:
        return Schedule(())
    rng = random.Random(cfg.seed * 2_654_435_761 + 97)
    out: list[Outage] = []
    sched = Schedule(())
    for t in range(cfg.steps):
        for r in range(cfg.replicas):
            u, v = rng.random(), rng.random()
            if any(o.replica == r and o.first <= t <= o.until for o in out):
                continue
            if u < cfg.edge_p:
                s, edge = (0 if v < 0.5 else cfg.stages - 1), True
            elif u < cfg.edge_p + cfg.p:
                s, edge = 1 + int(v * (cfg.stages - 2)), False
            else:
                continue
            sched = Schedule(tuple(out))
            if not any(not sched.down(q, s, t) and not sched.rejoining(q, s, t) for q in range(cfg.replicas) if q != r):
                continue  # the last steady copy of the stage: dropped
            out.append(Outage(r, s, t, min(t + cfg.k, cfg.steps), -1, edge))
    sched = Schedule(tuple(out))
    fixed = []
    for o in out:
        src = -1
        if o.until < cfg.steps:
            src = next(q for q in range(cfg.replicas) if q != o.replica and not sched.down(q, o.stage, o.until)
                       and not sched.rejoining(q, o.stage, o.until))
        fixed.append(Outage(o.replica, o.stage, o.first, o.until, src, o.edge))
    return Schedule(tuple(fixed))


def plans_at(cfg: StagesConfig, sched: Schedule, t: int) -> dict[str, dict[str, Any]]:
    """Every plan ctl sends at step ``t`` (a worker that is offline at ``t`` and did not
    go down at ``t`` gets none)."""
    plans: dict[str, dict[str, Any]] = {}
    S = cfg.stages
    exchange = (t + 1) % cfg.outer_every == 0
    evaluate = (t + 1) % cfg.eval_every == 0 or t == cfg.steps - 1
    for r in range(cfg.replicas):
        o = sched.active(r, t)
        stalled = o is not None and (o.edge or cfg.policy == "wait")
        chain = [j for j in range(S) if not (o is not None and o.stage == j)]
        for j in range(S):
            name = cfg.worker(r, j)
            if o is not None and o.stage == j:
                if t == o.first:
                    plans[name] = {"kind": "plan", "step": t, "role": "down", "until": o.until}
                continue
            pos = chain.index(j)
            up = cfg.worker(r, chain[pos - 1]) if pos > 0 else ""
            down = cfg.worker(r, chain[pos + 1]) if pos + 1 < len(chain) else ""
            rejoin = next((x for x in sched.outages if x.replica == r and x.stage == j and x.until == t), None)
            serve = sorted(cfg.worker(x.replica, j) for x in sched.outages
                           if x.until == t and x.source == r and x.stage == j)
            xchg = [cfg.worker(q, j) for q in range(cfg.replicas) if not sched.down(q, j, t)] if exchange else []
            bypassing = o is not None and not stalled
            plans[name] = {
                "kind": "plan", "step": t,
                "role": "stall" if stalled else "run",
                "stall": ("edge-down" if o is not None and o.edge else "wait") if stalled else "",
                "up": "" if stalled else up,
                "down": "" if stalled else down,
                "offline": cfg.worker(r, o.stage) if o is not None else "",
                "bypass_fwd": bool(bypassing and o is not None and o.stage == j + 1),
                "bypass_bwd": bool(bypassing and o is not None and o.stage == j - 1),
                "recover_from": cfg.worker(rejoin.source, j) if rejoin is not None else "",
                "serve": serve,
                "xchg": xchg,
                "eval": bool(evaluate and not stalled),
            }
    return plans


def describe(cfg: StagesConfig, sched: Schedule) -> list[str]:
    """One line per outage, for the demo's output."""
    out = []
    for o in sched.outages:
        what = "edge stage: replica stalls" if o.edge else ("replica waits" if cfg.policy == "wait" else "bypassed")
        back = f"rejoins at {o.until} from r{o.source}s{o.stage}" if o.source >= 0 else "until the end"
        out.append(f"r{o.replica}s{o.stage} offline steps {o.first}..{o.until - 1} ({what}); {back}")
    return out
