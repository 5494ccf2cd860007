"""The model and data every DiLoCo actor builds the same way (a pure function of the config)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from runs.common.tiny_lm import TinyConfig, TinyLM, make_corpus
from runs.diloco.config import DiLoCoConfig

__all__ = ["build_model", "initial_state", "LearnerShards", "learner_corpus", "val_corpus", "weighted_loss",
           "eval_loss"]


def build_model(cfg: DiLoCoConfig) -> TinyLM:
    # dropout 0: learners run as threads of one process in replay, and a dropout mask
    # drawn from the global RNG would depend on how the threads interleave.
    return TinyLM(TinyConfig(vocab=cfg.vocab, dim=cfg.dim, heads=cfg.heads, layers=cfg.layers,
                             seq_len=cfg.seq_len, dropout=0.0))


def initial_state(cfg: DiLoCoConfig) -> dict[str, torch.Tensor]:
    """Theta_0, shared by the syncer and every learner; the global RNG is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        m = build_model(cfg)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@functools.lru_cache(maxsize=4)
def _corpus(seed: int, n: int, seq_len: int, vocab: int) -> torch.Tensor:
    return make_corpus(n, seq_len, vocab, seed=seed)


def _full_corpus(cfg: DiLoCoConfig) -> torch.Tensor:
    # One language for everyone: make_corpus draws its bigram table first from the seed,
    # so per-learner seeds would give every learner (and the validation set) a different
    # table and the merged model nothing to agree on. Learner i gets rows
    # [i*S, (i+1)*S), validation the rows after the last learner's.
    n = cfg.learners * cfg.seqs_per_learner + cfg.val_seqs
    return _corpus(cfg.seed * 1000 + 1, n, cfg.seq_len, cfg.vocab)


def learner_corpus(cfg: DiLoCoConfig, index: int) -> torch.Tensor:
    s = cfg.seqs_per_learner
    return _full_corpus(cfg)[index * s:(index + 1) * s]


def val_corpus(cfg: DiLoCoConfig) -> torch.Tensor:
    return _full_corpus(cfg)[cfg.learners * cfg.seqs_per_learner:]


class LearnerShards:
    """A ShardSource over one learner's corpus; samples are ``(tokens, loss_weight)``.

    Shards named in ``poisoned`` have NaN loss weights: the data-skew fault. It is a
    pure function of the stored data, as quarantine requires."""

    def __init__(self, corpus: torch.Tensor, shards: int, poisoned: tuple[int, ...] = ()) -> None:
        self.corpus = corpus
        self.shards = shards
        self.poisoned = frozenset(poisoned)
        self.per = corpus.shape[0] // shards

    def num_shards(self) -> int:
        return self.shards

    def shard_size(self, shard: int) -> int:
        return self.per

    def read(self, shard: int, offset: int) -> Any:
        w = float("nan") if shard in self.poisoned else 1.0
        return self.corpus[shard * self.per + offset], torch.tensor(w, dtype=torch.float32)


def weighted_loss(model: TinyLM, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                                     reduction="none").view(tokens.shape[0], -1).mean(1)
    return (ce * weights).mean()


@torch.no_grad()
def eval_loss(model: TinyLM, corpus: torch.Tensor, batch: int = 32) -> float:
    total, n = 0.0, 0
    for i in range(0, corpus.shape[0], batch):
        b = corpus[i:i + batch]
        total += float(model.loss(b)) * b.shape[0]
        n += b.shape[0]
    return total / n
