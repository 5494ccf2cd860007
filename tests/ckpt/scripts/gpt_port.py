"""A small GPT training script in the common single-file style, in two ports to ckpt.

Its shape is that of the popular single-file GPT trainers: a config dict with paths
(``out_dir``, ``data_dir``) overridable from the command line, a data file read relative
to the working directory, ``init_from = "resume"`` loading the checkpoint before the
first batch is drawn, the next batch prefetched before each optimizer step, and an
evaluation at every ``eval_interval`` that draws its batches from the global RNG right
before the checkpoint is written to one path (``ckpt`` in ``out_dir``).

``--port swap``: the quick start's swap, ``torch.save``/``torch.load`` replaced by
``ckpt.save``/``ckpt.load`` and nothing else changed (the two marked lines).
``--port guided``: the porting guide followed: the in-flight batch is in the checkpoint,
the evaluation runs inside ``ckpt.rng.isolated()``, and the load restores the RNG streams
right before the loop, after the script's own first draw.

Usage: python gpt_port.py --out_dir=out [--init_from=resume] [--port=swap|guided] [--max_iters=N]
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

import ckpt

config = {"out_dir": "out", "data_dir": "data", "init_from": "scratch", "port": "swap", "max_iters": 12,
          "eval_interval": 4, "eval_iters": 2, "block_size": 16, "batch_size": 8, "n_embd": 32, "lr": 3e-3}
for arg in sys.argv[1:]:  # --key=value, as the configurator of such scripts does
    key, _, val = arg[2:].partition("=")
    if key not in config:
        raise SystemExit(f"unknown option {arg}")
    config[key] = type(config[key])(val)
globals().update(config)

torch.manual_seed(1337)
torch.set_num_threads(1)
with open(os.path.join(data_dir, "input.txt")) as f:  # relative to the working directory
    text = f.read()
chars = sorted(set(text))
vocab = len(chars)
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)) :]


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - block_size, (batch_size,))
    return (torch.stack([d[i : i + block_size] for i in ix]), torch.stack([d[i + 1 : i + 1 + block_size] for i in ix]))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.block = nn.TransformerEncoderLayer(n_embd, 2, 4 * n_embd, dropout=0.1, batch_first=True)
        self.head = nn.Linear(n_embd, vocab)
        self.register_buffer("mask", torch.triu(torch.full((block_size, block_size), float("-inf")), 1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        logits = self.head(self.block(x, src_mask=self.mask, is_causal=True))
        return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


@torch.no_grad()
def estimate_loss() -> float:
    model.eval()
    out = sum(model(*get_batch("val")).item() for _ in range(eval_iters)) / eval_iters
    model.train()
    return out


os.makedirs(out_dir, exist_ok=True)
ckpt_path = os.path.join(out_dir, "ckpt")
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
inflight = {"x": torch.zeros(batch_size, block_size, dtype=torch.long), "y": torch.zeros(batch_size, block_size,
                                                                                          dtype=torch.long)}
state = {"model": model, "optimizer": optimizer}
if port == "guided":
    state["inflight"] = inflight  # the batch drawn before the step boundary is part of the state
iter_num, best_val_loss, loaded = 0, 1e9, None
if init_from == "resume":
    # swap: `checkpoint = torch.load(ckpt_path)` and the load_state_dict lines became this line
    loaded = ckpt.load(ckpt_path, state, restore_rng=port != "guided")
    iter_num, best_val_loss = loaded.extra["iter_num"], loaded.extra["best_val_loss"]

X, Y = get_batch("train")  # fetch the very first batch
if loaded is not None and port == "guided":
    X, Y = inflight["x"].clone(), inflight["y"].clone()  # the batch the crashed run had drawn
    ckpt.rng.restore_rng(loaded.context["rng"])  # the streams as saved, right before the loop

while iter_num < max_iters:
    if iter_num % eval_interval == 0 and iter_num > 0:
        if port == "guided":
            with ckpt.rng.isolated():
                val = estimate_loss()
        else:
            val = estimate_loss()
        best_val_loss = min(best_val_loss, val)
        inflight["x"], inflight["y"] = X, Y
        # swap: `torch.save(checkpoint, ckpt_path)` became this line
        ckpt.save(ckpt_path, state, extra={"iter_num": iter_num, "best_val_loss": best_val_loss}, config=config,
                  overwrite=True)
    loss = model(X, Y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    X, Y = get_batch("train")  # prefetch the next batch while the GPU would be busy
    optimizer.step()
    iter_num += 1
print(f"iter {iter_num}: loss {loss.item():.6f}", flush=True)
