"""Checkpoints on a real S3-compatible server (moto's, started by the tests on localhost).

Every test talks HTTP to ``tests/s3server.py`` through the standard AWS environment
(``AWS_ENDPOINT_URL`` and keys): no in-process mock. What is covered: save, load and
lazy ranged reads; multipart uploads; a writer SIGKILLed mid-upload or before its
MANIFEST; two writers racing for one name; retention and latest-valid resume; the lock
object; the CLI on ``s3://`` URLs as subprocesses; corrupt, truncated and missing
objects; URLs no backend serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import ckpt
from ckpt import knobs
from ckpt.errors import (
    ChecksumMismatchError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    MissingFileError,
    RunDirLockedError,
    SizeMismatchError,
    UnsafePathError,
    UnsupportedSchemeError,
)
import hangs
import worlds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG = hangs.hang_s(12)  # a subprocess that has not finished by then is stuck, not slow

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ckpt.ledger.ResumeVerificationWarning")]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _objects(bucket, prefix: str) -> list[str]:
    st = bucket.storage()
    return sorted(o["path"] for o in st.walk(bucket.url(prefix)))


def _run(bucket, code: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return hangs.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=bucket.env,
                     capture_output=True, text=True, bound_s=HANG, input=stdin)


# --- save, load, lazy reads ------------------------------------------------------------


def test_save_load_and_lazy_reads_round_trip(s3, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory (no folder "s3:")
    m, opt = _model(1), None
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(4, 32)).sum().backward()
    opt.step()
    url = s3.url("run/step-00000001")
    info = ckpt.save(url, {"model": m, "optim": opt}, step=1, config={"lr": 1e-3})
    assert info.path == url
    # Every file of the save carries its tag; the MANIFEST names exactly those.
    r = ckpt.open(url)
    names = {f.name for f in r.manifest.files}
    assert _objects(s3, "run") == sorted(["run/step-00000001/MANIFEST", *(f"run/step-00000001/{n}" for n in names)])
    tag = next(iter(names)).split(".")[1]
    assert all(n.split(".")[1] == tag and len(tag) == 12 for n in names)

    m2 = _model(2)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    res = ckpt.load(url, {"model": m2, "optim": opt2}, exactness="off")
    assert res.step == 1 and res.path == url
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    fresh = ckpt.open(url).state()
    assert torch.equal(fresh["model"]["0.weight"], m.state_dict()["0.weight"])
    assert ckpt.open(url).verify().bytes == info.bytes
    assert os.listdir(tmp_path) == []


def test_the_service_specific_endpoint_variable_wins(s3, monkeypatch) -> None:
    from ckpt.storage import forget_backends

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    forget_backends()
    ckpt.save(s3.url("ep/step-00000001"), {"w": torch.ones(3)}, step=1)
    assert torch.equal(ckpt.open(s3.url("ep/step-00000001")).state()["w"], torch.ones(3))


def test_lazy_tensor_fetches_only_its_chunks(s3) -> None:
    ts = {f"t{i}": torch.full((256 * 1024,), float(i)) for i in range(6)}  # 1 MiB each
    url = s3.url("lazy/step-00000001")
    with ckpt.knobs.override(chunk_size=64 * 1024):
        ckpt.save(url, {"w": ts}, step=1)
    r = ckpt.open(url)
    st = r.storage
    before = st.stats.snapshot()
    got = r.tensor("w/t3")
    after = st.stats.snapshot()
    assert torch.equal(got, ts["t3"])
    fetched = after["get_bytes"] - before["get_bytes"]
    size = r.part().file("tensors").size
    # The tensor's 1 MiB plus at most one 64 KiB chunk each side (and the header), of a 6 MiB file.
    assert 1 << 20 <= fetched <= (1 << 20) + 3 * 64 * 1024 + 4096, (fetched, size)


def test_large_file_is_a_parallel_multipart_upload_hashed_while_streaming(s3) -> None:
    st = s3.storage()
    big = {"w": torch.randn(12 * (1 << 20) // 4 * 3)}  # 36 MiB: three 16 MiB parts
    url = s3.url("big/step-00000001")
    info = ckpt.save(url, big, step=1)
    f = ckpt.open(url).part().file("tensors")
    etag = st.etag(f"{url}/{f.name}")
    assert etag is not None and etag.strip('"').endswith("-3"), etag  # S3 names a multipart object's part count
    assert ckpt.open(url).verify().bytes == info.bytes  # the digests computed on upload match the bytes stored
    assert torch.equal(ckpt.open(url).state()["w"], big["w"])
    # Unverified reads of a large part take the local two-thread path's branch: one handle, shared.
    assert torch.equal(ckpt.open(url).state(verify=False)["w"], big["w"])
    target = {"w": torch.empty_like(big["w"])}
    ckpt.load(url, target, verify=False, restore_rng=False, exactness="off")
    assert torch.equal(target["w"], big["w"])


def test_in_place_load_downloads_each_byte_once(s3) -> None:
    """The two passes of an in-place load (verify every chunk, then copy) read the second
    time from a local spool of the first, not from the store again."""
    w = torch.randn(6 << 20)  # 24 MiB: several read blocks
    url = s3.url("once/step-00000001")
    ckpt.save(url, {"w": {"x": w}}, step=1)
    r = ckpt.open(url)
    size = r.part().file("tensors").size
    target = {"w": {"x": torch.empty_like(w)}}
    before = r.storage.stats.snapshot()["get_bytes"]
    ckpt.load(url, target, exactness="off", restore_rng=False)
    fetched = r.storage.stats.snapshot()["get_bytes"] - before
    assert torch.equal(target["w"]["x"], w)
    assert size <= fetched < size + (1 << 20), (fetched, size)  # + MANIFEST, header, state file


# --- crash safety: SIGKILL of the writer -----------------------------------------------

_KILLED_WRITER = """
import sys
import torch
import ckpt
from ckpt.storage.s3 import S3Storage
from tests.sim.faultfs import FaultPlan, FaultRule, FaultyStorage

url, where, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
# mid-upload: SIGKILL right after the tensor bytes (the tensor file's second write, after
# its header) were handed to the sink, whose multipart upload is then in flight;
# before-manifest: SIGKILL when the commit would put MANIFEST
rule = (FaultRule("sigkill", "write", ".safetensors", skip=1, after=True) if where == "mid-upload"
        else FaultRule("sigkill", "publish"))
st = FaultyStorage(S3Storage(url.split("/")[2]), FaultPlan(rules=[rule]))
w = torch.full((12 << 20,), 7.0)
assert w.numel() * w.element_size() > st.inner.part_size  # a multipart upload (S3Sink)
ckpt.save(url, {"w": w}, step=2, overwrite=overwrite, storage=st)
print("not killed")
"""


@pytest.mark.parametrize("where", ["mid-upload", "before-manifest"])
def test_sigkill_during_a_save_never_leaves_a_committed_checkpoint(s3, where: str) -> None:
    url = s3.url("run/step-00000002")
    p = _run(s3, _KILLED_WRITER, url, where, "0")
    assert p.returncode == -9, (p.returncode, p.stderr[-2000:])
    assert f"run/step-00000002/MANIFEST" not in _objects(s3, "run")
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)) as ei:
        ckpt.open(url)
    assert url in str(ei.value)
    if where == "before-manifest":
        assert isinstance(ei.value, IncompleteCheckpointError)  # parts uploaded, never committed
        assert _objects(s3, "run/step-00000002")
    # Cleanup leaves a save's objects alone while they are young (a writer without the
    # run's lock may still commit them), and removes them once older than the grace.
    left = _objects(s3, "run")
    assert ckpt.writer.recover(s3.url("run")).removed == () and _objects(s3, "run") == left
    with knobs.override(orphan_grace_s=0):
        rec = ckpt.writer.recover(s3.url("run"))
    assert _objects(s3, "run") == []
    assert bool(rec.removed) == (where == "before-manifest")


def test_sigkill_while_replacing_keeps_the_old_checkpoint(s3) -> None:
    url = s3.url("run/step-00000002")
    ckpt.save(url, {"w": torch.full((16,), 1.0)}, step=2)
    for where in ("mid-upload", "before-manifest"):
        p = _run(s3, _KILLED_WRITER, url, where, "1")
        assert p.returncode == -9, p.stderr[-2000:]
        r = ckpt.open(url)  # leftovers of the dead save are ignored by readers...
        assert torch.equal(r.state()["w"], torch.full((16,), 1.0))
        r.verify()
    with knobs.override(orphan_grace_s=0):  # (aged: see the test above)
        ckpt.writer.recover(s3.url("run"))  # ...and removed by cleanup, the committed files kept
    assert len(_objects(s3, "run")) == 3
    ckpt.open(url).verify()


# --- two writers racing for one name ---------------------------------------------------

_RACER = """
import json, sys
import torch
import ckpt
from ckpt.errors import CheckpointExistsError

me, url = int(sys.argv[1]), sys.argv[2]
pending = ckpt.begin(url)                       # both pass the early existence check
part = ckpt.write_part(pending, "rank-00000", {"who": torch.tensor([me])}, step=1)
print("ready", flush=True)
sys.stdin.readline()                            # the test releases both writers together
try:
    ckpt.commit(pending, [part], step=1)
    print(json.dumps({"won": True}))
except CheckpointExistsError as e:
    ckpt.abort(pending)
    print(json.dumps({"won": False, "err": str(e)}))
"""


def test_conditional_put_race_exactly_one_writer_wins(s3) -> None:
    url = s3.url("race/step-00000001")
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RACER), str(i), url], cwd=ROOT, env=s3.env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (1, 2)]
    for p in procs:  # both have uploaded their parts and wait before the MANIFEST put
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [hangs.communicate(p, bound_s=HANG) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    winners = [i for i, r in zip((1, 2), res) if r["won"]]
    assert len(winners) == 1, res
    loser = next(r for r in res if not r["won"])
    assert "already exists" in loser["err"] and url in loser["err"]
    r = ckpt.open(url)
    assert r.state()["who"].tolist() == winners
    r.verify()
    # The loser removed its own objects; only the winner's remain.
    names = {f.name for f in r.manifest.files}
    assert _objects(s3, "race") == sorted(["race/step-00000001/MANIFEST", *(f"race/step-00000001/{n}" for n in names)])


def test_the_server_honours_if_none_match(s3) -> None:
    """The property the race relies on, checked on the server directly."""
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    st = s3.storage()
    st.put(s3.url("x/MANIFEST"), b"one", mode="create")
    with pytest.raises((AlreadyExistsError, PreconditionError)):
        st.put(s3.url("x/MANIFEST"), b"two", mode="create")
    etag = st.etag(s3.url("x/MANIFEST"))
    with pytest.raises(PreconditionError):
        st.put(s3.url("x/MANIFEST"), b"three", mode={"e_tag": '"0000"'})
    st.put(s3.url("x/MANIFEST"), b"four", mode={"e_tag": etag})
    assert st.read_all(s3.url("x/MANIFEST")) == b"four"


def test_overwrite_replaces_and_removes_the_old_files(s3) -> None:
    url = s3.url("ow/step-00000001")
    ckpt.save(url, {"w": torch.zeros(8)}, step=1)
    with pytest.raises(CheckpointExistsError):
        ckpt.save(url, {"w": torch.ones(8)}, step=1)
    ckpt.save(url, {"w": torch.ones(8)}, step=1, overwrite=True)
    r = ckpt.open(url)
    assert torch.equal(r.state()["w"], torch.ones(8))
    assert len(_objects(s3, "ow")) == 1 + len(r.manifest.files)  # the old save's files are gone


# --- the manager: retention, latest valid, the lock ------------------------------------


def test_manager_retention_and_latest_valid_resume(s3) -> None:
    from ckpt import CheckpointManager, RetentionPolicy, list_checkpoints

    run = s3.url("mgr")
    m = _model(3)
    at: dict[int, torch.Tensor] = {}
    with CheckpointManager(run, {"model": m}, every_steps=1, retention=RetentionPolicy(keep_last=2), signals=()) as mgr:
        for step in range(1, 5):
            with torch.no_grad():
                m[0].weight.add_(1.0)
            at[step] = m[0].weight.detach().clone()
            mgr.after_step(step)
        assert [r.deleted for r in mgr.reports] == [(), (), ("step-00000001",), ("step-00000002",)]
    assert [r.name for r in list_checkpoints(run)] == ["step-00000003", "step-00000004"]
    assert all(not o.startswith(("mgr/step-00000001/", "mgr/step-00000002/")) for o in _objects(s3, "mgr"))

    # Corrupt the newest: resume falls back to the one before, naming why.
    r4 = ckpt.open(f"{run}/step-00000004")
    f = r4.part().file("tensors")
    st = s3.storage()
    obj = f"{run}/step-00000004/{f.name}"
    data = bytearray(st.read_all(obj))
    data[-1] ^= 0xFF
    st.put(obj, bytes(data))
    found = ckpt.latest(run)  # what resume() will pick, from the object store, loading nothing
    assert (found.step, found.skipped[0][0]) == (3, "step-00000004")
    m2 = _model(4)
    with pytest.warns(ckpt.manager.ResumeFallbackWarning, match="step-00000004.*ChecksumMismatchError"):
        with CheckpointManager(run, {"model": m2}, signals=()) as mgr2:
            res = mgr2.resume()
    assert res.step == 3
    assert torch.equal(m2.state_dict()["0.weight"], at[3])
    # A model that does not fit stops the resume; nothing of the run is deleted or replaced.
    before = _objects(s3, "mgr")
    wide = torch.nn.Sequential(torch.nn.Linear(32, 65), torch.nn.ReLU(), torch.nn.Linear(65, 8))
    with CheckpointManager(run, {"model": wide}, every_steps=1, signals=()) as mgr3:
        with pytest.raises(ckpt.errors.ResumeMismatchError, match="does not fit"):
            mgr3.resume()
        with pytest.raises(ckpt.errors.ResumeMismatchError):
            mgr3.after_step(5)
    assert _objects(s3, "mgr") == before


def test_async_manager_saves_to_s3_in_the_background(s3) -> None:
    from ckpt import CheckpointManager, list_checkpoints

    run = s3.url("async")
    m = _model(5)
    with CheckpointManager(run, {"model": m}, every_steps=1, async_save=True, signals=()) as mgr:
        for step in (1, 2, 3):
            mgr.after_step(step)
        mgr.wait()
        assert [r.asynchronous for r in mgr.reports] == [True, True, True]
    assert [c.name for c in list_checkpoints(run)] == ["step-00000002", "step-00000003"]
    assert torch.equal(ckpt.open(f"{run}/step-00000003").state()["model"]["0.weight"], m.state_dict()["0.weight"])


def test_link_is_a_server_side_copy(s3) -> None:
    st = s3.storage()
    st.put(s3.url("l/a"), b"payload")
    before = st.stats.snapshot()["put_bytes"]
    assert st.link(s3.url("l/a"), s3.url("l/b.0123456789ab")) is True
    assert st.read_all(s3.url("l/b.0123456789ab")) == b"payload"
    assert st.stats.snapshot()["put_bytes"] == before  # no bytes went up again


def test_one_manager_per_run_prefix(s3) -> None:
    from ckpt import CheckpointManager

    run = s3.url("locked")
    with CheckpointManager(run, {"model": _model()}, signals=()):
        with pytest.raises(RunDirLockedError, match="another writer holds this run"):
            CheckpointManager(run, {"model": _model()}, signals=())
    with CheckpointManager(run, {"model": _model()}, signals=()):  # released on close
        pass
    # A lock left by a process of this host that is dead is taken over.
    p = _run(s3, """
        import os, signal, sys
        from ckpt.storage import resolve
        st, run = resolve(sys.argv[1])
        st.lock(run)
        os.kill(os.getpid(), signal.SIGKILL)
    """, run)
    assert p.returncode == -9
    with CheckpointManager(run, {"model": _model()}, signals=()):
        pass


# --- the CLI on s3:// URLs, as subprocesses --------------------------------------------


def _ckpt(bucket, *args: str) -> subprocess.CompletedProcess[str]:
    return hangs.run([sys.executable, "-m", "ckpt_cli", *args], cwd=ROOT, env=bucket.env,
                     capture_output=True, text=True, bound_s=HANG)


def test_cli_ls_verify_inspect_on_s3(s3) -> None:
    run = s3.url("cli")
    ckpt.save(f"{run}/step-00000001", {"model": _model()}, step=1)
    ckpt.save(f"{run}/step-00000002", {"model": _model()}, step=2)
    # an uncommitted prefix (a crashed save's parts)
    s3.storage().put(f"{run}/step-00000003/rank-00000.0123456789ab.safetensors", b"x" * 10)

    p = _ckpt(s3, "ls", run)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["name", "step", "time", "size", "status"]
    assert "step-00000001" in lines[1] and "step-00000002" in lines[2]
    assert "step-00000003" in lines[3] and "incomplete" in lines[3]

    p = _ckpt(s3, "verify", f"{run}/step-00000002")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"ok: {run}/step-00000002 (2 files, 2 chunks")

    p = _ckpt(s3, "inspect", f"{run}/step-00000001", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["step"] == 1

    p = _ckpt(s3, "verify", f"{run}/step-00000003")
    assert p.returncode == 4 and "no MANIFEST" in p.stderr and f"{run}/step-00000003" in p.stderr


# --- bad input: corrupt, truncated, missing objects -------------------------------------


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_damaged_objects_raise_the_documented_errors_naming_the_url(s3, damage: str) -> None:
    url = s3.url(f"bad/{damage}")
    ckpt.save(url, {"w": torch.arange(100_000, dtype=torch.float32)}, step=1)
    st = s3.storage()
    f = ckpt.open(url).part().file("tensors")
    obj = f"{url}/{f.name}"
    data = bytearray(st.read_all(obj))
    if damage == "corrupt":
        data[len(data) // 2] ^= 0x01
        st.put(obj, bytes(data))
        with pytest.raises(ChecksumMismatchError, match="chunk 0") as ei:
            ckpt.open(url).verify()
        with pytest.raises(ChecksumMismatchError):
            ckpt.open(url).state()
    elif damage == "truncated":
        st.put(obj, bytes(data[:-100]))
        with pytest.raises(SizeMismatchError, match="manifest says") as ei:
            ckpt.open(url)
    else:
        st.delete([obj])
        with pytest.raises(MissingFileError) as ei:
            ckpt.open(url)
    assert obj in str(ei.value) or url in str(ei.value)
    p = _ckpt(s3, "verify", url)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert url in p.stderr


def test_hostile_manifest_objects(s3) -> None:
    from ckpt.errors import FormatError, LimitExceededError

    st = s3.storage()
    st.put(s3.url("h/big/MANIFEST"), b"x" * 5000)
    before = st.stats.snapshot()["get_bytes"]
    with ckpt.knobs.override(max_manifest_bytes=4096):
        with pytest.raises(LimitExceededError, match="above the limit") as ei:
            ckpt.open(s3.url("h/big"))
    assert s3.url("h/big/MANIFEST") in str(ei.value)
    assert st.stats.snapshot()["get_bytes"] == before  # refused on its size, never downloaded
    st.put(s3.url("h/junk/MANIFEST"), b"CKPTMAN\x00" + b"\xff" * 200)
    with pytest.raises(FormatError) as ei:
        ckpt.open(s3.url("h/junk"))
    assert s3.url("h/junk/MANIFEST") in str(ei.value)
    with pytest.raises(UnsafePathError):
        ckpt.open(s3.url("h/../etc"))


# --- URLs no backend serves (no server needed) -------------------------------------------


def test_a_url_is_never_a_local_path(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url in ("gs://bucket/run/step-1", "az://c/run", "hdfs://nn/x"):
        with pytest.raises(UnsupportedSchemeError, match=url.split(":")[0] + "://") as ei:
            ckpt.save(url, {"w": torch.zeros(2)}, step=1)
        assert ei.value.exit_code == 2 and url in str(ei.value)
        with pytest.raises(UnsupportedSchemeError):
            ckpt.open(url)
    with pytest.raises(UnsupportedSchemeError, match=r"ckpt-replay\[gcs\]"):
        ckpt.CheckpointManager("gs://bucket/run", {"w": {"x": torch.zeros(1)}}, signals=())
    # An explicit local backend refuses a URL too.
    from ckpt.storage import local

    with pytest.raises(UnsupportedSchemeError):
        ckpt.save("s3://bucket/x", {"w": torch.zeros(2)}, storage=local)
    from ckpt.stream import read_stream

    with pytest.raises(UnsupportedSchemeError, match="local directories"):
        read_stream(lambda n: b"", "s3://bucket/received")
    assert os.listdir(tmp_path) == []  # no folder named "gs:", "s3:", ...


def test_s3_without_the_extra_names_the_extra(tmp_path, monkeypatch) -> None:
    import ckpt.storage._url as urlmod

    monkeypatch.setitem(urlmod.BACKENDS, "s3", "ckpt.storage._not_installed:S3Storage.from_url")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedSchemeError, match=r"pip install 'ckpt-replay\[s3\]'"):
        ckpt.save("s3://bucket/run/step-1", {"w": torch.zeros(2)}, step=1)
    assert os.listdir(tmp_path) == []


def test_cli_refuses_an_unknown_scheme_without_creating_anything(tmp_path) -> None:
    for args in (["verify", "gs://b/run/step-1"], ["ls", "gs://b/run"], ["inspect", "gs://b/x"]):
        p = hangs.run([sys.executable, "-m", "ckpt_cli", *args], cwd=tmp_path, capture_output=True, text=True,
                      bound_s=HANG, env={**os.environ, "PYTHONPATH": ROOT})
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert "gs://" in p.stderr and "ckpt-replay[gcs]" in p.stderr
    assert os.listdir(tmp_path) == []


def test_import_ckpt_does_not_import_the_s3_backend() -> None:
    p = hangs.run([sys.executable, "-c", "import sys, ckpt, ckpt.storage, ckpt.reader, ckpt.manager;"
                        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('obstore', 's3fs', 'boto3') or m == 'ckpt.storage.s3'))"],
                  cwd=ROOT, capture_output=True, text=True, bound_s=HANG)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# --- two gloo ranks saving to one s3:// checkpoint ---------------------------------------


def _dist_worker(rank: int, init: str, timeout: Any, url: str, env: dict, out: str) -> None:
    import traceback

    os.environ.update(env)  # the forkserver may predate this test's environment
    result: dict = {"rank": rank}
    try:
        import torch.distributed as dist

        from ckpt.distributed import DistributedCheckpointer
        from ckpt.manager import CheckpointManager, RetentionPolicy, list_checkpoints

        worlds.arm(out, rank)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timeout)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        per = {"r": torch.tensor([rank])}
        dc = DistributedCheckpointer()
        dc.save(f"{url}/ck", {"model": model, "per": per}, replicated=["model"], step=1)
        with torch.no_grad():
            model.weight.zero_()
        per["r"].fill_(-1)
        got = dc.load(f"{url}/ck", {"model": model, "per": per}, exactness="off")
        result.update(part=got.part, per=int(per["r"]), restored=bool(model.weight.abs().sum() > 0))
        r = ckpt.open(f"{url}/ck")
        result["tags"] = sorted({f.name.split(".")[1] for f in r.manifest.files})
        with CheckpointManager(f"{url}/run", {"model": model, "per": per}, every_steps=1, signals=(),
                               retention=RetentionPolicy(keep_last=2)) as mgr:
            for step in (1, 2, 3):
                mgr.after_step(step)
        with CheckpointManager(f"{url}/run", {"model": model, "per": per}, signals=()) as mgr:
            result["resumed"] = mgr.resume(exactness="off").step
        result["run"] = [c.name for c in list_checkpoints(f"{url}/run")]
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_ranks_save_one_checkpoint_and_run_a_manager_on_s3(s3, tmp_path) -> None:
    from ckpt.testing.resume_entry import _forkserver, _main_not_reimported

    ctx = _forkserver()
    env = {k: v for k, v in s3.env.items() if k.startswith("AWS_")}
    init, timeout = worlds.file_init(tmp_path), worlds.pg_timeout(10)
    procs = [ctx.Process(target=_dist_worker, args=(r, init, timeout, s3.url("dist"), env, str(tmp_path)))
             for r in range(2)]
    with _main_not_reimported():
        for p in procs:
            p.start()
    worlds.join(procs, tmp_path, bound_s=hangs.hang_s(10))
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert "error" not in res, res["error"]
        assert res["restored"] and res["resumed"] == 3
        assert res["run"] == ["step-00000002", "step-00000003"]
        assert len(res["tags"]) == 1  # both ranks' files carry the one tag rank 0 drew
    assert [res["part"] for res in results] == ["rank-00000", "rank-00001"]
    assert [res["per"] for res in results] == [0, 1]
    ckpt.open(s3.url("dist/ck")).verify()


_SHARDED = """
import os, sys, datetime
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import ckpt

url, init, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo", init_method=init, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s))
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
full = torch.randn(8, 4)
state = {"w": {"x": distribute_tensor(full, mesh, [Shard(0)])}}
info = ckpt.save(url, state, step=5)                 # DTensor state: through DCP, our format
r = ckpt.open(url)
assert "sharded" in r.meta, r.meta
assert torch.equal(r.state()["w"]["x"], full)
target = {"w": {"x": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}}
ckpt.load(url, target, exactness="off")
assert torch.equal(target["w"]["x"].full_tensor(), full)
dist.destroy_process_group()
print("ok", info.path)
"""


def test_sharded_dtensor_state_through_dcp_to_s3(s3, tmp_path) -> None:
    url = s3.url("sharded/step-00000005")
    p = _run(s3, _SHARDED, url, worlds.file_init(tmp_path), str(worlds.pg_timeout(10).total_seconds()))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == f"ok {url}"
    ckpt.open(url).verify()


def test_no_credentials_fails_at_once(monkeypatch) -> None:
    """With instance metadata disabled (the standard switch; tests/conftest.py sets it) and
    no credentials, an s3:// URL fails before any request, naming the bucket."""
    pytest.importorskip("obstore")
    from ckpt.errors import StorageError
    from ckpt.storage import forget_backends

    for k in ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
              "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    forget_backends()
    with pytest.raises(StorageError, match="no AWS credentials") as ei:
        ckpt.open("s3://some-bucket/run/step-1")
    assert "s3://some-bucket" in str(ei.value)
    forget_backends()
