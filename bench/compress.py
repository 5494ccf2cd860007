"""Compression benchmark (issue 17 item 5; spec/format-2.md §V.3): BPZ1 byte planes + zstd.

Figures, each against the reference named, measured side by side in this run:

- size ratio (raw bytes / stored bytes) of `ckpt.save(compress=True)` on trained-like weights:
  targets float32 >= 1.15x, bfloat16 >= 1.4x; plain zstd-1 of the same bytes beside it (the
  reference: what a byte-oblivious compressor gets);
- save throughput, `ckpt.save(compress=True)` against `ckpt.save()` of the same state on local
  disk (durable, digests on): target >= 0.8x; an A/A pair (uncompressed against uncompressed) as
  the noise control;
- fresh-load time of the compressed checkpoint against the uncompressed one (informative).

Timings are medians of paired ratios over >= 7 interleaved rounds (absolute speeds on these
shared 2-core VMs swing several-fold; only ratios are comparable).

The trained-like state is an MLP trained for a few AdamW steps on a synthetic regression: its
weights, both Adam moments, and a bfloat16 copy of the weights.

- the same save and load against a local S3-compatible server (``--s3``: moto, one request at a
  time), where the sink is slower than the encoder and compression is meant to pay.

Usage: python bench/compress.py [--rounds 7] [--model-mib 96] [--dir DIR] [--json OUT] [--s3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import zstandard  # noqa: E402

import ckpt  # noqa: E402
from ckpt.writer import tensor_memoryview  # noqa: E402

MiB = 1 << 20


def trained_mlp(size_mib: int, steps: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Weights ~ size/3, so weights + two moments ~ size."""
    width = 1024
    layers = max(2, size_mib * MiB // 3 // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(width, width, generator=g) / width**0.5
    for _ in range(steps):
        x = torch.randn(64, width, generator=g)
        loss = (model(x) - x @ w_true).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _zstd1(tensors: dict[str, torch.Tensor]) -> int:
    c = zstandard.ZstdCompressor(level=1)
    return sum(len(c.compress(tensor_memoryview(t.contiguous()))) for t in tensors.values())


def _packed_size(path: str) -> int:
    r = ckpt.open(path)
    return sum(t.stored for t in r.part().tensors if t.encoding)


def sizes(model: torch.nn.Module, opt: torch.optim.Optimizer, d: str) -> list[dict]:
    params = {k: v.detach() for k, v in model.state_dict().items() if v.dim() == 2}
    st = opt.state_dict()["state"]
    groups = {
        "float32 weights": params,
        "bfloat16 weights": {k: v.to(torch.bfloat16) for k, v in params.items()},
        "AdamW exp_avg": {str(i): s["exp_avg"] for i, s in st.items() if s["exp_avg"].dim() == 2},
        "AdamW exp_avg_sq": {str(i): s["exp_avg_sq"] for i, s in st.items() if s["exp_avg_sq"].dim() == 2},
    }
    rows = []
    for name, tensors in groups.items():
        path = os.path.join(d, "size-" + name.replace(" ", "-"))
        ckpt.save(path, {"t": tensors}, compress=True)
        raw = _bytes(tensors)
        rows.append({"what": name, "mib": raw / MiB, "ckpt_bpz": raw / _packed_size(path), "zstd1": raw / _zstd1(tensors)})
        shutil.rmtree(path)
    return rows


def _durable_save(path: str, state: dict, compress: bool) -> float:
    t0 = time.perf_counter()
    ckpt.save(path, state, compress=compress or None)
    return time.perf_counter() - t0


def _load(path: str) -> float:
    t0 = time.perf_counter()
    ckpt.open(path).state()
    return time.perf_counter() - t0


def _remove(path: str) -> None:
    if "://" in path:
        from ckpt.storage import resolve

        storage, p = resolve(path)
        storage.remove_tree(p)
    else:
        shutil.rmtree(path)


def timings(state: dict, d: str, rounds: int) -> dict:
    save, aa, load = [], [], []
    for i in range(rounds):
        paths = {k: f"{d}/{k}-{i}" for k in ("plain", "plain2", "packed")}
        order = ["plain", "packed", "plain2"] if i % 2 == 0 else ["packed", "plain2", "plain"]
        t = {k: _durable_save(paths[k], state, k == "packed") for k in order}
        save.append(t["plain"] / t["packed"])  # > 1: compressed saves faster
        aa.append(t["plain"] / t["plain2"])
        lt = {k: _load(paths[k]) for k in (("plain", "packed") if i % 2 == 0 else ("packed", "plain"))}
        load.append(lt["plain"] / lt["packed"])
        for p in paths.values():
            _remove(p)
    return {
        "save_throughput_vs_uncompressed": statistics.median(save),
        "save_aa_control": statistics.median(aa),
        "save_rounds": save,
        "fresh_load_speed_vs_uncompressed": statistics.median(load),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model-mib", type=int, default=96)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--s3", action="store_true",
                    help="also time saves to a local S3-compatible server (moto, tests/s3server.py; needs the s3 extra)")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench-compress-", dir=args.dir)
    server = None
    try:
        model, opt = trained_mlp(args.model_mib)
        rows = sizes(model, opt, d)
        print("size ratio (raw / stored), ckpt.save(compress=True) beside plain zstd-1 of the same bytes:")
        for r in rows:
            print(f"  {r['what']:<18} {r['mib']:7.1f} MiB   ckpt bpz1 {r['ckpt_bpz']:.3f}x   zstd-1 {r['zstd1']:.3f}x")
        state = {"model": model, "optim": opt}
        t = timings(state, d, args.rounds)
        mib = _bytes({k: v for k, v in model.state_dict().items()}) * 3 / MiB
        print(f"save of model + AdamW (~{mib:.0f} MiB, fp32), {args.rounds} interleaved rounds, median of paired ratios:")
        print(f"  compressed save throughput / uncompressed: {t['save_throughput_vs_uncompressed']:.2f}x "
              f"(target >= 0.8x; A/A control {t['save_aa_control']:.2f}x)")
        print(f"  fresh load, uncompressed time / compressed time: {t['fresh_load_speed_vs_uncompressed']:.2f}x")
        out = {"sizes": rows, "timings": t, "state_mib": mib, "rounds": args.rounds}
        if args.s3:
            # An object store through its HTTP API: moto serves one request at a time (a
            # slow sink, as remote stores are per writer); the same interleaved pairs.
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from s3server import start

            server = start()
            os.environ.update(server.env())
            server.create_bucket("bench-compress")
            ts = timings(state, "s3://bench-compress/run", args.rounds)
            out["s3"] = ts
            print(f"  to the S3-compatible server (moto): compressed save throughput / uncompressed "
                  f"{ts['save_throughput_vs_uncompressed']:.2f}x (A/A control {ts['save_aa_control']:.2f}x); "
                  f"load {ts['fresh_load_speed_vs_uncompressed']:.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
