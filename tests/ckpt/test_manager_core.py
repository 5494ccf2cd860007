"""CheckpointManager: saves, resume fallback, retention, orphans, lineage, signals, async."""

from __future__ import annotations

import os
import signal
import threading
import warnings

import pytest
import torch

import ckpt
from ckpt.errors import BackgroundSaveError, CheckpointExistsError, ChecksumMismatchError
from ckpt.manager import (
    CheckpointManager,
    CheckpointRecord,
    ResumeFallbackWarning,
    RetentionPolicy,
    list_checkpoints,
    plan_retention,
)
from ckpt.storage import LocalStorage
from tests.sim.faultfs import FaultPlan, FaultRule, FaultyStorage
import hangs


def _model_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters(), lr=0.05)
    s = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
    return m, o, s


def _step(m: torch.nn.Module, o: torch.optim.Optimizer, s: torch.optim.lr_scheduler.LRScheduler) -> float:
    x = torch.randn(6, 4)
    loss = m(x).pow(2).mean()
    o.zero_grad()
    loss.backward()
    o.step()
    s.step()
    return loss.item()


def _run(run_dir, steps, *, stop_at=None, async_save=False, every=2, **kw):
    m, o, s = _model_opt()
    counters = {"tokens": 0}
    mgr = CheckpointManager(run_dir, {"model": m, "optim": o, "sched": s, "counters": counters}, every_steps=every, async_save=async_save, signals=(), **kw)
    mgr.resume()
    losses = {}
    for step in range(mgr.start_step + 1, steps + 1):
        losses[step] = _step(m, o, s)
        counters["tokens"] += 6
        mgr.after_step(step)
        if stop_at == step:
            break
    mgr.close()
    return losses, m, o, counters, mgr


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("async_save", [False, True])
def test_interrupted_run_equals_straight_run(tmp_path, async_save):
    ref_losses, ref_m, ref_o, ref_c, _ = _run(tmp_path / "ref", 7, async_save=async_save)
    first, _, _, _, _ = _run(tmp_path / "b", 7, stop_at=5, async_save=async_save)  # "dies" after step 5
    second, m, o, c, mgr = _run(tmp_path / "b", 7, async_save=async_save)
    assert mgr.start_step == 4
    assert {**{k: v for k, v in first.items() if k <= 4}, **second} == ref_losses
    _assert_same_state(ref_m, m)
    for k, v in ref_o.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(t, o.state_dict()["state"][k][name])
    assert c == ref_c
    if async_save:
        assert mgr.staging_allocations == 1
        assert all(r.asynchronous and r.nbytes > 0 for r in mgr.reports)


def test_run_dir_names_and_lineage(tmp_path):
    _, _, _, _, mgr1 = _run(tmp_path, 4, stop_at=4)
    _, _, _, _, mgr2 = _run(tmp_path, 6)
    names = [r.name for r in list_checkpoints(tmp_path)]
    assert names == ["step-00000004", "step-00000006"]  # keep_last=2 by default
    r4 = ckpt.open(tmp_path / "step-00000004")
    r6 = ckpt.open(tmp_path / "step-00000006")
    assert r4.context()["lineage"]["resumed_from"] is None
    assert r6.context()["lineage"]["run_id"] == r4.context()["lineage"]["run_id"] == mgr1.run_id == mgr2.run_id
    assert r6.context()["lineage"]["resumed_from"] == r4.manifest.id
    assert r6.meta["resumed_from"]["name"] == "step-00000004"


def test_resume_falls_back_past_corrupt_newest_with_named_warning(tmp_path):
    _run(tmp_path, 4)
    newest = tmp_path / "step-00000004"
    tensors = newest / "rank-00000.safetensors"
    raw = bytearray(tensors.read_bytes())
    raw[-3] ^= 0x40
    tensors.write_bytes(bytes(raw))
    (tmp_path / ".tmp-step-00000006-abc").mkdir()  # a crashed save: never a candidate
    os.utime(tmp_path / ".tmp-step-00000006-abc", (0, 0))  # crashed long ago: cleanup removes it
    m, o, s = _model_opt(seed=1)
    mgr = CheckpointManager(tmp_path, {"model": m, "optim": o, "sched": s}, signals=())
    assert mgr.removed_orphans == (".tmp-step-00000006-abc",)
    with pytest.warns(ResumeFallbackWarning, match=r"step-00000004.*ChecksumMismatchError.*rank-00000.safetensors"):
        res = mgr.resume()
    assert res.step == 2 and mgr.start_step == 2
    ref = ckpt.open(tmp_path / "step-00000002").state()
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref["model"][k])
    # The re-run step replaces the corrupt checkpoint (commit moves the old one aside).
    mgr.save(4)
    ckpt.open(tmp_path / "step-00000004").verify()
    mgr.close()


def test_resume_with_nothing_returns_none_and_never_reads_tmp(tmp_path):
    (tmp_path / ".tmp-step-00000002-x").mkdir()
    os.utime(tmp_path / ".tmp-step-00000002-x", (0, 0))  # left long ago: cleanup removes it
    m, o, s = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, signals=())
    assert mgr.resume() is None and mgr.start_step == 0
    assert not (tmp_path / ".tmp-step-00000002-x").exists()
    mgr.close()


def test_all_corrupt_resumes_nothing_and_warns_for_each(tmp_path):
    _run(tmp_path, 4)
    for name in ("step-00000002", "step-00000004"):
        os.remove(tmp_path / name / "MANIFEST")
    m, _, _ = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, signals=())
    with pytest.warns(ResumeFallbackWarning) as rec:
        assert mgr.resume() is None
    assert [str(w.message).split(":")[0] for w in rec] == [
        f"skipping {tmp_path / 'step-00000004'}",
        f"skipping {tmp_path / 'step-00000002'}",
    ]
    mgr.close()


def test_plan_retention_sets_are_separate_and_united():
    recs = [CheckpointRecord(f"step-{s:08d}", f"/r/step-{s:08d}", s, True, {"loss": loss}) for s, loss in
            [(1, 5.0), (2, 1.0), (3, 4.0), (4, 0.5), (5, 3.0), (6, float("nan")), (7, 2.0), (8, 9.0)]]
    keep = plan_retention(recs, RetentionPolicy(keep_last=2, keep_every=3, keep_best=2, best_metric="loss"))
    assert keep == {
        "step-00000008": ("resume-point", "last"),
        "step-00000007": ("last",),
        "step-00000003": ("every",),
        "step-00000006": ("every",),
        "step-00000004": ("best",),
        "step-00000002": ("best",),
    }
    keep_max = plan_retention(recs, RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss", best_mode="max"))
    assert keep_max == {"step-00000008": ("resume-point", "last", "best")}
    assert plan_retention([], RetentionPolicy()) == {}
    uncommitted = [CheckpointRecord("step-00000009", "/r/x", 9, False)]
    assert "step-00000009" not in plan_retention(recs + uncommitted, RetentionPolicy(keep_last=1))


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"keep_last": 0}, "keep_last must be >= 1"),
        ({"keep_every": 0}, "keep_every must be >= 1"),
        ({"keep_best": 1}, "keep_best needs best_metric"),
        ({"keep_best": 1, "best_metric": "l", "best_mode": "up"}, "best_mode must be"),
    ],
)
def test_retention_policy_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RetentionPolicy(**kw)


def test_retention_on_disk_keeps_best_and_every(tmp_path):
    m, o, s = _model_opt()
    pol = RetentionPolicy(keep_last=1, keep_every=4, keep_best=1, best_metric="loss")
    mgr = CheckpointManager(tmp_path, {"model": m}, every_steps=1, retention=pol, signals=())
    metric = {1: 3.0, 2: 0.1, 3: 2.0, 4: 5.0, 5: 4.0, 6: 6.0}
    for step in range(1, 7):
        mgr.after_step(step, metrics={"loss": metric[step]})
    mgr.close()
    assert [r.name for r in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000004", "step-00000006"]
    # Deleted only after the next checkpoint committed, and never the newest one.
    assert [r.deleted for r in mgr.reports] == [(), ("step-00000001",), (), ("step-00000003",), (), ("step-00000005",)]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def _failing_storage(armed: bool) -> tuple[FaultyStorage, FaultRule]:
    """Creating any tensor file fails with ENOSPC while the rule is armed."""
    rule = FaultRule("enospc", "create", ".safetensors", times=None, armed=armed)
    return FaultyStorage(LocalStorage(), FaultPlan(rules=[rule])), rule


def test_background_failure_surfaces_at_next_call(tmp_path):
    storage, enospc = _failing_storage(armed=False)
    m, o, s = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, every_steps=1, async_save=True, signals=(), storage=storage)
    mgr.after_step(1)
    mgr.wait()
    enospc.armed = True
    assert mgr.after_step(2) is True  # the save starts; its failure is not lost
    with pytest.raises(BackgroundSaveError, match=r"async save of step 2 failed.*No space left on device") as ei:
        mgr.wait()
    assert ei.value.path.endswith("step-00000002")
    assert isinstance(ei.value.__cause__, OSError)
    assert [r.name for r in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    enospc.armed = False
    mgr.after_step(3)  # the error was raised once; the manager carries on
    mgr.close()
    assert [r.name for r in list_checkpoints(tmp_path)] == ["step-00000001", "step-00000003"]


def test_background_failure_raised_by_after_step(tmp_path):
    storage, _ = _failing_storage(armed=True)
    m, _, _ = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, every_steps=1, async_save=True, signals=(), storage=storage)
    mgr.after_step(1)
    mgr._join()  # let it fail, without raising
    with pytest.raises(BackgroundSaveError, match="async save of step 1 failed"):
        mgr.after_step(2)
    mgr.close()


def test_async_save_writes_the_state_of_the_step_boundary(tmp_path):
    entered, release = threading.Event(), threading.Event()

    def gate(i: int, op: str, path: str) -> None:  # holds the background writer until the test lets it go
        if op == "create" and path.endswith(".safetensors"):
            entered.set()
            assert release.wait(hangs.hang_s(3))

    storage = FaultyStorage(LocalStorage(), on_op=gate)
    m, o, s = _model_opt()
    counters = {"n": 1}
    mgr = CheckpointManager(tmp_path, {"model": m, "optim": o, "counters": counters}, every_steps=1, async_save=True, signals=(), storage=storage)
    _step(m, o, s)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    exp_avg = o.state_dict()["state"][0]["exp_avg"].clone()
    lr = o.param_groups[0]["lr"]
    torch.manual_seed(123)
    rng_at_save = torch.get_rng_state()
    assert mgr.after_step(1)
    assert entered.wait(hangs.hang_s(3))
    # The loop moves on while the write is held: none of this may leak into step 1.
    for _ in range(2):
        _step(m, o, s)
    o.param_groups[0]["lr"] = 99.0
    counters["n"] = 2
    release.set()
    mgr.wait()
    saved = ckpt.open(tmp_path / "step-00000001")
    st = saved.state()
    for k, v in expected.items():
        assert torch.equal(st["model"][k], v)
    assert torch.equal(st["optim"]["state"][0]["exp_avg"], exp_avg)
    assert st["optim"]["param_groups"][0]["lr"] == lr
    assert st["counters"] == {"n": 1}
    assert saved.context()["rng"]["torch_cpu"] == bytes(rng_at_save.numpy().tobytes())
    rep = mgr.reports[-1]
    assert rep.asynchronous and rep.step == 1 and rep.nbytes > 0
    mgr.close()


def test_staging_is_allocated_once_and_reused(tmp_path):
    m, o, s = _model_opt()
    _step(m, o, s)  # optimizer state exists from here on: the layout is fixed
    mgr = CheckpointManager(tmp_path, {"model": m, "optim": o}, every_steps=1, async_save=True, signals=())
    for step in range(1, 5):
        _step(m, o, s)
        mgr.after_step(step)
    mgr.wait()
    assert mgr.staging_allocations == 1
    n_bytes = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    n_bytes += sum(t.numel() * t.element_size() for st in o.state_dict()["state"].values() for t in st.values())
    assert n_bytes <= mgr.staging_nbytes <= n_bytes + 64 * 16  # one copy, plus slot alignment
    mgr.close()


def test_tied_weights_stay_tied_through_staging(tmp_path):
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    mgr = CheckpointManager(tmp_path, {"model": model}, every_steps=1, async_save=True, signals=())
    mgr.after_step(1)
    mgr.close()
    r = ckpt.open(tmp_path / "step-00000001")
    assert len(r.tensor_entries()) == 1
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    fresh.head.weight = fresh.emb.weight
    ckpt.load(tmp_path / "step-00000001", {"model": fresh})
    assert torch.equal(fresh.emb.weight, emb.weight) and fresh.head.weight is fresh.emb.weight


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_at_next_boundary_and_stops(tmp_path, sig):
    m, o, s = _model_opt()
    old = signal.getsignal(sig)
    mgr = CheckpointManager(tmp_path, {"model": m}, every_steps=100, async_save=True)
    _step(m, o, s)
    assert mgr.after_step(1) is False and not mgr.should_stop
    os.kill(os.getpid(), sig)  # the handler only sets a flag; the process keeps running
    assert list_checkpoints(tmp_path) == []
    _step(m, o, s)
    assert mgr.after_step(2) is True
    assert mgr.should_stop
    assert [r.name for r in list_checkpoints(tmp_path)] == ["step-00000002"]  # synchronous: already committed
    mgr.close()
    assert signal.getsignal(sig) is old


def test_signal_right_after_a_save_does_not_save_twice(tmp_path):
    m, _, _ = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, every_steps=2, async_save=True, signals=())
    mgr.after_step(2)
    mgr.request_stop()
    assert mgr.after_step(2) is False  # same boundary: the in-flight save is waited for
    assert mgr.should_stop
    mgr.close()
    assert [r.name for r in list_checkpoints(tmp_path)] == ["step-00000002"]


def test_every_seconds_uses_the_clock(tmp_path):
    now = [100.0]
    m, _, _ = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, every_seconds=10.0, clock=lambda: now[0], signals=())
    assert mgr.after_step(1) is False
    now[0] += 9.9
    assert mgr.after_step(2) is False
    now[0] += 0.2
    assert mgr.after_step(3) is True
    now[0] += 5
    assert mgr.after_step(4) is False
    mgr.close()
    assert [r.step for r in list_checkpoints(tmp_path)] == [3]


def test_manager_argument_errors(tmp_path):
    m, _, _ = _model_opt()
    with pytest.raises(ValueError, match="every_steps must be >= 1"):
        CheckpointManager(tmp_path, {"model": m}, every_steps=0, signals=())
    with pytest.raises(ValueError, match="every_seconds must be > 0"):
        CheckpointManager(tmp_path, {"model": m}, every_seconds=0, signals=())
    with pytest.raises(ValueError, match="exactness must be"):
        CheckpointManager(tmp_path, {"model": m}, exactness="loose", signals=())
    with pytest.raises(ValueError, match=r"replicated entries \['optim'\]"):
        CheckpointManager(tmp_path, {"model": m}, replicated=["optim"], signals=())
    mgr = CheckpointManager(tmp_path, {"model": m}, signals=())
    mgr.close()
    with pytest.raises(ckpt.CkptError, match="closed"):
        mgr.after_step(1)
    with pytest.raises(ckpt.CkptError, match="no deferred RNG state"):
        CheckpointManager(tmp_path, {"model": m}, signals=()).restore_rng()


def test_strict_exactness_refuses_on_env_difference(tmp_path, monkeypatch):
    m, _, _ = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, every_steps=1, signals=())
    mgr.after_step(1)
    mgr.close()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    strict = CheckpointManager(tmp_path, {"model": m}, exactness="strict", signals=())
    with pytest.raises(ckpt.errors.EnvironmentMismatchError, match=r"env.CUBLAS_WORKSPACE_CONFIG: None -> ':4096:8'"):
        strict.resume()
    strict.close()
    warn = CheckpointManager(tmp_path, {"model": m}, signals=())
    with pytest.warns(RuntimeWarning, match="CUBLAS_WORKSPACE_CONFIG"):
        res = warn.resume()
    assert not res.exact and res.env_differences == ("env.CUBLAS_WORKSPACE_CONFIG: None -> ':4096:8'",)
    warn.close()


def test_existing_step_is_not_clobbered_by_plain_save(tmp_path):
    # The manager replaces a re-run step on purpose; ckpt.save never does by default.
    m, _, _ = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, signals=())
    mgr.save(3)
    mgr.close()
    with pytest.raises(CheckpointExistsError):
        ckpt.save(tmp_path / "step-00000003", {"model": m})


def test_corrupt_chunk_error_names_file(tmp_path):
    _run(tmp_path, 2)
    f = tmp_path / "step-00000002" / "rank-00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="rank-00000.safetensors"):
        ckpt.open(tmp_path / "step-00000002").verify()
    m, _, _ = _model_opt()
    mgr = CheckpointManager(tmp_path, {"model": m}, signals=())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert mgr.resume() is None
    assert any("ChecksumMismatchError" in str(w.message) for w in rec)
    mgr.close()


def test_grad_scaler_and_counters_round_trip(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler.update(new_scale=123.0)
    counters = {"tokens": 77, "micro_step": 0, "epoch": 2}
    mgr = CheckpointManager(tmp_path, {"scaler": scaler, "counters": counters}, signals=())
    mgr.save(1)
    mgr.close()
    # The scaler exists before the load (composer#1376): its state lands in it.
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    counters2 = {"tokens": 0, "micro_step": 0, "epoch": 0}
    mgr2 = CheckpointManager(tmp_path, {"scaler": scaler2, "counters": counters2}, signals=())
    mgr2.resume()
    mgr2.close()
    assert scaler2.state_dict() == scaler.state_dict()
    assert counters2 == counters


@pytest.mark.cuda
def test_cuda_state_is_staged_in_pinned_memory(tmp_path):
    m = torch.nn.Linear(64, 64).cuda()
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64, device="cuda")).sum().backward()
    o.step()
    mgr = CheckpointManager(tmp_path, {"model": m, "optim": o}, every_steps=1, async_save=True, signals=())
    expected = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    mgr.after_step(1)
    assert mgr._staging.pinned
    with torch.no_grad():
        m.weight.add_(1.0)  # after the copy-in: must not reach the checkpoint
    mgr.close()
    st = ckpt.open(tmp_path / "step-00000001").state()
    for k, v in expected.items():
        assert torch.equal(st["model"][k], v)
