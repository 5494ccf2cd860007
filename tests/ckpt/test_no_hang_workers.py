"""No hang with DataLoader workers: asynchronous saves in flight while workers fork.

Every epoch's iterator forks two workers (random augmentation in them) while the
previous epoch's asynchronous save is being written. Two routes deadlocked this
(issue 25): ``git`` started on the save thread (a forked worker held its pipe), and the
temporary directory's ``flock`` released by ``close`` (a forked worker held the open
file description). Each route also has a deterministic test of its own below.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointManager
from ckpt.context import env as ctx_env
from ckpt.context import provenance
from ckpt.errors import WaitTimeoutError
from ckpt.knobs import override
from ckpt.manager import list_checkpoints
from ckpt.writer import begin, commit, write_part

from _hang_kit import PRELUDE, git_checkout, run_script
import hangs

EPOCHS = 10

LOOP = PRELUDE + textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, Dataset
    import ckpt

    class Augmented(Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            x = torch.randn(16) * (1 + torch.rand(()))  # random augmentation, drawn in the worker
            return x, x.sum()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=2)
    mgr = ckpt.CheckpointManager(sys.argv[1], {"model": model, "optim": opt}, async_save=True,
                                 every_steps=len(loader), ledger=False)
    step = 0
    for epoch in range(int(sys.argv[2])):
        for x, y in loader:  # iter() forks the workers while the last epoch's save is in flight
            loss = (model(x).squeeze(-1) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            mgr.after_step(step)  # the epoch's last step: an asynchronous save
    mgr.close()
    print("completed", step)
""")


@pytest.mark.slow
def test_async_saves_in_flight_while_dataloader_workers_fork_every_epoch_complete(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    sha = git_checkout(repo)  # the script lives in a git checkout: the commit is captured
    script = repo / "train.py"
    script.write_text(LOOP)
    run = tmp_path / "run"
    out = run_script(script, str(run), str(EPOCHS), cwd=repo)
    assert f"completed {EPOCHS * 5}" in out
    records = [r for r in list_checkpoints(run) if r.committed]
    assert [r.step for r in records] == [5 * e for e in range(1, EPOCHS + 1)][-len(records):] and records
    reader = ckpt.open(records[-1].path)
    reader.verify()
    commit_info = reader.context()["commit"]
    # git ran (on the loop's thread, at construction): a full capture, dirty flag included
    assert commit_info["sha"] == sha and commit_info["dirty"] is False and commit_info["reason"] is None


SPY = PRELUDE + textwrap.dedent("""
    import subprocess, threading
    spawned = []
    _init = subprocess.Popen.__init__

    def spy(self, *a, **k):
        spawned.append((threading.current_thread().name, (a[0] if a else k.get("args"))[:2]))
        return _init(self, *a, **k)

    subprocess.Popen.__init__ = spy
    import torch, ckpt
    model = torch.nn.Linear(4, 4)
    with ckpt.CheckpointManager(sys.argv[1], {"model": model}, async_save=True, ledger=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
        mgr.wait()
    off_main = [s for s in spawned if s[0] != "MainThread"]
    assert spawned and not off_main, spawned
    print("spawned on the main thread only:", spawned)
""")


@pytest.mark.slow
def test_no_process_is_started_on_the_save_thread(tmp_path: Path) -> None:
    """git (and ``uname -p``, behind ``platform.platform()``) run on the thread that
    builds the manager; the background save thread starts no process."""
    repo = tmp_path / "repo"
    git_checkout(repo)
    script = repo / "spy.py"
    script.write_text(SPY)
    out = run_script(script, str(tmp_path / "run"), cwd=repo)
    assert "'git'" in out and "'uname'" in out


def test_part_lock_is_released_although_a_forked_child_holds_its_description(tmp_path: Path) -> None:
    """A process forked while ``write_part`` holds the temporary directory's shared lock
    (a DataLoader worker) shares the lock's open file description; the lock must go
    when ``write_part`` returns all the same, or the commit waits for that process."""
    release_r, release_w = os.pipe()
    children: list[int] = []

    class ForksWhileWritten(torch.nn.Linear):
        def state_dict(self, *a, **k):  # type: ignore[override]
            pid = os.fork()
            if pid == 0:  # the "worker": lives until the test lets it go
                os.read(release_r, 1)
                os._exit(0)
            children.append(pid)
            return super().state_dict(*a, **k)

    pending = begin(str(tmp_path / "ckpt"))
    try:
        part = write_part(pending, "rank-00000", {"m": ForksWhileWritten(3, 3)}, step=1)
        assert children  # the child is alive and holds a copy of every descriptor of then
        probe = os.open(pending.tmp_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError on the old release
        finally:
            os.close(probe)
        commit(pending, [part], step=1)
    finally:
        os.write(release_w, b"x" * len(children))
        for pid in children:
            os.waitpid(pid, 0)
        os.close(release_r)
        os.close(release_w)
    ckpt.open(tmp_path / "ckpt").verify()


def test_commit_waiting_on_a_held_lock_raises_wait_timeout_naming_it(tmp_path: Path) -> None:
    """The committer's wait for part writers is bounded: a lock that is never released
    ends in WaitTimeoutError naming the directory and the holder, not a hang."""
    pending = begin(str(tmp_path / "ckpt"))
    part = write_part(pending, "rank-00000", {"x": torch.arange(4)}, step=1)
    holder = os.open(pending.tmp_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_SH)  # a part writer that never finishes
    try:
        with override(lock_timeout_s=0.2), pytest.raises(WaitTimeoutError) as err:
            commit(pending, [part], step=1)
        e = err.value
        assert isinstance(e, TimeoutError) and e.path == pending.tmp_dir
        assert "exclusive lock on the temporary directory, for the part writers still in flight" in str(e)
        assert f"pid {os.getpid()}" in str(e) and e.context["holders"] == [os.getpid()]
    finally:
        os.close(holder)
    commit(pending, [part], step=1)  # the holder gone, the same commit goes through
    ckpt.open(tmp_path / "ckpt").verify()


def test_waiting_for_a_stuck_async_save_raises_naming_the_save_and_where_it_is(tmp_path: Path) -> None:
    stuck = threading.Event()
    entered = threading.Event()
    mgr = CheckpointManager(tmp_path / "run", {"m": torch.nn.Linear(2, 2)}, async_save=True, ledger=False)
    run = mgr._run

    def blocked_save(job):  # type: ignore[no-untyped-def]
        entered.set()
        stuck.wait()  # the test's stand-in for a system call that never returns
        run(job)

    mgr._run = blocked_save  # type: ignore[method-assign]
    try:
        mgr.save(7)
        assert entered.wait(60)
        with override(save_timeout_s=0.2), pytest.raises(WaitTimeoutError) as err:
            mgr.wait()
        msg = str(err.value)
        assert "asynchronous save of step 7 has not finished" in msg and "blocked_save" in msg
        assert err.value.context["step"] == 7 and err.value.path.endswith("step-00000007")
    finally:
        stuck.set()
    assert mgr.wait().step == 7  # it was only stuck: once free, it commits
    mgr.close()
    ckpt.open(tmp_path / "run" / "step-00000007").verify()


# --- the commit, read without starting a process ------------------------------------


def _git(cwd: Path, *args: str) -> str:
    g = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    return subprocess.run([*g, *args], cwd=cwd, check=True, capture_output=True).stdout.decode().strip()


def test_read_head_agrees_with_git_on_loose_packed_detached_and_worktree_heads(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    first = git_checkout(repo)
    (repo / "sub").mkdir()
    assert provenance.read_head(str(repo / "sub")) == (first, str(repo.resolve()))  # loose ref
    _git(repo, "pack-refs", "--all")
    assert not (repo / ".git" / "refs" / "heads" / "main").exists()
    assert provenance.read_head(str(repo)) == (first, str(repo.resolve()))  # packed-refs
    (repo / "README").write_text("changed\n")
    _git(repo, "commit", "-q", "-am", "second")
    second = _git(repo, "rev-parse", "HEAD")
    assert provenance.read_head(str(repo))[0] == second != first
    wt = tmp_path / "linked"
    _git(repo, "worktree", "add", "-q", "--detach", str(wt), first)  # a .git file, a detached HEAD
    assert provenance.read_head(str(wt)) == (first, str(wt.resolve()))
    assert provenance.read_head(str(tmp_path)) is None  # not a checkout


def test_capture_commit_off_the_main_thread_reads_the_git_files_and_starts_nothing(tmp_path: Path,
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    sha = git_checkout(repo)

    def no_process(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError(f"a process was started: {a}")

    got: list[dict] = []
    monkeypatch.setattr(subprocess, "Popen", no_process)
    t = threading.Thread(target=lambda: got.append(provenance.capture_commit(str(repo))), name="ckpt-save")
    t.start()
    t.join()
    monkeypatch.undo()
    assert got[0]["sha"] == sha and got[0]["repo"] == str(repo.resolve()) and got[0]["dirty"] is None
    assert "background thread" in got[0]["reason"]
    full = provenance.prime(str(repo))  # the loop's thread: git runs, the full capture is cached
    assert full["sha"] == sha and full["dirty"] is False and full["reason"] is None
    t = threading.Thread(target=lambda: got.append(provenance.capture_commit(str(repo))))
    t.start()
    t.join()
    assert got[1] == full  # a background save finds the loop's capture


@pytest.mark.slow
def test_capture_env_off_the_main_thread_starts_no_process_and_names_the_same_platform(tmp_path: Path) -> None:
    script = tmp_path / "env_probe.py"
    script.write_text(PRELUDE + textwrap.dedent("""
        import platform, subprocess, threading
        def no_process(*a, **k):
            raise AssertionError(f"a process was started: {a}")
        real = subprocess.Popen
        subprocess.Popen = no_process
        from ckpt.context.env import capture_env
        got = []
        t = threading.Thread(target=lambda: got.append(capture_env()["platform"]))
        t.start(); t.join()
        subprocess.Popen = real
        assert got == [platform.platform()], (got, platform.platform())
        print("same platform", got)
    """))
    assert "same platform" in run_script(script, cwd=tmp_path)
    assert ctx_env.capture_env()["platform"]


# --- signal handlers of several managers in one process (issue 22 item 10) -------------

SIGNALS = PRELUDE + textwrap.dedent("""
    import os, signal, torch
    from ckpt import CheckpointManager
    ms = [CheckpointManager(os.path.join(sys.argv[1], f"r{i}"), {"m": torch.nn.Linear(2, 2)}, ledger=False)
          for i in range(3)]
    for i in sys.argv[2]:
        ms[int(i)].close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    print("SIGTERM IGNORED")
""")


@pytest.mark.slow
@pytest.mark.parametrize("order", ["012", "210", "102", "120", "021", "201"])
def test_sigterm_terminates_after_managers_close_in_any_order(tmp_path: Path, order: str) -> None:
    script = tmp_path / "signals.py"
    script.write_text(SIGNALS)
    p = hangs.run([sys.executable, str(script), str(tmp_path), order], capture_output=True, text=False, bound_s=hangs.hang_s(30))
    out = (p.stdout + p.stderr).decode(errors="replace")
    assert p.returncode == -15, f"closing in order {order} left SIGTERM handled (rc {p.returncode}):\n{out[-3000:]}"


def test_a_closed_manager_in_the_chain_forwards_to_the_handler_before_it(tmp_path: Path) -> None:
    """Closing the older manager first leaves it under the newer one; a signal then still
    reaches the newer (open) manager and the user's handler installed before both."""
    import signal

    seen: list[int] = []

    def user(signum, frame):  # type: ignore[no-untyped-def]
        seen.append(signum)

    before = signal.signal(signal.SIGUSR1, user)
    try:
        a = CheckpointManager(tmp_path / "a", {"m": torch.nn.Linear(2, 2)}, ledger=False)
        b = CheckpointManager(tmp_path / "b", {"m": torch.nn.Linear(2, 2)}, ledger=False)
        a.close()
        signal.raise_signal(signal.SIGUSR1)
        assert b._signals.received == signal.SIGUSR1 and a._signals.received is None and seen == [signal.SIGUSR1]
        b.close()
        assert signal.getsignal(signal.SIGUSR1) is user  # the closed one is not restored
    finally:
        signal.signal(signal.SIGUSR1, before)


# --- locks a save thread holds when a worker forks ----------------------------------------


def _in_fork(child_body) -> int:  # type: ignore[no-untyped-def]
    """Run ``child_body`` in a forked child bounded by SIGALRM (a hang detector: a child
    stuck on a lock dies of it); returns the child's wait status."""
    import signal

    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(120)
        try:
            child_body()
            os._exit(0)
        except BaseException:
            os._exit(3)
    return os.waitpid(pid, 0)[1]


@pytest.mark.parametrize("lock", ["gc", "bpz", "provenance"])
def test_a_child_forked_while_a_save_thread_holds_a_ckpt_lock_can_use_it(lock: str, tmp_path: Path) -> None:
    """A DataLoader worker forked while the save thread was inside one of ckpt's module
    locks (the collector pause, the codec buffers, the commit cache) has no thread to
    release it: the child must start with a free lock (SIGALRM status on the old code)."""
    import gc

    from ckpt import _gc
    from ckpt.format import bpz

    held = {"gc": lambda: _gc._lock, "bpz": lambda: bpz._shared_lock, "provenance": lambda: provenance._cache_lock}[lock]
    use = {
        "gc": lambda: _gc.paused().__enter__(),
        "bpz": lambda: bpz._buffers_for(4096),
        "provenance": lambda: provenance.capture_commit(str(tmp_path)),
    }[lock]
    gc_was = gc.isenabled()
    with held():  # the save thread's critical section, at the moment of the fork
        status = _in_fork(use)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child ended with status {status:#x} (SIGALRM: hung)"
    assert gc.isenabled() == gc_was


def test_a_child_forked_during_a_collector_pause_collects_again() -> None:
    import gc

    from ckpt import _gc

    with _gc.paused():  # the save thread is walking a state when the worker forks
        status = _in_fork(lambda: None if gc.isenabled() else os._exit(4))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child's collector stayed off ({status:#x})"
