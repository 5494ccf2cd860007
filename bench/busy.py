"""Run a command beside CPU hogs: a busy machine on demand, to show that no check depends on timing.

    python bench/busy.py [--hogs 4] [--runs 1] -- COMMAND [ARGS...]
    python bench/busy.py --demo NAME [--quick] [--runs 5]     # ckpt demo NAME --out <fresh dir>

Starts ``--hogs`` processes that spin (``while True: pass``), runs the command ``--runs``
times one after the other (each ``--demo`` run in a fresh output directory), stops the hogs,
and prints one line per run and a summary: pass/fail, the wall time, and the load average
seen (1-minute, before and after), with the date. Exit status 0 only when every run passed.
The hogs are this script's children: they are killed on any exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOG = "while True: pass"


def _load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=4, help="spinning processes beside the command (default 4)")
    ap.add_argument("--runs", type=int, default=1, help="consecutive runs (default 1)")
    ap.add_argument("--demo", help="run `ckpt demo NAME --out DIR` (a fresh DIR each run)")
    ap.add_argument("--quick", action="store_true", help="with --demo: the --quick demo")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    a = ap.parse_args(argv)
    cmd = [c for c in a.command if c != "--"] if a.command[:1] == ["--"] else list(a.command)
    if bool(a.demo) == bool(cmd):
        ap.error("give either --demo NAME or -- COMMAND")
    ckpt = Path(sys.executable).with_name("ckpt")
    label = f"ckpt demo {a.demo}{' --quick' if a.quick else ''}" if a.demo else shlex.join(cmd)
    print(f"busy: {label} x{a.runs} beside {a.hogs} CPU hogs on {os.cpu_count()} cores, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {_load():.1f}", flush=True)
    # SIGTERM ends this script the way Ctrl-C does: through the `finally` that stops the hogs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(a.hogs)]
    results: list[tuple[bool, float, float]] = []
    try:
        for i in range(a.runs):
            if a.demo:
                out = tempfile.mkdtemp(prefix=f"busy-{a.demo}-")
                run = [str(ckpt), "demo", a.demo, "--out", out] + (["--quick"] if a.quick else [])
            else:
                out, run = "", cmd
            t0 = time.monotonic()
            if a.demo:  # the demo's own lines go to a log beside its output; shown when it failed
                with open(out + ".log", "wb") as log:
                    rc = subprocess.call(run, stdout=log, stderr=subprocess.STDOUT)
                if rc != 0:
                    sys.stdout.write(Path(out + ".log").read_text(errors="replace")[-4000:])
            else:
                rc = subprocess.call(run)
            wall = time.monotonic() - t0
            results.append((rc == 0, wall, _load()))
            print(f"busy: run {i + 1}/{a.runs}: {'PASS' if rc == 0 else f'FAIL (exit {rc})'} in {wall:.0f} s, "
                  f"load {_load():.1f}" + (f", output {out}" if out else ""), flush=True)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
    passed = sum(ok for ok, _, _ in results)
    walls = [w for _, w, _ in results]
    print(f"busy: {label}: {passed}/{len(results)} passed beside {a.hogs} hogs; wall {min(walls):.0f}-{max(walls):.0f} s; "
          f"load up to {max(ld for _, _, ld in results):.1f}", flush=True)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
