"""Writers under real processes: the run-directory lock, racing saves, the overwrite crash
window, a full disk, and chained signal handlers (issue 9, items 9-13).

Children are real Python processes started with ``sys.executable``; they wait for
each other on files, never on sleeps, so the tests hold with the cores oversubscribed.
Their bounds (tests/hangs.py) only stop a hung child from hanging the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt
from ckpt import knobs
from ckpt.errors import RunDirLockedError
from ckpt.manager import CheckpointManager, RetentionPolicy, list_checkpoints
from ckpt.runlock import LOCK_NAME
from ckpt.writer import recover
import hangs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG = hangs.hang_s(18)  # seconds before a child is declared hung (never reached when things work)


def _py(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return hangs.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, capture_output=True, text=True, bound_s=HANG, **kw)


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


# --- 9. one writer per run directory -------------------------------------------------

HOLD = """
import os, sys
from ckpt.manager import CheckpointManager
mgr = CheckpointManager(sys.argv[1], {"counters": {"n": 1}}, signals=(), run_id="holder-run")
print("READY", os.getpid(), flush=True)
sys.stdin.readline()       # hold the lock until the parent says (or kills us)
mgr.close()
"""

TRY = """
import json, sys
from ckpt.errors import RunDirLockedError
from ckpt.manager import CheckpointManager
try:
    mgr = CheckpointManager(sys.argv[1], {"counters": {"n": 2}}, signals=())
except RunDirLockedError as e:
    print(json.dumps({"locked": str(e), "holder": e.context.get("holder")}))
else:
    mgr.save(7)
    mgr.close()
    print(json.dumps({"saved": True}))
"""


def _start_holder(run: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD), run], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    assert line and line[0] == "READY", line
    return p, int(line[1])


@pytest.mark.slow
def test_second_manager_is_refused_naming_pid_and_host_and_sigkill_leaves_no_stale_lock(tmp_path):
    run = str(tmp_path / "run")
    holder, pid = _start_holder(run)
    try:
        # A save of the holder in progress: the refused manager must not clean it up.
        inflight = os.path.join(run, ".tmp-step-00000009-0123456789ab")
        os.mkdir(inflight)
        got = _last_json(_py(TRY, run).stdout)
        assert "locked" in got, got
        assert f"pid {pid} on host {socket.gethostname()}" in got["locked"]
        assert "run_id holder-run" in got["locked"]
        assert got["holder"]["pid"] == pid
        assert os.path.isdir(inflight)
        assert not os.path.exists(os.path.join(run, "step-00000007"))
    finally:
        holder.kill()  # SIGKILL: no close(), no atexit
        hangs.communicate(holder, bound_s=HANG)
    assert holder.returncode == -signal.SIGKILL
    got = _last_json(_py(TRY, run).stdout)
    assert got == {"saved": True}
    assert [c.name for c in list_checkpoints(run)] == ["step-00000007"]


HOLD_AND_FORK = """
import os, sys
from ckpt.manager import CheckpointManager
mgr = CheckpointManager(sys.argv[1], {"counters": {"n": 1}}, signals=())
child = os.fork()
if child == 0:             # lingers like a DataLoader worker whose parent was killed
    sys.stdin.readline()
    os._exit(0)
print("READY", os.getpid(), child, flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
def test_a_forked_child_outliving_a_killed_holder_does_not_keep_the_lock(tmp_path):
    run = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_AND_FORK), run], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready, _, child = p.stdout.readline().split()
    assert ready == "READY"
    try:
        assert "locked" in _last_json(_py(TRY, run).stdout)
        p.kill()
        hangs.communicate(p, bound_s=HANG)
        os.kill(int(child), 0)  # the child is still alive, holding a copy of every fd
        assert _last_json(_py(TRY, run).stdout) == {"saved": True}
    finally:
        p.stdin.close()
        try:
            os.kill(int(child), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_lock_is_held_for_the_lifetime_and_released_by_close_and_context_exit(tmp_path):
    run = tmp_path / "run"
    a = CheckpointManager(run, {"c": {"n": 1}}, signals=())
    # Same process, second manager: flock is per open file, so it conflicts too.
    with pytest.raises(RunDirLockedError, match=rf"pid {os.getpid()} on host"):
        CheckpointManager(run, {"c": {"n": 1}}, signals=())
    assert _last_json(_py(TRY, str(run)).stdout)["holder"]["pid"] == os.getpid()
    a.close()
    assert (run / LOCK_NAME).read_bytes() == b""  # no stale holder description
    with CheckpointManager(run, {"c": {"n": 1}}, signals=()) as b:
        b.save(3)
        with pytest.raises(RunDirLockedError):
            CheckpointManager(run, {"c": {"n": 1}}, signals=())
    assert _last_json(_py(TRY, str(run)).stdout) == {"saved": True}


def test_lock_file_symlink_is_not_followed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, run / LOCK_NAME)
    with pytest.raises(RunDirLockedError, match="symbolic link"):
        CheckpointManager(run, {"c": {}}, signals=())
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("planted", ["fifo", "directory"])
def test_lock_file_of_another_kind_is_refused_by_name(tmp_path, planted):
    """A FIFO would block a plain open (and fail ftruncate), a directory fails open with
    EISDIR: both were raw OSErrors; now RunDirLockedError naming the lock file."""
    run = tmp_path / "run"
    run.mkdir()
    if planted == "fifo":
        os.mkfifo(run / LOCK_NAME)
    else:
        (run / LOCK_NAME).mkdir()
    with pytest.raises(RunDirLockedError, match="lock file is (not a regular file|a directory)") as ei:
        CheckpointManager(run, {"c": {}}, signals=())
    assert ei.value.path == str(run / LOCK_NAME)


# --- 10. ckpt.save under a process group; overwrite=False is atomic -------------------

RANK = """
import datetime, json, os, sys
import torch, torch.distributed as dist
import ckpt
from ckpt.errors import DistributedUsageError, RunDirLockedError
from ckpt.manager import CheckpointManager
rank, out, held, bound_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "rdzv"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=bound_s))
res = {}
try:
    ckpt.save(os.path.join(out, "ck"), {"r": torch.tensor([rank])}, step=1)
    res["save"] = "saved"
except DistributedUsageError as e:
    res["save"] = str(e)
dist.barrier()
res["ck_exists"] = os.path.exists(os.path.join(out, "ck"))
if rank == 0:   # one rank saving its own state on purpose
    ckpt.save(os.path.join(out, "solo"), {"r": torch.tensor([rank])}, step=1, this_rank_only=True)
# The manager: rank 0 takes the lock for the job; when another job holds it, every rank is told.
try:
    CheckpointManager(held, {"r": torch.tensor([rank])}, signals=())
    res["held"] = "opened"
except RunDirLockedError as e:
    res["held"] = str(e)
mgr = CheckpointManager(os.path.join(out, "run"), {"r": torch.tensor([rank])}, signals=())
with open(os.path.join(out, "run", ".ckpt-writer.lock")) as f:
    res["lock"] = json.loads(f.read())
res["pid"] = os.getpid()
mgr.save(2)
mgr.close()
dist.barrier()
dist.destroy_process_group()
print(json.dumps(res))
"""


@pytest.mark.slow
def test_save_under_a_process_group_refuses_and_one_rank_locks_for_the_job(tmp_path):
    held = str(tmp_path / "held")
    holder, hpid = _start_holder(held)
    try:
        procs = [
            hangs.popen([sys.executable, "-c", textwrap.dedent(RANK), str(r), str(tmp_path), held, str(HANG)], cwd=ROOT,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)
        ]
        outs = [hangs.communicate(p, bound_s=HANG) for p in procs]
    finally:
        holder.kill()
        hangs.communicate(holder, bound_s=HANG)
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e
    res = [_last_json(o) for o, _ in outs]
    for r in res:
        assert "DistributedCheckpointer" in r["save"] and "this_rank_only" in r["save"], r
        assert r["ck_exists"] is False
        assert f"pid {hpid}" in r["held"] or "another CheckpointManager" in r["held"], r["held"]
        assert r["lock"]["pid"] == res[0]["pid"] and r["lock"]["world_size"] == 2
    assert ckpt.open(tmp_path / "solo").state()["r"].tolist() == [0]
    assert len(ckpt.open(tmp_path / "run" / "step-00000002").parts) == 2


RACE = """
import json, os, sys, time
import torch
import ckpt
from ckpt.errors import CheckpointExistsError
from ckpt.storage import LocalStorage
me, path, meet, use_rename2 = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"

class MeetBeforePublish(LocalStorage):
    # The commit fsyncs the finished temporary directory just before it publishes it:
    # both writers meet there, so both have passed every existence check when they race.
    def fsync_dir(self, p):
        super().fsync_dir(p)
        if os.path.basename(p).startswith(".tmp-") and os.path.exists(os.path.join(p, "MANIFEST")):
            open(os.path.join(meet, me), "w").close()
            while len(os.listdir(meet)) < 2:   # waits for the other writer, however late
                time.sleep(0.005)

try:
    ckpt.save(path, {"who": torch.tensor([int(me)])}, step=1, storage=MeetBeforePublish(renameat2=use_rename2))
    print(json.dumps({"won": True}))
except CheckpointExistsError as e:
    print(json.dumps({"won": False, "err": str(e)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("rename2", [True, False], ids=["renameat2", "fallback"])
def test_two_processes_racing_overwrite_false_exactly_one_wins(tmp_path, rename2):
    path, meet = tmp_path / "step-00000001", tmp_path / "meet"
    meet.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(RACE), str(i), str(path), str(meet), "1" if rename2 else "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (1, 2)
    ]
    outs = [hangs.communicate(p, bound_s=HANG) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e
    res = [_last_json(o) for o, _ in outs]
    winners = [i for i, r in zip((1, 2), res) if r["won"]]
    assert len(winners) == 1, res
    loser = next(r for r in res if not r["won"])
    assert "already exists" in loser["err"]
    assert ckpt.open(path).state()["who"].tolist() == winners
    ckpt.open(path).verify()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


# --- 11. the overwrite crash window ------------------------------------------------------

CRASH = """
import os, sys
import torch
import ckpt
from ckpt.storage import LocalStorage
from tests.sim.faultfs import FaultPlan, FaultRule, FaultyStorage
path, kill_at, use_rename2, overwrite, value = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", float(sys.argv[5])

# SIGKILL before step number kill_at of the commit once MANIFEST is created (its directory
# fsyncs, renames, the exchange, removals): every instant between two steps of the commit
# sequence. Past the last step the save completes, and says how many steps it took.
steps = FaultRule("sigkill", ("fsync_dir", "rename", "exchange", "remove_tree"), skip=kill_at, armed=False)

def arm(i, name, p):
    if name == "create" and os.path.basename(p) == "MANIFEST":
        steps.armed = True

st = FaultyStorage(LocalStorage(renameat2=use_rename2), FaultPlan(rules=[steps]), on_op=arm)
ckpt.save(path, {"w": torch.full((64,), value)}, step=5, overwrite=overwrite, storage=st)
print("DONE", steps.seen)
"""


def _crash_cases():
    for rename2 in (True, False):
        for overwrite in (True, False):
            yield pytest.param(rename2, overwrite, id=f"{'renameat2' if rename2 else 'fallback'}-{'overwrite' if overwrite else 'fresh'}")


@pytest.mark.slow
@pytest.mark.parametrize("rename2,overwrite", list(_crash_cases()))
def test_a_kill_at_any_step_of_the_commit_leaves_a_complete_copy_that_cleanup_keeps(tmp_path, rename2, overwrite):
    killed_at = []
    for k in range(64):
        run = tmp_path / f"k{k}"
        path = run / "step-00000005"
        if overwrite:
            ckpt.save(path, {"w": torch.full((64,), 1.0)}, step=5)
        p = _py(CRASH, str(path), str(k), "1" if rename2 else "0", "1" if overwrite else "0", "2.0")
        done = p.returncode == 0
        if done:
            # k steps: none left to kill at; what follows checks the instant after the last one
            assert p.stdout.split() == ["DONE", str(k)], p.stdout
        else:
            assert p.returncode == -signal.SIGKILL, p.stderr
            killed_at.append(k)
        # At least one complete copy, whatever its name; then the manager's cleanup
        # (it runs at start, under the lock) must put one under the final name. (The
        # leftovers are aged: a young one might be a live lock-less writer's, and stays.)
        with knobs.override(orphan_grace_s=0):
            mgr = CheckpointManager(run, {"w": torch.zeros(64)}, signals=())
        res = mgr.resume()
        assert res is not None and res.step == 5, (k, os.listdir(run))
        w = mgr.state["w"]
        assert torch.equal(w, torch.full((64,), 2.0)) or (overwrite and torch.equal(w, torch.full((64,), 1.0))), (k, w[:3])
        assert not [n for n in os.listdir(run) if n.startswith(".tmp-")], (k, os.listdir(run))
        mgr.close()
        ckpt.open(path).verify()
        if done:
            break
    else:
        pytest.fail("the save never completed")
    assert killed_at == list(range(len(killed_at))) and len(killed_at) >= 2


def test_recover_restores_only_complete_copies_and_prefers_the_new_one(tmp_path):
    old, new = tmp_path / "old-src", tmp_path / "new-src"
    ckpt.save(old / "step-00000001", {"v": torch.tensor([1])}, step=1)
    ckpt.save(new / "step-00000001", {"v": torch.tensor([2])}, step=1)
    run = tmp_path / "run"
    run.mkdir()
    os.rename(old / "step-00000001", run / ".tmp-step-00000001-aaaaaaaaaaaa.old")
    os.rename(new / "step-00000001", run / ".tmp-step-00000001-bbbbbbbbbbbb")
    torn = run / ".tmp-step-00000002-cccccccccccc"  # a save killed while writing
    torn.mkdir()
    (torn / "rank-00000.state.msgpack.zst").write_bytes(b"partial")
    (run / ".tmp-step-00000003-dddddddddddd.del").mkdir()  # retention mid-delete
    rec = recover(run)
    assert rec.restored == ((".tmp-step-00000001-bbbbbbbbbbbb", "step-00000001"),)
    assert rec.removed == ()  # young: a writer holding no lock may be between two of its steps
    with knobs.override(orphan_grace_s=0):
        assert sorted(recover(run).removed) == [".tmp-step-00000001-aaaaaaaaaaaa.old", ".tmp-step-00000002-cccccccccccc",
                                                ".tmp-step-00000003-dddddddddddd.del"]
    assert sorted(os.listdir(run)) == ["step-00000001"]
    assert ckpt.open(run / "step-00000001").state()["v"].tolist() == [2]


# --- 12. retention never wedges on a full disk ------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_retention_frees_space_before_the_next_save_after_enospc(small_tmpfs, async_save):
    # 2.8 MB of weights per checkpoint on an 8 MiB filesystem: two fit, a third does not.
    run = small_tmpfs / "run"
    w = {"w": torch.zeros(700_000)}
    mgr = CheckpointManager(run, w, retention=RetentionPolicy(keep_last=2), async_save=async_save, signals=())
    outcome = {}
    for step in range(1, 9):
        w["w"].fill_(float(step))
        try:
            mgr.save(step)
            mgr.wait()  # an async save's failure surfaces here
            outcome[step] = "ok"
        except ckpt.errors.BackgroundSaveError as e:
            assert isinstance(e.__cause__, OSError) and "No space left" in str(e.__cause__)
            outcome[step] = "ENOSPC"
        assert not [n for n in os.listdir(run) if n.startswith(".tmp-")]
    # The third save finds the disk full; every later one first deletes what its own
    # commit would delete, so none fails again.
    assert outcome == {1: "ok", 2: "ok", 3: "ENOSPC", 4: "ok", 5: "ok", 6: "ok", 7: "ok", 8: "ok"}
    assert [c.name for c in list_checkpoints(run)] == ["step-00000007", "step-00000008"]

    # Never the newest valid checkpoint: with the newest corrupt, the one before it is
    # the resume point and is not deleted to make room (so this save cannot fit).
    raw = bytearray((run / "step-00000008" / "rank-00000.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (run / "step-00000008" / "rank-00000.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ckpt.errors.BackgroundSaveError):
        mgr.save(9)
        mgr.wait()
    assert [c.name for c in list_checkpoints(run)] == ["step-00000007", "step-00000008"]
    mgr.close()
    w2 = {"w": torch.zeros(700_000)}
    with pytest.warns(ckpt.manager.ResumeFallbackWarning, match="step-00000008"):
        res = CheckpointManager(run, w2, signals=()).resume()
    assert res.step == 7 and torch.equal(w2["w"], torch.full((700_000,), 7.0))


# --- 13. signal handlers are chained and restored --------------------------------------

SIG = """
import json, os, signal, sys, time
import torch
from ckpt.manager import CheckpointManager
sig = getattr(signal, sys.argv[2])
seen = []
def user_handler(signum, frame):
    seen.append(signum)
signal.signal(sig, user_handler)
mgr = CheckpointManager(sys.argv[1], {"w": torch.ones(3)}, signals=(signal.SIGTERM, signal.SIGUSR1))
print("READY", flush=True)
step = 0
while not mgr.should_stop:   # ends once the signal has arrived, whenever that is
    step += 1
    mgr.after_step(step)     # saves at the boundary after the signal, then should_stop
    time.sleep(0.01)
mgr.close()
print(json.dumps({"seen": seen, "stopped": mgr.should_stop, "saved": [r.step for r in mgr.reports],
                  "restored": signal.getsignal(sig) is user_handler,
                  "other_restored": signal.getsignal(signal.SIGUSR1 if sig == signal.SIGTERM else signal.SIGTERM) is signal.SIG_DFL}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_previous_signal_handler_is_called_and_restored_on_close(tmp_path, signame):
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SIG), str(tmp_path / "run"), signame], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "READY"
    p.send_signal(getattr(signal, signame))
    out, err = hangs.communicate(p, bound_s=HANG)
    assert p.returncode == 0, err
    got = _last_json(out)
    assert got["seen"] == [int(getattr(signal, signame))]
    assert got["stopped"] is True and len(got["saved"]) == 1
    assert got["restored"] is True and got["other_restored"] is True


def test_a_handler_installed_after_the_managers_is_left_in_place(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    calls = []
    try:
        mgr = CheckpointManager(tmp_path / "run", {"w": torch.ones(1)}, signals=(signal.SIGUSR1,))
        ours = signal.getsignal(signal.SIGUSR1)

        def later(signum, frame):
            calls.append("later")
            ours(signum, frame)  # chains to the manager's

        signal.signal(signal.SIGUSR1, later)
        mgr.close()
        assert signal.getsignal(signal.SIGUSR1) is later
        signal.raise_signal(signal.SIGUSR1)  # the closed manager only forwards
        assert calls == ["later"] and not mgr.should_stop
    finally:
        signal.signal(signal.SIGUSR1, before)
