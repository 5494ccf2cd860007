"""The model cut into pipeline stages, the boundary projections, and the data.

Stage 0 holds the token and position embeddings, stage S-1 the final norm, the head and the
loss; every stage holds ``layers`` pre-norm transformer blocks (a residual stream, which is
why dropping a whole inner stage is a tolerable skip). Dropout is 0: the run draws no
random numbers after initialisation, so a worker's state is its tensors only.

Boundary b (the input of stage b, 1 <= b <= S-1) carries ``h @ P_b`` when pipeline
compression is on; stage b-1 owns the down-projection ``P_b`` and stage b the
up-projection ``Q_b`` (spec/stages.md §4).
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import torch
from torch import nn

from runs.common.tiny_lm import make_corpus, warmup_cosine
from runs.stages.config import StagesConfig

__all__ = ["Stage", "build_stage", "forward_without", "projection", "Data", "lr_factor",
           "flat_params", "set_flat_params"]

# Module construction draws from the global torch RNG; stages built by threads of one
# process (the threads transport, every replay) must not interleave their draws.
_INIT_LOCK = threading.Lock()


def projection(cfg: StagesConfig, boundary: int) -> torch.Tensor:
    """A fixed D x r matrix with orthonormal columns: one for every boundary (``shared``,
    ``boundary`` ignored) or one per boundary (``random``, and ``learned``'s start)."""
    b = 0 if cfg.compression == "shared" else boundary
    g = torch.Generator().manual_seed(cfg.seed * 7919 + 104729 + b)
    a = torch.randn(cfg.dim, cfg.rank, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))  # a unique QR: the same matrix on every machine's LAPACK
    return q.to(torch.float32).contiguous()


class Stage(nn.Module):
    def __init__(self, cfg: StagesConfig, j: int) -> None:
        super().__init__()
        self.j = j
        self.first = j == 0
        self.last = j == cfg.stages - 1
        self.compressed = cfg.compression != "none"
        if self.first:
            self.tok = nn.Embedding(cfg.vocab, cfg.dim)
            nn.init.normal_(self.tok.weight, std=0.02)
            self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.dim, cfg.heads, dim_feedforward=4 * cfg.dim, dropout=0.0, batch_first=True,
                                       norm_first=True)
            for _ in range(cfg.layers))
        if self.last:
            self.norm = nn.LayerNorm(cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if self.compressed:
            learned = cfg.compression == "learned"
            if not self.first:  # Q_j: r x D
                self._projection("up", projection(cfg, j).t().contiguous(), learned)
            if not self.last:  # P_{j+1}: D x r
                self._projection("down", projection(cfg, j + 1), learned)
        mask = torch.triu(torch.full((cfg.seq_len, cfg.seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def _projection(self, name: str, value: torch.Tensor, learned: bool) -> None:
        if learned:
            setattr(self, name, nn.Parameter(value))
        else:  # fixed: a persistent buffer, so checkpoints and digests cover it
            self.register_buffer(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            t = x.shape[1]
            h = self.tok(x) + self.pos[:t]
        else:
            t = x.shape[1]
            h = x @ self.up if self.compressed else x
        m = self.mask[:t, :t]
        for b in self.blocks:
            h = b(h, src_mask=m, is_causal=True)
        if self.last:
            return self.head(self.norm(h))
        return h @ self.down if self.compressed else h


def build_stage(cfg: StagesConfig, j: int) -> Stage:
    """Stage ``j`` as every replica starts it: the same initial weights in all replicas,
    in a process of its own or in a thread (the global RNG is forked and seeded here)."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed * 1000 + j)
        return Stage(cfg, j)


def forward_without(stages: Sequence[Stage], x: torch.Tensor, skip: Iterable[int] = ()) -> torch.Tensor:
    """The model's forward pass with the stages in ``skip`` removed: each skipped stage is
    the identity on its input boundary tensor, which goes straight to the next stage. A
    bypassed pipeline step MUST compute exactly this (spec/stages.md §4)."""
    gone = set(skip)
    if 0 in gone or len(stages) - 1 in gone:
        raise ValueError("the first and last stages are never skipped")
    h = x
    for j, s in enumerate(stages):
        if j not in gone:
            h = s(h)
    return h


def flat_params(module: nn.Module) -> torch.Tensor:
    """The trainable parameters as one float32 vector, in ``named_parameters()`` order."""
    return torch.cat([p.detach().reshape(-1) for _, p in module.named_parameters()])


def set_flat_params(module: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        i = 0
        for _, p in module.named_parameters():
            n = p.numel()
            p.copy_(flat[i:i + n].view_as(p))
            i += n


def lr_factor(cfg: StagesConfig, step: int) -> float:
    return warmup_cosine(cfg.warmup, cfg.steps)(step)


class Data:
    """The generated corpus, the replicas' sample order and the validation set (no RNG
    state: sample ids are a pure function of replica, step and microbatch)."""

    def __init__(self, cfg: StagesConfig) -> None:
        self.cfg = cfg
        self.corpus = make_corpus(cfg.corpus_seqs, cfg.seq_len, cfg.vocab, seed=cfg.seed)
        # The validation set: the corpus' last val_seqs rows, which the training order never uses.
        n = cfg.corpus_seqs - cfg.val_seqs
        if n < cfg.batch * cfg.microbatches:
            raise ValueError("corpus_seqs must leave a training set after the validation rows")
        self.train_rows = n
        self.val = self.corpus[n:]
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def ids(self, replica: int, step: int, mb: int) -> list[int]:
        per = self.cfg.batch
        start = ((step * self.cfg.microbatches) + mb) * per
        epoch, off = divmod(start, self.train_rows)
        perm = self._perm(replica, epoch)
        return [int(perm[(off + i) % self.train_rows]) for i in range(per)]

    def _perm(self, replica: int, epoch: int) -> torch.Tensor:
        key = (replica, epoch)
        p = self._perms.get(key)
        if p is None:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + replica * 9973 + epoch)
            p = self._perms[key] = torch.randperm(self.train_rows, generator=g)
        return p

    def batch(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.corpus[list(ids)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def val_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.val[:, :-1].contiguous(), self.val[:, 1:].contiguous()
