"""The run's configuration: one frozen record, taped in the tape's metadata (``{"stages": ...}``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runs.common.config import Record

__all__ = ["StagesConfig", "COMPRESSIONS", "POLICIES", "TRANSPORTS"]

COMPRESSIONS = ("none", "shared", "random", "learned")
POLICIES = ("bypass", "wait")
TRANSPORTS = ("gloo", "threads")


@dataclass(frozen=True)
class StagesConfig(Record):
    what = "stages config"

    # topology
    replicas: int = 3
    stages: int = 4
    # model: every stage holds `layers` pre-norm transformer blocks of width `dim`
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 1
    seq_len: int = 32
    # data and inner optimisation
    corpus_seqs: int = 4096
    val_seqs: int = 64
    microbatches: int = 2
    batch: int = 8  # sequences per microbatch
    steps: int = 160
    lr: float = 3e-3
    warmup: int = 10
    clip: float = 1.0
    eval_every: int = 8
    # compressed replica exchange (SparseLoCo style, spec/stages.md §6)
    outer_every: int = 8  # H
    outer_lr: float = 1.0  # alpha
    ef_beta: float = 0.9
    chunk: int = 64
    topk: int = 8
    bits: int = 2
    # pipeline compression (spec/stages.md §4)
    compression: str = "shared"
    rank: int = 16
    # chaos (spec/stages.md §5): per replica and global step
    chaos: bool = True
    p: float = 0.03
    k: int = 6
    edge_p: float = 0.0
    policy: str = "bypass"
    seed: int = 0
    # snapshots: Chandy-Lamport cuts at the start of these global steps
    snapshot_at: tuple[int, ...] = field(default=())
    transport: str = "gloo"
    io_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.replicas < 2:
            raise ValueError("peer recovery needs at least two replicas")
        if self.stages < 3:
            raise ValueError("stage skipping needs at least one inner stage: stages >= 3")
        if not 1 <= self.chunk <= 256 or not 1 <= self.topk <= self.chunk:
            raise ValueError("chunk must be in 1..256 and topk in 1..chunk")
        if self.bits not in (2, 4, 8):
            raise ValueError("bits must be 2, 4 or 8 (a sign bit and the magnitude level)")
        if not 1 <= self.rank <= self.dim:
            raise ValueError("rank must be in 1..dim")
        if self.dim % self.heads:
            raise ValueError("dim must be a multiple of heads")
        if any(not 0 < s < self.steps for s in self.snapshot_at):
            raise ValueError("snapshot steps must lie inside the run (0 < step < steps)")
        object.__setattr__(self, "snapshot_at", tuple(sorted(int(s) for s in self.snapshot_at)))

    # -- names --------------------------------------------------------------------------
    def worker(self, replica: int, stage: int) -> str:
        return f"r{replica}s{stage}"

    @property
    def workers(self) -> list[str]:
        return [self.worker(i, j) for i in range(self.replicas) for j in range(self.stages)]

    @property
    def actors(self) -> list[str]:
        return ["ctl", *self.workers]

    def edges(self) -> list[tuple[str, str]]:
        """The fixed channel graph (spec/stages.md §1), both directions of every pair."""
        pairs: set[tuple[str, str]] = set()
        for i in range(self.replicas):
            for j in range(self.stages):
                pairs.add(("ctl", self.worker(i, j)))
                if j + 1 < self.stages:
                    pairs.add((self.worker(i, j), self.worker(i, j + 1)))
                if j + 2 < self.stages:
                    pairs.add((self.worker(i, j), self.worker(i, j + 2)))
                for k in range(i + 1, self.replicas):
                    pairs.add((self.worker(i, j), self.worker(k, j)))
        return sorted({e for a, b in pairs for e in ((a, b), (b, a))})

    def neighbours(self, actor: str) -> tuple[list[str], list[str]]:
        """(inbound, outbound) peers of ``actor`` in the channel graph."""
        es = self.edges()
        return sorted(a for a, b in es if b == actor), sorted(b for a, b in es if a == actor)
