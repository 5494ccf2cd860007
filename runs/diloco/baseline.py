"""The synchronous elastic data-parallel baseline, built from the same parts.

The same model, data shards, inner AdamW, scheduler and fault schedule as the
Decoupled-DiLoCo run, trained the classic way: every step all live learners compute a
gradient on their own batch, the gradients are averaged and one optimizer step is taken
(lockstep). Checkpoints are real ``ckpt`` checkpoints written by a
:class:`~ckpt.manager.CheckpointManager` every ``inner_h`` steps, kept under its
retention policy.

It runs in one process in *logical time*: a slot is the time of one synchronous step,
and ``M`` learner-step slots pass per slot. The rules, stated so the goodput figure can
be judged (spec: issue #6):

- ``kill``/``loss`` at step t: everyone stops; the steps since the last checkpoint are
  lost for every live learner; the job restarts from that checkpoint (``ckpt`` resume)
  after ``restart_slots`` idle slots, elastically, with the survivors;
- the lost learners come back ``rejoin_slots`` slots after their death, the same delay
  the DiLoCo syncer gives a replacement (``rejoin_after`` syncer steps of ``H/P`` inner
  steps); scaling back up is a graceful stop (a checkpoint at the current step, nothing
  lost) plus another restart;
- ``jitter``: a lockstep job waits for its slowest member, so each jittered step costs
  ``jitter_slots`` extra idle slots for everyone (1: the delay is about a step);
- ``nan``: the loader's quarantine is the same, so a poisoned shard costs nothing.

Goodput = learner-steps that survive to the final model / learner-step slots that passed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from runs.diloco.chaos import Schedule, learner_names
from runs.diloco.config import DiLoCoConfig
from runs.diloco.learner import LearnerCore
from runs.diloco.model import eval_loss, initial_state, val_corpus, weighted_loss

__all__ = ["BaselineResult", "run_baseline"]


@dataclass
class BaselineResult:
    slots: int = 0  # logical time that passed, in synchronous-step slots
    capacity: int = 0  # learner-step slots: learners x slots
    useful: int = 0  # learner-steps in the final model
    executed: int = 0  # learner-steps computed (useful + rolled back)
    restarts: int = 0
    downtime_slots: int = 0  # slots in which nobody trained (restarts, jitter waits)
    rolled_back_steps: int = 0  # synchronous steps thrown away by restarts
    val: list[tuple[int, float]] = field(default_factory=list)  # (slot, validation loss)
    events: list[tuple[int, str, str]] = field(default_factory=list)  # (slot, kind, detail)
    checkpoints: list[str] = field(default_factory=list)  # kept by the retention policy

    @property
    def goodput(self) -> float:
        return self.useful / self.capacity if self.capacity else 0.0


def run_baseline(cfg: DiLoCoConfig, schedule: Schedule, run_dir: str | os.PathLike[str], *,
                 restart_slots: int | None = None, jitter_slots: int = 1,
                 progress: Callable[[int, int], None] | None = None) -> BaselineResult:
    """Train the lockstep baseline under ``schedule``; checkpoints go to ``run_dir``."""
    from ckpt import CheckpointManager, RetentionPolicy

    torch.set_num_threads(1)
    names = learner_names(cfg)
    M, H = cfg.learners, cfg.inner_h
    per_sync = max(1, H // cfg.fragments)  # inner steps per syncer step
    restart = per_sync if restart_slots is None else restart_slots
    rejoin_slots = schedule.rejoin_after * per_sync
    theta0 = initial_state(cfg)
    cores = [LearnerCore(cfg, i, theta0, schedule.nan_shards(names[i])) for i in range(M)]
    model, opt, sched = cores[0].model, cores[0].opt, cores[0].sched  # one replica: lockstep
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched}
    for i, c in enumerate(cores):
        state[f"loader{i}"] = c.loader
    val = val_corpus(cfg)
    out = BaselineResult()
    # The ledger still records every step, but a restart here is elastic on purpose: it
    # resumes with the learners that are alive *now*, so the re-executed steps average
    # other members' gradients than the first attempt did. Checking them against the first
    # attempt would report that intended difference as a divergence on every restart.
    mgr = CheckpointManager(run_dir, state, every_steps=H, retention=RetentionPolicy(keep_last=2), signals=(),
                            run_id="diloco-baseline", config=cfg.to_dict(), verify_resume="off")
    alive = [True] * M
    fired: set[int] = set()
    rejoin_at: dict[int, int] = {}  # learner index -> slot it can rejoin at
    jitter_left: dict[int, int] = {}
    step_members: list[int] = []  # live learners of each surviving step (index = step)
    its: list[Any] = [None] * M
    slot = 0

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            if its[i] is None:
                its[i] = iter(cores[i].loader)
            b = next(its[i], None)
            if b is not None:
                return b
            its[i] = None

    def restart_from_checkpoint(k: int) -> int:
        nonlocal slot
        res = mgr.resume()  # step 0 is saved first, so there is always one
        back = int(res.step)
        for i in range(M):
            its[i] = None
        out.rolled_back_steps += k - back
        del step_members[back:]
        slot += restart
        out.downtime_slots += restart
        out.restarts += 1
        return back

    mgr.save(0, block=True)
    k = 0
    while k < cfg.steps:
        # rejoins first: a graceful stop (save now, nothing lost), then a restart
        back_now = [i for i, s in sorted(rejoin_at.items()) if slot >= s]
        if back_now:
            if not any(r.step == k and r.committed for r in mgr.checkpoints()):
                mgr.save(k, block=True)
            for i in back_now:
                alive[i] = True
                del rejoin_at[i]
            out.events.append((slot, "rejoin", ",".join(names[i] for i in back_now)))
            k = restart_from_checkpoint(k)
            continue
        hit = [j for j, f in enumerate(schedule.faults) if j not in fired and f.step == k
               and f.kind in ("kill", "loss", "jitter")]
        lost_now: list[int] = []
        for j in hit:
            f = schedule.faults[j]
            fired.add(j)
            targets = [names.index(a) for a in f.targets]
            if f.kind == "jitter":
                for i in targets:
                    jitter_left[i] = int(f.detail["steps"])
                out.events.append((slot, "jitter", ",".join(f.targets)))
            else:
                lost_now += [i for i in targets if alive[i]]
                out.events.append((slot, f.kind, ",".join(f.targets)))
        if lost_now:
            for i in lost_now:
                alive[i] = False
                rejoin_at[i] = slot + rejoin_slots
            k = restart_from_checkpoint(k)
            continue
        live = [i for i in range(M) if alive[i]]
        opt.zero_grad(set_to_none=True)
        for i in live:
            tokens, w = batch(i)
            (weighted_loss(model, tokens, w) / len(live)).backward()
        opt.step()
        sched.step()
        out.executed += len(live)
        step_members.append(len(live))
        slot += 1
        if any(jitter_left.get(i, 0) > 0 and alive[i] for i in live):
            slot += jitter_slots
            out.downtime_slots += jitter_slots
        for i in list(jitter_left):
            jitter_left[i] -= 1
            if jitter_left[i] <= 0:
                del jitter_left[i]
        k += 1
        mgr.after_step(k)
        if k % per_sync == 0 or k == cfg.steps:
            model.eval()
            out.val.append((slot, eval_loss(model, val)))
            model.train()
        if progress is not None:
            progress(k, cfg.steps)
    mgr.wait()
    out.checkpoints = [r.path for r in mgr.checkpoints() if r.committed]
    mgr.close()
    out.slots = slot
    out.capacity = M * slot
    out.useful = sum(step_members)
    return out
