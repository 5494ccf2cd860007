"""The simulator's own rules: faults fire where the plan says, and a power loss keeps
exactly what was made durable."""

from __future__ import annotations

import errno
import os
import random

import pytest

from ckpt.storage import LocalStorage
from tests.sim.faultfs import FaultPlan, FaultRule, FaultyStorage, SimCrash, flip_bit


def _write(fs: FaultyStorage, path: str, data: bytes, *, durable: bool = True) -> None:
    s = fs.create(path, 4096, durable=durable)
    s.write(data)
    s.close()


def test_io_faults_fire_at_their_operation(tmp_path) -> None:
    fs = FaultyStorage(LocalStorage(), FaultPlan({1: "eio", 3: "enospc"}))
    p = str(tmp_path / "f")
    s = fs.create(p, 4096)  # op 0
    with pytest.raises(OSError) as e:
        s.write(b"x")  # op 1
    assert e.value.errno == errno.EIO
    s.write(b"y")  # op 2
    with pytest.raises(OSError) as e:
        s.close()  # op 3
    assert e.value.errno == errno.ENOSPC
    assert [i for i, *_ in fs.injected] == [1, 3]


def test_a_crash_kills_every_later_operation(tmp_path) -> None:
    fs = FaultyStorage(LocalStorage(), FaultPlan.one(1, "crash"))
    fs.mkdir(str(tmp_path / "a"))
    with pytest.raises(SimCrash):
        fs.mkdir(str(tmp_path / "b"))
    with pytest.raises(SimCrash):
        fs.mkdir(str(tmp_path / "c"))  # a dead process does nothing more
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_power_loss_keeps_what_was_fsynced(tmp_path) -> None:
    inner = LocalStorage()
    for seed in range(20):
        root = tmp_path / f"r{seed}"
        root.mkdir()
        fs = FaultyStorage(inner, seed=seed, trash=str(root / ".simtrash"))
        d = str(root / "d")
        fs.mkdir(d)
        _write(fs, os.path.join(d, "durable"), b"a" * 100)
        fs.fsync_dir(d)
        fs.fsync_dir(str(root))
        _write(fs, os.path.join(d, "late"), b"b" * 100, durable=False)
        fs.rename_noreplace(d, str(root / "e"))  # never fsynced
        fs.power_loss(random.Random(seed))
        # the durable file survives whole, under one of its two possible names
        where = [p for p in (root / "d" / "durable", root / "e" / "durable") if p.exists()]
        assert len(where) == 1 and where[0].read_bytes() == b"a" * 100
        late = where[0].parent / "late"
        if late.exists():
            assert late.read_bytes() == b"b" * len(late.read_bytes())  # a prefix, never other bytes


def test_an_unsynced_removal_can_come_back(tmp_path) -> None:
    inner = LocalStorage()
    came_back = gone = 0
    for seed in range(16):
        root = tmp_path / f"r{seed}"
        root.mkdir()
        fs = FaultyStorage(inner, seed=seed, trash=str(root / ".simtrash"))
        d = str(root / "d")
        fs.mkdir(d)
        _write(fs, os.path.join(d, "f"), b"z" * 10)
        fs.fsync_dir(d)
        fs.fsync_dir(str(root))
        fs.remove_tree(d)
        assert not os.path.exists(d)
        assert fs.listdir(str(root)) == []  # the trash is invisible
        fs.power_loss(random.Random(seed))
        if os.path.exists(d):
            came_back += 1
            assert open(os.path.join(d, "f"), "rb").read() == b"z" * 10
        else:
            gone += 1
    assert came_back and gone  # both outcomes are reachable


def test_flip_bit_keeps_size_and_mtime(tmp_path) -> None:
    p = tmp_path / "f"
    p.write_bytes(bytes(64))
    st = os.stat(p)
    off, bit = flip_bit(str(p), random.Random(3))
    st2 = os.stat(p)
    assert st2.st_size == st.st_size and st2.st_mtime_ns == st.st_mtime_ns
    assert p.read_bytes()[off] == 1 << bit


@pytest.mark.parametrize("backend", ["posix", "memory"])
def test_the_commit_protocol_runs_through_the_wrapper(tmp_path, backend: str) -> None:
    """``storage.commit`` of a wrapper is the inner protocol bound to the wrapper: the
    commit's MANIFEST create, renames and fsyncs are operations the simulator sees (and can
    fail), and the part lock still keeps a late part out."""
    import torch

    import ckpt
    from ckpt.errors import DistributedUsageError
    from ckpt.storage import RenameCommit
    from ckpt.storage.memory import MemoryStorage

    inner = LocalStorage() if backend == "posix" else MemoryStorage()
    root = str(tmp_path) if backend == "posix" else "/sim"
    fs = FaultyStorage(inner)
    assert isinstance(fs.commit, RenameCommit) and fs.commit.storage is fs
    ckpt.save(f"{root}/c", {"w": torch.ones(2)}, storage=fs)
    seen = [(name, os.path.basename(path)) for _, name, path in fs.log]
    assert ("create", "MANIFEST") in seen and ("rename", "c") in seen and ("fsync_dir", os.path.basename(root)) in seen
    # a fault at the commit's rename is injected like any other
    at = next(i for i, (name, _) in enumerate(seen) if name == "rename")
    failing = FaultyStorage(inner, FaultPlan.one(at, "eio"))
    with pytest.raises(OSError):
        ckpt.save(f"{root}/d", {"w": torch.ones(2)}, storage=failing)
    assert [(kind, name) for _, kind, name, _ in failing.injected] == [("eio", "rename")]
    assert not inner.exists(f"{root}/d")
    pending = ckpt.begin(f"{root}/e", storage=fs)
    ckpt.commit(pending, [ckpt.write_part(pending, "rank-00000", {"w": torch.ones(1)}, storage=fs)], storage=fs)
    with pytest.raises(DistributedUsageError):
        ckpt.write_part(pending, "rank-00001", {"w": torch.ones(1)}, storage=fs)


def test_rules_fire_by_operation_and_path_and_can_be_switched(tmp_path) -> None:
    rule = FaultRule("enospc", "create", ".bin", skip=1, times=None, armed=False)
    fs = FaultyStorage(LocalStorage(), FaultPlan(rules=[rule, FaultRule("refuse", "link")]))
    _write(fs, str(tmp_path / "a.bin"), b"a")  # disarmed: not even counted
    rule.armed = True
    _write(fs, str(tmp_path / "b.bin"), b"b")  # the one skipped
    _write(fs, str(tmp_path / "c.txt"), b"c")  # another suffix
    for name in ("d.bin", "e.bin"):  # times=None: every one after the skip
        with pytest.raises(OSError) as e:
            fs.create(str(tmp_path / name), 4096)
        assert e.value.errno == errno.ENOSPC and "No space left on device" in str(e.value)
    assert fs.link(str(tmp_path / "a.bin"), str(tmp_path / "l1")) is False  # refused once (times=1)
    assert not os.path.exists(tmp_path / "l1")
    assert fs.link(str(tmp_path / "a.bin"), str(tmp_path / "l2")) is True
    with pytest.raises(ValueError, match="cannot be refused"):
        FaultyStorage(LocalStorage(), FaultPlan.on("refuse", "mkdir")).mkdir(str(tmp_path / "m"))


def test_a_rule_may_name_several_operations_and_kill_after_its_operation(tmp_path) -> None:
    names = ("mkdir", "fsync_dir")
    fs = FaultyStorage(LocalStorage(), FaultPlan(rules=[FaultRule("crash", names, skip=2, after=True)]))
    fs.mkdir(str(tmp_path / "a"))  # named: seen 1
    _write(fs, str(tmp_path / "a" / "f"), b"x")  # create, write, close: not named
    fs.fsync_dir(str(tmp_path / "a"))  # named: seen 2
    fs.mkdir(str(tmp_path / "b"))  # named: seen 3, fires after it is done
    assert os.path.isdir(tmp_path / "b") and not fs.crashed
    with pytest.raises(SimCrash, match=r"after operation \d+ \(mkdir"):
        fs.create(str(tmp_path / "b" / "g"), 4096)  # the next operation, whatever it is, never starts
    assert not os.path.exists(tmp_path / "b" / "g") and fs.crashed
    with pytest.raises(SimCrash):
        fs.mkdir(str(tmp_path / "c"))
    assert [(kind, name) for _, kind, name, _ in fs.injected] == [("crash", "mkdir")]
    with pytest.raises(ValueError, match="crash or sigkill"):
        FaultRule("eio", "mkdir", after=True)
