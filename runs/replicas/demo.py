"""``ckpt demo replicas``: per-step replica fault tolerance on torchft, taped and replayed.

Four recorded runs of the same tiny transformer and data, each on its own tape:

1. ``nofault``: three replica groups of one rank, no faults (the reference curve);
2. ``replace``: the same, group g2 SIGKILLed mid-run; the survivors train on with no
   restart, a replacement group g3 joins and recovers from a live peer through the
   checkpoint stream;
3. ``shrink``: three groups of two ranks, group g1 SIGKILLed and never replaced;
4. ``sdc``: bit flips: one in g2's own gradient (found by re-executing the step), one in
   g1's reduced gradient (found by the cross-replica digest check, g1 excluded).

Each tape is checked (``ckpt tape check``) and force-replayed (``ckpt replay --mode
force``) bit for bit; the losses of the faulty runs are compared with the no-fault run.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

import replay
from replay import TapeReader
from runs.replicas.config import Join, Kill, ReplicaConfig, SdcFault
from runs.replicas.run import RunResult, record

__all__ = ["main", "scenarios", "LOSS_TOLERANCE"]

# The faulty runs train on the same global batches in the same order (a failed step's
# samples are retried), with the same global-mean gradient; only the summation order of
# the all-reduce changes with the number of groups. Their loss stays within this of the
# no-fault run's, averaged over the last quarter of the steps.
LOSS_TOLERANCE = 0.02


def scenarios(steps: int) -> dict[str, tuple[ReplicaConfig, str]]:
    one = (("g0", 1), ("g1", 1), ("g2", 1))
    kill = max(3, steps // 4)
    return {
        "nofault": (ReplicaConfig(groups=one, steps=steps), "threads"),
        "replace": (ReplicaConfig(groups=one, steps=steps, kills=(Kill("g2", kill),),
                                  joins=(Join("g3", 1, kill + 3),)), "processes"),
        "shrink": (ReplicaConfig(groups=(("g0", 2), ("g1", 2), ("g2", 2)), steps=steps, kills=(Kill("g1", kill),)),
                   "processes"),
        "sdc": (ReplicaConfig(groups=one, steps=max(10, steps // 2), reexec_every=2,
                              sdc_faults=(SdcFault("g2.0", 4, "local", bucket=1, index=7, bit=27),
                                          SdcFault("g1.0", 7, "reduced", bucket=2, index=5, bit=30))), "threads"),
    }


def _events(tape: str) -> list[Any]:
    return list(TapeReader(tape).events())


def _losses(events: list[Any]) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in events:
        if e.kind.name == "loss":
            out.setdefault(e.step, e.payload["value"])
    return out


def _tail_mean(losses: Mapping[int, float], steps: int) -> float:
    tail = [v for s, v in losses.items() if s >= steps - max(1, steps // 4)]
    return sum(tail) / max(1, len(tail))


def main(out_dir: str, *, quick: bool, echo: Callable[[str], None], progress: bool,
         options: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """``ckpt demo replicas`` (the registry's entry point, :data:`runs.DEMOS`)."""
    steps = 16 if quick else 32
    checks: list[tuple[str, bool]] = []
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
        checks.append((f"{name}: tape check (no step committed without a quorum, recovered state = source's)",
                       not violations))
        checks.append((f"{name}: force replay bit-identical", rr.identical))
        evs = _events(tape)
        runs[name] = (res, evs)
    base = _losses(runs["nofault"][1])
    echo(f"[nofault] final loss {base[steps - 1]:.4f} (step {steps - 1})")
    for name in ("replace", "shrink"):
        res, evs = runs[name]
        cfg = res.cfg
        dead = cfg.kills[0].group
        done = {a: r for a, r in res.ranks.items() if r.get("outcome") == "finished"}
        survivors = [a for a in done if not a.startswith(cfg.kills[0].group + ".")]
        killed_ok = all(res.exitcodes.get(a) == -9 for a in cfg.actors() if a.startswith(dead + "."))
        checks.append((f"{name}: group {dead} SIGKILLed at step {cfg.kills[0].step} (exit -9)", killed_ok))
        checks.append((f"{name}: the survivors trained to step {cfg.steps} with no restart",
                       len(survivors) >= 2 and all(r["steps"] == cfg.steps and res.exitcodes.get(a) == 0
                                                   for a, r in done.items())))
        params = {bytes(r["params"]) for r in done.values()}
        checks.append((f"{name}: every finishing replica holds the same parameters", len(params) == 1))
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
                    and sent[(e.payload["source"], e.actor, e.step)].payload["state"] == e.payload["state"]
                    for e in loaded]
            for e in loaded:
                echo(f"[{name}] {e.actor} joined at step {e.step} and recovered from live peer {e.payload['source']} "
                     f"(checkpoint stream {e.payload['stream'].hex()[:16]}, state {e.payload['state'].hex()[:16]} = "
                     f"the source's)")
            checks.append((f"{name}: {j.group} joined and recovered from a live peer with its exact state",
                           bool(loaded) and all(same)))
        losses = _losses(evs)
        a, b = _tail_mean(losses, cfg.steps), _tail_mean(base, cfg.steps)
        rel = abs(a - b) / b
        echo(f"[{name}] loss over the last quarter {a:.4f} vs no-fault {b:.4f}: {100 * rel:.2f}% apart "
             f"(tolerance {100 * LOSS_TOLERANCE:.0f}%)")
        checks.append((f"{name}: loss within {100 * LOSS_TOLERANCE:.0f}% of the no-fault run", rel <= LOSS_TOLERANCE))
    res, evs = runs["sdc"]
    verdicts = [e for e in evs if e.kind.name == "sdc_verdict" and not e.payload["ok"]]
    cross = {(e.step, tuple(e.payload["odd"]), tuple(e.payload["buckets"])) for e in verdicts
             if e.payload["check"] == "cross-replica"}
    rex = {(e.step, tuple(e.payload["odd"])) for e in verdicts if e.payload["check"] == "reexec"}
    for e in verdicts:
        if e.actor in e.payload["odd"] or e.payload["check"] == "cross-replica" and e.actor == "g0.0":
            echo(f"[sdc] step {e.step}: {e.payload['check']} check names {e.payload['odd']} "
                 f"(buckets {e.payload['buckets']}), seen by {e.actor}")
    checks.append(("sdc: a bit flipped in g1's reduced gradient at step 7 is caught at step 7, g1 named",
                   (7, ("g1",), ("b2",)) in cross))
    checks.append(("sdc: a bit flipped in g2's own gradient at step 4 is caught by re-execution at step 4",
                   (4, ("g2.0",)) in rex))
    checks.append(("sdc: g1 excluded, torchft continued without it",
                   res.ranks.get("g1.0", {}).get("outcome") == "excluded"
                   and all(res.ranks[a]["steps"] == res.cfg.steps for a in ("g0.0", "g2.0"))))
    _plot(os.path.join(out_dir, "replicas-loss.png"), base, runs, echo)
    return checks


def _plot(path: str, base: Mapping[int, float], runs: Mapping[str, tuple[RunResult, list[Any]]],
          echo: Callable[[str], None]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the demo extra is not installed
        echo("(matplotlib missing: no plot)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(sorted(base), [base[s] for s in sorted(base)], label="no fault (3 groups)", lw=2, color="black")
    for i, (name, style) in enumerate((("replace", "-"), ("shrink", "--"))):
        res, evs = runs[name]
        ls = _losses(evs)
        ax.plot(sorted(ls), [ls[s] for s in sorted(ls)], style, label=f"{name}", alpha=0.8)
        for k in res.cfg.kills:
            ax.axvline(k.step, color="red", alpha=0.3)
            ax.text(k.step, max(base.values()) - 0.06 * i, f" SIGKILL {k.group} ({name})", color="red", fontsize=7,
                    va="top")
        for j in res.cfg.joins:
            joined = [e.step for e in evs if e.kind.name == "recovery_loaded"]
            if joined:
                ax.axvline(joined[0], color="green", alpha=0.3)
                ax.text(joined[0], min(base.values()), f" {j.group} joins, recovers", color="green", fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch mean)")
    ax.set_title("replica groups on torchft: kill, replace, shrink")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    echo(f"plot: {path}")
