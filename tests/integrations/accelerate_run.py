"""A small training loop under ``CkptAccelerator``; run as a fresh process by test_accelerate.py.

Dropout, AdamW, a LambdaLR warmup, gradient accumulation 2 (``accelerator.accumulate``),
a shuffled ``StatefulDataLoader`` prepared with ``use_stateful_dataloader=True`` and a
registered counters object. Saves every 3 optimizer steps; ``--kill-at K`` SIGKILLs after
step K. At the end it writes the final state and the per-step losses to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import ckpt  # noqa: E402
from ckpt.data import ResumableLoader  # noqa: E402
from ckpt.integrations.accelerate import CkptAccelerator  # noqa: E402
from ckpt.manager import checkpoint_name, list_checkpoints  # noqa: E402


class Counters:
    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.samples = int(sd["samples"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--loader", choices=("resumable", "stateful"), default="resumable")
    a = p.parse_args()
    torch.set_num_threads(1)
    set_seed(0)
    acc = CkptAccelerator(cpu=True, gradient_accumulation_steps=2,
                          dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(44, 6, generator=g), torch.randn(44, 1, generator=g))
    counters = Counters()
    if a.loader == "stateful":  # prepared by Accelerate: its position is saved as dataloader_0
        loader = StatefulDataLoader(data, batch_size=4, shuffle=True)  # 11 micro-batches per epoch
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    else:  # ckpt's loader shards by rank itself: registered, not prepared
        loader = ResumableLoader(data, seed=3, global_batch_size=4 * acc.num_processes, drop_last=False)
        model, opt, sched = acc.prepare(model, opt, sched)
        acc.register_for_checkpointing(loader)
    acc.register_for_checkpointing(counters)

    done = [r for r in list_checkpoints(a.run_dir) if r.committed]
    step, losses, resumed_from = 0, [], None
    res = acc.load_state(done[-1].path, defer_rng=True) if done else None
    if res is not None:
        it = acc.resumed_iter(loader, res)  # RNG restored after the iterator's setup drew its seed
        step, resumed_from = res.step, res.step
    else:
        it = iter(loader)
    while step < a.steps:
        for x, y in it:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            counters.samples += len(x)
            if not acc.sync_gradients:
                continue
            step += 1
            losses.append(loss.item())
            if step % 3 == 0:
                acc.save_state(os.path.join(a.run_dir, checkpoint_name(step)), step=step)
            if step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == a.steps:
                break
        it = iter(loader)
    ckpt.save(a.out, {"model": acc.unwrap_model(model), "optim": opt.optimizer, "sched": sched.scheduler},
              step=step, extra={"losses": losses, "samples": counters.samples, "resumed_from": resumed_from})


if __name__ == "__main__":
    main()
