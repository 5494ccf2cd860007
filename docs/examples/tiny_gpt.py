"""A tiny GPT trained the way many scripts are written, ported to ckpt.

Common style: the next batch is drawn (prefetched) before the step boundary, and an
evaluation that draws from the global torch RNG runs at the top of the iteration,
right before the checkpoint is written. Two switches make the port exact:

* ``--save-batch``: the prefetched batch goes into the checkpoint (in-flight state);
* ``--isolate-eval``: the evaluation runs inside ``ckpt.rng.isolated()``.

Without them (the naive port: ``torch.save``/``torch.load`` replaced by
``ckpt.save``/``ckpt.load``), the step ledger names the first resumed step that
differs and why. Run: ``python tiny_gpt.py --out run [--save-batch --isolate-eval]``.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch import nn
from torch.nn import functional as F

import ckpt

p = argparse.ArgumentParser()
p.add_argument("--out", default="out")
p.add_argument("--steps", type=int, default=24)
p.add_argument("--eval-interval", type=int, default=6)
p.add_argument("--save-batch", action="store_true")
p.add_argument("--isolate-eval", action="store_true")
args = p.parse_args()

torch.manual_seed(1337)
torch.set_num_threads(1)
block_size, batch_size, vocab, eval_iters = 16, 8, 48, 2
corpus = torch.randint(0, vocab, (4000,), generator=torch.Generator().manual_seed(0))
train_data, val_data = corpus[:3600], corpus[3600:]


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[: x.size(1), : x.size(1)], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        logits = self.head(self.blocks(x))
        return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


@torch.no_grad()
def estimate_loss() -> float:
    model.eval()
    losses = [model(*get_batch("val")).item() for _ in range(eval_iters)]
    model.train()
    return sum(losses) / len(losses)


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
ckpt_path = os.path.join(args.out, "ckpt")
ledger = ckpt.ledger.Ledger(os.path.join(args.out, "ledger"), params=model, params_every=4)
X, Y = get_batch("train")  # prefetch the first batch
inflight = {"x": X, "y": Y}  # in-flight state: the batch drawn before the step boundary
state = {"model": model, "optim": optimizer, **({"inflight": inflight} if args.save_batch else {})}
iter_num = 0
if os.path.exists(ckpt_path):
    r = ckpt.load(ckpt_path, state)  # restores the RNG streams last
    iter_num = r.step
    ledger.resumed(iter_num, source=ckpt_path)
    if args.save_batch:
        X, Y = inflight["x"], inflight["y"]
    else:
        X, Y = get_batch("train")  # naive: a new batch, not the one the crashed run had drawn

while iter_num < args.steps:
    if iter_num % args.eval_interval == 0 and iter_num > 0:
        if args.isolate_eval:
            with ckpt.rng.isolated():
                val = estimate_loss()
        else:
            val = estimate_loss()
        print(f"step {iter_num}: val loss {val:.4f}", flush=True)
        inflight["x"], inflight["y"] = X, Y
        ckpt.save(ckpt_path, state, step=iter_num, overwrite=True)
    loss = model(X, Y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    consumed = (X, Y)
    X, Y = get_batch("train")  # prefetch the next batch while this step's results are used
    iter_num += 1
    ledger.step(iter_num, batch=consumed, loss=loss)

report = ledger.close()
print(report.text if report is not None else "fresh run: nothing to verify", flush=True)
print(f"final loss {loss.item():.6f} lr-free check {math.isfinite(loss.item())}", flush=True)
