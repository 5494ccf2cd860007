"""Issue 13 §2-§3 figures, as ratios against references measured side by side.

1. CLI start-up: ``ckpt --help`` and ``ckpt inspect`` against a bare ``python -c pass``
   (the floor) and ``python -c "import torch"`` (what importing torch would add).
2. ``ckpt.open(p).config()`` (structure file only) against ``ckpt.open(p).state()`` (every
   tensor), the way a script read the config before: time, on a ~``--mib`` MiB checkpoint.
3. ``state("model")`` against ``state()`` of a model + AdamW checkpoint (the optimizer holds
   twice the model's bytes): time.
4. ``ckpt export hf`` (verified copy from the checkpoint) against ``safetensors.torch.save_file``
   of the same tensors from memory (what ``save_pretrained`` does underneath), both fsynced.

Interleaved rounds, medians of paired ratios; the page cache is warm for every read.
``python bench/cli_hf.py [--rounds 7] [--mib 256]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _t(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _proc(args: list[str]) -> float:
    return _t(lambda: subprocess.run(args, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mib", type=int, default=256)
    a = ap.parse_args()
    import torch

    import ckpt
    from ckpt.convert.hf import export_hf

    work = Path(tempfile.mkdtemp(prefix="bench-cli-hf-"))
    try:
        # a model of ~mib/3 MiB of float32 weights, and AdamW's two moments beside it
        n = max(1, a.mib // 3)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 256, bias=False) for _ in range(n)])
        opt = torch.optim.AdamW(model.parameters())
        for p in model.parameters():  # one step, so that AdamW holds its two moments
            p.grad = torch.ones_like(p)
        opt.step()
        path = work / "step-00000001"
        ckpt.save(path, {"model": model, "optim": opt}, config={"model": {"layers": n, "dim": 1024}}, step=1)
        r = ckpt.open(path)
        total = r.manifest.total_bytes
        ckpt_bin = str(Path(sys.executable).with_name("ckpt"))
        rows: dict[str, list[float]] = {k: [] for k in ("help/floor", "inspect/floor", "help/torch", "config/state",
                                                         "model/state", "export/save_file")}
        from safetensors.torch import save_file

        sd = model.state_dict()
        for i in range(a.rounds):
            floor = _proc([sys.executable, "-c", "pass"])
            torch_imp = _proc([sys.executable, "-c", "import torch"])
            helpt = _proc([ckpt_bin, "--help"])
            insp = _proc([ckpt_bin, "inspect", str(path)])
            rows["help/floor"].append(helpt / floor)
            rows["inspect/floor"].append(insp / floor)
            rows["help/torch"].append(helpt / torch_imp)
            t_cfg = _t(lambda: ckpt.open(path).config())
            t_all = _t(lambda: ckpt.open(path).state())
            rows["config/state"].append(t_cfg / t_all)
            t_model = _t(lambda: ckpt.open(path).state("model"))
            rows["model/state"].append(t_model / _t(lambda: ckpt.open(path).state()))
            out = work / f"hf-{i}"
            ref = work / f"ref-{i}.safetensors"

            def ref_save() -> None:
                save_file(sd, str(ref), metadata={"format": "pt"})
                fd = os.open(ref, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

            if i % 2:
                t_ref, t_exp = _t(ref_save), _t(lambda: export_hf(path, out))
            else:
                t_exp, t_ref = _t(lambda: export_hf(path, out)), _t(ref_save)
            rows["export/save_file"].append(t_exp / t_ref)
            shutil.rmtree(out)
            ref.unlink()
        print(f"checkpoint: {total / 2**20:.0f} MiB (model {sum(t.numel() * 4 for t in sd.values()) / 2**20:.0f} MiB "
              f"+ AdamW), {a.rounds} interleaved rounds, medians of paired ratios")
        labels = {
            "help/floor": "`ckpt --help` / `python -c pass`",
            "inspect/floor": "`ckpt inspect` / `python -c pass`",
            "help/torch": "`ckpt --help` / `python -c 'import torch'`",
            "config/state": "`open(p).config()` / `open(p).state()`",
            "model/state": "`open(p).state('model')` / `open(p).state()`",
            "export/save_file": "`export_hf` (verified copy) / `safetensors save_file` from memory",
        }
        for k, v in rows.items():
            print(f"  {labels[k]:<72} {statistics.median(v):.3f}x  (range {min(v):.3f}-{max(v):.3f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
