"""MemoryStorage: the same contracts as a disk, through the same commit protocol.

Save, load, verify, a manager's retention and resume, crash recovery, dedup links and
both locks run on it, and nothing is written to the local filesystem."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointManager, RetentionPolicy, list_checkpoints
from ckpt.knobs import override
from ckpt.errors import (
    CheckpointExistsError,
    DistributedUsageError,
    RunDirLockedError,
    SaveConflictError,
    UnexpectedFileError,
)
from ckpt.storage import RenameCommit
from ckpt.storage.memory import MemoryCommit, MemoryStorage
from ckpt.writer import begin, commit, part_name_for_rank, recover, write_part
import hangs


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = m(torch.randn(5, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _equal_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_load_verify_round_trip_touches_no_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    mem = MemoryStorage()
    assert isinstance(mem.commit, MemoryCommit) and isinstance(mem.commit, RenameCommit)
    m = _model(0)
    opt = torch.optim.Adam(m.parameters())
    _step(m, opt)
    info = ckpt.save("/exp/step-1", {"model": m, "opt": opt}, step=1, storage=mem, dedup=True)
    assert info.path == "/exp/step-1" and mem.listdir("/exp") == ["step-1"]  # the temporary dir is gone
    assert mem.isfile("/exp/step-1/MANIFEST")
    assert not os.listdir(tmp_path) and not os.path.exists("/exp")  # nothing on the local disk

    reader = ckpt.open("memory:///exp/step-1", storage=mem)
    report = reader.verify()
    assert report.files >= 2 and report.bytes == info.bytes
    m2 = _model(1)
    opt2 = torch.optim.Adam(m2.parameters())
    from ckpt._load import load_into

    load_into(reader, {"model": m2, "opt": opt2})
    assert _equal_state(m, m2)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])

    # a damaged byte is found by verify, as on disk
    f = mem._file("/exp/step-1/" + reader.part().files[1].name)
    f.data[-1] ^= 1
    with pytest.raises(ckpt.errors.CkptError):
        ckpt.open("/exp/step-1", storage=mem).verify()


def test_manager_retention_resume_and_run_lock() -> None:
    mem = MemoryStorage()
    m = _model(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mgr = CheckpointManager("/runs/a", {"model": m, "opt": opt}, every_steps=1,
                            retention=RetentionPolicy(keep_last=2), storage=mem, ledger=False)
    try:
        with pytest.raises(RunDirLockedError):  # one writer per run directory, in memory too
            CheckpointManager("/runs/a", {"model": _model(3)}, storage=mem, ledger=False)
        for step in range(1, 6):
            _step(m, opt)
            mgr.save(step, block=True)
        kept = [r.name for r in list_checkpoints("/runs/a", storage=mem)]
        assert kept == ["step-00000004", "step-00000005"], kept
        assert [n for n in mem.listdir("/runs/a") if n.startswith(".tmp-")] == []  # retention left no trash
    finally:
        mgr.close()

    m2 = _model(7)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    mgr2 = CheckpointManager("/runs/a", {"model": m2, "opt": opt2}, storage=mem, ledger=False)  # the lock was released
    try:
        res = mgr2.resume()
        assert res is not None and res.step == 5
        assert _equal_state(m, m2)
    finally:
        mgr2.close()


def test_run_lock_wait_takes_over_when_the_holder_releases() -> None:
    mem = MemoryStorage()
    held = mem.commit.run_lock("/runs/b", owner={"run_id": "first"})
    got = threading.Event()

    def second() -> None:
        mem.commit.run_lock("/runs/b", wait=True).release()
        got.set()

    t = threading.Thread(target=second)
    t.start()
    assert not got.wait(0.2)  # still held
    held.release()
    assert got.wait(hangs.hang_s(3))
    t.join(hangs.hang_s(3))
    held.release()  # idempotent


def test_crash_leftovers_are_recovered_and_overwrite_exchanges() -> None:
    mem = MemoryStorage()
    ckpt.save("/r/step-00000001", {"w": torch.arange(4.0)}, step=1, storage=mem)
    # a save that died before its commit: its temporary directory stays
    pending = begin("/r/step-00000002", storage=mem)
    write_part(pending, part_name_for_rank(0), {"w": torch.ones(3)}, step=2, storage=mem)
    # an overwrite that died between moving the old copy aside and renaming the new one in
    mem.rename_dir("/r/step-00000001", "/r/.tmp-step-00000001-0123456789ab.old")
    rec = recover("/r", storage=mem)
    assert rec.restored == ((".tmp-step-00000001-0123456789ab.old", "step-00000001"),)
    assert rec.removed == ()  # the crashed save changed just now: a live writer may still commit it
    with override(orphan_grace_s=0):
        rec = recover("/r", storage=mem)
    assert rec.removed == (os.path.basename(pending.tmp_dir),)
    assert mem.listdir("/r") == ["step-00000001"]
    # overwrite: one atomic exchange, the old copy removed
    with pytest.raises(CheckpointExistsError):
        ckpt.save("/r/step-00000001", {"w": torch.zeros(2)}, storage=mem)
    ckpt.save("/r/step-00000001", {"w": torch.zeros(2)}, storage=mem, overwrite=True)
    assert mem.listdir("/r") == ["step-00000001"]
    assert torch.equal(ckpt.open("/r/step-00000001", storage=mem).tensor("w"), torch.zeros(2))


def test_part_lock_keeps_a_late_part_out_of_a_committed_checkpoint() -> None:
    mem = MemoryStorage()
    pending = begin("/c/step-1", storage=mem)
    p0 = write_part(pending, "rank-00000", {"w": torch.ones(2)}, storage=mem)
    commit(pending, [p0], storage=mem)
    with pytest.raises(DistributedUsageError, match="temporary directory is gone"):
        write_part(pending, "rank-00001", {"w": torch.ones(2)}, storage=mem)
    reader = ckpt.open("/c/step-1", storage=mem)
    assert [p.name for p in reader.parts] == ["rank-00000"]
    reader.verify()


def test_a_file_the_manifest_does_not_name_is_refused() -> None:
    mem = MemoryStorage()
    ckpt.save("/d/step-1", {"w": torch.ones(2)}, storage=mem)
    mem.create("/d/step-1/stray.bin", 4096).close()
    with pytest.raises(UnexpectedFileError):
        ckpt.open("/d/step-1", storage=mem)


def test_dedup_shares_unchanged_files_by_link() -> None:
    mem = MemoryStorage()
    frozen = {"emb": torch.randn(64, 64)}
    ckpt.save("/e/step-1", {"m": frozen}, storage=mem, dedup=True)
    ckpt.save("/e/step-2", {"m": frozen}, storage=mem, dedup_from="/e/step-1")
    one = ckpt.open("/e/step-1", storage=mem)
    two = ckpt.open("/e/step-2", storage=mem)
    shared = [f for f in two.part().files if f.origin == "step-1"]
    assert shared, [f.name for f in two.part().files]
    a = mem.lstat("/e/step-1/" + shared[0].name)
    b = mem.lstat("/e/step-2/" + shared[0].name)
    assert a.st_ino == b.st_ino and a.st_nlink == 2
    one.verify()
    two.verify()
    assert torch.equal(two.tensor("m/emb"), frozen["emb"])


def test_recovery_leaves_a_save_whose_part_writer_holds_the_lock() -> None:
    mem = MemoryStorage()
    pending = begin("/g/step-1", storage=mem)
    with override(orphan_grace_s=0):
        with mem.commit.part_lock(pending, exclusive=False):  # a part being written
            assert recover("/g", storage=mem).removed == ()
            assert mem.isdir(pending.tmp_dir)
        assert recover("/g", storage=mem).removed == (os.path.basename(pending.tmp_dir),)
    with pytest.raises(SaveConflictError):  # its commit finds the directory gone
        commit(pending, [], storage=mem)
