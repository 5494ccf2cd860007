"""The default fresh load: a verified, lease-protected private mapping, never a SIGBUS.

``CheckpointReader.state()`` maps a local tensor file privately under a read lease
(``ckpt.storage._lease``, spec §11.1) and falls back to reading into fresh memory where
no lease can be taken. The claims tested here, each in a child process where a SIGBUS
would show as a signal exit rather than take pytest down:

* a truncation of the file by another process *during* the load waits until this
  process has copied the bytes away; the load returns the verified bytes;
* the same after the load, with tensors already in use (written ones included);
* without a lease (``mmap=False``, or where the kernel refuses one) a truncation during
  the read is a clear ``CkptError``, and the interpreter lives on;
* every chunk is verified before anything is returned, on both halves of the file.

The truncations are synchronised on conditions (the lease break seen by this process,
a pipe), never on sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import ChecksumMismatchError, CkptError
from ckpt.storage import _lease
import hangs

ROOT = Path(__file__).resolve().parents[2]
HANG = hangs.hang_s(30)


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return hangs.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, bound_s=HANG, env=env, cwd=ROOT)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"t{i}": torch.randn(300_000 + i, generator=g) for i in range(6)} | {"i": torch.arange(10, dtype=torch.int64)}


@pytest.fixture
def leases(tmp_path: Path) -> None:
    """Skip where this kernel or filesystem grants no read lease (then the default load
    reads into fresh memory, which the other tests here cover)."""
    import fcntl

    probe = tmp_path / "lease-probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, _lease.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, _lease.F_SETLEASE, fcntl.F_UNLCK)
    except OSError as e:
        pytest.skip(f"no read leases here ({e}): the default fresh load reads instead of mapping")
    finally:
        os.close(fd)


def _save(path: Path) -> Path:
    ckpt.save(path, {"s": _state()}, step=1)
    return path / "rank-00000.safetensors"


CHILD_COMMON = """
import os, subprocess, sys, time
import torch
import ckpt
from ckpt import _materialize
from ckpt.storage import _lease
path = sys.argv[1]
tensor_file = os.path.join(path, "rank-00000.safetensors")
g = torch.Generator().manual_seed(7)
want = {f"t{i}": torch.randn(300_000 + i, generator=g) for i in range(6)} | {"i": torch.arange(10, dtype=torch.int64)}
TRUNCATE = [sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], 0); print('truncated')", tensor_file]

def wait_for(cond, what):
    # a condition the kernel or the other process makes true; a bug that never makes it true
    # is caught by the test's hang bound on this whole process group (tests/hangs.py), which dumps our stacks
    while not cond():
        time.sleep(0.001)
"""


@pytest.mark.slow
def test_a_truncation_during_the_load_waits_and_the_load_returns_the_verified_bytes(tmp_path: Path, leases: None) -> None:
    _save(tmp_path / "c")
    code = CHILD_COMMON + """
truncator = []
real_verify = _materialize._verify_parallel

def verify_then_race(*args):
    # The file is mapped under the lease: start a truncation in another process and wait
    # until this process has been told (the lease break) and has moved the bytes away.
    truncator.append(subprocess.Popen(TRUNCATE, stdout=subprocess.PIPE, text=True))
    wait_for(lambda: _lease.migrations(), "the lease break")
    real_verify(*args)

_materialize._verify_parallel = verify_then_race
got = ckpt.open(path).state()["s"]
out = truncator[0].communicate()[0].strip()
assert out == "truncated" and os.path.getsize(tensor_file) == 0, out
assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
print("ok", sum(float(v.double().sum()) for v in got.values()) == sum(float(v.double().sum()) for v in want.values()))
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == ["ok", "True"]
    with pytest.raises(CkptError):  # the truncated checkpoint itself is now refused
        ckpt.open(tmp_path / "c").state()


@pytest.mark.slow
def test_tensors_in_use_survive_a_truncation_after_the_load(tmp_path: Path, leases: None) -> None:
    _save(tmp_path / "c")
    code = CHILD_COMMON + """
got = ckpt.open(path).state()["s"]
got["t0"][0] = 123.0             # a written page is a private copy already
got["t1"].mul_(2)                # every page of t1 written
p = subprocess.run(TRUNCATE, capture_output=True, text=True)
assert p.stdout.strip() == "truncated", p
assert _lease.migrations() == (tensor_file,), _lease.migrations()
assert got["t0"][0].item() == 123.0 and torch.equal(got["t0"][1:], want["t0"][1:])
assert torch.equal(got["t1"], want["t1"] * 2)
assert all(torch.equal(got[k], want[k]) for k in want if k not in ("t0", "t1"))
# the tensors are plain memory now: sum them all (a SIGBUS would kill us here)
print("ok", round(sum(float(v.double().abs().sum()) for v in got.values()), 3) > 0)
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == ["ok", "True"]


@pytest.mark.slow
def test_without_a_lease_a_truncation_during_the_read_is_a_clear_error(tmp_path: Path) -> None:
    _save(tmp_path / "c")
    code = CHILD_COMMON + """
from ckpt.storage import posix
from ckpt.errors import CkptError
real = posix.LocalFile.pread_into
calls = []

def pread_then_truncate(self, offset, buf):
    got = real(self, offset, buf)
    if not calls and len(buf) >= 1_000_000:  # the first tensor is read: now cut the file short
        calls.append(offset)
        subprocess.run(TRUNCATE, check=True, capture_output=True)
    return got

posix.LocalFile.pread_into = pread_then_truncate
try:
    ckpt.open(path).state(mmap=False)
except CkptError as e:
    print("refused", type(e).__name__, os.path.basename(e.path or ""))
print("alive", sum(1 for _ in range(3)))
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == ["refused", "SizeMismatchError", "rank-00000.safetensors", "alive", "3"], p.stdout


def test_no_lease_while_the_file_is_open_for_writing_reads_into_fresh_memory(tmp_path: Path) -> None:
    tf = _save(tmp_path / "c")
    before = len(_lease.migrations())
    fd = os.open(tf, os.O_WRONLY)  # a writer holds the file: the kernel refuses a read lease
    try:
        got = ckpt.open(tmp_path / "c").state()["s"]
    finally:
        os.close(fd)
    want = _state()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(t.untyped_storage().resizable() for t in got.values())  # read into torch-owned memory
    os.truncate(tf, 0)  # nothing maps the file: nothing to protect, nothing to fault
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(_lease.migrations()) == before


def test_the_default_load_maps_and_mmap_false_reads(tmp_path: Path, leases: None) -> None:
    _save(tmp_path / "c")
    want = _state()
    mapped = ckpt.open(tmp_path / "c").state()["s"]
    read = ckpt.open(tmp_path / "c").state(mmap=False)["s"]
    for k in want:
        assert torch.equal(mapped[k], want[k]) and torch.equal(read[k], want[k])
        # each mapped tensor owns a storage of exactly its bytes (torch.save of one writes one)
        assert mapped[k].untyped_storage().nbytes() == want[k].numel() * want[k].element_size()
        assert not mapped[k].untyped_storage().resizable() and read[k].untyped_storage().resizable()
    mapped["t2"].add_(1)  # copy-on-write: the file keeps the saved bytes
    again = ckpt.open(tmp_path / "c").state(mmap=False)["s"]
    assert torch.equal(again["t2"], want["t2"])


def test_a_corrupt_chunk_in_either_half_is_refused_before_anything_is_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt import _materialize

    monkeypatch.setattr(_materialize, "_PARALLEL_VERIFY_MIN", 0)  # two threads even for a small file
    tf = _save(tmp_path / "c")
    r = ckpt.open(tmp_path / "c")
    f = r.part().file("tensors")
    nchunks = (f.size + f.chunk_size - 1) // f.chunk_size
    assert nchunks >= 2
    size = tf.stat().st_size
    for where in (size // 4, size - 5):  # one flip in each half, one at a time
        data = bytearray(tf.read_bytes())
        data[where] ^= 0x40
        tf.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatchError) as e:
            ckpt.open(tmp_path / "c").state()
        assert e.value.context["chunk"] == where // f.chunk_size
        data[where] ^= 0x40
        tf.write_bytes(bytes(data))
    got = ckpt.open(tmp_path / "c").state()["s"]
    assert torch.equal(got["t5"], _state()["t5"])


@pytest.mark.slow
def test_the_first_load_off_the_main_thread_reads_mmap_true_refuses_and_unsafe_mmap_maps(tmp_path: Path) -> None:
    _save(tmp_path / "c")
    code = CHILD_COMMON + """
import threading
from ckpt.errors import UnprotectedMappingError
res = {}
def load():
    res["s"] = ckpt.open(path).state()["s"]          # no handler can be installed here
    try:
        ckpt.open(path).state(mmap=True)             # a mapping is asked for: never an unprotected one
    except UnprotectedMappingError as e:
        res["refused"] = os.path.basename(e.path)
    res["m"] = ckpt.open(path).state(unsafe_mmap=True)["s"]  # the explicit opt-in: mapped, unprotected
th = threading.Thread(target=load); th.start(); th.join()
s, m = res["s"], res["m"]
assert all(torch.equal(s[k], want[k]) and torch.equal(m[k], want[k]) for k in want)
print(res.get("refused"), all(t.untyped_storage().resizable() for t in s.values()),
      any(t.untyped_storage().resizable() for t in m.values()), len(_lease._LIVE))
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == ["rank-00000.safetensors", "True", "False", "0"]


def test_the_lease_handler_opt_out_and_the_explicit_install(tmp_path: Path, leases: None) -> None:
    """``CKPT_LEASE_HANDLER=off``: no load installs a signal handler (fresh memory instead of
    a mapping); ``ckpt.storage.install_lease_handler()`` from the main thread installs it,
    after which a load in another thread maps too; off the main thread it is refused."""
    _save(tmp_path / "c")
    code = CHILD_COMMON + """
import signal, threading
import ckpt.storage
from ckpt.errors import UnprotectedMappingError
os.environ["CKPT_LEASE_HANDLER"] = "off"
sig = _lease.lease_signal()
s = ckpt.open(path).state()["s"]
untouched = signal.getsignal(sig) is signal.SIG_DFL and not _lease.handler_installed()
res = {}
def install():
    try:
        ckpt.storage.install_lease_handler()
    except UnprotectedMappingError as e:
        res["refused"] = "main thread" in str(e)
th = threading.Thread(target=install); th.start(); th.join()
ckpt.storage.install_lease_handler()
ckpt.storage.install_lease_handler()  # idempotent
def load():
    res["m"] = ckpt.open(path).state()["s"]
th = threading.Thread(target=load); th.start(); th.join()
m = res["m"]
assert all(torch.equal(s[k], want[k]) and torch.equal(m[k], want[k]) for k in want)
print(untouched, all(t.untyped_storage().resizable() for t in s.values()), res.get("refused"),
      signal.getsignal(sig) is _lease._on_break, any(t.untyped_storage().resizable() for t in m.values()))
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == ["True", "True", "True", "True", "False"]


OVERWRITE = """
OVERWRITE = [sys.executable, "-c",
             "import sys; f = open(sys.argv[1], 'r+b'); f.seek(int(sys.argv[2])); f.write(bytes(64)); f.close(); print('written')",
             tensor_file]
offset = next(t.offset for t in ckpt.open(path).tensor_entries() if t.key == "s/t3")
"""


@pytest.mark.slow
def test_mmap_true_without_a_lease_is_refused_where_an_overwrite_would_change_the_tensors(tmp_path: Path) -> None:
    """Issue 22 item 11: no lease (the program owns the lease signal), a file overwritten in
    place. ``mmap=True`` refuses; the default reads fresh memory the write cannot reach; only
    ``unsafe_mmap=True`` maps, and its tensors change silently (the hazard it names)."""
    _save(tmp_path / "c")
    code = CHILD_COMMON + OVERWRITE + """
import signal
from ckpt.errors import UnprotectedMappingError
signal.signal(_lease.lease_signal(), lambda *a: None)  # the program uses the signal: no lease
try:
    ckpt.open(path).state(mmap=True)
    print("mapped")
except UnprotectedMappingError as e:
    print("refused", os.path.basename(e.path), "unsafe_mmap=True" in str(e))
fresh = ckpt.open(path).state()["s"]
unsafe = ckpt.open(path).state(unsafe_mmap=True)["s"]
print(subprocess.run(OVERWRITE + [str(offset)], capture_output=True, text=True).stdout.strip())
print(torch.equal(fresh["t3"], want["t3"]), torch.equal(unsafe["t3"], want["t3"]))
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == ["refused", "rank-00000.safetensors", "True", "written", "True", "False"], p.stdout


@pytest.mark.slow
def test_an_in_place_overwrite_after_a_leased_mmap_load_leaves_the_tensors_as_verified(tmp_path: Path, leases: None) -> None:
    """With the lease, ``mmap=True`` maps, and a writer opening the file breaks the lease
    first: the bytes are moved away before the write, which the tensors never see."""
    _save(tmp_path / "c")
    code = CHILD_COMMON + OVERWRITE + """
got = ckpt.open(path).state(mmap=True)["s"]
assert not got["t3"].untyped_storage().resizable()  # mapped
print(subprocess.run(OVERWRITE + [str(offset)], capture_output=True, text=True).stdout.strip())
assert _lease.migrations() == (tensor_file,), _lease.migrations()
print(all(torch.equal(got[k], want[k]) for k in want), torch.equal(ckpt.open(path).state(mmap=False, verify=False)["s"]["t3"], want["t3"]))
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == ["written", "True", "False"], p.stdout


def test_unsafe_mmap_contradicts_mmap_false(tmp_path: Path) -> None:
    _save(tmp_path / "c")
    with pytest.raises(ValueError, match="contradicts mmap=False"):
        ckpt.open(tmp_path / "c").state(mmap=False, unsafe_mmap=True)


@pytest.mark.slow
def test_an_unprotected_mapping_is_what_would_fault(tmp_path: Path) -> None:
    """The control: what the lease prevents. unsafe_mmap=True on a file with no lease possible
    (its signal is taken by the program), then a truncation: the child dies of SIGBUS."""
    _save(tmp_path / "c")
    code = CHILD_COMMON + """
import signal
signal.signal(_lease.lease_signal(), lambda *a: None)  # the program uses the signal: no lease
got = ckpt.open(path).state(unsafe_mmap=True)["s"]
subprocess.run(TRUNCATE, check=True, capture_output=True)
print("touching", flush=True)
float(got["t3"].sum())
print("survived")
"""
    p = _run(code, str(tmp_path / "c"))
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stdout, p.stderr[-2000:])
    assert p.stdout.split() == ["touching"]
