"""A tiny mixture-of-experts transformer language model (4 experts, top-2 routing).

Each block is pre-norm causal self-attention followed by an MoE feed-forward layer: a
linear router scores the experts per token, ``ckpt.guard.select_experts`` picks the top
k (so the loss-spike guard can replay a cached choice after a rollback), and the gates
are the softmax of the router's *current* logits at the chosen experts. Every expert is
a small MLP; tokens are dispatched with ``index_add_`` (deterministic on CPU). No
dropout: the forward is a pure function of weights and batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import ckpt.guard

__all__ = ["MoEConfig", "MoELayer", "TinyMoE"]


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    hidden: int = 64
    seq_len: int = 32


class MoELayer(nn.Module):
    """Top-k routed experts. ``last_experts``: the ``[tokens, k]`` ids of the last forward."""

    def __init__(self, dim: int, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(experts))
        self.last_experts: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        logits = self.router(x)
        idx = ckpt.guard.select_experts(self, logits, self.k)  # choice: cached after a rollback
        self.last_experts = idx.detach()
        gates = torch.softmax(logits.gather(-1, idx), dim=-1)  # weights: always the current ones
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, gates[tok, slot].unsqueeze(-1) * expert(x[tok]))
        return out.reshape_as(h)


class _Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MoELayer(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.moe(self.ln2(h))


class TinyMoE(nn.Module):
    def __init__(self, cfg: MoEConfig = MoEConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.blocks]  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
