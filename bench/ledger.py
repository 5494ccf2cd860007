"""Step ledger overhead on the reference small transformer (the one bench/tape.py trains).

Three series in interleaved rounds, in a seeded random order per round: ``plain`` (a
``CheckpointManager`` with ``ledger=False``), ``ledger`` (the default manager, with
``after_step(step, batch=(x, y), loss=loss)``: batch digest, loss bits, every RNG stream,
parameter digest every 10 steps) and ``control`` (plain again, the A/A control). No
checkpoint is due during the measurement, so only the ledger differs. Reported:

* end to end: median ledger step / median plain step - 1, next to the A/A noise floor;
* hooks: time inside ``after_step`` with the ledger minus without, per step, as a share
  of a plain step (what the ledger itself costs, without the step-to-step noise).

The default ledger of a script that only calls ``ckpt.save``/``ckpt.load`` (torch's
optimizer step hooks, ``ckpt.ledger.auto``: every RNG stream, each group's lr, a sample of
every parameter every step, every parameter every 10 steps) is measured the same way:
``plain`` (no default ledger), ``default`` (started by a ``ckpt.save``, outside the timed
steps) and ``control``, interleaved; its own time is the time inside ``opt.step()`` with
the hooks minus without.

Usage: python bench/ledger.py [--steps S] [--rounds R] [--threads T] [--only manager|default]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ckpt  # noqa: E402
from tape import make_run  # noqa: E402  - the same reference model and data as bench/tape.py

TARGET_OVERHEAD = 0.01


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, data: list, steps: int, start: int,
                mgr: ckpt.CheckpointManager) -> tuple[list[float], float]:
    times: list[float] = []
    hooks = 0.0
    pc = time.perf_counter
    for step in range(start, start + steps):
        x, y = data[step % len(data)]
        t0 = pc()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 1000), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        h0 = pc()
        mgr.after_step(step, batch=(x, y), loss=loss)
        hooks += pc() - h0
        times.append(pc() - t0)
    return times, hooks


def overhead(steps: int, rounds: int, tmp: Path) -> dict[str, float]:
    model, opt, data = make_run()
    state = {"model": model, "optim": opt}
    mgrs = {
        "plain": ckpt.CheckpointManager(tmp / "plain", state, ledger=False, signals=()),
        "ledger": ckpt.CheckpointManager(tmp / "ledger", state, signals=()),
        "control": ckpt.CheckpointManager(tmp / "control", state, ledger=False, signals=()),
    }
    train_steps(model, opt, data, 5, 1, mgrs["plain"])  # warm-up
    series: dict[str, list[float]] = {k: [] for k in mgrs}
    hooks: dict[str, float] = {k: 0.0 for k in mgrs}
    step = 10
    shuffle = random.Random(0)
    for _ in range(rounds):
        order = list(mgrs)
        shuffle.shuffle(order)
        for name in order:
            t, h = train_steps(model, opt, data, steps, step, mgrs[name])
            step += steps
            series[name] += t
            hooks[name] += h
    n = rounds * steps
    base = statistics.median(series["plain"] + series["control"])
    led = statistics.median(series["ledger"])
    tape = mgrs["ledger"].ledger.path
    for m in mgrs.values():
        m.close()
    per_step_hook = (hooks["ledger"] - (hooks["plain"] + hooks["control"]) / 2) / n
    return {
        "plain_ms": base * 1e3,
        "ledger_ms": led * 1e3,
        "end_to_end": led / base - 1.0,
        "noise": abs(statistics.median(series["control"]) / statistics.median(series["plain"]) - 1.0),
        "hooks_us": per_step_hook * 1e6,
        "hooks": per_step_hook / base,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes_per_step": Path(tape).stat().st_size / n if tape else 0.0,
    }


def default_overhead(steps: int, rounds: int, tmp: Path) -> dict[str, float]:
    """The default ledger of ckpt.save/ckpt.load against the same loop without it."""
    from ckpt.ledger import auto

    model, opt, data = make_run()
    state = {"model": model, "optim": opt}
    pc = time.perf_counter

    def run(start: int) -> tuple[list[float], float]:
        times, inside = [], 0.0
        for step in range(start, start + steps):
            x, y = data[step % len(data)]
            t0 = pc()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, 1000), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            s0 = pc()
            opt.step()  # the default ledger's hooks run inside
            inside += pc() - s0
            times.append(pc() - t0)
        return times, inside

    def engage(on: bool) -> None:
        auto.reset()
        if on:
            ckpt.save(tmp / "default" / "ckpt", state, overwrite=True)

    engage(False)
    run(1)  # warm-up
    series: dict[str, list[float]] = {"plain": [], "default": [], "control": []}
    inside = {k: 0.0 for k in series}
    step, shuffle = 10, random.Random(1)
    for _ in range(rounds):
        order = list(series)
        shuffle.shuffle(order)
        for name in order:
            engage(name == "default")
            t, h = run(step)
            step += steps
            series[name] += t
            inside[name] += h
    engage(False)
    tapes = list((tmp / "default" / "ledger").glob("*.tape"))
    n = rounds * steps
    base = statistics.median(series["plain"] + series["control"])
    led = statistics.median(series["default"])
    per_step = (inside["default"] - (inside["plain"] + inside["control"]) / 2) / n
    return {
        "plain_ms": base * 1e3,
        "ledger_ms": led * 1e3,
        "end_to_end": led / base - 1.0,
        "noise": abs(statistics.median(series["control"]) / statistics.median(series["plain"]) - 1.0),
        "hooks_us": per_step * 1e6,
        "hooks": per_step / base,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes_per_step": sum(t.stat().st_size for t in tapes) / n,
    }


def report(title: str, o: dict[str, float], rounds: int, steps: int) -> None:
    print(title.format(params=o["params"], rounds=rounds, steps=steps))
    print(f"  plain step (median, both)  {o['plain_ms']:8.2f} ms")
    print(f"  ledger step (median)       {o['ledger_ms']:8.2f} ms")
    print(f"  end to end                 {o['end_to_end'] * 100:+8.2f} %   "
          f"(ratio {1 + o['end_to_end']:.4f}; target <= {TARGET_OVERHEAD * 100:.0f} %, noise included)")
    print(f"  A/A noise floor            {o['noise'] * 100:8.2f} %   (plain vs plain again, same rounds)")
    print(f"  inside the ledger          {o['hooks_us']:8.1f} us/step = {o['hooks'] * 100:.3f} % of a plain step "
          f"({o['hooks'] / TARGET_OVERHEAD:.2f}x the 1 % budget)")
    print(f"  ledger tape                {o['bytes_per_step']:8.0f} bytes/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="steps per series per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("manager", "default"), default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        if a.only in (None, "manager"):
            report("step ledger overhead, small transformer ({params:,} params), batch + loss + RNG every step, "
                   "params every 10 steps, {rounds} interleaved rounds x {steps} steps each side:",
                   overhead(a.steps, a.rounds, Path(d)), a.rounds, a.steps)
        if a.only in (None, "default"):
            report("default ledger of ckpt.save/ckpt.load (optimizer step hooks), small transformer ({params:,} "
                   "params), RNG + lr + parameter sample every step, params every 10 steps, {rounds} interleaved "
                   "rounds x {steps} steps each side:", default_overhead(a.steps, a.rounds, Path(d)), a.rounds,
                   a.steps)

if __name__ == "__main__":
    main()
