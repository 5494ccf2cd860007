"""A seeded fault schedule in *logical* time, shared by the reference runs.

A schedule is a pure function of a seed and the run's shape, and a run tapes it once
(:func:`taped_schedule`: one decision of a ``chaos`` actor), so a replay takes it from the
tape and never re-draws it. Faults fire at a target's own step counter (an inner step, a
micro-batch, a pipeline tick: whatever the run counts), so the point where a worker dies
is the same in every replay.

Fault classes (Decoupled DiLoCo's chaos engineering; the resilient-training platforms'
taxonomy). A run may add its own kinds; these four have shared placement and wording:

``kill``     hardware fault: the worker is SIGKILLed (a thread is dropped in the in-process
             transport), restarted and recovered from a healthy peer;
``jitter``   network jitter: the worker's messages are held back ``delay_s`` seconds for
             ``steps`` steps; quorum and grace windows route around it;
``loss``     partial cluster loss: several workers die at one step, the run goes on with
             the rest, and they rejoin later;
``nan``      data shard skew: one shard of one worker holds NaN loss weights; the loader
             quarantines and resamples it, so no NaN reaches the model.

:func:`place_faults` draws one fault of each class with a ``random.Random(seed)`` in a fixed
order, so a schedule never changes when a run is refactored around it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Fault", "Schedule", "place_faults", "taped_schedule", "describe", "NO_FAULTS", "FAULT_CLASSES",
           "DEATHS"]

FAULT_CLASSES = ("kill", "jitter", "loss", "nan")
DEATHS = ("kill", "loss")  # the classes that end an incarnation


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str  # "kill", "jitter", "loss", "nan" (or a run's own kind)
    targets: tuple[str, ...]
    step: int  # the target's own step it fires at (nan: 0, the data is bad from the start)
    detail: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "targets": list(self.targets), "step": self.step, "detail": dict(self.detail)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Fault":
        return cls(str(d["kind"]), tuple(d["targets"]), int(d["step"]), dict(d["detail"]))


@dataclass(frozen=True, slots=True)
class Schedule:
    faults: tuple[Fault, ...]
    rejoin_after: int  # coordinator steps between detecting a death and starting the replacement

    def to_json(self) -> dict[str, Any]:
        return {"faults": [f.to_json() for f in self.faults], "rejoin_after": self.rejoin_after}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Schedule":
        return cls(tuple(Fault.from_json(f) for f in d["faults"]), int(d["rejoin_after"]))

    def for_target(self, name: str) -> list[Fault]:
        return [f for f in self.faults if name in f.targets]

    for_learner = for_target  # the DiLoCo run's word for it

    def deaths(self, name: str) -> int:
        """How many times ``name`` dies: the number of replacement incarnations it needs."""
        return sum(1 for f in self.for_target(name) if f.kind in DEATHS)

    def death_kinds(self, name: str) -> list[str]:
        """The kinds of ``name``'s deaths, in schedule order (its n-th death is incarnation n's)."""
        return [f.kind for f in self.for_target(name) if f.kind in DEATHS]

    def nan_shards(self, name: str) -> tuple[int, ...]:
        return tuple(int(f.detail["shard"]) for f in self.for_target(name) if f.kind == "nan")

    def mortal(self) -> set[str]:
        return {a for f in self.faults if f.kind in DEATHS for a in f.targets}


NO_FAULTS = Schedule((), 2)


def place_faults(names: Sequence[str], *, steps: int, period: int, lost: int, shards: int, seed: int,
                 jitter_s: float, rejoin_after: int = 2) -> Schedule:
    """One fault of each class over workers ``names`` running ``steps`` steps each.

    ``names[0]`` never dies (every recovery needs a healthy peer). The kill falls in
    ``[period, steps/4)``, the jitter (``period`` steps long) in ``[period/2, steps/3)``, the
    loss of ``lost`` workers at once in ``[steps/2, 2 steps/3)``; the NaN shard is one of
    ``shards``. ``period`` is the run's natural interval (DiLoCo: the inner steps between
    two syncs of a fragment)."""
    rng = random.Random(seed)
    names = list(names)
    H, T = period, steps
    faults: list[Fault] = []
    mortal = names[1:]
    if mortal:
        victim = rng.choice(mortal)
        faults.append(Fault("kill", (victim,), rng.randrange(H, max(H + 1, T // 4)), {"signal": "SIGKILL"}))
    if len(names) > 1:
        j = rng.choice([n for n in names if not faults or n not in faults[0].targets])
        start = rng.randrange(H // 2, max(H // 2 + 1, T // 3))
        faults.append(Fault("jitter", (j,), start, {"delay_s": jitter_s, "steps": H}))
    if lost > 0 and mortal:
        who = tuple(sorted(rng.sample(mortal, min(lost, len(mortal)))))
        faults.append(Fault("loss", who, rng.randrange(T // 2, max(T // 2 + 1, 2 * T // 3)), {"at_once": len(who)}))
    faults.append(Fault("nan", (rng.choice(names),), 0, {"shard": rng.randrange(shards)}))
    return Schedule(tuple(faults), rejoin_after)


class _Decides:  # the one method of a recorder Actor (or a DiLoCo tape sink) this needs
    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any: ...


def taped_schedule(actor: _Decides, make: Callable[[], Schedule]) -> Schedule:
    """The run's schedule as one taped decision of ``actor`` (by convention the ``chaos``
    actor): drawn by ``make`` when recording, read from the tape in a replay."""
    return Schedule.from_json(actor.decide("schedule", "all", lambda: make().to_json()))


def describe(schedule: Schedule, *, worker: str = "inner step") -> list[str]:
    """One line per fault, for a demo's header (``worker``: what a target's step is called)."""
    out = []
    for f in schedule.faults:
        who = ",".join(f.targets)
        if f.kind == "kill":
            out.append(f"kill     {who} with SIGKILL at its {worker} {f.step}; restart, recover from a peer")
        elif f.kind == "jitter":
            out.append(f"jitter   {who}: messages delayed {f.detail['delay_s']} s for {f.detail['steps']} steps "
                       f"from {worker} {f.step}")
        elif f.kind == "loss":
            out.append(f"loss     {who} lost at once at {worker} {f.step}; rejoin later")
        elif f.kind == "nan":
            out.append(f"nan      {who}: shard {f.detail['shard']} yields NaN; quarantined and resampled")
        else:
            out.append(f"{f.kind:<8} {who} at {worker} {f.step}: {dict(f.detail)}")
    return out
