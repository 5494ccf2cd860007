"""Multi-writer rules on a real S3 server (moto's, tests/s3server.py) and on local disk.

The run lock of an object store is a lease (ckpt/storage/_objlock.py, spec
object-storage.md §O.6): a holder in another PID namespace of this host (a container
with host networking: same hostname, same boot id, a pid that means nothing here) keeps
the run while it renews; a contender takes it over only after the lease expired, and
the writer that lost it commits and deletes nothing. Cleanup at a manager's start leaves
a concurrent save's files alone, and a save whose files were removed anyway fails with
``SaveConflictError`` instead of committing a MANIFEST that names missing files.

Time is a logical clock injected into the lease code: no test sleeps for a verdict;
the only real waits are generous hang detectors on events.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable

import pytest
import torch

import ckpt
from ckpt import knobs
from ckpt.errors import BackgroundSaveError, LeaseLostError, RunDirLockedError, SaveConflictError
from ckpt.manager import CheckpointManager, RetentionPolicy, list_checkpoints
from ckpt.writer import begin, commit, recover, write_part
from hangs import hang_s

pytest.importorskip("obstore", reason="the s3 extra is not installed (pip install 'ckpt-replay[s3]')")
from ckpt.storage import _objlock  # noqa: E402
import hangs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG = hang_s(12.0, floor_s=120.0)  # an event not seen by then will not come: a hang detector (scaled), not a verdict

pytestmark = pytest.mark.filterwarnings("ignore::ckpt.ledger.ResumeVerificationWarning")


class ManualClock:
    """A logical clock: time moves only when the test calls ``advance``."""

    def __init__(self) -> None:
        self._t = 0.0
        self._cv = threading.Condition()
        self.asleep: dict[int, float] = {}  # thread -> the time it sleeps until

    def now(self) -> float:
        with self._cv:
            return self._t

    def wall(self) -> float:
        return 1.9e9 + self.now()

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        with self._cv:
            end = self._t + seconds
            me = threading.get_ident()
            self.asleep[me] = end
            try:
                while self._t < end and not (stop is not None and stop.is_set()):
                    self._cv.wait(0.05)  # a stop is an Event, not a notify: look at it often
            finally:
                self.asleep.pop(me, None)
            return stop is not None and stop.is_set()

    def advance(self, dt: float) -> None:
        with self._cv:
            self._t += dt
            self._cv.notify_all()


def _until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG
    while not pred():
        assert time.monotonic() < deadline, f"hang: never saw {what}"
        time.sleep(0.01)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8))


def _objects(bucket: Any, prefix: str) -> list[str]:
    return sorted(o["path"] for o in bucket.storage().walk(bucket.url(prefix)))


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _drive(clock: ManualClock, contender: threading.Thread, others: tuple[threading.Thread, ...], step: float,
           limit: float) -> None:
    """Advance logical time in ``step``s, each time once the contender and the other
    lease threads (heartbeats) are back asleep, until the contender is done."""
    def settled() -> bool:
        # Every thread asleep until a time still ahead (one whose time has come is
        # about to run: time must not move on before it has).
        if not contender.is_alive():
            return True
        now = clock.now()
        return all(clock.asleep.get(t.ident, now) > now or not t.is_alive() for t in (contender, *others))

    while contender.is_alive():
        _until(settled, "the lease threads asleep")
        if not contender.is_alive():
            break
        assert clock.now() <= limit, "the contender kept waiting past the point it had to decide"
        clock.advance(step)
    contender.join(HANG)
    assert not contender.is_alive()


@pytest.fixture
def clock(monkeypatch) -> ManualClock:
    c = ManualClock()
    monkeypatch.setattr(_objlock, "CLOCK", c)
    return c


def _as_other_namespace(monkeypatch) -> Callable[[], None]:
    """Make the next lock holder look like a process in another PID namespace of this
    host: same hostname and boot id, a pid that is not alive here. Returns the undo."""
    real = _objlock._identity
    me = real()
    monkeypatch.setattr(_objlock, "_identity", lambda: {**me, "pid": 4_000_000, "pidns": "other-" + me["pidns"]})
    return lambda: monkeypatch.setattr(_objlock, "_identity", real)


def test_a_live_writer_in_another_pid_namespace_keeps_the_run_until_its_lease_expires(s3, clock, monkeypatch) -> None:
    run = s3.url("ns")
    with knobs.override(lock_heartbeat_s=1.0, lock_expiry_s=6.0):
        undo = _as_other_namespace(monkeypatch)
        a = CheckpointManager(run, {"model": _model(1)}, retention=RetentionPolicy(keep_last=1), signals=())
        undo()
        a.save(1)
        # B (this namespace: A's pid is not alive here) watches A renew, and is refused.
        t, box = _in_background(lambda: CheckpointManager(run, {"model": _model(2)}, signals=()))
        _drive(clock, t, (a._role.lock._thread,), step=0.5, limit=5.5)
        assert isinstance(box.get("error"), RunDirLockedError), box
        assert "renewed the lease" in str(box["error"])
        assert a._role.lock.renewals >= 1 and a._role.lock.held
        a.save(2)  # A still writes; nothing of its was touched
        assert [r.name for r in list_checkpoints(run)] == ["step-00000002"]
        ckpt.open(f"{run}/step-00000002").verify()

        # A hangs (its heartbeat stops, the process does not exit): once the whole lease
        # went by without a renewal, B takes the run over.
        a._role.lock.stop_heartbeat()
        _until(lambda: not a._role.lock._thread.is_alive(), "A's heartbeat thread ending")
        t, box = _in_background(lambda: CheckpointManager(run, {"model": _model(2)}, signals=()))
        _drive(clock, t, (), step=0.5, limit=12.5)
        b = box.get("value")
        assert b is not None, box
        assert b._role.lock.generation == a._role.lock.generation + 1

        # A comes back: its commit is fenced off, and nothing of B's run is deleted.
        before = _objects(s3, "ns")
        with pytest.raises(BackgroundSaveError) as ei:
            a.save(3)
        assert isinstance(ei.value.__cause__, LeaseLostError), ei.value.__cause__
        assert not a._role.lock.held
        assert _objects(s3, "ns") == before  # A's upload removed by its own abort, nothing else
        assert [r.name for r in list_checkpoints(run)] == ["step-00000002"]
        # A's retention cannot delete through the lost lease either.
        with pytest.raises(LeaseLostError):
            a._storage.remove_checkpoint(f"{run}/step-00000002")
        a.close()  # its release leaves B's lock in place
        b.save(4)
        assert [r.name for r in list_checkpoints(run)] == ["step-00000002", "step-00000004"]
        b.close()
    assert not s3.storage().isfile(f"{run}/.ckpt-writer.lock")  # B released it


def test_a_lock_without_renewals_is_taken_over_only_after_its_lease(s3, clock, monkeypatch) -> None:
    st = s3.storage()
    run = s3.url("expire")
    with knobs.override(lock_heartbeat_s=1.0, lock_expiry_s=4.0):
        undo = _as_other_namespace(monkeypatch)
        a = st.lock(run)
        undo()
        a.stop_heartbeat()  # a SIGSTOPped holder
        _until(lambda: not a._thread.is_alive(), "A's heartbeat thread ending")
        t, box = _in_background(lambda: st.lock(run))
        # Not before the lease ran out on the contender's own clock...
        _drive(clock, t, (), step=0.25, limit=4.25)
        b = box.get("value")
        assert b is not None, box
        assert clock.now() >= 4.0
        with pytest.raises(LeaseLostError):
            a.fence()
        b.fence()  # the new holder's token is good
        b.release()
        a.release()


def test_a_lock_object_without_a_lease_is_never_taken_over(s3) -> None:
    """A lock of the earlier version (a pid and no lease: its holder never renews) that
    names this host, this boot and a pid not alive here was taken over at once; its holder
    may be alive in another namespace, so it is refused, naming the object to remove."""
    st = s3.storage()
    run = s3.url("v1")
    me = _objlock._identity()
    legacy = {"pid": 4_000_000, "host": me["host"], "boot": me["boot"], "since": time.time()}
    st.put(f"{run}/.ckpt-writer.lock", json.dumps(legacy).encode())
    with pytest.raises(RunDirLockedError, match=r"without a lease.*delete s3://.*/v1/\.ckpt-writer\.lock"):
        CheckpointManager(run, {"m": _model()}, signals=())
    assert json.loads(st.read_all(f"{run}/.ckpt-writer.lock")) == legacy  # not touched


def test_the_heartbeat_never_blocks_process_exit(s3) -> None:
    code = textwrap.dedent("""
        import sys, threading
        from ckpt.storage import resolve
        st, run = resolve(sys.argv[1])
        lock = st.lock(run)
        beat = [t for t in threading.enumerate() if t.name == "ckpt-lease"]
        assert len(beat) == 1 and beat[0].daemon, beat
        print("HELD", lock.token)
        # no release: the interpreter must still exit at once
    """)
    env = {**s3.env, "CKPT_LOCK_HEARTBEAT_S": "0.05", "CKPT_LOCK_EXPIRY_S": "0.5"}
    p = hangs.run([sys.executable, "-c", code, s3.url("exit")], cwd=ROOT, env=env, capture_output=True,
                  text=True, bound_s=HANG)
    assert p.returncode == 0 and p.stdout.startswith("HELD"), p.stderr[-2000:]
    # Its lock stays behind (a lock left by an exited process), and, the pid being gone
    # in this very namespace, the next writer takes it over at once.
    st = s3.storage()
    assert st.isfile(s3.url("exit/.ckpt-writer.lock"))
    with CheckpointManager(s3.url("exit"), {"m": _model()}, signals=()) as mgr:
        assert mgr._role.lock.held


# --- cleanup never deletes what a live writer may still commit --------------------------


def test_manager_start_leaves_a_concurrent_s3_save_alone(s3) -> None:
    run = s3.url("race")
    path = f"{run}/step-00000007"
    pending = begin(path)  # a plain ckpt.save, in another process, between its steps
    part = write_part(pending, "rank-00000", {"w": torch.arange(16.0)}, step=7)
    mine = _objects(s3, "race/step-00000007")
    assert mine
    with CheckpointManager(run, {"m": _model()}, signals=()) as mgr:
        assert mgr.removed_orphans == ()
    assert _objects(s3, "race/step-00000007") == mine
    commit(pending, [part], step=7)
    assert torch.equal(ckpt.open(path).state()["w"], torch.arange(16.0))
    ckpt.open(path).verify()


def test_an_s3_save_whose_files_were_deleted_fails_instead_of_committing(s3) -> None:
    run = s3.url("gone")
    path = f"{run}/step-00000008"
    pending = begin(path)
    part = write_part(pending, "rank-00000", {"w": torch.arange(16.0)}, step=8)
    with knobs.override(orphan_grace_s=-3600):  # a cleanup that took them for abandoned
        recover(run)
    assert _objects(s3, "gone") == []
    with pytest.raises(SaveConflictError, match="deleted before its MANIFEST"):
        commit(pending, [part], step=8)
    assert _objects(s3, "gone") == []  # no MANIFEST naming missing files


def test_manager_start_leaves_a_concurrent_local_save_alone(tmp_path) -> None:
    run = tmp_path / "run"
    path = run / "step-00000007"
    pending = begin(path)
    part = write_part(pending, "rank-00000", {"w": torch.arange(16.0)}, step=7)
    with CheckpointManager(run, {"m": _model()}, signals=()) as mgr:
        assert mgr.removed_orphans == ()
    commit(pending, [part], step=7)
    ckpt.open(path).verify()


def test_a_local_save_holding_its_directory_lock_is_never_cleaned(tmp_path) -> None:
    """Even aged past the grace, a temporary directory whose flock a writer holds (a part
    being written) is neither removed nor restored."""
    import fcntl

    run = tmp_path / "run"
    pending = begin(run / "step-00000003")
    fd = os.open(pending.tmp_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # what write_part holds while it writes
        with knobs.override(orphan_grace_s=-3600):
            assert recover(run).removed == ()
        assert os.path.isdir(pending.tmp_dir)
    finally:
        os.close(fd)
    with knobs.override(orphan_grace_s=-3600):
        assert recover(run).removed == (os.path.basename(pending.tmp_dir),)


def test_a_local_save_whose_directory_was_removed_raises_the_documented_error(tmp_path) -> None:
    run = tmp_path / "run"
    pending = begin(run / "step-00000009")
    part = write_part(pending, "rank-00000", {"w": torch.arange(16.0)}, step=9)
    shutil.rmtree(pending.tmp_dir)  # another process's cleanup
    with pytest.raises(SaveConflictError, match="temporary directory is gone") as ei:
        commit(pending, [part], step=9)
    assert not isinstance(ei.value, FileNotFoundError)
    assert not os.path.exists(run / "step-00000009")

    # One file of the save removed: refused by name, nothing committed.
    pending = begin(run / "step-00000010")
    part = write_part(pending, "rank-00000", {"w": torch.arange(16.0)}, step=10)
    victim = part.files[-1].name
    os.unlink(os.path.join(pending.tmp_dir, victim))
    with pytest.raises(SaveConflictError, match="removed before its commit") as ei:
        commit(pending, [part], step=10)
    assert victim in str(ei.value)
    assert not os.path.exists(run / "step-00000010")
