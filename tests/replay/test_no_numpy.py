"""Issue 9 item 19: nothing hangs without numpy.

numpy is a required dependency now (pyproject), but the gloo channel's receiver must not
need it anyway: ``Tensor.numpy()`` raising "Numpy is not available" inside a receiver
thread once read as "peer gone" while the peer, alive, blocked forever in its send, and
``ckpt demo --quick`` hung. Here two gloo processes exchange messages with numpy
blocked (a sitecustomize raises ModuleNotFoundError for it, as a venv without numpy
would), and a receiver's own failure must surface as a ChannelError, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import hangs
import worlds

ROOT = Path(__file__).resolve().parents[2]

BLOCK = """
import sys
class _NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError("numpy is blocked for this test")
        return None
sys.meta_path.insert(0, _NoNumpy())
"""

SCRIPT = """
import datetime, os, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist, torch.multiprocessing as mp

def child(rank, init, bound_s, mode, q):
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=bound_s))
        from replay.channel import Endpoint, TorchDistTransport
        from replay.channel import torchdist
        if mode == "local-failure" and rank == 1:
            def broken(buf):
                raise ValueError("decoder bug")
            torchdist._host_bytes = broken
        ep = Endpoint(TorchDistTransport(["a", "b"]))
        if rank == 0:
            for i in range(3):
                ep.send("b", {"i": i}, [torch.full((4,), float(i))])
            q.put(("a", "sent"))
        else:
            got = []
            for _ in range(3):
                m = ep.recv(timeout=bound_s)
                got.append((m.meta["i"], m.tensors[0].tolist()))
            q.put(("b", got))
        ep.close() if hasattr(ep, "close") else None
    except BaseException as e:
        q.put((rank, f"{type(e).__name__}: {e}"))
        q.close(); q.join_thread()  # flushed before the hard exit
        os._exit(3)

if __name__ == "__main__":
    init, bound_s = sys.argv[2], float(sys.argv[3])  # a file:// rendezvous, a hang bound
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=child, args=(r, init, bound_s, sys.argv[1], q), daemon=True) for r in range(2)]
    for p in ps: p.start()
    for p in ps: p.join()  # on the exits: a rank left blocked is a hang, the test's bound dumps its stacks
    alive = [p.pid for p in ps if p.is_alive()]
    for p in ps:
        if p.is_alive(): p.kill()
    out = []
    while not q.empty(): out.append(q.get())
    print("RESULTS", sorted(map(str, out)), "ALIVE", alive, "CODES", [p.exitcode for p in ps])
"""


def test_numpy_is_a_required_dependency() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps)


def _run(tmp_path: Path, mode: str) -> str:
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    (tmp_path / "exchange.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    init, bound_s = worlds.file_init(tmp_path), hangs.hang_s(24)
    p = hangs.run([sys.executable, str(tmp_path / "exchange.py"), mode, init, str(bound_s)], capture_output=True,
                  text=True, env=env, cwd=ROOT, bound_s=bound_s)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gloo_channel_works_without_numpy(tmp_path: Path) -> None:
    out = _run(tmp_path, "ok")
    assert "ALIVE []" in out and "CODES [0, 0]" in out, out
    assert "('b', [(0, [0.0, 0.0, 0.0, 0.0]), (1, [1.0, 1.0, 1.0, 1.0]), (2, [2.0, 2.0, 2.0, 2.0])])" in out, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_receivers_own_failure_is_an_error_not_a_dead_peer(tmp_path: Path) -> None:
    out = _run(tmp_path, "local-failure")
    # The receiving side fails with the channel error naming its own failure; nobody is
    # left blocked (the sender's send fails once the receiver's process has exited).
    assert "ALIVE []" in out, out
    assert "receiver failed" in out and "decoder bug" in out, out
