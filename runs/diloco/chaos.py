"""The seeded fault schedule: four fault classes, placed in *logical* time.

A schedule is a pure function of ``(chaos_seed, config)`` and is taped once, as the
chaos actor's first decision, so a replay takes it from the tape. Learner faults fire
at a learner's own inner step (so the point where a learner dies is the same in every
replay); rejoins fire at the syncer step ``rejoin_after`` steps after the syncer
*detected* the death, and detection time is part of the syncer's taped plan.

Fault classes (Decoupled DiLoCo's chaos engineering; the resilient-training platforms'
taxonomy):

``kill``     hardware fault: the learner process is SIGKILLed (a thread is dropped in
             the in-process transport), restarted and recovered from a healthy peer;
``jitter``   network jitter: the learner's messages are held back ``delay_s`` seconds
             for ``steps`` inner steps; the grace window and quorum route around it;
``loss``     partial cluster loss: learners - quorum learners die at one inner step,
             the run goes on at the quorum minimum, and they rejoin later;
``nan``      data shard skew: one shard of one learner holds NaN loss weights; the
             loader quarantines and resamples it, so no NaN reaches the merged model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping

from runs.diloco.config import DiLoCoConfig

__all__ = ["Fault", "Schedule", "make_schedule", "describe", "learner_names", "NO_FAULTS", "FAULT_CLASSES"]

FAULT_CLASSES = ("kill", "jitter", "loss", "nan")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str  # "kill", "jitter", "loss", "nan"
    targets: tuple[str, ...]
    step: int  # the learner inner step it fires at (nan: 0, the data is bad from the start)
    detail: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "targets": list(self.targets), "step": self.step, "detail": dict(self.detail)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Fault":
        return cls(str(d["kind"]), tuple(d["targets"]), int(d["step"]), dict(d["detail"]))


@dataclass(frozen=True, slots=True)
class Schedule:
    faults: tuple[Fault, ...]
    rejoin_after: int  # syncer steps between detecting a death and starting the replacement

    def to_json(self) -> dict[str, Any]:
        return {"faults": [f.to_json() for f in self.faults], "rejoin_after": self.rejoin_after}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Schedule":
        return cls(tuple(Fault.from_json(f) for f in d["faults"]), int(d["rejoin_after"]))

    def for_learner(self, actor: str) -> list[Fault]:
        return [f for f in self.faults if actor in f.targets]

    def deaths(self, actor: str) -> int:
        """How many times ``actor`` dies: the number of replacement incarnations it needs."""
        return sum(1 for f in self.for_learner(actor) if f.kind in ("kill", "loss"))

    def nan_shards(self, actor: str) -> tuple[int, ...]:
        return tuple(int(f.detail["shard"]) for f in self.for_learner(actor) if f.kind == "nan")

    def mortal(self) -> set[str]:
        return {a for f in self.faults if f.kind in ("kill", "loss") for a in f.targets}


NO_FAULTS = Schedule((), 2)


def learner_names(cfg: DiLoCoConfig) -> list[str]:
    return [f"learner-{i}" for i in range(cfg.learners)]


def make_schedule(cfg: DiLoCoConfig) -> Schedule:
    """One fault of each class, placed by ``cfg.chaos_seed``; no faults when ``cfg.chaos`` is off."""
    if not cfg.chaos:
        return NO_FAULTS
    rng = random.Random(cfg.chaos_seed)
    names = learner_names(cfg)
    H, T = cfg.inner_h, cfg.steps
    faults: list[Fault] = []
    # learner-0 never dies: every recovery needs a healthy peer.
    mortal = names[1:]
    if mortal:
        victim = rng.choice(mortal)
        faults.append(Fault("kill", (victim,), rng.randrange(H, max(H + 1, T // 4)), {"signal": "SIGKILL"}))
    if len(names) > 1:
        j = rng.choice([n for n in names if not faults or n not in faults[0].targets])
        start = rng.randrange(H // 2, max(H // 2 + 1, T // 3))
        faults.append(Fault("jitter", (j,), start, {"delay_s": cfg.jitter_s, "steps": H}))
    n_lost = cfg.learners - cfg.quorum
    if n_lost > 0 and mortal:
        lost = tuple(sorted(rng.sample(mortal, min(n_lost, len(mortal)))))
        faults.append(Fault("loss", lost, rng.randrange(T // 2, max(T // 2 + 1, 2 * T // 3)), {"at_once": len(lost)}))
    faults.append(Fault("nan", (rng.choice(names),), 0, {"shard": rng.randrange(cfg.shards_per_learner)}))
    return Schedule(tuple(faults), 2)


def describe(schedule: Schedule) -> list[str]:
    out = []
    for f in schedule.faults:
        who = ",".join(f.targets)
        if f.kind == "kill":
            out.append(f"kill     {who} with SIGKILL at its inner step {f.step}; restart, recover from a peer")
        elif f.kind == "jitter":
            out.append(f"jitter   {who}: messages delayed {f.detail['delay_s']} s for {f.detail['steps']} steps "
                       f"from inner step {f.step}")
        elif f.kind == "loss":
            out.append(f"loss     {who} lost at once at inner step {f.step}; rejoin later")
        elif f.kind == "nan":
            out.append(f"nan      {who}: shard {f.detail['shard']} yields NaN; quarantined and resampled")
    return out


