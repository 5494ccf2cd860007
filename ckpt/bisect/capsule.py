"""Step capsules: everything one training step depends on, as one file that travels.

A capsule is a checkpoint (all seven fields: weights, optimizer, RNG streams, data
position, config, topology, commit) of the state *just before* a step, whose ``extra``
holds the step's batch and number, sent through the checkpoint stream format
(spec/checkpoint-stream.md) into one file: every frame is checked on arrival, so a
capsule damaged on its way to another machine is refused, never traced.

The training script supplies a :class:`Target`: its state (what ``ckpt.save`` takes), a
function that runs one step on a batch, and, to make capsules, a function that draws
the next batch. ``ckpt bisect`` names it as ``module:function`` on the command line
(the user's own choice of code to run; nothing named inside a file is ever run).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import CkptError, FormatError
from .trace import StepTracer, Trace

__all__ = ["Target", "load_target", "write_capsule", "open_capsule", "make_capsule", "trace_capsule", "CAPSULE_KEY"]

CAPSULE_KEY = "ckpt_bisect_capsule"


@dataclass
class Target:
    """What bisecting a step needs from a training script.

    ``state``: the mapping ``ckpt.save``/``ckpt.load`` take (model, optimizer, scheduler,
    ...). ``step(batch)`` runs one optimizer step and returns the loss. ``next_batch()``
    draws the batch of the next step (needed to make a capsule from a checkpoint, and to
    re-execute the steps between the checkpoint and the one being bisected). ``model`` and
    ``optimizer`` are what gets traced (default: the first ``nn.Module`` and the first
    optimizer in ``state``). ``data``/``generators`` as for ``ckpt.save``."""

    state: Mapping[str, Any]
    step: Callable[[Any], Any]
    next_batch: Callable[[], Any] | None = None
    model: Any = None
    optimizer: Any = None
    data: Any = None
    generators: Mapping[str, Any] | None = None

    def traced(self) -> tuple[Any, Any]:
        import torch

        model = self.model
        opt = self.optimizer
        for v in self.state.values():
            if model is None and isinstance(v, torch.nn.Module):
                model = v
            if opt is None and isinstance(v, torch.optim.Optimizer):
                opt = v
        if model is None:
            raise CkptError("the bisect target has no model: pass Target(model=...) or put an nn.Module in its state")
        return model, opt


def load_target(entry: str, *, cwd: str | None = None) -> Target:
    """Call ``module:function`` (importable from ``cwd``, default the working directory)
    and return the :class:`Target` it builds."""
    mod_name, sep, fn_name = entry.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"--entry must be module:function, got {entry!r}")
    where = os.path.abspath(cwd or os.getcwd())
    if where not in sys.path:
        sys.path.insert(0, where)
    fn = getattr(importlib.import_module(mod_name), fn_name)
    target = fn()
    if not isinstance(target, Target):
        raise TypeError(f"{entry} returned {type(target).__name__}, not ckpt.bisect.Target")
    return target


def write_capsule(path: str | os.PathLike[str], state: Mapping[str, Any], batch: Any, *, step: int,
                  data: Any = None, generators: Mapping[str, Any] | None = None, config: Any = None,
                  source: str = "") -> str:
    """Write the capsule of ``step``: ``state`` as it is now (RNG streams included: the
    step draws from them next) and ``batch``. Returns the path."""
    from .. import save
    from ..stream import write_stream

    out = os.fspath(path)
    with tempfile.TemporaryDirectory(prefix="ckpt-capsule-") as tmp:
        d = os.path.join(tmp, "capsule")
        save(d, state, step=step - 1, data=data, generators=generators, config=config,
             extra={CAPSULE_KEY: {"step": step, "batch": batch, "source": source}})
        part = out + ".tmp"
        with open(part, "wb") as f:
            write_stream(d, f.write, meta={"capsule_step": step})
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, out)
    return out


@dataclass(frozen=True)
class OpenedCapsule:
    step: int
    batch: Any
    id: str  # the checkpoint id inside: two traces of one capsule name the same id
    source: str


def open_capsule(path: str | os.PathLike[str], state: Mapping[str, Any], *, data: Any = None,
                 generators: Mapping[str, Any] | None = None) -> OpenedCapsule:
    """Load a capsule into ``state`` (RNG streams restored) and return its step and batch."""
    from .. import load
    from ..stream import read_stream

    p = os.fspath(path)
    tmp = tempfile.mkdtemp(prefix="ckpt-capsule-")
    try:
        with open(p, "rb") as f:
            info = read_stream(f.read, os.path.join(tmp, "capsule"))
        res = load(info.path, state, data=data, generators=generators, exactness="off")
        body = (res.extra or {}).get(CAPSULE_KEY) if isinstance(res.extra, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("step"), int) or "batch" not in body:
            raise FormatError("not a step capsule: the checkpoint inside holds no capsule record", path=p)
        return OpenedCapsule(body["step"], body["batch"], res.id, str(body.get("source", "")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_capsule(checkpoint: str | None, target: Target, out: str, *, step: int | None = None) -> OpenedCapsule:
    """Restore ``checkpoint`` into the target, re-execute the steps up to ``step`` - 1, draw
    step ``step``'s batch and write its capsule (``step`` defaults to the one right after
    the checkpoint). ``checkpoint=None`` starts from the target as built: step 0 of a run
    whose script seeds everything it draws."""
    from .. import load

    if target.next_batch is None:
        raise CkptError("making a capsule needs Target(next_batch=...): the batch of the step comes from the script")
    if checkpoint is None:
        at, rid = 0, "start"
    else:
        res = load(checkpoint, target.state, data=target.data, generators=target.generators, exactness="off")
        at, rid = int(res.step or 0), res.id
    step = at + 1 if step is None else step
    if step <= at:
        raise CkptError(f"step {step} is not after the checkpoint's step {at}", path=checkpoint or "")
    for _ in range(at + 1, step):
        target.step(target.next_batch())
    batch = target.next_batch()
    write_capsule(out, target.state, batch, step=step, data=target.data, generators=target.generators,
                  source=os.path.abspath(checkpoint) if checkpoint else "the target as built")
    return OpenedCapsule(step, batch, rid, checkpoint or "")


def trace_capsule(capsule: str, target: Target, *, keep_tensors: bool = True) -> Trace:
    """Load ``capsule`` into the target and run its step under a :class:`StepTracer`."""
    opened = open_capsule(capsule, target.state, data=target.data, generators=target.generators)
    model, opt = target.traced()
    with StepTracer(model, opt, keep_tensors=keep_tensors) as tracer, warnings.catch_warnings():
        # the first module's inputs (token ids) need no gradient: torch says so once per step
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss = target.step(opened.batch)
        tracer.loss(loss)
    return tracer.trace(meta={"capsule": opened.id, "step": opened.step, "source": opened.source})
