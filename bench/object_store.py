"""Object storage: ckpt on S3 (moto's server on localhost) against its references.

Part 1 (``--part libraries``): the two candidate libraries side by side on the same
server: obstore and fsspec/s3fs, put and get of one object, 1 MiB range reads, and
which conditional writes each can express (If-None-Match create, If-Match replace).

Part 2 (``--part checkpoints``): save and load of a 256 MiB state (``--mib``):
``ckpt.save``/``ckpt.load`` to ``s3://`` against the same on the local filesystem, and
against ``torch.distributed.checkpoint.save``/``load`` to the same server through
DCP's fsspec writer and reader (s3fs underneath). Printed as ratios, medians of paired
per-round ratios over interleaved rounds (``--rounds``, default 7).

The server is moto's (Python, one request at a time: see tests/s3server.py), so the
absolute figures are those of that server on this machine, not of AWS S3; the ratios
compare the clients and protocols against one and the same server. ``--cap-mbps N`` puts a
bandwidth-capped proxy (``bench/throttle.py``, N MB/s each way, shared by all connections) between
every client and the server, for figures on a link slower than this machine's loopback.
"""

from __future__ import annotations

import argparse
import os
import warnings
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(ROOT, "tests"))

MiB = 1 << 20


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def libraries(server: Any, rounds: int, mib: int) -> None:
    import fsspec  # noqa: F401
    import obstore
    import s3fs
    from obstore.store import S3Store

    server.create_bucket("libs")
    env = server.env()
    store = S3Store("libs", config={"endpoint": env["AWS_ENDPOINT_URL"], "region": "us-east-1"},
                    client_options={"allow_http": True})
    fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=env["AWS_ENDPOINT_URL"], use_listings_cache=False)
    data = os.urandom(mib * MiB)
    times: dict[str, list[float]] = {k: [] for k in ("ob_put", "fs_put", "ob_get", "fs_get", "ob_range", "fs_range")}
    starts = [(i * 7919 * 4096) % (len(data) - MiB) for i in range(32)]
    for r in range(rounds):
        order = [("ob", "fs"), ("fs", "ob")][r % 2]
        for lib in order:
            key = f"obj-{lib}-{r}"
            if lib == "ob":
                times["ob_put"].append(_timed(lambda: obstore.put(store, key, data, chunk_size=16 * MiB, max_concurrency=8)))
                times["ob_get"].append(_timed(lambda: obstore.get(store, key).bytes()))
                times["ob_range"].append(_timed(lambda: [obstore.get_range(store, key, start=s, length=MiB) for s in starts]))
                obstore.delete(store, key)
            else:
                times["fs_put"].append(_timed(lambda: fs.pipe_file(f"libs/{key}", data, chunksize=16 * MiB)))
                times["fs_get"].append(_timed(lambda: fs.cat_file(f"libs/{key}")))
                times["fs_range"].append(_timed(lambda: [fs.cat_file(f"libs/{key}", start=s, end=s + MiB) for s in starts]))
                fs.rm_file(f"libs/{key}")
    print(f"libraries, {mib} MiB object, {rounds} interleaved rounds (median; ratio = s3fs time / obstore time):")
    for op, what in (("put", f"put {mib} MiB"), ("get", f"get {mib} MiB"), ("range", "32 x 1 MiB range reads")):
        ob, fsv = times[f"ob_{op}"], times[f"fs_{op}"]
        ratio = _med([f / o for f, o in zip(fsv, ob)])
        print(f"  {what:<24} obstore {_med(ob) * 1000:8.1f} ms   s3fs {_med(fsv) * 1000:8.1f} ms   s3fs/obstore {ratio:5.2f}x")
    # Conditional writes: what each API can say.
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    obstore.put(store, "cond", b"1", mode="create")
    try:
        obstore.put(store, "cond", b"2", mode="create")
        ob_create = "NOT refused"
    except (AlreadyExistsError, PreconditionError):
        ob_create = "refused (412)"
    etag = obstore.head(store, "cond")["e_tag"]
    try:
        obstore.put(store, "cond", b"3", mode={"e_tag": '"stale"'})
        ob_update = "NOT refused"
    except PreconditionError:
        obstore.put(store, "cond", b"3", mode={"e_tag": etag})
        ob_update = "stale ETag refused, current accepted"
    fs.pipe_file("libs/cond2", b"1", mode="create")
    try:
        fs.pipe_file("libs/cond2", b"2", mode="create")
        fs_create = "NOT refused"
    except Exception:
        fs_create = "refused"
    print(f"  If-None-Match create:    obstore {ob_create}; s3fs {fs_create} (pipe_file mode='create')")
    print(f"  If-Match replace:        obstore {ob_update}; s3fs no API for it (pipe_file has no ETag condition)")


def checkpoints(server: Any, rounds: int, mib: int) -> None:
    import torch

    import ckpt
    from ckpt.storage import forget_backends

    os.environ.update(server.env())
    forget_backends()
    server.create_bucket("bench")
    n = mib * MiB // 4
    state = {"model": {f"layer{i}.weight": torch.randn(n // 16) for i in range(16)}}
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-os-")
    dcp_ok = True
    why_no_dcp = ""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError as e:
        dcp_ok, why_no_dcp = False, f"ImportError: {e}"
    t: dict[str, list[float]] = {k: [] for k in ("s3_save", "s3_load", "s3_fresh", "fs_save", "fs_load", "fs_fresh", "dcp_save", "dcp_load")}
    st = None
    for r in range(rounds):
        url = f"s3://bench/r{r}/step-00000001"
        local = os.path.join(tmp, f"r{r}", "step-00000001")
        jobs: list[tuple[str, Callable[[], Any]]] = [
            ("s3_save", lambda: ckpt.save(url, state, step=1)),
            ("s3_load", lambda: ckpt.load(url, target, restore_rng=False, exactness="off")),
            ("s3_fresh", lambda: ckpt.open(url).state()),
            ("fs_save", lambda: ckpt.save(local, state, step=1)),
            ("fs_load", lambda: ckpt.load(local, target, restore_rng=False, exactness="off")),
            ("fs_fresh", lambda: ckpt.open(local).state()),
        ]
        if dcp_ok:
            dpath = f"s3://bench/dcp-r{r}"
            jobs += [
                ("dcp_save", lambda: dcp.save(state, storage_writer=FsspecWriter(dpath, sync_files=False))),
                ("dcp_load", lambda: dcp.load(target, storage_reader=FsspecReader(dpath))),
            ]
        if r % 2:
            jobs = jobs[6:] + jobs[:6]
        for name, fn in jobs:
            try:
                t[name].append(_timed(fn))
            except Exception as e:  # DCP's fsspec path may not run against this server
                if name.startswith("dcp"):
                    dcp_ok, why_no_dcp = False, f"{type(e).__name__}: {e}"
                    t["dcp_save"], t["dcp_load"] = [], []
                    continue
                raise
        st = ckpt.open(url).storage
        st.remove_tree(f"s3://bench/r{r}")
        st.remove_tree(f"s3://bench/dcp-r{r}")
        shutil.rmtree(os.path.join(tmp, f"r{r}"), ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a: str, b: str) -> float:
        return _med([x / y for x, y in zip(t[a], t[b])])

    print(f"checkpoints, {mib} MiB state, {rounds} interleaved rounds (median seconds; ratio = time / reference time):")
    rows = [
        ("ckpt.save  s3://", "s3_save", "fs_save", "dcp_save"),
        ("ckpt.load  s3:// (in place)", "s3_load", "fs_load", "dcp_load"),
        ("ckpt.open().state() s3://", "s3_fresh", "fs_fresh", None),
    ]
    for label, a, fsref, dref in rows:
        line = f"  {label:<30} {_med(t[a]):6.2f} s   vs local fs {_med(t[fsref]):5.2f} s: {ratio(a, fsref):5.1f}x"
        if dref and t.get(dref):
            line += f"   vs dcp+fsspec to the same server {_med(t[dref]):5.2f} s: {ratio(a, dref):4.2f}x"
        print(line)
    if not dcp_ok:
        print(f"  dcp.save through FsspecWriter did not run against this server: {why_no_dcp[:300]}")
    if st is not None:
        print(f"  MiB/s to the server: save {mib / _med(t['s3_save']):.0f}, in-place load {mib / _med(t['s3_load']):.0f}, "
              f"fresh load {mib / _med(t['s3_fresh']):.0f}")


def main() -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP on one process
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["libraries", "checkpoints", "all"], default="all")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mib", type=int, default=256, help="checkpoint state size")
    ap.add_argument("--object-mib", type=int, default=64, help="object size for the library comparison")
    ap.add_argument("--cap-mbps", type=float, default=0.0,
                    help="put a bandwidth-capped proxy (bench/throttle.py, MB/s each way) between every client and the server")
    args = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("s3fs") is None:
        # The references (s3fs, and DCP's fsspec writer on it) are not in the environment
        # `make venv` builds: s3fs's aiobotocore pins botocore below the boto3 that moto
        # needs, so installing it there breaks the S3 tests' server. Said, not hidden.
        print("bench/object_store.py: not run: s3fs is not installed (it would downgrade botocore below "
              "boto3's pin); run it in a separate environment: python -m venv /tmp/v && /tmp/v/bin/pip install "
              "torch==2.13.0 -e '.[test,s3]' s3fs")
        return
    from s3server import start

    server = start()
    os.environ.update(server.env())  # keys and endpoint for every client (never the instance-metadata path)
    proxy = None
    if args.cap_mbps > 0:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import throttle

        proxy = throttle.start(server.endpoint, args.cap_mbps)
        server.endpoint = proxy.endpoint  # server.env() now names the proxy: every client goes through it
        os.environ.update(server.env())
        print(f"every request goes through a proxy capped at {args.cap_mbps:g} MB/s each way (bench/throttle.py)")
    try:
        if args.part in ("libraries", "all"):
            libraries(server, args.rounds, args.object_mib)
        if args.part in ("checkpoints", "all"):
            checkpoints(server, args.rounds, args.mib)
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
