"""Time to localise a divergence with ``ckpt bisect run``, against the time of one run.

<<<<<<<< HEAD:bench/bisect_time.py
    python bench/bisect_time.py [--steps 60] [--rounds 3]
========
    python bench/bisect_localise.py [--steps 60] [--rounds 3]

(Not ``bench/bisect.py``: a script's folder comes first on the import path, and that name
would shadow the standard library's ``bisect``, which ``random`` imports.)
>>>>>>>> main:bench/bisect_localise.py

Two runs of the GPT-style test script (tests/bisect/plant_script.py), the second with a
layer changed from step STEPS*3/4 on; then ``ckpt ledger diff`` (the step) and ``ckpt
bisect run`` (the operation). Prints each as a ratio of one training run of the same
script, measured side by side in one process, medians over the rounds, with the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT_DIR = os.path.join(ROOT, "tests", "bisect")
BIN = os.path.dirname(sys.executable)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _timed(cmd: list[str], ok: tuple[int, ...] = (0,), **env: str) -> float:
    t = time.perf_counter()
    rc = subprocess.run(cmd, cwd=SCRIPT_DIR, env=_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    if rc not in ok:
        raise SystemExit(f"{cmd} exited {rc}")
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    plant_at = a.steps * 3 // 4
    run_t, diff_t, bisect_t = [], [], []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as d:
            ra, rb = os.path.join(d, "a"), os.path.join(d, "b")
            run_t.append(_timed([sys.executable, "plant_script.py", "--out", ra, "--steps", str(a.steps)]))
            _timed([sys.executable, "plant_script.py", "--out", rb, "--steps", str(a.steps)], PLANT="layer",
                   PLANT_STEP=str(plant_at))
            diff_t.append(_timed([os.path.join(BIN, "ckpt"), "ledger", "diff", ra, rb], ok=(6,)))
            bisect_t.append(_timed([os.path.join(BIN, "ckpt"), "bisect", "run", ra, rb, "--entry", "plant_script:target",
                                    "--env-b", "PLANT=layer"], ok=(6,)))
    one = statistics.median(run_t)
    print(f"bisect benchmark: {a.steps}-step run, divergence planted at step {plant_at}, {a.rounds} rounds, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"  one training run:            {one:6.2f} s   (reference, 1.00x)")
    print(f"  ckpt ledger diff (the step): {statistics.median(diff_t):6.2f} s   {statistics.median(diff_t) / one:.2f}x of one run")
    print(f"  ckpt bisect run (the op):    {statistics.median(bisect_t):6.2f} s   {statistics.median(bisect_t) / one:.2f}x of one run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
