"""One random-kill trial run of a trainer integration on 2 gloo processes (issue 25, item 4).

The run of ``trainer_trial.py`` (a tiny GPT-style model, ``num_workers=2`` with random
augmentation in the workers, warmup + decay, accumulation 2, clipping, dropout, bf16
autocast, a save every 4 steps), launched as each trainer's users launch it:

- Lightning: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``; Lightning's own
  launcher starts rank 1 by re-running this script;
- Accelerate: ``torchrun --standalone --nproc-per-node 2`` (see :func:`command`), a
  ``CkptAccelerator(cpu=True)``, which then runs on gloo.

``--kill K --where W`` SIGKILLs the whole job (every process descended from the launcher,
DataLoader workers included, as a node loss does) at the point ``trainer_trial.Killer``
names. Each rank writes its final model, optimizer, scheduler, RNG and losses to
``<--out>/rank-<r>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: proctree

import torch  # noqa: E402

import proctree  # noqa: E402
import trainer_trial as T  # noqa: E402

import ckpt  # noqa: E402

# The fixed kill points of the stateful-loader trials (48 samples, 2 ranks, batch 4,
# accumulation 2: 3 steps an epoch): killed at step 9, resumed from the save of step 8 in
# the third epoch; killed right after the save of step 12, after an epoch's last batch.
EPOCH_POINTS = ((9, "step", "third-epoch"), (12, "save", "epoch-end"))
PROCS = 2
ROOT_ENV = "CKPT_TRIAL_ROOT"  # pid of the launcher: the kill takes down every process under it


def kill_job() -> None:
    """SIGKILL every process group under the launcher (torchrun starts each rank in a
    session of its own), this process's last."""
    groups: list[int] = []
    for p in proctree.tree(int(os.environ[ROOT_ENV])):  # the launcher first
        try:
            g = os.getpgid(p)
        except ProcessLookupError:
            continue
        if g not in groups:
            groups.append(g)
    # The launcher's group goes first. Both ranks reach the kill point at about the same
    # time and each kills the other: were a rank to die before the launcher, torchrun would
    # see a child die and exit 1 instead of dying by SIGKILL with the job. With the
    # launcher first, the first kill any rank sends is the launcher's.
    for g in groups:
        if g == os.getpgrp():
            continue
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


class JobKiller(T.Killer):
    def die(self) -> None:
        kill_job()


def rank() -> int:
    # Accelerate's end_training() destroys the process group: the launchers' variables then
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _local(tree: Any) -> Any:
    """This rank's shards of a state tree (FSDP2 parameters and moments are DTensors)."""
    if callable(getattr(tree, "to_local", None)):
        return tree.to_local().clone()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return tree


def write_out(a: argparse.Namespace, killer: T.Killer, state: dict[str, Any], step: int, resumed_from: int | None) -> None:
    state = {k: _local(v.state_dict()) for k, v in state.items()}
    ckpt.save(os.path.join(a.out, f"rank-{rank()}"), state, step=step, this_rank_only=True,
              extra={"losses": [x.hex() for x in killer.losses], "resumed_from": resumed_from})


# -- Lightning -----------------------------------------------------------------------------
def run_lightning(a: argparse.Namespace, killer: T.Killer) -> None:
    import lightning.pytorch as pl

    from ckpt.integrations.lightning import CkptCheckpointIO, CkptModelCheckpoint, CkptModelParallelStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = T.TinyGPT()

        def configure_model(self) -> None:
            if not a.strategy.startswith("fsdp2"):
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net.block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def train_dataloader(self) -> Any:
            # built here, under the process group: a ResumableLoader takes its rank from it
            return T.make_loader(a)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.net(**batch)["loss"]
            killer.micro(loss, self.trainer.global_step)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % T.ACCUM == 0:
                killer.step_end(self.trainer.global_step)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, T.warmup_decay(a.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class IO(CkptCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            killer.saved(int(checkpoint["global_step"]))  # rank 0 saves: it takes the job down

    pl.seed_everything(0, verbose=False)
    module = Module()
    io = IO()
    every = CkptModelCheckpoint(dirpath=a.run_dir, every_n_train_steps=T.SAVE_EVERY, save_top_k=-1)
    # FSDP2 over every process. "fsdp2-auto": Lightning's default sizes, one data-parallel
    # group per node and tensor parallelism within it, which this module (sharded over the
    # data-parallel mesh only, each rank reading its own batches) turns into independent
    # replicas: refused at the first save
    strategy: Any = "ddp"
    if a.strategy == "fsdp2":
        strategy = CkptModelParallelStrategy(data_parallel_size=a.procs, tensor_parallel_size=1)
    elif a.strategy == "fsdp2-auto":
        strategy = CkptModelParallelStrategy()
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=a.procs, strategy=strategy,
                         precision="bf16-mixed", accumulate_grad_batches=T.ACCUM, gradient_clip_val=1.0, plugins=[io],
                         callbacks=[io.rng_callback, every], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path="last")
    resumed = trainer.ckpt_path
    write_out(a, killer, {"model": module.net, "optim": trainer.optimizers[0],
                          "sched": trainer.lr_scheduler_configs[0].scheduler}, trainer.global_step,
              None if resumed is None else ckpt.open(resumed).step)


# -- Accelerate ----------------------------------------------------------------------------
def run_accelerate(a: argparse.Namespace, killer: T.Killer) -> None:
    T.run_accelerate(a, killer, write=write_out)


def command(trainer: str, loader: str, run_dir: str, out: str, steps: int, kill: int = 0, where: str = "step",
            procs: int = PROCS) -> list[str]:
    """The job's command line: the launcher as the trainer's users start it, wrapped so
    that its pid is known to the kill (``sh`` execs into it). ``trainer``: ``lightning``,
    ``lightning-fsdp2`` (``CkptModelParallelStrategy`` sharding over every process),
    ``lightning-fsdp2-auto`` (its default sizes) or ``accelerate``."""
    trainer, _, strategy = trainer.partition("-")
    me = [os.path.abspath(__file__), "--trainer", trainer, "--loader", loader, "--run-dir", run_dir, "--out", out,
          "--steps", str(steps), "--procs", str(procs), "--strategy", strategy or "ddp"]
    me += ["--kill", str(kill), "--where", where] if kill else []
    if trainer == "accelerate":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] + me
    else:  # Lightning's own launcher re-runs this script for the other ranks
        launcher = [sys.executable] + me
    return ["sh", "-c", f'{ROOT_ENV}=$$ exec "$@"', "sh"] + launcher


def launch(cmd: list[str], *, expect_kill: bool) -> str:
    """Run one job (hang-bounded by tests/hangs.py); returns its stderr."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import hangs

    import worlds

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE",
                                                             "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    store = None
    if "torch.distributed.run" not in cmd:
        # Lightning's launcher, left alone, picks a port it found free and closed: another
        # job (pytest-xdist runs three) could take it before rank 0 listens. This process
        # serves the rendezvous on a port the OS assigned as it listened, and both ranks
        # join it as clients, as under torchrun's agent; Lightning uses a MASTER_PORT it is
        # given. (torchrun --standalone holds the port it binds itself.)
        store = worlds.agent_store()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        p = hangs.run(cmd, bound_s=hangs.hang_s(60.0, floor_s=600.0), env=env)
    finally:
        del store  # the job has exited: its rendezvous goes with it
    if expect_kill and p.returncode == -signal.SIGKILL:
        return p.stderr
    if p.returncode != 0 or expect_kill:
        raise RuntimeError(f"{' '.join(cmd[5:])}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-6000:]}")
    return p.stderr


def differences(straight: str, resumed: str, procs: int = PROCS) -> list[str]:
    """What is not bit-identical, per rank."""
    return [f"rank {r}: {d}" for r in range(procs)
            for d in T.differences(os.path.join(straight, f"rank-{r}"), os.path.join(resumed, f"rank-{r}"))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=("lightning", "accelerate"), required=True)
    p.add_argument("--loader", choices=("resumable", "stateful", "stateful-plain"), default="resumable")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--procs", type=int, default=PROCS)
    p.add_argument("--strategy", choices=("ddp", "fsdp2", "fsdp2-auto"), default="ddp",
                   help="Lightning: ddp or FSDP2 (ModelParallel over every process, or with Lightning's auto sizes)")
    p.add_argument("--kill", type=int, default=0)
    p.add_argument("--where", choices=("step", "save", "micro"), default="step")
    a = p.parse_args()
    torch.set_num_threads(1)
    killer = JobKiller(a)
    {"lightning": run_lightning, "accelerate": run_accelerate}[a.trainer](a, killer)


if __name__ == "__main__":
    main()
