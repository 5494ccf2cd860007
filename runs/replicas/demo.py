"""``ckpt demo replicas``: per-step replica fault tolerance on torchft, taped and replayed.

Four recorded runs of the same tiny transformer and data, each on its own tape:

1. ``nofault``: three replica groups of one rank, no faults (the reference curve);
2. ``replace``: the same, group g2 SIGKILLed mid-run; the survivors train on with no
   restart, a replacement group g3 joins and recovers from a live peer through the
   checkpoint stream;
3. ``shrink``: three groups of two ranks, group g1 SIGKILLed and never replaced;
4. ``sdc``: four groups; bit flips: one in g2's own gradient (found by re-executing the
   step: every replica drops it, g2 is excluded), one in g1's reduced gradient (found by
   the cross-replica digest check, g1 excluded);
5. ``spike``: periodic checkpoints (the quorum's first replica writes them), a corrupted
   window of global batches, the loss-spike guard on every replica: all roll back together
   to the same checkpoint and skip the window; ``spike-ref`` is the same run without the
   corrupted window (the reference of its loss).

Each tape is checked (``ckpt tape check``) and force-replayed (``ckpt replay --mode
force``) bit for bit; the losses of the faulty runs are compared with the no-fault run.
torchft's own logging goes to ``DIR/<scenario>/run.logs/``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

import replay
from replay import TapeReader
from runs.common.plot import Curve, fault_marks, loss_plot
from runs.common.report import Checks
from runs.replicas.config import Join, Kill, ReplicaConfig, SdcFault, Spike
from runs.replicas.run import RunResult, record

__all__ = ["main", "scenarios", "LOSS_TOLERANCE"]

# The faulty runs train on the same global batches in the same order (a failed step's
# samples are retried), with the same global-mean gradient; only the summation order of
# the all-reduce changes with the number of groups. Their loss stays within this of the
# no-fault run's, averaged over the last quarter of the steps.
LOSS_TOLERANCE = 0.02
# The guarded run trains two global batches fewer than its reference (the skipped window)
# and re-trains the steps after its checkpoint: its loss over the last quarter stays
# within this of the reference's.
SPIKE_TOLERANCE = 0.05
GUARD = {"window": 16, "min_history": 6, "z_threshold": 6.0, "skip_after": 1}


def scenarios(steps: int) -> dict[str, tuple[ReplicaConfig, str]]:
    one = (("g0", 1), ("g1", 1), ("g2", 1))
    kill = max(3, steps // 4)
    # the spike needs a settled loss to stand out against (a robust z over the window): at
    # step 18 of a 16-step quick run the loss still falls too fast for z > 6, so the spike
    # scenarios (threads: a few seconds) keep the full run's length even in --quick
    at = max(steps, 32) + 2
    spike = ReplicaConfig(groups=one, steps=at + 10, lr=1e-2, ckpt_every=4, guard=GUARD, spikes=(Spike(at, 2),))
    return {
        "nofault": (ReplicaConfig(groups=one, steps=steps), "threads"),
        "replace": (ReplicaConfig(groups=one, steps=steps, kills=(Kill("g2", kill),),
                                  joins=(Join("g3", 1, kill + 3),)), "processes"),
        "shrink": (ReplicaConfig(groups=(("g0", 2), ("g1", 2), ("g2", 2)), steps=steps, kills=(Kill("g1", kill),)),
                   "processes"),
        "sdc": (ReplicaConfig(groups=one + (("g3", 1),), steps=max(10, steps // 2), reexec_every=2,
                              sdc_faults=(SdcFault("g2.0", 4, "local", bucket=1, index=7, bit=27),
                                          SdcFault("g1.0", 7, "reduced", bucket=2, index=5, bit=30))), "threads"),
        "spike": (spike, "threads"),
        "spike-ref": (ReplicaConfig.from_dict({**spike.to_dict(), "spikes": []}), "threads"),
    }


def _events(tape: str) -> list[Any]:
    return list(TapeReader(tape).events())


def _losses(events: list[Any], actor: str | None = None) -> dict[int, float]:
    """Step -> loss as trained last (a rolled-back step's loss is replaced by its re-run)."""
    out: dict[int, float] = {}
    for e in events:
        if e.kind.name == "loss" and (actor is None or e.actor == actor):
            if actor is None:
                out.setdefault(e.step, e.payload["value"])
            else:
                out[e.step] = e.payload["value"]
    return out


def _tail_mean(losses: Mapping[int, float], steps: int) -> float:
    tail = [v for s, v in losses.items() if s >= steps - max(1, steps // 4)]
    return sum(tail) / max(1, len(tail))


def main(out_dir: str, *, quick: bool, echo: Callable[[str], None], progress: bool,
         options: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """``ckpt demo replicas`` (the registry's entry point, :data:`runs.DEMOS`)."""
    steps = 16 if quick else 32
    checks = Checks()
    runs: dict[str, tuple[RunResult, list[Any]]] = {}
    os.makedirs(out_dir, exist_ok=True)
    for name, (cfg, transport) in scenarios(steps).items():
        tape = os.path.join(out_dir, name, "run.tape")
        t0 = time.monotonic()
        res = record(tape, cfg, transport=transport)
        rec_s = time.monotonic() - t0
        violations = replay.check_tape(tape)
        t0 = time.monotonic()
        rr = replay.replay(tape, mode="force")
        echo(f"[{name}] recorded with torchft ({transport}, {len(cfg.actors())} ranks) in {rec_s:.1f} s; "
             f"force replay: {'IDENTICAL' if rr.identical else 'DIVERGED'} ({rr.events_compared} events, "
             f"{time.monotonic() - t0:.1f} s)")
        if not rr.identical:
            echo(rr.format())
        for v in violations:
            echo("  " + v.format())
        checks.add(f"{name}: tape check (no step committed without a quorum, recovered state = source's)",
                   not violations)
        checks.add(f"{name}: force replay bit-identical", rr.identical)
        runs[name] = (res, _events(tape))
    base = _losses(runs["nofault"][1])
    echo(f"[nofault] final loss {base[steps - 1]:.4f} (step {steps - 1})")
    for name in ("replace", "shrink"):
        _faulty(name, runs[name], base, checks, echo)
    _sdc(runs["sdc"], checks, echo)
    _spike(runs["spike"], runs["spike-ref"], checks, echo)
    _plot(os.path.join(out_dir, "replicas-loss.png"), base, runs, echo)
    return checks.items()


def _faulty(name: str, run: tuple[RunResult, list[Any]], base: Mapping[int, float], checks: Checks,
            echo: Callable[[str], None]) -> None:
    res, evs = run
    cfg = res.cfg
    dead = cfg.kills[0].group
    done = {a: r for a, r in res.ranks.items() if r.get("outcome") == "finished"}
    survivors = [a for a in done if not a.startswith(dead + ".")]
    killed_ok = all(res.exitcodes.get(a) == -9 for a in cfg.actors() if a.startswith(dead + "."))
    checks.add(f"{name}: group {dead} SIGKILLed at step {cfg.kills[0].step} (exit -9)", killed_ok)
    checks.add(f"{name}: the survivors trained to step {cfg.steps} with no restart",
               len(survivors) >= 2 and all(r["steps"] == cfg.steps and res.exitcodes.get(a) == 0 for a, r in done.items()))
    checks.add(f"{name}: every finishing replica holds the same parameters", len({bytes(r["params"]) for r in done.values()}) == 1)
    reassigned = [e for e in evs if e.kind.name == "data_reassign"]
    if reassigned:
        p = reassigned[0].payload
        echo(f"[{name}] step {reassigned[0].step}: the attempt {dead} died in was not committed; its "
             f"{len(p['sample_ids'])} samples were {p['policy']}d over {sorted(set(e.actor for e in reassigned))}")
    if cfg.joins:
        j = cfg.joins[0]
        loaded = [e for e in evs if e.kind.name == "recovery_loaded" and e.actor.startswith(j.group + ".")]
        sent = {(e.actor, e.payload["peer"], e.step): e for e in evs if e.kind.name == "recovery_sent"}
        same = [sent.get((e.payload["source"], e.actor, e.step)) is not None
                and sent[(e.payload["source"], e.actor, e.step)].payload["state"] == e.payload["state"] for e in loaded]
        for e in loaded:
            echo(f"[{name}] {e.actor} joined at step {e.step} and recovered from live peer {e.payload['source']} "
                 f"(checkpoint stream {e.payload['stream'].hex()[:16]}, state {e.payload['state'].hex()[:16]} = "
                 f"the source's)")
        checks.add(f"{name}: {j.group} joined and recovered from a live peer with its exact state", bool(loaded) and all(same))
    losses = _losses(evs)
    a, b = _tail_mean(losses, cfg.steps), _tail_mean(base, cfg.steps)
    rel = abs(a - b) / b
    echo(f"[{name}] loss over the last quarter {a:.4f} vs no-fault {b:.4f}: {100 * rel:.2f}% apart "
         f"(tolerance {100 * LOSS_TOLERANCE:.0f}%)")
    checks.add(f"{name}: loss within {100 * LOSS_TOLERANCE:.0f}% of the no-fault run", rel <= LOSS_TOLERANCE)


def _sdc(run: tuple[RunResult, list[Any]], checks: Checks, echo: Callable[[str], None]) -> None:
    res, evs = run
    verdicts = [e for e in evs if e.kind.name == "sdc_verdict" and not e.payload["ok"]]
    cross = {(e.step, tuple(e.payload["odd"]), tuple(e.payload["buckets"])) for e in verdicts
             if e.payload["check"] == "cross-replica"}
    rex = {(e.step, tuple(e.payload["odd"])) for e in verdicts if e.payload["check"] == "reexec"}
    for e in verdicts:
        if e.actor in e.payload["odd"] or e.payload["check"] == "cross-replica" and e.actor == "g0.0":
            echo(f"[sdc] step {e.step}: {e.payload['check']} check names {e.payload['odd']} "
                 f"(buckets {e.payload['buckets']}), seen by {e.actor}")
    checks.add("sdc: a bit flipped in g1's reduced gradient at step 7 is caught at step 7, g1 named",
               (7, ("g1",), ("b2",)) in cross)
    checks.add("sdc: a bit flipped in g2's own gradient at step 4 is caught by re-execution at step 4", (4, ("g2.0",)) in rex)
    dropped = {e.actor for e in evs if e.kind.name == "step_commit" and e.step == 4 and not e.payload["committed"]}
    checks.add("sdc: every replica dropped step 4 (g2's wrong gradient was in every replica's sum)",
               dropped >= {"g0.0", "g1.0", "g2.0", "g3.0"})
    checks.add("sdc: g2 and g1 excluded, torchft continued without them",
               all(res.ranks.get(a, {}).get("outcome") == "excluded" for a in ("g1.0", "g2.0"))
               and all(res.ranks[a]["steps"] == res.cfg.steps for a in ("g0.0", "g3.0")))


def _spike(run: tuple[RunResult, list[Any]], ref: tuple[RunResult, list[Any]], checks: Checks,
           echo: Callable[[str], None]) -> None:
    res, evs = run
    cfg = res.cfg
    spikes = [e for e in evs if e.kind.name == "spike"]
    rollbacks = [e for e in evs if e.kind.name == "rollback"]
    for e in spikes:
        if e.actor == "g0.0":
            echo(f"[spike] step {e.step}: loss {e.payload['value']:.4f} against a window median "
                 f"{e.payload['median']:.4f} (robust z {e.payload['score']:.1f} > {e.payload['threshold']:g}), "
                 f"seen by every replica")
    for e in rollbacks:
        if e.actor == "g0.0":
            p = e.payload
            echo(f"[spike] every replica rolled back to {p['ckpt_name']} (written by the quorum's first replica), "
                 f"policy {p['policy']}: loader steps {[s for x in p['edits'] for s in x['steps']]} skipped")
    agreed = {(e.step, e.payload["to_step"], e.payload["ckpt_id"]) for e in rollbacks}
    checks.add("spike: every replica detected the spike and rolled back to the same checkpoint, together",
               {e.actor for e in rollbacks} == set(cfg.actors()) and len(agreed) == 1)
    done = res.ranks.values()
    checks.add(f"spike: the run continued to step {cfg.steps}, one replicated state at the end",
               all(r["steps"] == cfg.steps for r in done) and len({bytes(r["params"]) for r in done}) == 1)
    a = _tail_mean(_losses(evs, "g0.0"), cfg.steps)
    b = _tail_mean(_losses(ref[1], "g0.0"), cfg.steps)
    rel = abs(a - b) / b
    echo(f"[spike] loss over the last quarter {a:.4f} vs the same run without the corrupted window {b:.4f}: "
         f"{100 * rel:.2f}% apart (tolerance {100 * SPIKE_TOLERANCE:.0f}%)")
    checks.add(f"spike: loss within {100 * SPIKE_TOLERANCE:.0f}% of the run without the corrupted window",
               rel <= SPIKE_TOLERANCE)


def _plot(path: str, base: Mapping[int, float], runs: Mapping[str, tuple[RunResult, list[Any]]],
          echo: Callable[[str], None]) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the demo extra is not installed
        echo("(matplotlib missing: no plot)")
        return
    curves = [Curve("no fault (3 groups)", sorted(base), [base[s] for s in sorted(base)])]
    marks: list[tuple[float, str]] = []
    for name, label, style in (("replace", "replace", "-"), ("shrink", "shrink", "--"),
                               ("spike", "spike (lr 1e-2, guarded; as trained last)", "-."),
                               ("spike-ref", "spike's reference (no corrupted window)", ":")):
        res, evs = runs[name]
        ls = _losses(evs, "g0.0")
        curves.append(Curve(label, sorted(ls), [ls[s] for s in sorted(ls)], style))
        marks += [(x, "kill" if kind == "sigkill" else "loss") for x, kind in fault_marks(evs)
                  if kind in ("sigkill", "loss-spike")]
    sp = [e for e in runs["spike"][1] if e.kind.name == "spike" and e.actor == "g0.0"]
    curves.append(Curve("the spiking step (rolled back)", [e.step for e in sp], [e.payload["value"] for e in sp], "rx"))
    joined = [float(e.step) for e in runs["replace"][1] if e.kind.name == "recovery_loaded" and e.actor.startswith("g3.")]
    loss_plot(path, curves, marks=sorted(set(marks)), spans=[(j, j + 1) for j in joined[:1]], ylabel="training loss",
              title="replica groups on torchft: kill + replace, shrink, loss spike + rollback (shaded: g3 joins)")
    echo(f"plot: {path}")
