"""The replica run's configuration: groups, faults, data, timeouts (all of it on the tape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from runs.common.config import Record

__all__ = ["ReplicaConfig", "Kill", "Join", "SdcFault", "Spike", "check"]


@dataclass(frozen=True)
class Kill:
    """SIGKILL every rank of ``group`` when it reaches ``step`` (after its quorum, before
    its forward pass: a logical point, so that a replay stops it at the same place)."""

    group: str
    step: int


@dataclass(frozen=True)
class Join:
    """Start a new replica group ``group`` of ``ranks`` ranks once the run has committed
    ``after_step``; it is in the quorum of step ``after_step + 1`` (every rank waits for it
    before asking) and recovers there from a live peer."""

    group: str
    ranks: int
    after_step: int


@dataclass(frozen=True)
class SdcFault:
    """Flip ``bit`` of element ``index`` of gradient bucket ``bucket`` on ``actor`` at
    ``step``: ``where`` = reduced (after the all-reduce: the cross-replica check sees it)
    or local (before it: every replica receives the corrupt sum; re-execution sees it);
    stream (the recovery streams ``actor`` sends: one frame, once) or received (the first
    recovery stream ``actor`` receives, hit in transit): refused on receipt either way."""

    actor: str
    step: int
    where: str = "reduced"
    bucket: int = 0
    index: int = 0
    bit: int = 30


@dataclass(frozen=True)
class Spike:
    """Corrupt the global batches of loader steps ``[step, step + span)`` of epoch 0
    (their samples come from ``runs.common.tiny_lm.unlikely_corpus``): the loss spikes
    when they are trained; the guard's skip policy rolls back and skips them."""

    step: int
    span: int = 1


@dataclass(frozen=True)
class ReplicaConfig(Record):
    what = "replica config"

    groups: tuple[tuple[str, int], ...] = (("g0", 2), ("g1", 1), ("g2", 1))  # (replica id, ranks)
    steps: int = 40
    global_batch: int = 12  # samples per committed step, split over the participating ranks
    seq_len: int = 32
    vocab: int = 64
    dim: int = 64
    layers: int = 2
    lr: float = 3e-3
    seed: int = 0
    corpus: int = 2048  # sequences in the generated corpus
    augment: float = 0.05  # probability of replacing an input token (the named generator "augment")
    bucket_elems: int = 32768  # gradient bucket size (elements) of the SDC digests
    kills: tuple[Kill, ...] = ()
    joins: tuple[Join, ...] = ()
    data_policy: str = "redistribute"  # or "drop": what happens to an uncommitted attempt's samples
    min_replicas: int = 1
    async_quorum: bool = True  # torchft's use_async_quorum: the quorum overlaps the forward and backward
    sdc: bool = True  # cross-replica digest check at every accumulation boundary
    sdc_policy: str = "exclude"  # on a named odd replica: exclude it (torchft continues) or rollback
    reexec_every: int = 0  # re-execute every Nth step locally and compare gradient digests (0: on suspicion only)
    sdc_faults: tuple[SdcFault, ...] = ()
    param_every: int = 1  # state digests on step_commit every N steps (0: never)
    # periodic checkpoints (a ckpt.CheckpointManager per rank on one run directory, written
    # by the replica that is first in the quorum) every N committed steps (0: none)
    ckpt_every: int = 0
    guard: Mapping[str, Any] | None = None  # ckpt.guard.GuardConfig fields: a loss-spike guard (needs ckpt_every)
    spikes: tuple[Spike, ...] = ()
    # (actor, step): the all-reduce of that step completes on every member, then ``actor``
    # reports it failed (a late error: a watchdog, a link reset) -- a partially failed collective
    late_failures: tuple[tuple[str, int], ...] = ()
    timeout_s: float = 20.0  # collectives and recovery
    heartbeat_timeout_ms: int = 1500
    # how often the lighthouse looks again while it waits for stragglers (torchft's default);
    # a quorum whose members are all back forms on the last one's request, not on a tick
    quorum_tick_ms: int = 100
    join_timeout_ms: int = 2500
    extra: Mapping[str, Any] = field(default_factory=dict)

    def all_groups(self) -> list[tuple[str, int]]:
        """Every group that ever runs: the initial ones, then the joiners."""
        return list(self.groups) + [(j.group, j.ranks) for j in self.joins]

    def actors(self) -> list[str]:
        return [f"{g}.{r}" for g, n in self.all_groups() for r in range(n)]

    def kill_step(self, group: str) -> int | None:
        for k in self.kills:
            if k.group == group:
                return k.step
        return None


def check(cfg: ReplicaConfig) -> ReplicaConfig:
    """torchft's replica groups are homogeneous: group rank r of every group shares one
    process group, so every group (joiners too) has the same number of ranks."""
    sizes = {n for _, n in cfg.all_groups()}
    if len(sizes) != 1 or not sizes <= {1, 2}:
        raise ValueError(f"every replica group must have the same size, 1 or 2 ranks; got {cfg.all_groups()}")
    names = [g for g, _ in cfg.all_groups()]
    if len(set(names)) != len(names) or any("." in g or ":" in g for g in names):
        raise ValueError(f"group names must be distinct, without '.' or ':': {names}")
    if cfg.data_policy not in ("redistribute", "drop") or cfg.sdc_policy not in ("exclude", "rollback"):
        raise ValueError("data_policy is redistribute or drop; sdc_policy exclude or rollback")
    if cfg.guard is not None and not cfg.ckpt_every:
        raise ValueError("a loss-spike guard rolls back to periodic checkpoints: set ckpt_every")
    if cfg.guard is not None:
        from ckpt.guard import GuardConfig

        GuardConfig(**cfg.guard)  # a bad field is refused here, naming it
    return cfg
