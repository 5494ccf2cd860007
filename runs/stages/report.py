"""The figures the demo prints and plots, from the runs' results and their tapes.

Every figure is a ratio against the reference the issue names: validation loss under chaos
against the same configuration's no-failure run; stage-steps kept busy by skipping against
the baseline that waits for the failed stage; the shared fixed projections' loss
degradation against the per-boundary alternatives'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from runs.common.report import Checks, yes
from runs.stages.config import StagesConfig

__all__ = ["LOSS_TOLERANCE", "curve", "final_val", "busy_fraction", "Report", "tape_counts", "plot"]

# A chaos run's final validation loss within 5% of its own no-failure run's: the seed's
# "stayed close to the no-failure baseline", made a number.
LOSS_TOLERANCE = 0.05


def curve(out: Any) -> tuple[list[int], list[float]]:
    """Mean validation loss over the replicas that evaluated, per eval step."""
    xs, ys = [], []
    for t in sorted(out.ctl.val):
        v = out.ctl.val[t]
        xs.append(t)
        ys.append(sum(v.values()) / len(v))
    return xs, ys


def final_val(out: Any) -> float:
    return curve(out)[1][-1]


def busy_fraction(out: Any) -> float:
    cfg: StagesConfig = out.ctl.cfg
    return sum(out.ctl.busy.values()) / (cfg.replicas * cfg.stages * cfg.steps)


def tape_counts(events: Iterable[Any]) -> dict[str, int]:
    """How many of each pipeline-stage event the tape holds (and merges, snapshots)."""
    names = ("stage_down", "stage_up", "recovery_sent", "recovery_loaded", "bypass", "ef_residual", "stage_stall",
             "merge", "snapshot_outcome", "fault_injected", "send", "recv")
    out = dict.fromkeys(names, 0)
    for e in events:
        if e.kind.name in out:
            out[e.kind.name] += 1
    return out


@dataclass
class Pair:
    name: str  # the configuration, e.g. "shared"
    chaos: Any
    calm: Any

    @property
    def ratio(self) -> float:
        return final_val(self.chaos) / final_val(self.calm)

    @property
    def gap(self) -> float:
        return final_val(self.chaos) - final_val(self.calm)

    def worst(self) -> tuple[int, float]:
        """The eval step where chaos is furthest above calm, and that relative gap."""
        xa, ya = curve(self.chaos)
        xb, yb = curve(self.calm)
        calm = dict(zip(xb, yb))
        gaps = [(t, y / calm[t] - 1) for t, y in zip(xa, ya) if t in calm]
        return max(gaps, key=lambda g: g[1])


@dataclass
class Report:
    cfg: StagesConfig
    headline: Pair
    wait: Any
    alternatives: list[Pair] = field(default_factory=list)
    uncompressed: Pair | None = None
    lines: list[str] = field(default_factory=list)  # exactness lines, in order
    checks: Checks = field(default_factory=Checks)

    def figures(self) -> list[str]:
        c, h = self.cfg, self.headline
        out = [f"pipeline stage skipping: {c.replicas} replicas x {c.stages} stages ({c.layers} block(s) of width "
               f"{c.dim} each), {c.steps} global steps of {c.microbatches} x {c.batch} sequences per replica",
               f"  replica exchange every {c.outer_every} steps: top-{c.topk} of every {c.chunk} values, {c.bits}-bit, "
               f"error feedback beta {c.ef_beta}; pipeline compression: rank {c.rank} of {c.dim}",
               f"  chaos: p = {c.p:g} per replica per step (seed: 1%; raised so outages happen in {c.steps} steps), "
               f"k = {c.k} steps (seed: 6), first/last-stage failures p = {c.edge_p:g}",
               "validation loss with failures against each configuration's own no-failure run "
               f"(tolerance: final within {LOSS_TOLERANCE:.0%}):"]
        pairs = [h, *([self.uncompressed] if self.uncompressed else []), *self.alternatives]
        for p in pairs:
            t, g = p.worst()
            out.append(f"  {p.name:<8} chaos {final_val(p.chaos):.4f}  no-failure {final_val(p.calm):.4f}  "
                       f"ratio {p.ratio:.4f}  ({'within' if abs(p.ratio - 1) <= LOSS_TOLERANCE else 'OUTSIDE'} "
                       f"tolerance; largest gap {g:+.1%} at step {t})")
        bf, bw = busy_fraction(h.chaos), busy_fraction(self.wait)
        out.append(f"stage-steps kept busy: skipping {bf:.1%}, waiting for recovery {bw:.1%}: "
                   f"ratio {bf / bw:.3f} (wait-baseline final validation loss {final_val(self.wait):.4f}, "
                   f"{final_val(self.wait) / final_val(h.chaos):.4f} x skipping's)")
        if self.alternatives:
            out.append("shared fixed projections against the alternatives (degradation = chaos - no-failure final "
                       "validation loss):")
            for p in [h, *self.alternatives]:
                out.append(f"  {p.name:<8} degradation {p.gap:+.4f}  (no-failure loss {final_val(p.calm):.4f})")
            less = all(h.gap < p.gap for p in self.alternatives)
            out.append(f"  shared is the least disrupted: {yes(less)} -> "
                       f"{'matches' if less else 'does NOT match'} the seed's claim")
        return out

    def format(self) -> str:
        return "\n".join([*self.figures(), "exactness:", *("  " + x for x in self.lines)])


def plot(path: str, rep: Report) -> str:
    """Validation loss curves with the outages marked: the headline pair and the wait
    baseline (top), every compression variant under chaos against its no-failure run (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if rep.alternatives or rep.uncompressed else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 4 * rows), dpi=110, squeeze=False)
    ax = axes[0][0]
    h = rep.headline
    for out, label, style in ((h.calm, f"{h.name}, no failures", "-"), (h.chaos, f"{h.name}, chaos, skipping", "-"),
                              (rep.wait, f"{h.name}, chaos, waiting for recovery", "--")):
        ax.plot(*curve(out), style, label=label)
    _mark_outages(ax, h.chaos.ctl.schedule, rep.cfg)
    ax.set_title(f"{rep.cfg.replicas} replicas x {rep.cfg.stages} stages, p = {rep.cfg.p:g}, k = {rep.cfg.k}")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
    if rows == 2:
        ax2 = axes[1][0]
        pairs: Sequence[Pair] = [h, *([rep.uncompressed] if rep.uncompressed else []), *rep.alternatives]
        for i, p in enumerate(pairs):
            color = f"C{i}"
            ax2.plot(*curve(p.calm), ":", color=color, label=f"{p.name}, no failures")
            ax2.plot(*curve(p.chaos), "-", color=color, label=f"{p.name}, chaos")
        _mark_outages(ax2, h.chaos.ctl.schedule, rep.cfg)
        ax2.set_ylabel("validation loss")
        ax2.set_title("pipeline compression variants (outages bypassed)")
        ax2.legend(fontsize=7, ncol=2)
    axes[-1][0].set_xlabel("global step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _mark_outages(ax: Any, sched: Any, cfg: StagesConfig) -> None:
    seen = set()
    for o in sched.outages:
        kind = "first/last stage down (replica stalls)" if o.edge else "inner stage down"
        ax.axvspan(o.first, o.until, color="red" if o.edge else "grey", alpha=0.12,
                   label=None if kind in seen else kind)
        seen.add(kind)
