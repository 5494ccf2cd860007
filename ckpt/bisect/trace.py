"""Per-operation traces of one training step, and the first place where two traces differ.

A :class:`StepTracer` hooks a model and its optimizer for one step and records, in the
order they happen:

* ``forward``: every module's output tensors (``register_forward_hook``);
* ``backward``: every module's gradient with respect to its inputs (full backward hooks):
  the first one that differs names the module whose backward computed other values;
* ``grad``: each parameter's ``.grad`` as the optimizer step begins (after clipping);
* ``optimizer``: each parameter after the step (the update);
* ``loss``: the value the step function returned.

Each entry keeps an xxh3-128 digest (the ledger's tensor digest: dtype, shape, bytes) and,
unless ``keep_tensors=False``, the tensor itself, so that a difference can be measured
(max abs, max ULP, count). :func:`compare_traces` aligns two traces by
``(module, phase, occurrence)`` and returns the first entry of the reference trace whose
counterpart is missing or differs.

A trace is stored as one safetensors file (tensors named by entry index, the entry table
and the environment as JSON in the header's ``__metadata__``): no pickle, readable by
stock safetensors.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ..errors import FormatError, LimitExceededError
from ..context.digest import tensor_digest

__all__ = ["TraceEntry", "Trace", "StepTracer", "TraceDiff", "TraceComparison", "compare_traces",
           "save_trace", "load_trace", "PHASES"]

PHASES = ("forward", "backward", "grad", "optimizer", "loss")
TRACE_FORMAT = "ckpt-step-trace"
TRACE_VERSION = 1
#: entries in one trace file (a step of a model with a million modules is not a use case)
MAX_ENTRIES = 1 << 20


@dataclass(frozen=True, slots=True)
class TraceEntry:
    index: int
    module: str  # module path ("" is the root), or the parameter name for grad/optimizer
    phase: str
    occurrence: int  # how many earlier entries had the same (module, phase): a module called twice
    digest: bytes
    dtype: str
    shape: tuple[int, ...]

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.module, self.phase, self.occurrence)

    def where(self) -> str:
        name = self.module or "<model>"
        twice = f" (call {self.occurrence + 1})" if self.occurrence else ""
        return f"{self.phase} of {name}{twice}"


@dataclass
class Trace:
    entries: list[TraceEntry]
    tensors: dict[int, Any] = field(default_factory=dict)  # entry index -> tensor (when kept)
    env: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _tensors_in(value: Any, depth: int = 0) -> Iterator[Any]:
    """The tensors inside a module's output (tuples, lists, dicts, HF ModelOutput), in order."""
    import torch

    if depth > 8:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors_in(v, depth + 1)


class StepTracer:
    """Hooks ``model`` (and ``optimizer``) while the ``with`` block runs one step.

    ``keep_tensors=False`` records digests only (a trace of a large model that travels);
    a comparison then says where, not by how much."""

    def __init__(self, model: Any, optimizer: Any = None, *, keep_tensors: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.keep_tensors = keep_tensors
        self._entries: list[TraceEntry] = []
        self._tensors: dict[int, Any] = {}
        self._seen: dict[tuple[str, str], int] = {}
        self._handles: list[Any] = []
        self._param_names: dict[int, str] = {}

    # -- recording ----------------------------------------------------------------------
    def _add(self, module: str, phase: str, t: Any) -> None:
        import torch

        if not isinstance(t, torch.Tensor):
            return
        if len(self._entries) >= MAX_ENTRIES:
            raise LimitExceededError(f"a step trace holds at most {MAX_ENTRIES} entries", limit=MAX_ENTRIES)
        t = t.detach()
        occ = self._seen.get((module, phase), 0)
        self._seen[(module, phase)] = occ + 1
        i = len(self._entries)
        from ..context.digest import dtype_name

        self._entries.append(TraceEntry(i, module, phase, occ, tensor_digest(t), dtype_name(t.dtype), tuple(t.shape)))
        if self.keep_tensors:
            self._tensors[i] = t.to("cpu", copy=True).contiguous()

    def loss(self, value: Any) -> None:
        """Record the step's loss (call with what the step returned)."""
        import torch

        if isinstance(value, torch.Tensor):
            self._add("", "loss", value)
        elif isinstance(value, (int, float)):
            self._add("", "loss", torch.tensor(float(value), dtype=torch.float64))

    def _forward_hook(self, name: str) -> Any:
        def hook(_mod: Any, _inp: Any, out: Any) -> None:
            for t in _tensors_in(out):
                self._add(name, "forward", t)

        return hook

    def _backward_hook(self, name: str) -> Any:
        def hook(_mod: Any, grad_input: Any, _grad_output: Any) -> None:
            for t in _tensors_in(grad_input):
                self._add(name, "backward", t)

        return hook

    def _pre_step(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._add(self._param_names.get(id(p), f"param{id(p)}"), "grad", p.grad)

    def _post_step(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self._add(self._param_names.get(id(p), f"param{id(p)}"), "optimizer", p)

    def __enter__(self) -> "StepTracer":
        self._param_names = {id(p): n for n, p in self.model.named_parameters()}
        for name, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_hook(self._forward_hook(name)))
            try:
                self._handles.append(mod.register_full_backward_hook(self._backward_hook(name)))
            except RuntimeError:  # a module whose forward the autograd hook cannot wrap
                pass
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._post_step))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def trace(self, *, meta: Mapping[str, Any] | None = None) -> Trace:
        from ..context.env import capture_env

        return Trace(list(self._entries), dict(self._tensors), capture_env(), dict(meta or {}))


# -- comparing ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceDiff:
    """The first entry that differs: where, and by how much (when both traces kept tensors)."""

    entry: TraceEntry
    other: TraceEntry | None  # None: the other run has no such entry (the structure differs)
    count: int | None = None  # elements whose bits differ
    numel: int | None = None
    max_abs: float | None = None
    max_ulp: int | None = None

    def describe(self) -> str:
        e = self.entry
        if self.other is None:
            return f"{e.where()}: the other run has no such operation (the model's structure differs)"
        if self.other.shape != e.shape or self.other.dtype != e.dtype:
            return (f"{e.where()}: {e.dtype}{list(e.shape)} here, {self.other.dtype}{list(self.other.shape)} "
                    f"in the other run")
        if self.count is None:
            return f"{e.where()}: digests differ (digest-only traces: no magnitude)"
        ulp = "" if self.max_ulp is None else f", max {self.max_ulp} ULP"
        return f"{e.where()}: {self.count} of {self.numel} elements differ, max abs {self.max_abs:.3g}{ulp}"


@dataclass(frozen=True, slots=True)
class TraceComparison:
    first: TraceDiff | None
    compared: int  # entries of the reference trace compared before the first difference (or all)
    env_differences: tuple[str, ...] = ()
    same_inputs: bool = True  # the step ran on the same batch and state (the capsule digests agree)

    @property
    def identical(self) -> bool:
        return self.first is None

    def summary(self) -> str:
        lines = []
        if self.first is None:
            lines.append(f"IDENTICAL: {self.compared} operations of the step agree bit for bit")
        else:
            lines.append(f"DIFFERENT at operation {self.first.entry.index + 1} (after {self.compared} that agree)")
            lines.append(f"  first: {self.first.describe()}")
        if self.env_differences:
            lines.append("  environments differ: " + "; ".join(self.env_differences))
        if not self.same_inputs:
            lines.append("  note: the two traces did not start from the same capsule")
        return "\n".join(lines)


def _ordered_bits(t: Any) -> Any:
    """Integers whose order and distance are the floats' order and ULP distance."""
    import torch

    width = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}.get(t.dtype)
    if width is None:
        return None
    i = t.contiguous().view(width).to(torch.int64)
    top = 1 << (8 * t.element_size() - 1)
    # sign-magnitude -> two's complement order: negative floats count down from zero (the
    # magnitude is the low bits; -0.0 and +0.0 are both 0)
    return torch.where(i < 0, -(i & (top - 1)), i)


def measure(a: Any, b: Any) -> tuple[int, int, float | None, int | None]:
    """(elements that differ in their bits, elements, max abs difference, max ULP)."""
    import torch

    ab, bb = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    raw_a = ab.view(torch.uint8).reshape(ab.numel(), -1) if ab.numel() else ab
    raw_b = bb.view(torch.uint8).reshape(bb.numel(), -1) if bb.numel() else bb
    differ = (raw_a != raw_b).any(dim=1) if ab.numel() else torch.zeros(0, dtype=torch.bool)
    count = int(differ.sum())
    max_abs: float | None = None
    max_ulp: int | None = None
    if count and (ab.is_floating_point() or ab.is_complex()):
        d = (ab[differ].double() - bb[differ].double()).abs()
        finite = d[torch.isfinite(d)]
        max_abs = float(finite.max()) if finite.numel() else math.inf
        oa, ob = _ordered_bits(ab[differ]), _ordered_bits(bb[differ])
        if oa is not None:
            max_ulp = int((oa - ob).abs().max())
    elif count:
        max_abs = float((ab[differ].double() - bb[differ].double()).abs().max())
    return count, ab.numel(), max_abs, max_ulp


def compare_traces(ref: Trace, other: Trace) -> TraceComparison:
    """The first entry of ``ref`` (in execution order) whose counterpart in ``other``
    (same module, phase and occurrence) is missing or differs."""
    from ..context.env import env_differences

    by_key = {e.key: e for e in other.entries}
    envd = tuple(env_differences(ref.env, other.env)) if ref.env and other.env else ()
    same = ref.meta.get("capsule") == other.meta.get("capsule")
    for n, e in enumerate(ref.entries):
        o = by_key.get(e.key)
        if o is None:
            return TraceComparison(TraceDiff(e, None), n, envd, same)
        if o.digest == e.digest:
            continue
        if o.shape != e.shape or o.dtype != e.dtype:
            return TraceComparison(TraceDiff(e, o), n, envd, same)
        ta, tb = ref.tensors.get(e.index), other.tensors.get(o.index)
        if ta is None or tb is None:
            return TraceComparison(TraceDiff(e, o), n, envd, same)
        count, numel, max_abs, max_ulp = measure(ta, tb)
        return TraceComparison(TraceDiff(e, o, count, numel, max_abs, max_ulp), n, envd, same)
    if len(other.entries) > len(ref.entries):
        extra = other.entries[len(ref.entries)]
        return TraceComparison(TraceDiff(extra, None), len(ref.entries), envd, same)
    return TraceComparison(None, len(ref.entries), envd, same)


# -- the file ---------------------------------------------------------------------------------


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as one safetensors file (temporary name, fsync, rename)."""
    from safetensors.torch import save_file

    table = [[e.index, e.module, e.phase, e.occurrence, e.digest.hex(), e.dtype, list(e.shape)] for e in trace.entries]
    meta = {"format": TRACE_FORMAT, "version": str(TRACE_VERSION),
            "entries": json.dumps(table), "env": json.dumps(trace.env, default=str), "meta": json.dumps(trace.meta, default=str)}
    p = os.fspath(path)
    tmp = p + ".tmp"
    save_file({f"{i:07d}": t for i, t in trace.tensors.items()}, tmp, metadata=meta)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; a file that is not one raises ``FormatError`` naming it."""
    from safetensors import SafetensorError, safe_open

    p = os.fspath(path)
    try:
        with safe_open(p, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != TRACE_FORMAT:
                raise FormatError("not a step trace (no ckpt-step-trace header)", path=p)
            if meta.get("version") != str(TRACE_VERSION):
                raise FormatError(f"step trace version {meta.get('version')!r} is not {TRACE_VERSION}", path=p)
            table = json.loads(meta["entries"])
            if not isinstance(table, list) or len(table) > MAX_ENTRIES:
                raise FormatError("the trace's entry table is not a list within the limit", path=p)
            entries = []
            for row in table:
                i, module, phase, occ, digest, dtype, shape = row
                if phase not in PHASES or not isinstance(module, str) or not isinstance(shape, list):
                    raise FormatError(f"trace entry {row!r:.80} is malformed", path=p)
                entries.append(TraceEntry(int(i), module, phase, int(occ), bytes.fromhex(digest), str(dtype),
                                          tuple(int(x) for x in shape)))
            tensors = {int(k): f.get_tensor(k) for k in f.keys()}
            env = json.loads(meta.get("env", "{}"))
            extra = json.loads(meta.get("meta", "{}"))
    except FormatError:
        raise
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise FormatError(f"not a readable step trace: {type(e).__name__}: {e}", path=p) from e
    return Trace(entries, tensors, env if isinstance(env, dict) else {}, extra if isinstance(extra, dict) else {})
