"""Gloo worlds of test processes that can neither collide nor fail on a clock.

- :func:`file_init`: the ``init_method`` of a world, a ``file://`` store in the test's own
  directory. A TCP port found free, closed and handed to the ranks could be taken in
  between (three pytest-xdist workers start worlds side by side, and gloo's own
  connections bind ephemeral ports); a file store has no port to lose, and gloo binds the
  ports of its connections itself;
- :func:`agent_store` and :func:`launch_env`: for ranks that join with ``env://`` (a trainer
  library does), the test's process serves the store itself on a port the OS assigned as
  it listens, as torchrun's agent does, and every rank connects to it;
- :func:`pg_timeout`: the group's timeout, a hang bound (``hangs.hang_s``): a peer slowed
  down by a loaded machine is never a failure, a rank stuck in a collective still ends;
- :func:`arm` (in each rank) and :func:`join` (in the test): every rank is waited on by
  its exit; only a hang bound ends the wait, and then each rank still alive writes its
  Python stacks (``replay.watchdog.arm``: SIGUSR1) and the test fails showing them.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

from hangs import hang_s

__all__ = ["file_init", "agent_store", "launch_env", "pg_timeout", "arm", "join"]


def file_init(directory: str | os.PathLike[str], name: str = "rendezvous") -> str:
    """``file://DIRECTORY/NAME``: one world's rendezvous. The file must be new (a store file
    left by an earlier world would hand its keys to this one): one name per world."""
    path = Path(directory, name)
    if path.exists():
        raise FileExistsError(f"{path}: a rendezvous file of an earlier world (one name per world)")
    return f"file://{path}"


def agent_store() -> Any:
    """A c10d ``TCPStore`` served by this process on port 0 (``.port``: the one the OS gave
    it, held while the store lives): one world's rendezvous, as torchrun's agent serves it.
    Keep it until the world's processes have exited; a new world needs a new store."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=hang_s(20)))


def launch_env(store: Any, rank: int, world: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of ``world``, joining ``store``
    (:func:`agent_store`): with ``TORCHELASTIC_USE_AGENT_STORE`` every rank's ``env://``
    rendezvous connects to the store as a client, none starts one of its own."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def pg_timeout(quiet_s: float) -> datetime.timedelta:
    """The process group's timeout for a world whose slowest wait takes ``quiet_s`` on a
    quiet machine: a hang bound (at least 10x it, times ``CKPT_TIMEOUT_SCALE``)."""
    return datetime.timedelta(seconds=hang_s(quiet_s))


def arm(directory: str | os.PathLike[str], rank: int) -> None:
    """In rank ``rank``, first thing: SIGUSR1 makes it write its stacks into
    ``DIRECTORY/stacks/`` (what :func:`join` shows for a hang)."""
    from replay.watchdog import arm as arm_worker

    arm_worker(Path(directory, "stacks"), f"rank{rank}")


def join(procs: Sequence[Any], directory: str | os.PathLike[str], *, bound_s: float) -> None:
    """Wait for every process (``multiprocessing``) to exit. ``bound_s`` is a hang bound
    (pass :func:`hangs.hang_s`): past it, each rank still alive writes its stacks (if
    :func:`arm` ran in it), is killed, and the test fails showing them."""
    deadline = time.monotonic() + bound_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [(r, p) for r, p in enumerate(procs) if p.exitcode is None]
    if not alive:
        return
    for _, p in alive:
        _signal(p.pid, signal.SIGUSR1)
    time.sleep(2)  # not a verdict: faulthandler writes at once, this only lets it finish before the kill
    for _, p in alive:
        p.kill()
        p.join()
    stacks = "\n".join(f.read_text(errors="replace") for f in sorted(Path(directory, "stacks").glob("*.stacks")))
    pytest.fail(f"HANG: ranks {[r for r, _ in alive]} had not exited after {bound_s:.0f} s (a hang bound: 10x the "
                f"quiet time times CKPT_TIMEOUT_SCALE); their stacks:\n{stacks or '(none written: not armed)'}",
                pytrace=False)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
