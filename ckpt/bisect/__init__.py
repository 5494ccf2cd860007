"""Why does my run differ from that run? Localise a divergence to a step, then to an operation.

* :func:`diff_runs` (``ckpt ledger diff A B``): the first step whose batch, RNG streams,
  loss or parameters differ between two runs' ledgers, and how their environments differ.
* a step capsule (:func:`make_capsule`, :func:`write_capsule`): the state before that step,
  its batch and its RNG streams, as one checked file that can travel to another machine;
* :func:`trace_capsule`: run the capsule's step with every module's forward output,
  backward gradient, each parameter's gradient and update digested (``StepTracer``);
* :func:`compare_traces` (``ckpt bisect compare``): the first module and phase whose output
  differs, and by how much (max abs, max ULP, count).

``ckpt bisect run A B --entry MODULE:FUNCTION`` does all of it; ``ckpt check-determinism``
runs one script twice and bisects the first nondeterministic step.
"""

from __future__ import annotations

from .capsule import Target, load_target, make_capsule, open_capsule, trace_capsule, write_capsule
from .rundiff import RunDiff, diff_runs
from .trace import StepTracer, Trace, TraceComparison, TraceDiff, compare_traces, load_trace, save_trace

__all__ = [
    "Target", "load_target", "make_capsule", "write_capsule", "open_capsule", "trace_capsule",
    "StepTracer", "Trace", "TraceDiff", "TraceComparison", "compare_traces", "save_trace", "load_trace",
    "RunDiff", "diff_runs",
]
