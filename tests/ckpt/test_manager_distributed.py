"""ckpt.distributed and the manager on 2 real gloo ranks (localhost, forked processes)."""

from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest

from ckpt.testing.resume_entry import _forkserver, _main_not_reimported
from hangs import hang_s
import worlds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _worker(rank: int, init: str, timeout: datetime.timedelta, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ckpt.distributed import DistributedCheckpointer, DistributedSaveError
    from ckpt.manager import CheckpointManager, list_checkpoints
    from ckpt.reader import CheckpointReader

    result: dict = {"rank": rank}
    try:
        worlds.arm(out, rank)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timeout)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)  # identical on both ranks, as DDP keeps it
        per_rank = {"r": torch.tensor([rank])}
        dc = DistributedCheckpointer()

        # 1. per-rank parts, replicated written once, per-rank RNG
        torch.manual_seed(100 + rank)
        expect = torch.rand(4)
        torch.manual_seed(100 + rank)
        path = os.path.join(out, "ck")
        dc.save(path, {"model": model, "per": per_rank}, replicated=["model"], step=1)
        torch.rand(4)
        with torch.no_grad():
            model.weight.zero_()
        got = dc.load(path, {"model": model, "per": per_rank})
        result["rng_exact"] = torch.equal(torch.rand(4), expect)
        result["part"] = got.part
        result["weight_restored"] = bool(model.weight.abs().sum() > 0)
        r = CheckpointReader(path)
        result["parts"] = [p.name for p in r.parts]
        result["tensor_keys"] = {p.name: [t.key for t in p.tensors] for p in r.parts}

        # 2. one rank fails: nothing is committed, both ranks raise
        bad = {"model": model, "per": per_rank}
        if rank == 1:
            bad = {"model": model, "per": {"x": object()}}
        try:
            dc.save(os.path.join(out, "bad"), bad, replicated=["model"], step=2)
            result["bad"] = "committed"
        except DistributedSaveError as e:
            result["bad"] = str(e)
        result["bad_listing"] = sorted(n for n in os.listdir(out) if "bad" in n)

        # 3. the manager: async saves, a stop request seen on one rank only
        run = os.path.join(out, "run")
        mgr = CheckpointManager(run, {"model": model, "per": per_rank}, every_steps=2, async_save=True, replicated=["model"], signals=())
        for step in (1, 2, 3):
            if step == 3 and rank == 1:
                mgr.request_stop()
            mgr.after_step(step)
        result["stopped"] = mgr.should_stop
        mgr.close()
        result["run"] = [c.name for c in list_checkpoints(run)]
        mgr2 = CheckpointManager(run, {"model": model, "per": {"r": torch.tensor([-1])}}, replicated=["model"], signals=())
        res = mgr2.resume()
        result["resumed_step"] = res.step
        result["resumed_per"] = int(mgr2.state["per"]["r"].item())
        mgr2.close()

        # 4. format 2.0 on two ranks: parts listed by reference; dedup and compression through the manager
        refs = os.path.join(out, "refs")
        dc.save(refs, {"model": model, "per": per_rank}, replicated=["model"], step=1, part_manifests=True)
        result["refs"] = CheckpointReader(refs).manifest.parts.refs
        big = {"frozen": torch.arange(20000, dtype=torch.float32) + rank, "moving": torch.zeros(3)}
        run2 = os.path.join(out, "run2")
        mgr3 = CheckpointManager(run2, {"model": model, "per": per_rank, "big": big}, replicated=["model"], signals=(),
                                 dedup=True, compress=True, ledger=False)
        mgr3.save(1)
        big["moving"] += 1
        mgr3.save(2)
        mgr3.close()
        r2 = CheckpointReader(os.path.join(run2, "step-00000002"))
        r2.verify()
        result["shared"] = sorted(f.name for f in r2.manifest.files if f.origin == "step-00000001")
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)


def test_two_ranks_save_load_commit_and_manager(tmp_path):
    ctx = _forkserver()
    init, timeout = worlds.file_init(tmp_path), worlds.pg_timeout(10)
    procs = [ctx.Process(target=_worker, args=(r, init, timeout, str(tmp_path))) for r in range(2)]
    with _main_not_reimported():
        for p in procs:
            p.start()
    worlds.join(procs, tmp_path, bound_s=hang_s(10))
    results = []
    for r in range(2):
        with open(tmp_path / f"result-{r}.json") as f:
            results.append(json.load(f))
    for res in results:
        assert "error" not in res, res["error"]
    r0, r1 = results
    assert r0["parts"] == ["rank-00000", "rank-00001"]
    # Replicated weights live once, in rank 0's part; rank 1 holds only its own tensors.
    assert sorted(r0["tensor_keys"]["rank-00000"]) == ["model/bias", "model/weight", "per/r"]
    assert r0["tensor_keys"]["rank-00001"] == ["per/r"]
    assert r0["part"] == "rank-00000" and r1["part"] == "rank-00001"
    assert r0["rng_exact"] and r1["rng_exact"]  # each rank's own stream
    assert r0["weight_restored"] and r1["weight_restored"]  # rank 1 resolved the replica
    for res in results:
        assert res["bad"].startswith("distributed save failed, nothing committed: rank 1: UnsupportedValueError")
        assert res["bad_listing"] == []  # no checkpoint, no temporary directory
        assert res["stopped"] is True  # rank 1's stop request reached rank 0
        assert res["run"] == ["step-00000002", "step-00000003"]
        assert res["resumed_step"] == 3
    assert r0["resumed_per"] == 0 and r1["resumed_per"] == 1
    assert r0["refs"] == 2
    # each rank shared its own packed file (the frozen tensor), named after its content
    assert len(r0["shared"]) == 2 and [n.split("-")[1] for n in r0["shared"]] == ["00000", "00001"]
    assert all(n.endswith(".bpz") for n in r0["shared"])
