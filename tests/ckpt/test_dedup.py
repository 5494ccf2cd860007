"""Dedup of unchanged tensors across the checkpoints of a run (format 2.0 shared files, §V.4).

A save whose tensors mostly did not change shares the previous checkpoint's files by hard
link and writes only the rest; every checkpoint stays loadable on its own terms (deleting the
one that wrote a file leaves the bytes to the others); a file that cannot be linked is written;
retention never removes bytes a kept checkpoint needs; verify checks every shared byte and tensor
digest; and a process SIGKILLed at any step of a dedup save and its retention leaves only
complete checkpoints whose every file is present.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt import CheckpointManager, RetentionPolicy
from ckpt.storage import LocalStorage
from tests.sim.faultfs import FaultPlan, FaultyStorage
import hangs

REPO = Path(__file__).resolve().parents[2]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(2000, 128), torch.nn.Linear(128, 16))
    m[0].weight.requires_grad_(False)  # frozen: 90 %+ of the bytes
    return m


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 2000, (8,), generator=g)
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _written(path: str) -> int:
    """Bytes the save of ``path`` wrote: every file it did not share (and its MANIFEST)."""
    r = ckpt.open(path)
    own = sum(f.size for f in r.manifest.files if f.origin is None)
    return own + os.path.getsize(os.path.join(path, "MANIFEST"))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_save_of_mostly_unchanged_tensors_writes_only_the_changed_ones(tmp_path: Path) -> None:
    m = _model()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    mgr = CheckpointManager(tmp_path, {"model": m, "optim": opt}, dedup=True, retention=RetentionPolicy(keep_last=1),
                            signals=(), ledger=False)
    mgr.save(1)
    full = _written(str(tmp_path / "step-00000001"))
    for step in (2, 3, 4):
        _train(m, opt, step)
        mgr.save(step)
    mgr.close()
    newest = str(tmp_path / "step-00000004")
    assert sorted(os.listdir(tmp_path)) == [".ckpt-writer.lock", "step-00000004"]  # the others retired
    r = ckpt.open(newest)
    assert r.manifest.version == (2, 0)
    shared = [f for f in r.manifest.files if f.origin is not None]
    assert [f.origin for f in shared] == ["step-00000001"]  # the frozen embedding, written once, deleted since
    assert os.stat(os.path.join(newest, shared[0].name)).st_nlink == 1  # its only name now
    assert _written(newest) <= 0.15 * full
    assert r.verify().shared == 1
    # the newest stands on its own terms: it loads exactly into fresh objects
    m2 = _model(seed=1)
    opt2 = torch.optim.SGD([p for p in m2.parameters() if p.requires_grad], lr=0.1)
    ckpt.load(newest, {"model": m2, "optim": opt2}, exactness="off")
    assert _equal(m2.state_dict(), m.state_dict())


def test_dedup_with_compression_and_a_moving_tensor(tmp_path: Path) -> None:
    frozen = torch.randn(50000) * 0.02
    ema = torch.randn(20000) * 0.02
    paths = []
    prev = None
    for step in range(1, 6):
        if step == 3:
            ema.mul_(0.5)  # an EMA copy updated rarely
        state = {"base": {"w": frozen}, "ema": {"w": ema}, "head": {"w": torch.full((100,), float(step))}}
        p = tmp_path / f"step-{step:08d}"
        ckpt.save(p, state, step=step, compress=True, dedup=True, dedup_from=prev)
        prev = p
        paths.append((p, {k: v["w"].clone() for k, v in state.items()}))
    origins = {f.name: f.origin for f in ckpt.open(paths[-1][0]).manifest.files}
    assert sorted(o for o in origins.values() if o) == ["step-00000001", "step-00000003"]  # base; ema since step 3
    for p, want in paths:
        got = ckpt.open(p).state()
        assert all(torch.equal(got[k]["w"], want[k]) for k in want), p
        ckpt.open(p).verify()


def _no_links() -> FaultyStorage:
    """An object store without server-side copy (spec/format-2.md §V.4.5): no link is made."""
    return FaultyStorage(LocalStorage(), FaultPlan.on("refuse", "link", times=None))


def test_a_file_that_cannot_be_linked_is_written_instead(tmp_path: Path) -> None:
    state = {"a": {"w": torch.randn(30000)}, "b": {"w": torch.randn(10)}}
    ckpt.save(tmp_path / "s1", state, dedup=True)
    ckpt.save(tmp_path / "s2", state, dedup_from=tmp_path / "s1", storage=_no_links())
    r = ckpt.open(tmp_path / "s2")
    assert not any(f.origin for f in r.manifest.files) and _written(r.path) > 100_000
    assert all(torch.equal(r.state()[k]["w"], state[k]["w"]) for k in state)
    # and a source that is gone (removed by hand) is no reason to fail either
    ckpt.save(tmp_path / "s3", state, dedup=True)
    src = tmp_path / "s3"
    victim = next(n for n in os.listdir(src) if n.endswith(".safetensors"))
    os.rename(src / victim, tmp_path / "elsewhere")
    info = ckpt.save(tmp_path / "s4", state, dedup_from=src)
    assert not any(f.origin for f in info.manifest.files)


def test_a_mostly_stale_file_is_not_kept_alive(tmp_path: Path) -> None:
    big = torch.randn(40000)
    ckpt.save(tmp_path / "s1", {"m": {"big": big, "small": torch.ones(10)}}, dedup=True)
    # now only the small tensor is unchanged: sharing its file would keep 160 KB of stale bytes alive
    info = ckpt.save(tmp_path / "s2", {"m": {"big": big + 1, "small": torch.ones(10)}}, dedup_from=tmp_path / "s1")
    assert not any(f.origin for f in info.manifest.files)


def test_verify_names_a_shared_file_damaged_underneath_every_checkpoint_that_links_it(tmp_path: Path) -> None:
    state = {"m": {"w": torch.randn(30000), "v": torch.zeros(3)}}
    ckpt.save(tmp_path / "s1", state, dedup=True)
    state["m"]["v"] += 1
    ckpt.save(tmp_path / "s2", state, dedup_from=tmp_path / "s1")
    shared = next(f for f in ckpt.open(tmp_path / "s2").manifest.files if f.origin)
    data = bytearray((tmp_path / "s2" / shared.name).read_bytes())
    data[-5] ^= 1
    with open(tmp_path / "s2" / shared.name, "r+b") as f:  # in place: both names see it
        f.write(data)
    for name in ("s1", "s2"):
        with pytest.raises(ckpt.errors.ChecksumMismatchError) as ei:
            ckpt.open(tmp_path / name).verify()
        assert shared.name in str(ei.value)
    out = hangs.run([sys.executable, "-m", "ckpt_cli.main", "verify", str(tmp_path / "s2")], cwd=REPO,
                    bound_s=hangs.hang_s(6))
    assert out.returncode == 3 and shared.name in out.stderr


# --- SIGKILL at every step of a dedup save and its retention -------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt
    from ckpt.storage import LocalStorage
    from tests.sim.faultfs import FaultPlan, FaultRule, FaultyStorage

    run, kill_at = sys.argv[1], int(sys.argv[2])

    # The operations that change the tree, each with an instant before it and one after it
    # (a kill between two of them): an odd kill_at is the instant before one, an even the
    # one after it; 0 never kills.
    changes = ("create", "link", "mkdir", "rename", "exchange", "remove_tree", "fsync_dir")
    kill = [FaultRule("sigkill", changes, skip=(kill_at - 1) // 2, after=kill_at % 2 == 0)] if kill_at else []
    dying = FaultyStorage(LocalStorage(), FaultPlan(rules=kill))

    def state_at(step):
        return {"base": {"w": torch.arange(60000, dtype=torch.float32)},  # frozen: never changes
                "ema": {"w": torch.full((20000,), float(step // 3))},      # changes every third step (packed)
                "head": {"w": torch.full((64,), float(step))}}

    holder = {k: {"w": v["w"].clone()} for k, v in state_at(0).items()}
    mgr = ckpt.CheckpointManager(run, holder, dedup=True, compress=["ema"], signals=(), ledger=False,
                                 retention=ckpt.RetentionPolicy(keep_last=2), storage=dying)
    res = mgr.resume(exactness="off")
    start = res.step if res is not None else 0
    for k, v in state_at(start).items():  # what was resumed is what that step saved
        assert torch.equal(holder[k]["w"], v["w"]), (start, k)
    for step in range(start + 1, start + 8):
        for k, v in state_at(step).items():
            holder[k]["w"].copy_(v["w"])
        mgr.save(step)
    mgr.close()
    print("done", start)
    """
)


def _check_run(run: Path) -> None:
    """Every committed checkpoint is complete (every shared file present) and exact."""
    for name in sorted(os.listdir(run)):
        if not name.startswith("step-") or not os.path.exists(run / name / "MANIFEST"):
            continue
        r = ckpt.open(run / name)  # a missing (dangling) file would raise here
        r.verify()
        step = int(name[5:])
        got = r.state()
        assert torch.equal(got["head"]["w"], torch.full((64,), float(step))), name
        assert torch.equal(got["ema"]["w"], torch.full((20000,), float(step // 3))), name


@pytest.mark.slow
def test_sigkill_at_any_step_of_a_dedup_save_leaves_no_dangling_reference(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # A save here is 14-24 storage operations (mkdir, links, creates, directory fsyncs, the publishing
    # rename, retention's rename and remove), each counted before and after; every child starts
    # with recovery and a resume, so these points fall in every phase of several saves in a row.
    # The children clean what the killed ones left at once (no grace: no other writer here).
    env = {**os.environ, "CKPT_ORPHAN_GRACE_S": "0"}
    for kill_at in (3, 9, 16, 24, 33, 45):
        out = hangs.run([sys.executable, "-c", _CHILD, str(run), str(kill_at)], capture_output=True, text=True,
                        cwd=REPO, bound_s=hangs.hang_s(30), env=env)
        assert out.returncode == -9, (kill_at, out.returncode, out.stdout, out.stderr[-2000:])
        _check_run(run)
    out = hangs.run([sys.executable, "-c", _CHILD, str(run), "0"], capture_output=True, text=True, cwd=REPO, bound_s=hangs.hang_s(30),
                    env=env)
    assert out.returncode == 0 and out.stdout.startswith("done"), out.stderr[-2000:]
    _check_run(run)
    names = sorted(n for n in os.listdir(run) if n.startswith("step-"))
    assert len(names) == 2 and not [n for n in os.listdir(run) if n.startswith(".tmp-")]
    assert any(f.origin for f in ckpt.open(run / names[-1]).manifest.files)  # still sharing after all the kills
    shutil.rmtree(run / names[0])
    _check_run(run)


def test_compression_and_dedup_on_an_object_store(s3: Any) -> None:
    """An S3-compatible server (moto): compressed, deduped saves through the manager load
    exactly; a backend without links or server-side copy writes the bytes (§V.4.5)."""
    state = {"base": {"w": torch.randn(30000) * 0.02}, "head": {"w": torch.zeros(8)}}
    mgr = CheckpointManager(s3.url("run"), state, compress=True, dedup=True, signals=(), ledger=False)
    mgr.save(1)
    state["head"]["w"] += 1
    mgr.save(2)
    mgr.close()
    r = ckpt.open(s3.url("run/step-00000002"))
    assert r.manifest.version == (2, 0) and any(t.encoding for t in r.part().tensors)
    r.verify()
    got = r.state()
    assert torch.equal(got["base"]["w"], state["base"]["w"]) and torch.equal(got["head"]["w"], state["head"]["w"])
    shared = [f for f in r.manifest.files if f.origin]
    assert bool(shared) == callable(getattr(s3.storage(), "link", None))


def test_files_are_shared_only_within_one_run_directory(tmp_path: Path) -> None:
    state = {"m": {"w": torch.randn(30000)}}
    ckpt.save(tmp_path / "a" / "s1", state, dedup=True)
    info = ckpt.save(tmp_path / "b" / "s2", state, dedup_from=tmp_path / "a" / "s1")  # another run: written
    assert not any(f.origin for f in info.manifest.files)
    same = ckpt.save(tmp_path / "a" / "s2", state, dedup_from=tmp_path / "a" / "s1")
    assert [f.origin for f in same.manifest.files if f.origin] == ["s1"]
