"""A tiny transformer language model and a generated corpus (no download).

The corpus is sampled from a fixed random bigram table with a few deterministic
"phrases" mixed in, so there is structure to learn and the loss falls visibly within
a few hundred steps on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["TinyConfig", "TinyLM", "make_corpus", "unlikely_corpus", "CorpusDataset", "warmup_cosine"]


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 32
    dropout: float = 0.1


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        layer = nn.TransformerEncoderLayer(
            cfg.dim, cfg.heads, dim_feedforward=4 * cfg.dim, dropout=cfg.dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied weights: a shared-storage case for ckpt
        nn.init.normal_(self.tok.weight, std=0.02)
        mask = torch.triu(torch.full((cfg.seq_len, cfg.seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _bigram(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, vocab, generator=g) * 2.5, dim=-1), g


def make_corpus(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``n_seqs`` sequences of ``seq_len + 1`` tokens from a seeded bigram process."""
    probs, g = _bigram(vocab, seed)
    out = torch.empty(n_seqs, seq_len + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n_seqs,), generator=g)
    for i in range(1, seq_len + 1):
        out[:, i] = torch.multinomial(probs[out[:, i - 1]], 1, generator=g).squeeze(1)
    return out


def unlikely_corpus(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Corrupted text for fault injection: sequences that follow, from a random first
    token, the *least* likely transition of :func:`make_corpus`'s bigram table (same
    ``seed``), so a model that learned the corpus finds every next token surprising and
    its loss spikes."""
    probs, _ = _bigram(vocab, seed)
    g = torch.Generator().manual_seed(seed + 1)
    worst = probs.argmin(dim=-1)
    out = torch.empty(n_seqs, seq_len + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n_seqs,), generator=g)
    for i in range(1, seq_len + 1):
        out[:, i] = worst[out[:, i - 1]]
    return out


class CorpusDataset(torch.utils.data.Dataset):
    """Map-style view of a corpus tensor; sample i is row i."""

    def __init__(self, corpus: torch.Tensor) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return self.corpus.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.corpus[i]


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))

    return f
