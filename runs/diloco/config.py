"""The one configuration record of a Decoupled-DiLoCo run (taped in the tape header).

Every knob is here; the defaults are the demo (docs/demo.md) (M=4 learners, quorum K=2,
P=2 fragments synced every H=8 inner steps, staggered). Times are in seconds only
where they feed timing-dependent *decisions* (grace window, jitter); everything that
changes the numerics is counted in logical steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from runs.common.config import Record

__all__ = ["DiLoCoConfig"]

MERGES = ("mean", "rda")
UPDATES = ("replace", "mean", "rda")


@dataclass(frozen=True, slots=True)
class DiLoCoConfig(Record):
    what = "DiLoCo config"  # in errors: "unknown DiLoCo config keys: [...]"

    # topology
    learners: int = 4
    quorum: int = 2  # K: a syncer step needs at least K contributions of its fragment
    fragments: int = 2  # P balanced fragments, synced on a staggered schedule
    # schedule: every learner runs `steps` inner steps; fragment p is sent every `inner_h`
    # steps, after inner step (p+1)*H/P - 1 of each round (Streaming DiLoCo staggering)
    inner_h: int = 8
    steps: int = 128
    # bounded staleness: a learner in round r waits until it has applied, for every
    # fragment, a merge of round r - max_lag_rounds or later. 1: with 2, learner processes
    # ran two rounds ahead of the merges they adopt, and a run without faults (every
    # learner ahead) ended 10% higher over gloo than with 1 (bench/diloco_outer.py)
    max_lag_rounds: int = 1
    # model / data (tiny transformer; see runs/common/tiny_lm.py)
    vocab: int = 64
    dim: int = 32
    heads: int = 2
    layers: int = 2
    seq_len: int = 32
    batch: int = 8
    seqs_per_learner: int = 512
    shards_per_learner: int = 8
    val_seqs: int = 64
    # optimisers
    inner_lr: float = 1e-2
    weight_decay: float = 0.01
    warmup: int = 8
    outer_lr: float = 0.7
    # Nesterov momentum of the outer SGD, tuned on the no-fault run (bench/diloco_outer.py):
    # 0.9 (DiLoCo's value, for thousands of outer steps) over the demo's 16 outer steps per
    # fragment keeps pushing along old rounds' directions; 0.6 ends 6% lower
    outer_momentum: float = 0.6
    # communication: bits per element of the outer gradients learners send and of the
    # fragment updates the syncer sends back (32: float32 as is; 16, 8, 4, 2, 1: quant.py,
    # per-block scales of comm_block elements, with error feedback)
    comm_bits: int = 32
    comm_block: int = 32
    # how the learners' outer gradients are averaged: "mean" (token-weighted) or "rda"
    # (radial-directional: norms and directions averaged separately; merge.py)
    merge: str = "mean"
    # how a learner updates its model when a merged fragment arrives (merge.py,
    # model_update): "replace" (adopt the global fragment; its own steps since it last
    # adopted one are dropped), or combine its own update (theta_local - base) with the
    # global one (Theta_new - base), both from ``base``, the global fragment it last
    # adopted, with weights update_alpha and 1 - update_alpha: "mean" (Streaming DiLoCo's
    # mixing, alpha * theta_local + (1 - alpha) * Theta_new) or "rda" (norms and
    # directions averaged separately, as the merge's "rda")
    model_update: str = "replace"
    update_alpha: float = 0.5
    # adaptive grace window, "Eq. 3": gamma * (tau * xi_step - xi_quorum - xi_sync), in [0, cap]
    grace_gamma: float = 1.0
    overlap_tau: int = 2
    grace_cap_s: float = 0.25
    ema_alpha: float = 0.125
    # heterogeneous learners: speed factors (1.0 = as fast as the machine allows, 0.25 = a
    # step takes four times as long), dealt to the learners by a permutation seeded with
    # chaos_seed; empty: all equal. Record mode only (a replay's timing is irrelevant).
    speeds: tuple[float, ...] = ()
    # seeds and chaos
    seed: int = 1234
    chaos: bool = True
    chaos_seed: int = 7
    jitter_s: float = 0.05
    # syncer steps from detecting a death to activating its replacement (a hot spare: it
    # runs from the start, so 0 means at once; the baseline waits as long to scale back up)
    rejoin_after: int = 2
    # evaluation and snapshots (in syncer steps; 0 = never)
    eval_every: int = 2
    snapshot_every: int = 0
    snapshot_keep: int = 2  # retention: the last N snapshots (plus the newest restorable one)
    # the syncer waits for every part of an open snapshot at the next step (instead of
    # deciding "not yet"), so one snapshot begins at every step: tests that need a cut at
    # a given step use it; it costs the part writes' time on the syncer's path
    snapshot_wait: bool = False
    # processes: "threads" (one process, an in-process transport) or "gloo"
    transport: str = "threads"
    io_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.learners < 1 or not 1 <= self.quorum <= self.learners:
            raise ValueError(f"need 1 <= quorum ({self.quorum}) <= learners ({self.learners})")
        if self.fragments < 1 or self.inner_h < self.fragments:
            raise ValueError(f"need 1 <= fragments ({self.fragments}) <= inner_h ({self.inner_h})")
        if self.steps < self.inner_h or self.steps % self.inner_h:
            raise ValueError(f"steps ({self.steps}) must be a positive multiple of inner_h ({self.inner_h})")
        if self.speeds and (len(self.speeds) != self.learners or not all(0 < f <= 1 for f in self.speeds)):
            raise ValueError(f"speeds must give each of the {self.learners} learners a factor in (0, 1], "
                             f"got {self.speeds}")
        if self.comm_bits not in (1, 2, 4, 8, 16, 32) or self.comm_block < 1:
            raise ValueError(f"comm_bits must be one of 1, 2, 4, 8, 16, 32 (got {self.comm_bits}), comm_block >= 1")
        if self.model_update not in UPDATES:
            raise ValueError(f"model_update must be one of {UPDATES}, got {self.model_update!r}")
        if not 0.0 <= self.update_alpha <= 1.0:
            raise ValueError(f"update_alpha must be in [0, 1], got {self.update_alpha}")
        if self.transport not in ("threads", "gloo"):
            raise ValueError(f"transport must be 'threads' or 'gloo', got {self.transport!r}")

    @property
    def rounds(self) -> int:
        return self.steps // self.inner_h

    @property
    def syncer_steps(self) -> int:
        """Syncer step s merges fragment s % P of round s // P."""
        return self.rounds * self.fragments

    def send_offset(self, p: int) -> int:
        """Inner step (mod H) after which fragment p is sent."""
        return (p + 1) * self.inner_h // self.fragments - 1

    def last_send(self, p: int) -> int:
        """The inner step after which a learner sends fragment p for the last time: the
        last step, for every fragment. The last round sends them all at the end, so every
        step of every learner reaches the model (at its staggered offset the last
        contribution of an early fragment would leave the round's later steps out)."""
        return self.steps - 1

    def send_step(self, p: int, rnd: int) -> int:
        """The inner step after which a learner sends fragment p of round ``rnd``."""
        if rnd >= self.rounds - 1:
            return self.last_send(p)
        return rnd * self.inner_h + self.send_offset(p)

    def fragments_due(self, t: int) -> list[int]:
        """The fragments a learner sends after inner step t (staggered; all at the end)."""
        if t >= self.steps - self.inner_h:  # the last round
            return list(range(self.fragments)) if t == self.steps - 1 else []
        return [p for p in range(self.fragments) if t % self.inner_h == self.send_offset(p)]

    def speed_of(self, index: int) -> float:
        """Learner ``index``'s speed factor (``speeds`` dealt by a permutation seeded with chaos_seed)."""
        if not self.speeds:
            return 1.0
        import random

        order = list(range(self.learners))
        random.Random(self.chaos_seed * 7919 + 1).shuffle(order)
        return float(self.speeds[order[index]])

    def checked(self) -> "DiLoCoConfig":
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {self.merge!r}")
        return self
