"""Anticipatory routing on the tiny MoE transformer (4 experts, top-2): after a rollback
the routing of the next K batches is cached with the restored weights, and those batches
train with exactly the cached experts; the warmup itself moves nothing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import ckpt
from ckpt.data import EpochOrder, ResumableLoader
from ckpt.errors import GuardError
from ckpt.guard import GuardConfig, LossGuard
from ckpt.ledger import read_ledger_dir
from runs.common.tiny_lm import CorpusDataset, make_corpus, unlikely_corpus
from runs.common.tiny_moe import TinyMoE
from _guard_kit import one_thread  # noqa: F401  (autouse)

B, N, SEED = 16, 1024, 1
K = 4  # warmup batches


def _corpus() -> torch.Tensor:
    corpus = make_corpus(N, 32, 64, seed=SEED)
    bad = unlikely_corpus(N, 32, 64, seed=SEED)
    order = EpochOrder(N, SEED, 0)
    for p in range(40 * B, 42 * B):  # global steps 40-41: the corrupted window
        corpus[order.index(p)] = bad[order.index(p)]
    return corpus


CORPUS = _corpus()




@dataclass
class MoERun:
    model: TinyMoE
    mgr: ckpt.CheckpointManager
    guard: LossGuard
    loader: ResumableLoader
    used: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    rollbacks: list[Any] = field(default_factory=list)


def moe_run(run_dir: str, *, warmup: int = K, every: int = 10, until: int = 47, resume: bool = False,
            stop: int | None = None, on_rollback: Callable[[MoERun], None] | None = None) -> MoERun:
    random.seed(0)
    torch.manual_seed(0)
    model = TinyMoE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = ResumableLoader(CorpusDataset(CORPUS), seed=SEED, global_batch_size=B)
    mgr = ckpt.CheckpointManager(run_dir, {"model": model, "optim": opt, "sched": sched}, data=loader,
                                 every_steps=every, signals=())
    # A short window: the tiny model's loss still falls fast, which widens a long window's MAD.
    cfg = GuardConfig(window=16, skip_after=1, warmup_batches=warmup)
    guard = LossGuard(mgr, cfg, model=model, forward=model.loss) if warmup else LossGuard(mgr, cfg)
    if resume:
        mgr.resume()
    else:
        mgr.save(0)
    run = MoERun(model, mgr, guard, loader)
    step = mgr.start_step
    while step < until:
        for batch in loader:
            info = loader.last_batch
            loss = model.loss(batch)
            run.used[(info.epoch, info.step)] = [m.last_experts.clone() for m in model.moe_layers]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            run.losses.append(loss.item())
            rb = guard.after_step(step, loss=loss, batch=batch)
            if rb is not None:
                run.rollbacks.append(rb)
                if on_rollback is not None:
                    on_rollback(run)
                step = rb.step
                break
            if step >= until or step == stop:
                break
        if step == stop:
            break
    mgr.wait()
    guard.close()
    mgr.close()
    return run


def test_the_replayed_window_trains_with_the_cached_experts(tmp_path) -> None:
    cached: dict[tuple[int, int, str], torch.Tensor] = {}
    run = moe_run(str(tmp_path / "r"), on_rollback=lambda r: cached.update(r.guard.routing.cache))
    [rb] = run.rollbacks
    assert (rb.detected, rb.step, rb.warmed) == (41, 40, ((0, 42), (0, 43), (0, 44), (0, 45)))
    layers = ["blocks.0.moe", "blocks.1.moe"]
    assert sorted(cached) == sorted((0, s, name) for s in range(42, 46) for name in layers)
    for (epoch, step, name), ids in cached.items():
        assert ids.shape == (B * 32, 2) and ids.dtype == torch.int64
        assert torch.equal(run.used[(epoch, step)][layers.index(name)], ids), (step, name)
    assert run.guard.routing is not None and run.guard.routing.cache == {}  # each entry went once trained
    assert [(e, s, n) for e, s, n, _ in run.guard.routing.replayed] == [(0, s, n) for s in range(42, 46) for n in layers]
    # The tape: 8 cached routings, the warmup, 8 replays; tape check finds the digests equal.
    [tape], _ = read_ledger_dir(f"{run.mgr.run_dir}/ledger")
    names = [type(g.record).__name__ for g in tape.guard]
    assert names == ["Verdict", "RollbackEvent"] + ["Routing"] * 8 + ["Warmup"] + ["RoutingReplay"] * 8
    warm = tape.guard[10].record
    assert warm.batches == ((0, 42), (0, 43), (0, 44), (0, 45))
    assert [g.step for g in tape.guard[11:]] == [41, 41, 42, 42, 43, 43, 44, 44]
    from replay import check_tape

    assert check_tape(tape.path) == []


@pytest.mark.slow
def test_the_warmup_moves_no_training_stream(tmp_path) -> None:
    # The same run twice: with a warmup whose cache is dropped right after it (so nothing
    # is replayed) and with no warmup at all. Bit-identical: the warmup's forward passes
    # moved no RNG stream, no weight, no optimizer state and no data position.
    dropped = moe_run(str(tmp_path / "w"), on_rollback=lambda r: r.guard.routing.clear())
    plain = moe_run(str(tmp_path / "p"), warmup=0)
    assert dropped.rollbacks[0].warmed and not plain.rollbacks[0].warmed
    assert dropped.losses == plain.losses
    for p, q in zip(dropped.model.state_dict().values(), plain.model.state_dict().values()):
        assert torch.equal(p, q)


@pytest.mark.slow
def test_a_resume_inside_the_window_still_replays(tmp_path) -> None:
    straight = moe_run(str(tmp_path / "a"), every=2)
    cut = moe_run(str(tmp_path / "b"), every=2, stop=43)  # killed inside the replayed window
    assert cut.rollbacks and cut.guard.routing.replayed[-1][1] == 44
    meta = ckpt.open(f"{tmp_path}/b/step-00000042").meta["guard"]["routing"]
    assert sorted((e, s, n) for e, s, n, _, _ in meta) == [(0, 44, "blocks.0.moe"), (0, 44, "blocks.1.moe"),
                                                           (0, 45, "blocks.0.moe"), (0, 45, "blocks.1.moe")]
    again = moe_run(str(tmp_path / "b"), every=2, resume=True)
    assert again.mgr.start_step == 42 and again.rollbacks == []
    assert [(s, n) for _, s, n, _ in again.guard.routing.replayed] == [(44, "blocks.0.moe"), (44, "blocks.1.moe"),
                                                                       (45, "blocks.0.moe"), (45, "blocks.1.moe")]
    for p, q in zip(straight.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(p, q)


def _controller_with(layer: torch.nn.Module, ids: torch.Tensor) -> Any:
    from ckpt.guard.routing import RoutingController

    model = torch.nn.ModuleDict({"moe": layer})
    ctl = RoutingController(model, lambda: (0, 7), lambda rec: None, lambda kind, compute: compute())
    ctl.cache[(0, 7, "moe")] = ids
    return ctl


def test_the_installed_controller_is_per_thread_and_an_explicit_router_wins() -> None:
    import threading

    from ckpt.guard import routing

    layer = torch.nn.Linear(2, 2)
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    mine = _controller_with(layer, torch.tensor([[0, 1], [1, 2]]))
    theirs = _controller_with(layer, torch.tensor([[2, 0], [0, 1]]))
    top = logits.topk(2, dim=-1).indices
    mine.install()
    try:
        assert routing.current() is mine
        assert routing.select(layer, logits, 2).tolist() == [[0, 1], [1, 2]]
        assert routing.select(layer, logits, 2, router=theirs).tolist() == [[2, 0], [0, 1]]
        seen: list[Any] = []

        def other_thread() -> None:
            # a thread of its own: nothing installed here, and installing does not collide
            seen.append(routing.current())
            seen.append(routing.select(layer, logits, 2).tolist())
            theirs.install()
            seen.append(routing.select(layer, logits, 2).tolist())
            theirs.uninstall()

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert seen == [None, top.tolist(), [[2, 0], [0, 1]]]
        with pytest.raises(GuardError, match="another LossGuard"):
            theirs.install()
        assert routing.current() is mine
    finally:
        mine.uninstall()
    assert routing.current() is None
    assert torch.equal(routing.select(layer, logits, 2), top)
