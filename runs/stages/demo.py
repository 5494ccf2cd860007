"""``ckpt demo stages``: pipeline stage skipping end to end, and its report.

1. the chaos run (every worker a process over gloo, or threads), recorded at ``DIR/run``:
   per-process tapes under ``DIR/run/tapes``, the job tape ``DIR/run/run.tape``;
2. ``tape check`` of the job tape and of the per-process tapes together;
3. ``replay --mode force`` of the job tape, every actor a thread;
4. the mid-run snapshot restored and continued under the tape (force mode);
5. every peer-recovery checkpoint verified;
6. the references, as threads (bit-identical to processes, which step 3 shows): the same
   configuration without failures, the wait-for-recovery baseline, and (not with
   ``--quick``) the other pipeline-compression variants with and without failures;
7. the report and ``DIR/stages-loss.png``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from runs.stages.config import StagesConfig

__all__ = ["demo_config", "run_demo", "main"]


def demo_config(*, quick: bool = False, transport: str = "gloo") -> StagesConfig:
    if quick:  # the tests' size: one outage bypassed and recovered, one to the end, a snapshot inside an outage
        return StagesConfig(replicas=2, steps=16, p=0.08, k=4, eval_every=4, outer_every=4, snapshot_at=(8,),
                            corpus_seqs=1024, val_seqs=32, transport=transport, seed=0)
    return StagesConfig(replicas=3, steps=120, p=0.03, k=6, edge_p=0.005, eval_every=8, outer_every=8,
                        snapshot_at=(60,), corpus_seqs=2048, transport=transport, seed=1)


def run_demo(out_dir: str | os.PathLike[str], *, quick: bool = False, transport: str = "gloo",
             echo: Callable[[str], None] = print, progress: bool = False) -> Any:
    """Run everything; returns the :class:`~runs.stages.report.Report` (its ``checks``)."""
    from replay import TapeReader, check_tape, check_tapes, replay
    from runs.common.report import ProgressBar, verify_checkpoints
    from runs.stages.chaos import describe
    from runs.stages.report import LOSS_TOLERANCE, Pair, Report, busy_fraction, plot, tape_counts
    from runs.stages.run import record, restore_run, snapshot_dirs

    torch.set_num_threads(1)  # every process's setting, before any tape records the environment
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if (out / "run").exists():
        raise FileExistsError(f"{out / 'run'} exists: pass an empty --out directory")
    cfg = demo_config(quick=quick, transport=transport)
    wall: dict[str, float] = {}

    def timed(label: str, fn: Callable[[], Any], key: str) -> Any:
        t0 = time.monotonic()
        echo(f"{label} ...")
        v = fn()
        wall[key] = time.monotonic() - t0
        return v

    progress_bar = ProgressBar(echo, progress)

    def bar(label: str) -> Callable[[int], None]:
        return lambda t: progress_bar(label, t + 1, cfg.steps)

    chaos = timed(f"chaos run: {cfg.replicas} replicas x {cfg.stages} stages ({cfg.transport}), compression "
                  f"{cfg.compression}, stage skipping", lambda: record(cfg, out / "run", on_step=bar("chaos run")), "chaos run")
    for line in describe(cfg, chaos.ctl.schedule):
        echo("  " + line)
    tape = Path(chaos.tape)
    events = list(TapeReader(tape).events())
    counts = tape_counts(events)
    violations = check_tape(tape)
    per_process = chaos.extra.get("process_tapes")
    pp_violations = check_tapes(per_process) if per_process else None

    rr = timed("replay --mode force of the job tape (every actor a thread)", lambda: replay(tape, mode="force"), "replay")
    again = rr.value
    same = bool(rr.identical and again is not None and again.ctl.val == chaos.ctl.val
                and again.ctl.loss == chaos.ctl.loss)

    restores = []
    for snap in snapshot_dirs(out / "run", cfg):
        res = timed(f"restore {snap.name} and continue under the tape (force mode)", lambda s=snap: restore_run(tape, s), "restore")
        v = res.value
        ok = bool(res.identical and v is not None
                  and v.ctl.val == {t: x for t, x in chaos.ctl.val.items()}
                  and v.ctl.loss == chaos.ctl.loss)
        restores.append((snap, res, ok))

    recoveries = sorted((out / "run" / "recovery").glob("*")) if (out / "run" / "recovery").exists() else []
    verified = [ok for _, ok in verify_checkpoints(str(p) for p in recoveries)]

    threads = cfg.with_(transport="threads", snapshot_at=())
    calm = timed("reference: the same configuration without failures (threads)",
                 lambda: record(threads.with_(chaos=False), out / "runs" / f"{cfg.compression}-calm",
                                on_step=bar("no failures")), "no-failure run")
    wait = timed("reference: the same chaos, waiting for recovery instead of skipping (threads)",
                 lambda: record(threads.with_(policy="wait"), out / "runs" / f"{cfg.compression}-wait",
                                on_step=bar("wait baseline")), "wait baseline")
    alternatives: list[Pair] = []
    uncompressed = None
    if not quick:
        for comp in ("random", "learned", "none"):
            pair = Pair(comp, *(timed(f"reference: compression {comp}, {'chaos' if c else 'no failures'} (threads)",
                                      lambda c=c, comp=comp: record(threads.with_(compression=comp, chaos=c),
                                                                    out / "runs" / f"{comp}-{'chaos' if c else 'calm'}",
                                                                    on_step=bar(f"{comp} {'chaos' if c else 'calm'}")),
                                      f"{comp} {'chaos' if c else 'calm'}")
                                for c in (True, False)))
            if comp == "none":
                uncompressed = pair
            else:
                alternatives.append(pair)

    refs = [calm, wait, *(o for p in alternatives for o in (p.chaos, p.calm)),
            *((uncompressed.chaos, uncompressed.calm) if uncompressed else ())]
    ref_violations = [v for o in refs for v in check_tape(o.tape)]
    rep = Report(cfg, Pair(cfg.compression, chaos, calm), wait, alternatives, uncompressed)
    n_up = counts["stage_up"]
    rejoins = sum(1 for o in chaos.ctl.schedule.outages if o.until < cfg.steps)
    rep.lines.append(f"tape {tape}: {len(events)} events; {counts['fault_injected']} outages, "
                     f"{counts['bypass']} bypass events, {counts['stage_stall']} stalls, {n_up} recoveries, "
                     f"{counts['merge']} replica-exchange merges, {counts['snapshot_outcome']} snapshot(s); "
                     f"{counts['send']} messages, every one taped at both ends")
    rep.lines.append(f"tape check of the job tape: {len(violations)} violations"
                     + (f"; of the {len(per_process)} per-process tapes together: {len(pp_violations or [])}"
                        if per_process else "") + f"; of the {len(refs)} reference runs' tapes: {len(ref_violations)}")
    for v in [*violations, *(pp_violations or []), *ref_violations][:5]:
        rep.lines.append("    " + v.format().splitlines()[0])
    rep.lines.append(f"replay --mode force: {'IDENTICAL' if rr.identical else 'DIVERGED'} ({rr.events_compared} "
                     f"events); losses and validation losses equal: {'yes' if same else 'NO'}")
    if not rr.identical and rr.divergence is not None:
        rep.lines.append("    " + rr.format().splitlines()[1])
    for snap, res, ok in restores:
        rep.lines.append(f"snapshot {snap.name} restored and continued: {'identical' if ok else 'NOT identical'} "
                         f"({res.events_compared} events after the cuts matched the tape)")
    rep.lines.append(f"peer recoveries: {n_up} of {rejoins} rejoins on the tape, each digest equal to its source's "
                     f"(tape check); {sum(verified)}/{len(verified)} recovery checkpoints verify")
    rep.checks.add("tape check", not violations and not pp_violations and not ref_violations)
    rep.checks.add("replay bit-identical", same)
    for snap, _res, ok in restores:
        rep.checks.add(f"snapshot restore {snap.name}", ok)
    rep.checks.add("peer recoveries", n_up == rejoins and all(verified) and len(verified) == rejoins)
    rep.checks.add("validation loss", all(abs(p.ratio - 1) <= LOSS_TOLERANCE
                                     for p in [rep.headline, *([uncompressed] if uncompressed else [])]))
    rep.checks.add("stage-steps kept busy", busy_fraction(chaos) > busy_fraction(wait))
    png = plot(str(out / "stages-loss.png"), rep)
    rep.lines.append(f"plot: {png}")
    text = rep.format()
    (out / "report.txt").write_text(text + "\n")
    echo("")
    echo(text)
    echo("")
    echo("wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()))
    echo("next:")  # one command a line (" | " between them read as a pipe)
    for cmd in (f"ckpt tape check {tape}", f"ckpt replay {tape} --mode force --trust", f"ckpt tape show {tape}",
                *([f"ckpt inspect {snapshot_dirs(out / 'run', cfg)[0]}"] if cfg.snapshot_at else [])):
        echo(f"  {cmd}")
    return rep


def main(out_dir: str, *, quick: bool, echo: Callable[[str], None], progress: bool,
         options: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """``ckpt demo stages`` (the registry's entry point, :data:`runs.DEMOS`)."""
    rep = run_demo(out_dir, quick=quick, transport=str(options.get("transport", "gloo")), echo=echo, progress=progress)
    return rep.checks.items()
