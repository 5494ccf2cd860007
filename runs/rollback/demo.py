"""``ckpt demo rollback``: a loss spike, rolled back, replayed, and checked.

1. the no-spike run (``DIR/clean.tape``);
2. the same seed with a corrupted window of batches injected (a taped fault), under the
   guard with anticipatory routing (``DIR/spike.tape``, checkpoints in ``DIR/run``);
3. the spiky run without the guard, for comparison;
4. ``replay --mode force`` of ``spike.tape``, and ``tape check`` of it and of the ledger;
5. the report: the episode, the routing replay, the end losses against the no-spike run,
   and ``DIR/loss.png`` (the three training-loss curves, the re-executed steps shaded).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

__all__ = ["main", "TOLERANCE", "ENTRY"]

ENTRY = "runs.rollback.run:main"

#: the guarded spiky run's held-out loss must end within this fraction of the no-spike run's
TOLERANCE = 0.05


def _config(quick: bool) -> dict[str, Any]:
    if quick:
        return {"steps": 48, "spike_at": 40}
    return {"steps": 160, "n_seqs": 4096, "spike_at": 100, "spike_len": 3, "every": 20, "warmup": 8, "skip_after": 2}


def main(out_dir: str | os.PathLike[str], *, quick: bool = False, echo: Callable[[str], None] = print,
         progress: bool = False, options: Mapping[str, Any] | None = None) -> list[tuple[str, bool]]:
    from replay import check_tape, replay
    from runs.rollback import run as entry

    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    spike_tape, clean_tape = out / "spike.tape", out / "clean.tape"
    if spike_tape.exists():
        raise FileExistsError(f"{spike_tape} exists: pass an empty --out directory")
    cfg = _config(quick)
    t0 = time.monotonic()

    echo(f"no-spike run: tiny MoE (4 experts, top-2), {cfg['steps']} steps")
    clean = _record(clean_tape, {**cfg, "spike_len": 0, "run_dir": str(out / "clean")})
    echo(f"spiky run: batches {cfg['spike_at']}..{cfg['spike_at'] + cfg.get('spike_len', 2) - 1} of epoch 0 corrupted "
         "(unlikely text), under the guard")
    spiky = _record(spike_tape, {**cfg, "run_dir": str(out / "run")})
    echo("spiky run without the guard")
    bare = _record(out / "unguarded.tape", {**cfg, "guard": False, "run_dir": str(out / "bare")})
    echo("forced replay of spike.tape")
    forced = replay(spike_tape, mode="force", entry=entry.main)
    violations = check_tape(spike_tape)
    ledger_tapes = sorted(Path(spiky.ledger).glob("*.tape"))
    ledger_violations = [v for t in ledger_tapes for v in check_tape(t)]

    for rb in spiky.rollbacks:
        v = rb.verdict
        echo(f"  episode {rb.episode}: {v.rule} at step {rb.detected}: loss {v.value:.4f}, window median "
             f"{v.median:.4f}, MAD {v.mad:.4f}, robust z {v.score:.1f} > {v.threshold:g}")
        echo(f"    rolled back to {rb.checkpoint} (step {rb.step}); policy {rb.policy}: "
             + "; ".join(f"epoch {e.epoch} batches {list(e.steps)} "
                         + ("skipped" if e.action == "skip" else f"deferred by {e.delay}") for e in rb.edits))
        if rb.warmed:
            echo(f"    warmup: routing of batches {[s for _, s in rb.warmed]} cached with the restored weights "
                 f"({len(spiky.cached)} layer-batches)")
    same = [key for key, ids in spiky.cached.items() if key in spiky.used and torch.equal(spiky.used[key], ids)]
    echo(f"  routing replay: {len(spiky.replayed)} layer-batches trained with the cached experts, "
         f"{len(same)}/{len(spiky.cached)} identical to the cache")
    rel = abs(spiky.eval_loss - clean.eval_loss) / clean.eval_loss
    echo(f"  held-out loss at step {cfg['steps']}: no-spike {clean.eval_loss:.4f}, guarded {spiky.eval_loss:.4f} "
         f"({100 * rel:.2f}% off, tolerance {100 * TOLERANCE:.0f}%), unguarded {bare.eval_loss:.4f}")
    peak = max(v for _, v in bare.losses)
    echo(f"  unguarded run: peak loss {peak:.4f}, its corrupted steps trained in")
    fv = forced.value
    echo(f"  forced replay: {forced.format().splitlines()[0]}")
    echo(f"  tape check: {len(violations)} violations on spike.tape, {len(ledger_violations)} on the ledger "
         f"({len(ledger_tapes)} tape)")
    png = _plot(out / "loss.png", clean, spiky, bare)
    echo(f"  wall {time.monotonic() - t0:.1f}s; loss curves in {png}")

    rb = spiky.rollbacks[0] if spiky.rollbacks else None
    window = set(spiky.corrupted)
    return [
        ("spike detected", bool(spiky.rollbacks) and not clean.rollbacks),
        ("rolled back before the spike", rb is not None and rb.step < rb.detected and rb.step % cfg.get("every", 10) == 0
         and rb.detected - rb.step <= cfg.get("every", 10)),
        ("window skipped", rb is not None and all(s in window for e in rb.edits for s in e.steps)),
        ("run finished", spiky.losses[-1][0] == cfg["steps"]),
        (f"within {100 * TOLERANCE:.0f}% of no-spike", rel <= TOLERANCE),
        ("routing replayed = cached", bool(spiky.cached) and len(same) == len(spiky.cached)
         and len(spiky.replayed) == len(spiky.cached)),
        ("force replay identical", forced.identical and fv is not None and len(fv.rollbacks) == len(spiky.rollbacks)),
        ("tape check", not violations and not ledger_violations),
    ]


def _timeline(losses: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """The steps the run kept: a rolled-back step's later value replaces the abandoned one."""
    last = dict(losses)
    steps = sorted(last)
    return steps, [last[s] for s in steps]


def _plot(path: Path, clean: Any, spiky: Any, bare: Any) -> str:
    from runs.common.plot import Curve, loss_plot

    curves = [Curve(label, *_timeline(run.losses), style) for label, run, style in (
        ("no spike", clean, "-"), ("spike, guarded", spiky, "-"), ("spike, unguarded", bare, ":"))]
    marks = [(float(rb.detected), "spike") for rb in spiky.rollbacks]
    spans = [(float(rb.step), float(rb.detected)) for rb in spiky.rollbacks]
    return loss_plot(str(path), curves, marks=marks, spans=spans, ylabel="training loss",
                     title="loss spike rolled back (grey: the re-executed steps)")


def _record(tape: Path, config: dict[str, Any]) -> Any:
    """Run the entry point in record mode onto ``tape``; its outcome."""
    from replay import Recorder
    from runs.rollback.run import main as entry

    with Recorder.open(str(tape), entry_point=ENTRY, config=config) as rec:
        return entry(rec)
