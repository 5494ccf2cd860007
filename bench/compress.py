"""Compression benchmark (issue 17 item 5; spec/format-2.md §V.3): BPZ1 byte planes + zstd.

Figures, each against the reference named, measured side by side in this run:

- size ratio (raw bytes / stored bytes) of `ckpt.save(compress=True)` on trained-like weights:
  targets float32 >= 1.15x, bfloat16 >= 1.4x; plain zstd-1 of the same bytes beside it (the
  reference: what a byte-oblivious compressor gets);
- save throughput, `ckpt.save(compress=True)` against `ckpt.save()` of the same state on local
  disk (durable, digests on): target >= 0.8x; an A/A pair (uncompressed against uncompressed) as
  the noise control. Cases (``--cases``): ``fp32`` (512 MiB of float32 in 16 tensors), ``bf16``
  (the same in bfloat16), ``model`` (an MLP + its AdamW state, ``--model-mib``);
- fresh-load time of the compressed checkpoint against the uncompressed one (informative);
- with ``--tmpfs``: the same saves into /dev/shm, where no disk waits and a save is CPU only
  (informative: it shows what the encoder costs when the CPU, not the sink, is the limit);
- with ``--s3``: save and load against a local S3-compatible server (moto, tests/s3server.py)
  through a bandwidth-capped proxy (bench/throttle.py; one token bucket each way, shared by all
  connections) at each cap of ``--caps`` (MB/s; 0 = the proxy uncapped: moto's own pace on these
  cores), compressed against uncompressed, with an A/A pair at every cap.

Timings are medians of paired ratios over >= 7 interleaved rounds (absolute speeds on these
shared 2-core VMs swing several-fold; only ratios are comparable). The machine's load average is
printed before and after.

The trained-like state is an MLP trained for a few AdamW steps on a synthetic regression: its
weights, both Adam moments, and a bfloat16 copy of the weights.

Usage: python bench/compress.py [--rounds 7] [--cases fp32,bf16,model] [--model-mib 96]
       [--dir DIR] [--tmpfs] [--s3 [--caps 50,200,0]] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


_CPU: dict[str, list[float]] = {}  # save kind -> CPU seconds (user + system, every thread of this process)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _durable_save(path: str, state: dict, compress: bool) -> float:
    c0 = _cpu()
    t0 = time.perf_counter()
    ckpt.save(path, state, compress=compress or None)
    t = time.perf_counter() - t0
    _CPU.setdefault("packed" if compress else "plain", []).append(_cpu() - c0)
    return t


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


def timings(state: dict, d: str, rounds: int, label: str = "") -> dict:
    """Interleaved rounds of three saves (uncompressed, compressed, uncompressed again: the
    A/A control) and two fresh loads, the order alternating; medians of per-round ratios."""
    save, aa, load = [], [], []
    tp, tc, lp, lc = [], [], [], []
    _CPU.clear()
    for i in range(rounds):
        paths = {k: f"{d}/{k}-{i}" for k in ("plain", "plain2", "packed")}
        order = ["plain", "packed", "plain2"] if i % 2 == 0 else ["packed", "plain2", "plain"]
        t = {k: _durable_save(paths[k], state, k == "packed") for k in order}
        save.append(t["plain"] / t["packed"])  # > 1: compressed saves faster
        aa.append(t["plain"] / t["plain2"])
        lt = {k: _load(paths[k]) for k in (("plain", "packed") if i % 2 == 0 else ("packed", "plain"))}
        load.append(lt["plain"] / lt["packed"])
        tp.append(t["plain"])
        tc.append(t["packed"])
        lp.append(lt["plain"])
        lc.append(lt["packed"])
        for p in paths.values():
            _remove(p)
        if label:
            print(f"    {label} round {i + 1}/{rounds}: save {t['plain'] * 1e3:.0f} / {t['packed'] * 1e3:.0f} / "
                  f"{t['plain2'] * 1e3:.0f} ms (plain / compressed / plain), load {lt['plain'] * 1e3:.0f} / "
                  f"{lt['packed'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    med = statistics.median
    return {
        "save_throughput_vs_uncompressed": med(save),
        "save_aa_control": med(aa),
        "save_rounds": save,
        "aa_rounds": aa,
        "fresh_load_speed_vs_uncompressed": med(load),
        "load_rounds": load,
        "plain_save_s": med(tp),
        "packed_save_s": med(tc),
        "plain_load_s": med(lp),
        "packed_load_s": med(lc),
        # CPU per save, this process only (the kernel's writeback threads are not in it):
        # on a machine whose cores are busy, the wall-time ratio tends to this one
        "plain_save_cpu_s": med(_CPU["plain"]),
        "packed_save_cpu_s": med(_CPU["packed"]),
    }


def flat_state(dtype: torch.dtype, mib: int = 512, tensors: int = 16) -> dict:
    """``mib`` MiB of weight-like values (normal, std 0.02) in ``tensors`` equal tensors."""
    g = torch.Generator().manual_seed(2)
    n = mib * MiB // (torch.finfo(dtype).bits // 8) // tensors
    return {"model": {f"layer{i}.weight": (torch.randn(n, generator=g) * 0.02).to(dtype) for i in range(tensors)}}


def _state_bytes(state: dict) -> int:
    total = 0
    for top in state.values():
        sd = top.state_dict() if hasattr(top, "state_dict") else top
        stack = [sd]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
    return total


def _load_line() -> str:
    a, b, c = os.getloadavg()
    return f"load average {a:.1f} {b:.1f} {c:.1f} on {os.cpu_count()} CPUs"


def _row(name: str, mib: float, t: dict) -> str:
    return (f"  {name:<22} {mib:6.0f} MiB  save throughput compressed / uncompressed {t['save_throughput_vs_uncompressed']:.2f}x "
            f"(A/A {t['save_aa_control']:.2f}x; median {mib / t['plain_save_s']:.0f} vs {mib / t['packed_save_s']:.0f} MiB/s)   "
            f"fresh load uncompressed / compressed time {t['fresh_load_speed_vs_uncompressed']:.2f}x\n"
            f"  {'':<22} {'':6}      CPU per save (this process) uncompressed {t['plain_save_cpu_s'] * 1e3:.0f} ms, "
            f"compressed {t['packed_save_cpu_s'] * 1e3:.0f} ms: ratio {t['plain_save_cpu_s'] / t['packed_save_cpu_s']:.2f}x")


def s3_caps(state: dict, caps: list[float], rounds: int, out: dict) -> None:
    """The same pairs against moto through the capped proxy, one cap after the other."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from s3server import start
    import throttle
    from ckpt.storage import forget_backends

    mib = _state_bytes(state) / MiB
    server = start()
    try:
        os.environ.update(server.env())
        server.create_bucket("bench-compress")
        print(f"to the S3-compatible server (moto) through a capped proxy, model + AdamW {mib:.0f} MiB, {rounds} interleaved "
              f"rounds per cap (save: uncompressed time / compressed time, > 1 = compression pays):")
        out["s3"] = {}
        for cap in caps:
            proxy = throttle.start(server.endpoint, cap)
            try:
                os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
                forget_backends()
                t = timings(state, f"s3://bench-compress/cap{cap:g}", rounds, label=f"s3 cap {cap:g}")
            finally:
                proxy.stop()
                os.environ["AWS_ENDPOINT_URL"] = server.endpoint
                forget_backends()
            name = f"cap {cap:g} MB/s" if cap > 0 else "uncapped (moto's pace)"
            t["plain_save_mb_s"] = mib * MiB / 1e6 / t["plain_save_s"]
            out["s3"][str(cap)] = t
            print(f"  {name:<24} save {t['save_throughput_vs_uncompressed']:.2f}x (A/A {t['save_aa_control']:.2f}x; "
                  f"uncompressed at {t['plain_save_mb_s']:.0f} MB/s)   load {t['fresh_load_speed_vs_uncompressed']:.2f}x "
                  f"(uncompressed {mib * MiB / 1e6 / t['plain_load_s']:.0f} MB/s)", flush=True)
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", default="fp32,bf16,model", help="which save cases: fp32, bf16 (512 MiB each), model")
    ap.add_argument("--model-mib", type=int, default=96)
    ap.add_argument("--dir", default=None, help="where the local saves go (default: the system temp dir)")
    ap.add_argument("--tmpfs", action="store_true", help="also time the saves into /dev/shm (CPU-bound, no disk)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--s3", action="store_true",
                    help="also time saves to a local S3-compatible server (moto, tests/s3server.py; needs the s3 extra)")
    ap.add_argument("--caps", default="50,200,0", help="--s3 bandwidth caps in MB/s, each way (0: proxy without a cap)")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    d = tempfile.mkdtemp(prefix="bench-compress-", dir=args.dir)
    out: dict = {"rounds": args.rounds, "load_before": os.getloadavg()}
    print(f"bench/compress.py: {_load_line()}")
    try:
        model, opt = trained_mlp(args.model_mib)
        rows = sizes(model, opt, d)
        out["sizes"] = rows
        print("size ratio (raw / stored), ckpt.save(compress=True) beside plain zstd-1 of the same bytes:")
        for r in rows:
            print(f"  {r['what']:<18} {r['mib']:7.1f} MiB   ckpt bpz1 {r['ckpt_bpz']:.3f}x   zstd-1 {r['zstd1']:.3f}x")
        states = {
            "fp32": ("512 MiB float32", lambda: flat_state(torch.float32)),
            "bf16": ("512 MiB bfloat16", lambda: flat_state(torch.bfloat16)),
            "model": ("model + AdamW", lambda: {"model": model, "optim": opt}),
        }
        sinks = [("local disk", d)]
        if args.tmpfs:
            sinks.append(("tmpfs (CPU only)", tempfile.mkdtemp(prefix="bench-compress-", dir="/dev/shm")))
        out["saves"] = {}
        for sink_name, where in sinks:
            print(f"saves to {sink_name} ({where}), durable, {args.rounds} interleaved rounds, median of paired ratios "
                  f"(target on local disk: save throughput >= 0.8x):")
            for case in cases:
                name, make = states[case]
                state = make()
                mib = _state_bytes(state) / MiB
                t = timings(state, where, args.rounds, label=f"{sink_name} {case}")
                out["saves"][f"{sink_name}/{case}"] = {"mib": mib, **t}
                print(_row(name, mib, t), flush=True)
                del state
            if where != d:
                shutil.rmtree(where, ignore_errors=True)
        if args.s3:
            caps = [float(c) for c in args.caps.split(",") if c]
            s3_caps({"model": model, "optim": opt}, caps, args.rounds, out)
        out["load_after"] = os.getloadavg()
        print(f"bench/compress.py done: {_load_line()}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
