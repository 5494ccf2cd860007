"""The fixed cost of a small checkpoint (issue 27 item 1), and what keeps it safe.

A small ``ckpt.save`` commits *fused* (spec §10.7): its part files are sealed, MANIFEST
is written from their digests, and every fsync of the commit is issued together (one
wait, then the rename and the parent's fsync), instead of the data files' fsyncs first.
MANIFEST may then be durable before the data files, so recovery re-hashes a temporary
copy that small before it publishes it (§10.3). The waits overlap on reused helper
threads: starting a thread blocks until it runs, a scheduling round trip per save on a
busy machine.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
import ckpt.storage.commit
from ckpt.errors import ChecksumMismatchError
from ckpt.knobs import override
from ckpt.storage.commit import FUSED_COMMIT_MAX
from ckpt.writer import is_complete, recover
import hangs


def _state(v: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((256,), v), "b": torch.arange(8, dtype=torch.float64)}, "opt": {"lr": 0.1}}


def _as_torn_copy(committed: Path, run: Path, hexid: str) -> Path:
    """Move a committed checkpoint to a temporary name, as a fused commit that lost
    power after MANIFEST was durable leaves it (the rename not yet durable)."""
    run.mkdir(exist_ok=True)
    tmp = run / f".tmp-{committed.name}-{hexid}"
    os.rename(committed, tmp)
    return tmp


def test_recovery_rehashes_a_small_copy_and_drops_one_whose_bytes_are_not_durable(tmp_path: Path) -> None:
    """A file of the right size holding zeros or old blocks (its fsync had not returned)
    beside a durable MANIFEST: the sizes match, only the digests tell. Recovery must not
    publish it; the intact copy of the same save is published."""
    src = tmp_path / "src"
    ckpt.save(src / "step-00000001", _state(2.0), step=1)
    run = tmp_path / "run"
    torn = _as_torn_copy(src / "step-00000001", run, "aaaaaaaaaaaa")
    tensors = torn / "rank-00000.safetensors"
    size = tensors.stat().st_size
    with open(tensors, "r+b") as f:  # the data region reads back as zeros: not written back
        f.seek(size - 512)
        f.write(bytes(512))
    assert tensors.stat().st_size == size
    assert not is_complete(str(torn))
    with override(orphan_grace_s=0):  # the copy is seconds old: no longer in a writer's grace
        rec = recover(run)
    assert rec.restored == () and rec.removed == (torn.name,)
    assert os.listdir(run) == []

    ckpt.save(src / "step-00000001", _state(3.0), step=1)
    intact = _as_torn_copy(src / "step-00000001", run, "bbbbbbbbbbbb")
    assert is_complete(str(intact))
    rec = recover(run)
    assert rec.restored == ((intact.name, "step-00000001"),)
    assert torch.equal(ckpt.open(run / "step-00000001").state()["model"]["w"], torch.full((256,), 3.0))


def test_recovery_checks_only_sizes_of_a_copy_above_the_fused_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the limit a save keeps the strict order (files durable before MANIFEST
    exists), so recovery does not re-hash: a resume verifies the digests on load."""
    src = tmp_path / "src"
    monkeypatch.setattr(ckpt.storage.commit, "FUSED_COMMIT_MAX", 0)
    ckpt.save(src / "c", _state(), step=1)
    copy = _as_torn_copy(src / "c", tmp_path / "run", "cccccccccccc")
    with open(copy / "rank-00000.safetensors", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(bytes(8))
    assert is_complete(str(copy))
    recover(tmp_path / "run")
    with pytest.raises(ChecksumMismatchError):
        ckpt.open(tmp_path / "run" / "c").verify()


def test_a_small_save_starts_no_thread_once_helpers_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt.save(tmp_path / "warm", _state(), step=0)  # the helpers' first use starts them
    started: list[str] = []
    real = threading.Thread.start

    def counting(self: threading.Thread) -> None:
        started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", counting)
    for i in range(3):
        ckpt.save(tmp_path / f"c{i}", _state(float(i)), step=i)
    assert started == []
    for i in range(3):
        assert torch.equal(ckpt.open(tmp_path / f"c{i}").state()["model"]["w"], torch.full((256,), float(i)))


@pytest.mark.parametrize("victim", ["rank-00000.safetensors", "rank-00000.state.msgpack.zst", "MANIFEST", "<dir>"])
def test_a_failed_fsync_in_a_fused_commit_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    real = os.fsync

    def failing(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        name = os.path.basename(target)
        if (victim == "<dir>" and name.startswith(".tmp-c-")) or name == victim:
            raise OSError(errno.EIO, "injected", target)
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError) as info:
        ckpt.save(tmp_path / "c", _state(), step=1)
    assert info.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []  # nothing published, the temporary directory removed
    monkeypatch.setattr(os, "fsync", real)
    ckpt.save(tmp_path / "c", _state(4.0), step=1)  # the helpers survived the failure
    assert torch.equal(ckpt.open(tmp_path / "c").state()["model"]["w"], torch.full((256,), 4.0))


def test_a_forked_child_saves_with_helpers_of_its_own(tmp_path: Path) -> None:
    """A DataLoader worker is forked with the parent's idle helpers on record, but their
    threads do not exist in it: handing them work would wait forever."""
    ckpt.save(tmp_path / "parent", _state(), step=0)
    child_state = _state(5.0)  # built here: the child runs as little torch as it can
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether its save committed
        code = 1
        try:
            ckpt.save(tmp_path / "child", child_state, step=1)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + hangs.hang_s(30)  # a hang detector, far above a healthy save
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's save hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(ckpt.open(tmp_path / "child").state()["model"]["w"], torch.full((256,), 5.0))


def test_the_fused_limit_is_the_one_the_spec_names() -> None:
    assert FUSED_COMMIT_MAX == 64 << 20
    spec = Path(__file__).resolve().parents[2] / "spec" / "checkpoint-format.md"
    assert "64 MiB" in spec.read_text().split("### 10.7", 1)[1].split("## 11.", 1)[0]


def test_a_manifest_last_commit_makes_unsynced_parts_durable_before_the_manifest_put() -> None:
    """An object store's MANIFEST put makes the checkpoint visible at once: a sealed part
    file handed to it must be closed (durable) before that put, never beside it."""
    from ckpt.storage.commit import ManifestLastCommit, PendingCheckpoint

    events: list[str] = []

    class Sink:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> tuple[int, bytes]:
            events.append(f"close {self.name}")
            return 0, b""

    class Store:
        def publish(self, pending: PendingCheckpoint, manifest: bytes, *, fence: Any = None) -> None:
            events.append("put MANIFEST")

    pending = PendingCheckpoint(final="s3://b/run/c", tmp_dir="s3://b/run/c", tag=".aaaaaaaaaaaa")
    ManifestLastCommit(Store()).publish(pending, b"m", (), unsynced=[Sink("a"), Sink("b")])  # type: ignore[arg-type]
    assert sorted(events[:2]) == ["close a", "close b"] and events[2:] == ["put MANIFEST"]
