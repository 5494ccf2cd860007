"""A small guarded training run for the loss-spike guard's tests: an MLP regression with
SGD + momentum and a LambdaLR schedule (so an exact restore must bring back momentum
buffers and the schedule), over a ResumableLoader, with a window of corrupted samples."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import torch

import ckpt
from ckpt.data import EpochOrder, ResumableLoader
from ckpt.guard import GuardConfig, LossGuard

N, BATCH, DIM = 4096, 32, 8


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls on a loaded 2-core box: a second intra-op thread only contends.
    (A module that imports this fixture gets it for every test.)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Regression(torch.utils.data.Dataset):
    """y = w.x + noise. Samples in ``scaled`` have y * 1000 (a loss spike); in ``nan`` x is NaN."""

    def __init__(self, scaled: frozenset[int] = frozenset(), nan: frozenset[int] = frozenset()) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, DIM, generator=g)
        w = torch.randn(DIM, generator=g)
        self.y = self.x @ w + 0.01 * torch.randn(N, generator=g)
        self.scaled, self.nan = scaled, nan

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.x[i], self.y[i]
        if i in self.scaled:
            y = y * 1000.0
        if i in self.nan:
            x = torch.full_like(x, float("nan"))
        return x, y


def samples_of(loader_steps: range | list[int], *, seed: int = 3, epoch: int = 0) -> frozenset[int]:
    """Dataset indices served by these global steps of ``epoch`` (unedited order)."""
    order = EpochOrder(N, seed, epoch)
    return frozenset(order.index(p) for s in loader_steps for p in range(s * BATCH, (s + 1) * BATCH))


@dataclass
class Run:
    run_dir: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    loader: ResumableLoader
    mgr: ckpt.CheckpointManager
    guard: LossGuard | None
    losses: list[tuple[int, float]] = field(default_factory=list)
    rollbacks: list[Any] = field(default_factory=list)
    served: list[tuple[int, int]] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.losses[-1][0] if self.losses else self.mgr.start_step


def objects(scaled: frozenset[int] = frozenset(), nan: frozenset[int] = frozenset(), seed: int = 3) -> tuple[Any, ...]:
    """(model, optimizer, schedule, loader), freshly built and seeded."""
    random.seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
    loader = ResumableLoader(Regression(scaled, nan), seed=seed, global_batch_size=BATCH)
    return model, opt, sched, loader


def build(run_dir: str, *, scaled: frozenset[int] = frozenset(), nan: frozenset[int] = frozenset(),
          config: GuardConfig | None = GuardConfig(), every: int = 10, retention: Any = None,
          tape: Any = None, save0: bool = True, resume: bool = False, seed: int = 3,
          async_save: bool = False) -> Run:
    model, opt, sched, loader = objects(scaled, nan, seed)
    mgr = ckpt.CheckpointManager(run_dir, {"model": model, "optim": opt, "sched": sched}, data=loader,
                                 every_steps=every, retention=retention, signals=(), async_save=async_save)
    guard = LossGuard(mgr, config, tape=tape) if config is not None else None
    if resume:
        mgr.resume()
    if save0 and not mgr.checkpoints():
        mgr.save(0)
    return Run(run_dir, model, opt, sched, loader, mgr, guard)


def train(run: Run, until: int, *, on_rollback: Callable[[Run, Any], None] | None = None,
          stop: Callable[[Run, int], bool] | None = None) -> Run:
    """Train to step ``until`` (or stop after a step where ``stop(run, step)``, as a crash would)."""
    step = run.mgr.start_step if not run.losses else run.losses[-1][0]
    while step < until:
        rolled = False
        for x, y in run.loader:
            info = run.loader.last_batch
            run.served.append((info.epoch, info.step))
            loss = torch.nn.functional.mse_loss(run.model(x).squeeze(-1), y)
            run.opt.zero_grad(set_to_none=True)
            loss.backward()
            run.opt.step()
            run.sched.step()
            step += 1
            run.losses.append((step, loss.item()))
            if run.guard is not None:
                rb = run.guard.after_step(step, loss=loss, batch=(x, y))
            else:
                run.mgr.after_step(step, loss=loss, batch=(x, y))
                rb = None
            if rb is not None:
                run.rollbacks.append(rb)
                if on_rollback is not None:
                    on_rollback(run, rb)
                step = rb.step
                rolled = True
                break
            if step >= until or (stop is not None and stop(run, step)):
                break
        if stop is not None and not rolled and stop(run, step):
            break
    return run


def finish(run: Run) -> Run:
    run.mgr.wait()
    if run.guard is not None:
        run.guard.close()
    run.mgr.close()
    return run


def eval_loss(run: Run) -> float:
    ds = Regression()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(run.model(ds.x).squeeze(-1), ds.y))


def ledger_dir(run: Run) -> str:
    return os.path.join(run.run_dir, "ledger")
