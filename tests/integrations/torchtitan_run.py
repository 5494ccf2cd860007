"""A training loop on torchtitan's components, one process per rank under torchrun over gloo.

Run by test_torchtitan.py. torchtitan 0.3.0's ``Trainer`` cannot train on a CPU-only torch
(README, torchtitan), so this is its training step by hand, with its own pieces: the
``OptimizersContainer`` (AdamW, ``default_adamw``), the ``LRSchedulersContainer`` (warmup 2,
linear decay), and the checkpoint manager, ``CkptCheckpointManager``, as torchtitan's trainer
builds and calls it (``load`` at start, ``save(step, last_step=)`` after every step,
``maybe_wait_for_saving``/``close`` at the end). The model is FSDP2-sharded over the ranks,
with dropout; the data loader is a stateful per-rank loader keyed ``dp_rank_N`` as
torchtitan's own. The harnesses' kill switch (``ckpt.testing.kill_switch``,
``CKPT_LEDGER_KILL_AT=K``) SIGKILLs rank 0 after step K and its save (a ledger step hook);
torchrun then ends the other ranks. At the end each rank writes its
per-step losses and the digests of its local shards (parameters, optimizer state) to
``<dump>/final-rank<r>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

VOCAB, DIM, SEQ, BATCH, SAMPLES = 64, 32, 16, 4, 48


class Loader:
    """A shuffled per-rank token stream whose position is its state (torchtitan keys a
    loader's state by data-parallel rank, so that every rank's survives the flattening)."""

    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(1000 + rank)
        self.rank = rank
        self.data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
        self.order = torch.randperm(SAMPLES, generator=g)
        self.pos = 0

    def next(self) -> torch.Tensor:
        idx = [int(self.order[(self.pos + i) % SAMPLES]) for i in range(BATCH)]
        self.pos += BATCH
        return self.data[idx]

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": {"pos": self.pos}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = int(sd[f"dp_rank_{self.rank}"]["pos"])


class TrainState:
    """torchtitan's trainer state entry (``train_state``): the step and tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.ntokens_seen = int(sd["ntokens_seen"])


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.ff = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                      torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(DIM)
        self.output = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _digest(t: Any) -> str:
    if isinstance(t, DTensor):
        t = t.to_local()
    if not isinstance(t, torch.Tensor):
        return repr(t)
    t = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest() + str(t.dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--async-mode", default="disabled")
    p.add_argument("--native", action="store_true", help="torchtitan's own CheckpointManager (the baseline)")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from ckpt.integrations.torchtitan import CkptCheckpointManager

    torch.manual_seed(0)  # one init on every rank; fully_shard keeps each rank's shard
    model = Tiny()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(10 + rank)  # dropout differs per rank: the per-rank RNG must resume
    optimizers = default_adamw(lr=3e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                 min_lr_factor=0.0).build(optimizers=optimizers, training_steps=a.steps)
    loader, train_state = Loader(rank), TrainState()
    common: dict[str, Any] = dict(enable=True, folder="checkpoint", interval=a.interval, keep_latest_k=3,
                                  last_save_model_only=False, async_mode=a.async_mode)
    if a.native:
        from torchtitan.components.checkpoint import CheckpointManager

        config: Any = CheckpointManager.Config(**common)
    else:
        config = CkptCheckpointManager.Config(**common, ledger_params_every=1)
    checkpointer = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder=a.dump)
    checkpointer.load(step=-1)
    losses: dict[int, str] = {}
    for step in range(train_state.step + 1, a.steps + 1):
        tokens = loader.next()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.step = step
        train_state.ntokens_seen += tokens.numel()
        losses[step] = float(loss.detach()).hex()
        checkpointer.save(step, last_step=step == a.steps)
        if a.native and os.environ.get("CKPT_LEDGER_KILL_AT") == str(step) and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # the baseline has no ledger: the same kill point, by hand
    checkpointer.maybe_wait_for_saving()
    ledger = getattr(checkpointer, "ledger", None)  # rank 0's; close() finishes its resume report
    checkpointer.close()
    out = {
        "losses": losses,
        "params": {k: _digest(v) for k, v in model.state_dict().items()},
        "optim": {k: _digest(v) for k, v in optimizers.state_dict().items()},
        "lr": optimizers.optimizers[0].param_groups[0]["lr"],
        "train_state": train_state.state_dict(),
        "loader_pos": loader.pos,
        "rng": _digest(torch.get_rng_state()),
        "resume_verdict": ledger.report.verdict if ledger is not None and ledger.report is not None else None,
    }
    with open(os.path.join(a.dump, f"final-rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
