"""A tiny LightningModule trained with ``CkptCheckpointIO``; run as a fresh process by
test_lightning.py. Dropout, AdamW, a StepLR, a shuffled ``StatefulDataLoader`` of 9
batches per epoch; ``ModelCheckpoint`` every 3 steps; ``--kill-at K`` SIGKILLs after step K.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import ckpt  # noqa: E402
from ckpt.integrations.lightning import CkptCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(hidden, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> object:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}


class KillAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def newest(run_dir: str) -> str | None:
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        m = re.fullmatch(r"step-(\d+)\.ckpt", name)
        if m and os.path.isfile(os.path.join(run_dir, name, "MANIFEST")):
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return max(found)[1] if found else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-at", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Tiny()
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(36, 6, generator=g), torch.randn(36, 1, generator=g))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True)
    io = CkptCheckpointIO(config=dict(model.hparams))
    callbacks = [io.rng_callback,
                 ModelCheckpoint(dirpath=a.run_dir, filename="step-{step:08d}", auto_insert_metric_name=False,
                                 every_n_train_steps=3, save_top_k=-1)]
    if a.kill_at:
        callbacks.append(KillAt(a.kill_at))
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=1, plugins=[io], callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, deterministic=True)
    resume = newest(a.run_dir)
    trainer.fit(model, loader, ckpt_path=resume)
    ckpt.save(a.out, {"model": model, "optim": trainer.optimizers[0], "sched": trainer.lr_scheduler_configs[0].scheduler},
              step=trainer.global_step,
              extra={"losses": model.losses, "resumed_from": resume and int(re.findall(r"step-(\d+)", resume)[-1]),
                     "epoch": trainer.current_epoch})


if __name__ == "__main__":
    main()
