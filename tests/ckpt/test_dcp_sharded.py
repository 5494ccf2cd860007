"""Sharded state (FSDP2, TP, FSDP+TP) through ckpt.save/ckpt.load on real gloo ranks.

One pipeline, each stage a fresh set of processes on 127.0.0.1 (the world size
changes between stages):

A. FSDP2 on 4 ranks: train, save (sharded); a value msgpack cannot hold is refused.
B. FSDP2 on 2 ranks: load A (4 -> 2), bit-exact; continue one step and save B; resume
   of B on the same 2 ranks is bit-identical (RNG per rank restored). TP on 2 loads A.
C. FSDP+TP on a 2x2 mesh: load B (2 -> 4, FSDP -> FSDP+TP), new ranks' RNG by the
   documented rule; save C.
D. this process, no process group: load C into a plain module and AdamW (M = 1); full
   tensors from ckpt.open; a corrupted shard fails verify and load naming its file.
E. FSDP2 on 2 ranks: load C (FSDP+TP -> FSDP); then one rank is SIGKILLed while
   writing a sharded save: nothing commits and the previous checkpoint loads.

Every "bit-exact" compares global tensors (parameters, AdamW exp_avg, exp_avg_sq, step)
with torch.equal against the global tensors recorded at save time (written with the
plain, unsharded ckpt.save by rank 0).
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from typing import Any

import pytest

from ckpt.testing.resume_entry import _forkserver, _main_not_reimported
import hangs
import worlds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


# --- helpers used inside the ranks ----------------------------------------------------


def _model() -> Any:
    import torch

    torch.manual_seed(0)  # same init everywhere; sharding happens after
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def _build(kind: str, world: int) -> tuple[Any, Any, int]:
    """(model, AdamW, data-parallel rank) for kind in plain/fsdp/tp/fsdp_tp."""
    import torch
    import torch.distributed as dist

    m = _model()
    dp_rank = 0
    if kind != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        if kind == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
            for layer in (m[0], m[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            dp_rank = dist.get_rank()
        elif kind == "tp":
            mesh = init_device_mesh("cpu", (world,))
            parallelize_module(m, mesh, plan)
        else:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(m, mesh["tp"], plan)
            fully_shard(m, mesh=mesh["dp"])
            dp_rank = mesh.get_local_rank("dp")
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    return m, opt, dp_rank


def _train(m: Any, opt: Any, steps: int, *, rng_inputs: bool, dp_rank: int, start: int) -> None:
    import torch

    for s in range(start, start + steps):
        if rng_inputs:
            x = torch.randn(4, 8)  # from this rank's global stream: resume must restore it
        else:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * s + dp_rank))
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _global(m: Any, opt: Any) -> dict[str, Any]:
    """Global tensors of model and optimizer, keyed by fqn (collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    def full(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out = {f"model.{k}": full(v) for k, v in get_model_state_dict(m).items()}
    for fqn, st in get_optimizer_state_dict(m, opt)["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = full(v)
    return out


def _mismatches(now: dict[str, Any], ref_path: str) -> list[str]:
    import torch

    import ckpt

    ref = ckpt.open(ref_path).state()["g"]
    bad = [k for k in ref if k not in now or not torch.equal(now[k], ref[k])]
    bad += [k for k in now if k not in ref]
    return bad


def _record(m: Any, opt: Any, path: str, rank: int) -> None:
    import ckpt

    g = _global(m, opt)
    if rank == 0:
        ckpt.save(path, {"g": g}, this_rank_only=True)


def _killing_storage() -> Any:
    """The local backend, SIGKILLing this process after its first tensor-file write: some
    bytes of the part are on disk, then the rank dies (before a second write or the close)."""
    from ckpt.storage import local
    from tests.sim.faultfs import FaultPlan, FaultRule, FaultyStorage

    return FaultyStorage(local, FaultPlan(rules=[FaultRule("sigkill", "write", ".safetensors", skip=1),
                                                 FaultRule("sigkill", "close", ".safetensors")]))


# --- the stages -----------------------------------------------------------------------


def _stage(stage: str, rank: int, world: int, init: str, timeout: Any, out: str) -> None:
    import torch
    import torch.distributed as dist

    result: dict[str, Any] = {"rank": rank}
    try:
        torch.set_num_threads(1)
        worlds.arm(os.path.join(out, f"world-{stage}"), rank)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
        import ckpt
        from ckpt.errors import UnsupportedValueError

        p = lambda name: os.path.join(out, name)  # noqa: E731
        if stage == "A":
            m, opt, dp = _build("fsdp", world)
            torch.manual_seed(100 + rank)
            _train(m, opt, 2, rng_inputs=True, dp_rank=dp, start=0)
            info = ckpt.save(p("A"), {"model": m, "optim": opt, "counters": {"step": 2, "tokens": 64}}, step=2)
            result["id"] = info.id
            _record(m, opt, p("refA"), rank)
            try:
                ckpt.save(p("bad"), {"model": m, "x": {"obj": object()}}, step=2)
                result["bad"] = "saved"
            except UnsupportedValueError as e:
                result["bad"] = str(e)
            result["bad_listing"] = sorted(n for n in os.listdir(out) if "bad" in n)
        elif stage == "B":
            m, opt, dp = _build("fsdp", world)
            counters = {"step": 0, "tokens": 0}
            res = ckpt.load(p("A"), {"model": m, "optim": opt, "counters": counters})
            result["A_to_2"] = _mismatches(_global(m, opt), p("refA"))
            result["counters"] = counters
            result["exact_claim"] = res.exact
            result["env_differences"] = list(res.env_differences)
            _train(m, opt, 1, rng_inputs=True, dp_rank=dp, start=2)
            ckpt.save(p("B"), {"model": m, "optim": opt, "counters": counters}, step=3)
            _record(m, opt, p("refB"), rank)
            # resume on the same world size: bit-identical continuation
            _train(m, opt, 2, rng_inputs=True, dp_rank=dp, start=3)
            first = _global(m, opt)
            m2, opt2, _ = _build("fsdp", world)
            res2 = ckpt.load(p("B"), {"model": m2, "optim": opt2, "counters": counters})
            result["same_world_exact_claim"] = res2.exact
            _train(m2, opt2, 2, rng_inputs=True, dp_rank=dp, start=3)
            again = _global(m2, opt2)
            result["resume_identical"] = sorted(first) == sorted(again) and all(torch.equal(first[k], again[k]) for k in first)
            # the manager takes the sharded state directly, and resumes it
            from ckpt.manager import CheckpointManager

            run = p("run")
            mgr = CheckpointManager(run, {"model": m, "optim": opt}, every_steps=1, signals=())
            mgr.after_step(6)
            mgr.close()
            mgr_state = _global(m, opt)
            m3, opt3, _ = _build("fsdp", world)
            mgr2 = CheckpointManager(run, {"model": m3, "optim": opt3}, signals=())
            res3 = mgr2.resume()
            mgr2.close()
            now = _global(m3, opt3)
            result["manager_resume"] = [res3.step, mgr.sharded, all(torch.equal(now[k], mgr_state[k]) for k in now)]
            # tensor parallel on 2 loads the FSDP-on-4 checkpoint
            mt, optt, _ = _build("tp", world)
            ckpt.load(p("A"), {"model": mt, "optim": optt, "counters": {}})
            result["A_to_tp2"] = _mismatches(_global(mt, optt), p("refA"))
        elif stage == "C":
            m, opt, _ = _build("fsdp_tp", world)
            res = ckpt.load(p("B"), {"model": m, "optim": opt, "counters": {}})
            result["B_to_2x2"] = _mismatches(_global(m, opt), p("refB"))
            result["restored_rng"] = list(res.restored_rng)
            result["initial_seed"] = str(torch.initial_seed())
            from ckpt.dcp.integration import new_rank_seed

            result["rule_seed"] = str(new_rank_seed(res.id, rank))
            ckpt.save(p("C"), {"model": m, "optim": opt, "counters": {"step": 3}}, step=3)
            result["mesh"] = ckpt.open(p("C")).meta["sharded"]["mesh"]
            result["placements"] = ckpt.open(p("C")).meta["sharded"]["placements"].get("model.0.weight")
        elif stage == "E":
            m, opt, _ = _build("fsdp", world)
            ckpt.load(p("C"), {"model": m, "optim": opt, "counters": {}})
            result["C_to_2"] = _mismatches(_global(m, opt), p("refB"))
            ckpt.save(p("E1"), {"model": m, "optim": opt}, step=4)
            _record(m, opt, p("refE1"), rank)
            result["before_kill"] = True
            with open(os.path.join(out, f"result-{stage}-{rank}.json"), "w") as f:
                json.dump(result, f)
            storage = _killing_storage() if rank == 1 else None
            try:
                kw = {"storage": storage} if storage is not None else {}
                ckpt.save(p("E2"), {"model": m, "optim": opt}, step=5, **kw)
                result["killed_save"] = "returned"
            except BaseException as e:  # noqa: BLE001 - what rank 0 sees when rank 1 dies
                result["killed_save"] = f"{type(e).__name__}: {e}"
            result["listing"] = sorted(os.listdir(out))
            with open(os.path.join(out, f"result-{stage}-{rank}.json"), "w") as f:
                json.dump(result, f)
            os._exit(0)  # the group lost a member: skip the collective teardown
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"result-{stage}-{rank}.json"), "w") as f:
        json.dump(result, f)


def _run(stage: str, world: int, out: str) -> list[dict[str, Any]]:
    ctx = _forkserver()
    here = os.path.join(out, f"world-{stage}")  # one rendezvous per stage's world
    os.makedirs(here)
    init, timeout = worlds.file_init(here), worlds.pg_timeout(20)
    procs = [ctx.Process(target=_stage, args=(stage, r, world, init, timeout, out)) for r in range(world)]
    with _main_not_reimported():
        for p in procs:
            p.start()
    worlds.join(procs, here, bound_s=hangs.hang_s(20))
    results = []
    for r in range(world):
        with open(os.path.join(out, f"result-{stage}-{r}.json")) as f:
            results.append(json.load(f))
    return results


def _ok(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert "error" not in res, f"rank {res['rank']}:\n{res['error']}"


def test_sharded_save_reshard_resume_and_failures(tmp_path):
    import torch

    import ckpt
    from ckpt._unshard import full_tensor
    from ckpt.errors import ChecksumMismatchError

    out = str(tmp_path)

    a = _run("A", 4, out)
    _ok(a)
    assert len({r["id"] for r in a}) == 1
    for r in a:
        assert "key 'x.obj'" in r["bad"], r["bad"]
        assert r["bad_listing"] == [], r["bad_listing"]  # nothing committed, no temporary left
    reader = ckpt.open(os.path.join(out, "A"))
    assert [p.name for p in reader.parts] == [f"rank-{i:05d}" for i in range(4)]
    assert reader.meta["sharded"]["world_size"] == 4
    assert reader.meta["sharded"]["mesh"]["shape"] == [4]
    assert reader.meta["sharded"]["placements"]["model.0.weight"] == ["Shard(0)"]
    for part in reader.parts:  # all seven fields in every part
        ctx = reader.context(part.name)
        assert ctx["step"] == 2 and ctx["rng"] is not None and ctx["topology"]["world_size"] == 4
        assert {"env", "commit", "lineage"} <= set(ctx)
    reader.verify()

    b = _run("B", 2, out)
    _ok(b)
    for r in b:
        assert r["A_to_2"] == [], r["A_to_2"]
        assert r["A_to_tp2"] == [], r["A_to_tp2"]
        assert r["counters"] == {"step": 2, "tokens": 64}
        assert r["exact_claim"] is False and any(d.startswith("world_size: 4 -> 2") for d in r["env_differences"])
        assert r["same_world_exact_claim"] is True
        assert r["resume_identical"] is True
        assert r["manager_resume"] == [6, True, True]

    c = _run("C", 4, out)
    _ok(c)
    for r in c:
        assert r["B_to_2x2"] == [], r["B_to_2x2"]
        if r["rank"] >= 2:  # ranks the saving job did not have: the documented rule
            assert r["initial_seed"] == r["rule_seed"]
        else:
            assert r["restored_rng"] == ["python", "numpy", "torch_cpu"]
    assert c[0]["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "tp"]}
    assert len(c[0]["placements"]) == 2

    # D: one process, no process group (M = 1)
    m, opt, _ = _build("plain", 1)
    ckpt.load(os.path.join(out, "C"), {"model": m, "optim": opt, "counters": {}}, exactness="off")
    assert _mismatches(_global(m, opt), os.path.join(out, "refB")) == []
    rc = ckpt.open(os.path.join(out, "C"))
    ref = ckpt.open(os.path.join(out, "refB")).state()["g"]
    assert torch.equal(full_tensor(rc, "model.2.weight"), ref["model.2.weight"])
    full = rc.state()
    assert torch.equal(full["optim"]["state"]["0.weight"]["exp_avg"], ref["optim.0.weight.exp_avg"])
    # ckpt inspect (a real subprocess, no torch) shows global shapes and the shard layout
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import runpy, sys; sys.argv = ['cli', 'inspect', sys.argv[1]]; sys.modules.setdefault('torch', None); runpy.run_module('cli', run_name='__main__')"
    shown = hangs.run([sys.executable, "-c", code, os.path.join(out, "C")], cwd=repo, capture_output=True, text=True, bound_s=hangs.hang_s(12))
    assert shown.returncode == 0, shown.stderr
    assert "sharded: saved on 4 rank(s), mesh 2x2 (dp, tp)" in shown.stdout
    line = next(ln for ln in shown.stdout.splitlines() if ln.strip().startswith("model.0.weight "))
    assert "[16, 8]" in line and "rank-00003" in line, line
    # a corrupted shard: verify and load fail naming the rank's file
    bad = os.path.join(out, "Cbad")
    shutil.copytree(os.path.join(out, "C"), bad)
    target = os.path.join(bad, "rank-00003.safetensors")
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError, match="rank-00003.safetensors"):
        ckpt.open(bad).verify()
    m2, opt2, _ = _build("plain", 1)
    with pytest.raises(ChecksumMismatchError, match="rank-00003.safetensors"):
        ckpt.load(bad, {"model": m2, "optim": opt2, "counters": {}}, exactness="off")

    # E: FSDP+TP -> FSDP, then a rank dies during a sharded save
    e = _run("E", 2, out)
    assert e[1].get("before_kill") and "killed_save" not in e[1], e[1]  # rank 1 died mid-write
    assert "error" not in e[0], e[0]["error"]
    assert e[0]["C_to_2"] == []
    assert e[0]["killed_save"].startswith("DistributedSaveError: sharded save failed, nothing committed"), e[0]["killed_save"]
    assert not os.path.exists(os.path.join(out, "E2"))
    # the surviving coordinator removed the temporary directory of the failed save
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-E2")], os.listdir(out)
    assert "E1" in e[0]["listing"] and "E2" not in e[0]["listing"]
    m3, opt3, _ = _build("plain", 1)
    ckpt.load(os.path.join(out, "E1"), {"model": m3, "optim": opt3}, exactness="off")
    assert _mismatches(_global(m3, opt3), os.path.join(out, "refE1")) == []
