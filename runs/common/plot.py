"""Loss curves against logical time with the faults marked: the PNG every demo writes.

matplotlib is imported on first use (the Agg backend: no display), so importing a run
never pulls it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

__all__ = ["Curve", "fault_marks", "loss_plot", "FAULT_COLORS"]

FAULT_COLORS = {"kill": "red", "loss": "purple", "jitter": "orange", "nan": "brown"}


@dataclass(frozen=True, slots=True)
class Curve:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    style: str = "-"


def fault_marks(events: Iterable[Any]) -> list[tuple[float, str]]:
    """(step, fault kind) of every ``fault_injected`` event on a tape; the step is the
    injection detail's ``step`` (0 when it has none: a fault present from the start)."""
    out = []
    for e in events:
        if e.kind.name != "fault_injected":
            continue
        d = e.payload.get("detail")
        out.append((float(d.get("step", 0)) if isinstance(d, dict) else 0.0, str(e.payload["fault"])))
    return out


def loss_plot(path: str, curves: Sequence[Curve], *, marks: Sequence[tuple[float, str]] = (),
              spans: Sequence[tuple[float, float]] = (), xlabel: str = "step", ylabel: str = "validation loss",
              title: str = "", size: tuple[float, float] = (8, 4.5)) -> str:
    """Write the curves to ``path``: a dotted vertical line per fault mark (one legend
    entry per kind), a grey band per span (e.g. a baseline's restarts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size, dpi=110)
    for c in curves:
        ax.plot(list(c.xs), list(c.ys), c.style, label=c.label)
    seen: set[str] = set()
    for x, kind in marks:
        ax.axvline(x, color=FAULT_COLORS.get(kind, "grey"), alpha=0.5, linestyle=":",
                   label=None if kind in seen else f"fault: {kind}")
        seen.add(kind)
    for a, b in spans:
        ax.axvspan(a, b, color="grey", alpha=0.15)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
