"""Scale past this machine, by simulation (issue 17 item 7; spec/format-2.md §V.5, §V.9).

N ranks each write a part of 100 small tensors into one checkpoint on tmpfs (/dev/shm), for
N = 8, 64, 512 and 4096. For each N it measures:

- the size of the top-level MANIFEST (and, beside it, the size the MANIFEST would have with every
  part inline, and the size of DCP's pickled ``.metadata`` for the same N ranks and tensors);
- the commit latency: ``ckpt.commit`` once every part is durable (the MANIFEST written, fsynced,
  the directory renamed into place);
- ``ckpt inspect``, ``ckpt verify --quick`` and ``ckpt ls`` as a user runs them (a new process);
- latest-valid discovery in a run directory of 100 such checkpoints whose two newest are damaged
  (one never committed, one with a corrupt part manifest): the time to find the newest that opens
  (MANIFEST and directory checked) and verifies quickly for rank 0.

How the ranks are simulated:

- N = 8: 8 real processes in one torch.distributed (gloo) job call
  ``ckpt.distributed.DistributedCheckpointer.save`` (the collectives for real); the commit is
  timed inside rank 0. The same 8 processes then save the same shapes as DTensor shards with
  ``torch.distributed.checkpoint.save``, and DCP's real ``.metadata`` is measured: it checks the
  stand-in below.
- N >= 64: an in-process stand-in for the collectives. The protocol is the one
  ``DistributedCheckpointer.save`` runs: the committer creates the temporary directory
  (``ckpt.begin``; the broadcast of its name becomes an argument), every rank writes its part
  (``ckpt.write_part``, in a pool of worker processes that take ranks in turn), the part records
  come back as the bytes a rank would send (``to_dict()`` through msgpack: the all-gather), and
  the committer commits. Above 16 ranks parts are listed by reference (part manifests), as the
  distributed checkpointer does. DCP's ``.metadata`` is built from DCP's own dataclasses, as its
  planner fills them for an FSDP-style layout (every rank holds a 1/N shard of each of 100 global
  tensors) and pickled, as DCP writes it.

Targets at N = 4096: MANIFEST <= 1 MiB, commit <= 1 s, inspect <= 1 s.

Usage: python bench/scale.py [--ranks 8,64,512,4096] [--tensors 100] [--dir /dev/shm] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import msgpack  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
ELEMS = 64  # float32 per tensor: 256 bytes, "small tensors"


def _state(rank: int, tensors: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(rank)
    return {"model": {f"layer{i}.weight": torch.randn(ELEMS, generator=g) for i in range(tensors)}}


# --- the stand-in: worker processes write parts, the committer commits -------------------------------


def _write_ranks(args: tuple[str, str, bool, list[int], int]) -> list[bytes]:
    final, tmp, refs, ranks, tensors = args
    from ckpt.writer import PendingCheckpoint, part_name_for_rank, write_part

    pending = PendingCheckpoint(final=final, tmp_dir=tmp, part_manifests=refs)
    out = []
    for r in ranks:
        part = write_part(pending, part_name_for_rank(r), _state(r, tensors), step=1, rng=False,
                          lineage={"run_id": "scale", "resumed_from": None})
        out.append(msgpack.packb({"part": part.to_dict()}, use_bin_type=True))  # what a rank sends
    return out


def simulated_save(path: str, n: int, tensors: int, pool: ProcessPoolExecutor) -> dict[str, Any]:
    from ckpt.format.manifest import part_record
    from ckpt.knobs import knobs
    from ckpt.writer import begin, commit

    refs = n > knobs().inline_parts_max
    pending = begin(path, part_manifests=refs)
    jobs = [(pending.final, pending.tmp_dir, refs, list(range(w, n, 8)), tensors) for w in range(8)]
    t0 = time.perf_counter()
    records = [rec for batch in pool.map(_write_ranks, jobs) for rec in batch]
    write_s = time.perf_counter() - t0
    parts = [part_record(msgpack.unpackb(b, raw=False)["part"]) for b in records]  # the all-gather
    t0 = time.perf_counter()
    commit(pending, parts, step=1)  # every part is durable: write_part fsyncs before it returns
    return {"commit_s": time.perf_counter() - t0, "write_parts_s": write_s, "by_reference": refs}


# --- N = 8: real processes ---------------------------------------------------------------------------------

_DIST = r"""
import json, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[5])
rank, world, path, tensors = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[6])
dist.init_process_group("gloo", rank=rank, world_size=world)
import ckpt.distributed as cd
from bench.scale import _state
timed = {}
real_commit = cd.commit
def commit(*a, **k):
    t0 = time.perf_counter()
    try:
        return real_commit(*a, **k)
    finally:
        timed["commit_s"] = time.perf_counter() - t0
cd.commit = commit
saver = cd.DistributedCheckpointer()
dist.barrier()
t0 = time.perf_counter()
saver.save(os.path.join(path, "step-00000001"), _state(rank, tensors), step=1, rng=False)
timed["save_s"] = time.perf_counter() - t0
# DCP: the same shapes as FSDP-style shards of 100 global tensors (its real .metadata)
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
mesh = init_device_mesh("cpu", (world,))
local = _state(rank, tensors)["model"]
sharded = {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()}
dcp.save({"model": sharded}, checkpoint_id=os.path.join(path, "dcp"))
dist.barrier()
if rank == 0:
    timed["dcp_metadata_bytes"] = os.path.getsize(os.path.join(path, "dcp", ".metadata"))
    print(json.dumps(timed))
dist.destroy_process_group()
"""


def real_processes(path: str, n: int, tensors: int) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _DIST, str(r), str(n), path, str(tensors), ROOT, port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for r in range(n)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"rank failed: {e[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


# --- DCP's metadata, built as its planner does -------------------------------------------------------------


def dcp_metadata_bytes(n: int, tensors: int) -> int:
    """Pickled size of DCP's Metadata for ``tensors`` global tensors sharded over ``n`` ranks."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, storage, planner = {}, {}, {}
    for i in range(tensors):
        fqn = f"model.layer{i}.weight"
        chunks = [ChunkStorageMetadata(offsets=torch.Size([r * ELEMS]), sizes=torch.Size([ELEMS])) for r in range(n)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n * ELEMS]), chunks)
        planner[fqn] = ("model", f"layer{i}.weight")
        for r in range(n):
            storage[MetadataIndex(fqn, torch.Size([r * ELEMS]), r)] = _StorageInfo(f"__{r}_0.distcp", i * 1500, 1500)
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id="/dev/shm/dcp", save_id="0" * 32, load_id=None))
    return len(pickle.dumps(md))


# --- measuring -------------------------------------------------------------------------------------------


def _cli(*args: str) -> float:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "ckpt_cli.main", *args], capture_output=True, text=True, cwd=ROOT)
    dt = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"ckpt {' '.join(args)}: {out.stderr[-2000:]}")
    return dt


def _median_cli(reps: int, *args: str) -> float:
    return statistics.median(_cli(*args) for _ in range(reps))


def inline_manifest_bytes(path: str) -> int:
    """The MANIFEST's size had every part been written inline (format 1.0 when nothing else is 2.0)."""
    import dataclasses

    import ckpt
    from ckpt.format.manifest import V2, encode_manifest, uses_v2

    m = ckpt.open(path).manifest
    parts = tuple(m.parts)  # reads every part manifest
    return len(encode_manifest(dataclasses.replace(m, parts=parts, version=V2 if uses_v2(parts) else (1, 0))))


def discovery(run: str, reps: int) -> dict[str, float]:
    """Newest-first search for the checkpoint a resume would take (rank 0's view)."""
    from ckpt import CheckpointReader
    from ckpt.errors import CkptError
    from ckpt.manager import list_checkpoints

    def find(quick: bool) -> str:
        for rec in reversed(list_checkpoints(run)):
            if not rec.committed:
                continue
            try:
                r = CheckpointReader(rec.path)
                if quick:
                    from ckpt._statecheck import check_part

                    pe = r.part("rank-00000")
                    r._header(pe)
                    check_part(r, pe, verify=False)
                return rec.name
            except CkptError:
                continue
        raise RuntimeError("no valid checkpoint")

    out = {}
    for quick in (False, True):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            got = find(quick)
            times.append(time.perf_counter() - t0)
        assert got == ("step-00000097" if quick else "step-00000098"), got
        out["open_s" if not quick else "open_and_quick_rank0_s"] = statistics.median(times)
    return out


def build_run(path: str, run: str, count: int = 100) -> None:
    """``count`` checkpoints: hard-linked copies of ``path`` (their bytes are the same; a resume
    reads only the newest ones), the three newest damaged: never committed (no MANIFEST), a file
    missing (refused at open), and rank 0's part detail corrupt (its part manifest, or for
    inline parts its safetensors header: refused by rank 0's quick check)."""
    os.makedirs(run)
    for i in range(1, count + 1):
        dst = os.path.join(run, f"step-{i:08d}")
        os.mkdir(dst)
        for name in os.listdir(path):
            os.link(os.path.join(path, name), os.path.join(dst, name))
    os.unlink(os.path.join(run, f"step-{count:08d}", "MANIFEST"))
    gone = os.path.join(run, f"step-{count - 1:08d}")
    os.unlink(os.path.join(gone, sorted(n for n in os.listdir(gone) if n.endswith(".safetensors"))[-1]))
    bad = os.path.join(run, f"step-{count - 2:08d}")
    victim = os.path.join(bad, "rank-00000.part")
    if not os.path.exists(victim):
        victim = os.path.join(bad, "rank-00000.safetensors")
    data = bytearray(open(victim, "rb").read())
    if victim.endswith(".part"):
        data[len(data) // 2] ^= 0xFF  # its reference's digest no longer matches
    else:
        data[8] = ord("X")  # the JSON header no longer starts with '{'
    os.unlink(victim)  # its own copy, not the shared inode
    with open(victim, "wb") as f:
        f.write(data)


def measure(n: int, tensors: int, base: str, pool: ProcessPoolExecutor, reps: int) -> dict[str, Any]:
    d = os.path.join(base, f"n{n}")
    os.makedirs(d)
    path = os.path.join(d, "step-00000001")
    row: dict[str, Any] = {"ranks": n}
    if n <= 8:
        got = real_processes(d, n, tensors)
        row.update(commit_s=got["commit_s"], dcp_metadata_bytes=got["dcp_metadata_bytes"], mode="processes (gloo)",
                   by_reference=False, dcp_metadata_bytes_sim=dcp_metadata_bytes(n, tensors))
        shutil.rmtree(os.path.join(d, "dcp"))
    else:
        row.update(simulated_save(path, n, tensors, pool), mode="in-process stand-in", dcp_metadata_bytes=dcp_metadata_bytes(n, tensors))
    row["manifest_bytes"] = os.path.getsize(os.path.join(path, "MANIFEST"))
    row["manifest_inline_bytes"] = inline_manifest_bytes(path) if row["by_reference"] else row["manifest_bytes"]
    row["files"] = len(os.listdir(path))
    row["inspect_s"] = _median_cli(reps, "inspect", path)
    row["verify_quick_s"] = _median_cli(reps, "verify", "--quick", path)
    row["ls_s"] = _median_cli(reps, "ls", d)
    run = os.path.join(d, "run")
    build_run(path, run)
    row.update({f"discovery_{k}": v for k, v in discovery(run, reps).items()})
    shutil.rmtree(d)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="8,64,512,4096")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir)
    rows = []
    try:
        with ProcessPoolExecutor(2) as pool:
            for n in (int(x) for x in args.ranks.split(",")):
                rows.append(measure(n, args.tensors, base, pool, args.reps))
                r = rows[-1]
                print(
                    f"N={n:5d} ({r['mode']}): MANIFEST {r['manifest_bytes'] / KiB:8.1f} KiB "
                    f"({'parts by reference; inline would be ' + format(r['manifest_inline_bytes'] / KiB, '.0f') + ' KiB' if r['by_reference'] else 'parts inline'}), "
                    f"DCP .metadata {r['dcp_metadata_bytes'] / KiB:8.1f} KiB ({r['dcp_metadata_bytes'] / r['manifest_bytes']:.1f}x ours); "
                    f"commit {r['commit_s'] * 1e3:7.1f} ms; inspect {r['inspect_s']:.2f} s, verify --quick {r['verify_quick_s']:.2f} s, "
                    f"ls {r['ls_s']:.2f} s; latest valid of 100: open {r['discovery_open_s'] * 1e3:.0f} ms, "
                    f"+ rank-0 quick check {r['discovery_open_and_quick_rank0_s'] * 1e3:.0f} ms",
                    flush=True,
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
