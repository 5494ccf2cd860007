"""A GPT-style script whose bits depend on the intra-op thread count (for ``ckpt bisect``).

``Center`` subtracts the mean of the whole activation tensor: torch sums a large tensor in
per-thread pieces, so 1 and 2 threads round differently. Everything else is seeded.

    python threads_gpt.py --out RUN --threads 1 --steps 6
    ckpt bisect run RUN_1 RUN_2 --entry threads_gpt:target --threads-a 1 --threads-b 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import ckpt
from ckpt.bisect import Target

VOCAB, DIM, CTX, BATCH = 64, 64, 64, 64


class Center(torch.nn.Module):
    def forward(self, x):
        return x - x.mean()  # one reduction over BATCH*CTX*4*DIM = 2**20 values


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.center = Center()
        self.down = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.center(self.up(self.norm(x)))))


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, VOCAB, (8192,), generator=torch.Generator().manual_seed(1))

    def next_batch():
        ix = torch.randint(0, len(data) - CTX - 1, (BATCH,))
        return torch.stack([data[i : i + CTX] for i in ix]), torch.stack([data[i + 1 : i + CTX + 1] for i in ix])

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return model, opt, next_batch, step


def target() -> Target:
    model, opt, next_batch, step = build()
    return Target(state={"model": model, "optim": opt}, step=step, next_batch=next_batch)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, opt, next_batch, step = build()
    # a parameter digest on the ledger at every step: the first differing step is exact
    mgr = ckpt.CheckpointManager(a.out, {"model": model, "optim": opt}, every_steps=3, ledger_params_every=1)
    for s in range(1, a.steps + 1):
        batch = next_batch()
        loss = step(batch)
        mgr.after_step(s, batch=batch, loss=loss)
    mgr.close()
