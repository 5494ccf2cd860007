"""The default step ledger of a script that only calls ``ckpt.save`` / ``ckpt.load``.

A script ported by swapping ``torch.save``/``torch.load`` for ``ckpt.save``/``ckpt.load``
gets a step ledger without another line: the first ``ckpt.save`` or ``ckpt.load`` of a
local path registers torch's global optimizer step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``/``..._post_hook``), which see
every optimizer step, its parameters and the RNG streams without the script's help.
Each step of an optimizer found in the saved state (of any optimizer when the state
holds only plain ``state_dict()``s) is one ledger step, numbered from the step of the
checkpoint the process started from. Per step the tape holds every RNG stream's digest,
the learning rate of each parameter group, a digest of one element of every parameter
(``ckpt.params_sample``: any change of the step's outcome moves it) and, every
``auto_ledger_params_every`` steps, the digest of every parameter; at the first step
after a save or a load, the streams' digests before the step (``ckpt.rng_before.*``).

The tapes go to ``DIR/ledger`` next to the checkpoint (``DIR`` holds it), or under
``$CKPT_LEDGER_DIR``. Every ``ckpt.save`` records in its MANIFEST meta (``ledger``) the
ledger step and run id it was taken at; a ``ckpt.load`` of such a checkpoint, followed by
an optimizer step, is a resume: the re-run steps are compared with the earlier process's
record, and the verdict is one line on stderr (``ckpt.ledger.announce``). A load that no
optimizer step follows (an evaluation, an export) writes and says nothing.

Off: ``CKPT_AUTO_LEDGER=0`` (``ckpt.knobs``) for the process, ``ledger=False`` for one
call. A script with its own ``Ledger`` or a ``CheckpointManager`` (which keeps one) has
that ledger only: the default one stands down.
"""

from __future__ import annotations

import atexit
import os
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..errors import ResumeDivergedError
from ..knobs import knobs
from .compare import RNG_BEFORE, SAMPLE
from ..context.digest import rng_digests, tensor_digest
from .ledger import ON_OWN_LEDGER, OWN_LEDGER, Ledger, ResumeVerificationWarning

__all__ = ["before_save", "after_load", "rng_restored", "stand_down", "reset", "active", "META_KEY"]

#: the MANIFEST meta key a default-ledger save writes: {"step": int, "run_id": str}
META_KEY = "ledger"

_auto: _Auto | None = None


@dataclass(slots=True)
class _Resume:
    step: int
    source: str
    run_id: str | None
    baseline: tuple[tuple[str, bytes], ...]
    held: str


def _optimizers(state: Any) -> list[Any]:
    import torch

    found: list[Any] = []
    items = state.values() if isinstance(state, Mapping) else ([state] if state is not None else [])
    for v in items:
        if isinstance(v, torch.optim.Optimizer):
            found.append(v)
        elif isinstance(v, Mapping):
            found += [x for x in v.values() if isinstance(x, torch.optim.Optimizer)]
    return found


def _steps_taken(state: Any) -> int | None:
    """The optimizer steps already taken, as the optimizers count them (Adam's ``step``
    per parameter), from optimizer objects or optimizer ``state_dict()``s in ``state``."""
    import torch

    found: list[int] = []

    def scan(opt_state: Any) -> None:
        if isinstance(opt_state, Mapping):
            for per_param in opt_state.values():
                st = per_param.get("step") if isinstance(per_param, Mapping) else None
                if isinstance(st, torch.Tensor) and st.numel() == 1:
                    found.append(int(st.item()))
                elif isinstance(st, (int, float)):
                    found.append(int(st))

    items = list(state.values()) if isinstance(state, Mapping) else []
    for v in items:
        if isinstance(v, torch.optim.Optimizer):
            scan(v.state)
        elif isinstance(v, Mapping) and "state" in v and "param_groups" in v:
            scan(v["state"])
    return max(found) if found else None


def _local(path: Any, kwargs: Mapping[str, Any]) -> str | None:
    from ..storage import url_scheme

    if kwargs.get("storage") is not None:
        return None
    p = os.fsdecode(os.fspath(path))
    return None if url_scheme(p) is not None else os.path.abspath(p)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _Auto:
    """The process's default ledger: hooks, step counter, and the pending resume."""

    def __init__(self, directory: str) -> None:
        import torch.optim.optimizer as topt

        self.directory = directory
        self.count = 0
        self.stepped = False
        # The optimizers whose steps are the ledger's, by index: those of the saved state, in
        # its order; with none there (plain state_dicts), every optimizer, in order of its
        # first step. Indices name the values (optimizer1.param_groups[0].lr), so they restart
        # with each resume, as a new process's would.
        self.order: list[weakref.ref[Any]] = []
        self.from_state = False
        self.before = True
        self.pending: _Resume | None = None
        self.ledger = self._new_ledger(None)
        self.handles = [topt.register_optimizer_step_pre_hook(self._pre),
                        topt.register_optimizer_step_post_hook(self._post)]
        atexit.register(self.close)

    def _new_ledger(self, run_id: str | None) -> Ledger:
        every = knobs().auto_ledger_params_every
        return Ledger(self.directory, params=self._named, params_every=every, run_id=run_id or uuid.uuid4().hex[:16],
                      _auto=True)

    # -- what the hooks see ----------------------------------------------------------------
    def track(self, state: Any, *, replace: bool = False) -> None:
        opts = _optimizers(state)
        if replace:
            self.order, self.from_state = [], False
        if opts:
            if not self.from_state:
                self.order, self.from_state = [], True
            known = {id(r()) for r in self.order}
            self.order += [weakref.ref(o) for o in opts if id(o) not in known]

    def _mine(self, opt: Any) -> bool:
        if any(r() is opt for r in self.order):
            return True
        if self.from_state:
            return False
        self.order.append(weakref.ref(opt))
        return True

    def _live(self) -> list[tuple[int, Any]]:
        return [(i, o) for i, r in enumerate(self.order) if (o := r()) is not None]

    def _named(self) -> Iterable[tuple[str, Any]]:
        for i, opt in self._live():
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    yield f"optimizer{i}/{g}/{j}", p

    def _values(self) -> dict[str, Any]:
        import torch

        values: dict[str, Any] = {}
        firsts = []
        for i, opt in self._live():
            pre = f"optimizer{i}." if i else ""
            for g, group in enumerate(opt.param_groups):
                lr = group.get("lr")
                if isinstance(lr, torch.Tensor) and lr.numel() == 1:
                    lr = lr.item()
                if isinstance(lr, (int, float)):
                    values[f"{pre}param_groups[{g}].lr"] = lr
                firsts += [p.detach().reshape(-1)[:1].to(torch.float64) for p in group["params"] if p.numel()]
        if firsts:
            values[SAMPLE] = tensor_digest(torch.cat(firsts))
        return values

    def _pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if OWN_LEDGER[0] or not self._mine(opt):
            return
        try:
            if self.pending is not None:
                p, self.pending = self.pending, None
                self.ledger.resumed(p.step, source=p.source, run_id=p.run_id, baseline=p.baseline, rng_held=p.held)
            if self.before:
                self.before = False
                self._rng_before = {RNG_BEFORE + n: d for n, d in rng_digests()}
        except ResumeDivergedError:
            raise
        except Exception as e:  # the ledger must never stop a training run
            self._fail(e)

    def _post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if OWN_LEDGER[0] or not self._mine(opt):
            return
        try:
            self.count += 1
            self.stepped = True
            values = self._values()
            values.update(getattr(self, "_rng_before", {}))
            self._rng_before = {}
            self.ledger.step(self.count, values=values)
        except ResumeDivergedError:
            raise
        except Exception as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        warnings.warn(f"the default step ledger in {self.directory} stopped: {type(e).__name__}: {e}",
                      ResumeVerificationWarning, stacklevel=3)
        self.detach()

    # -- save / load ---------------------------------------------------------------------
    def saved(self) -> dict[str, Any]:
        self.before = True
        assert self.ledger.run_id is not None
        return {"step": self.count, "run_id": self.ledger.run_id}

    def loaded(self, path: str, result: Any, restore_rng: bool) -> None:
        meta = getattr(result.manifest, "meta", None) or {}
        led = meta.get(META_KEY) if isinstance(meta.get(META_KEY), Mapping) else {}
        step = led.get("step") if isinstance(led.get("step"), int) else result.step
        run_id = led.get("run_id") if isinstance(led.get("run_id"), str) else None
        if self.stepped:  # a load in the middle of a run: a new timeline, on a new tape
            self.ledger.close()
            self.ledger = self._new_ledger(run_id)
            self.stepped = False
        self.count = int(step or 0)
        self.before = True
        if not led:  # saved without a default ledger: nothing to verify against; this process records
            self.pending = None
            return
        held = ""
        if not restore_rng or not result.restored_rng:
            held = ("ckpt.load(..., restore_rng=False)|restore them with ckpt.rng.restore_rng(result.context['rng']) "
                    "before the first step")
        self.pending = _Resume(self.count, path, run_id, tuple(rng_digests()), held)

    def rng_restored(self) -> None:
        if self.pending is not None and self.pending.held:
            self.pending.held = ""
            self.pending.baseline = tuple(rng_digests())

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def close(self) -> None:
        self.detach()
        if self.stepped:
            self.ledger.close()


def _engage(path: Any, state: Any, kwargs: Mapping[str, Any], *, step: Any = None) -> _Auto | None:
    global _auto
    if OWN_LEDGER[0] or not knobs().auto_ledger:
        return None
    where = _local(path, kwargs)
    if where is None or _distributed():
        return None
    if _auto is None:
        from ..context.rng import RESTORE_LISTENERS

        root = knobs().ledger_dir
        parent = os.path.dirname(where)
        directory = os.path.join(root, os.path.basename(parent)) if root else os.path.join(parent, "ledger")
        _auto = _Auto(directory)
        RESTORE_LISTENERS.append(rng_restored)
        ON_OWN_LEDGER.append(stand_down)
        # The steps before the first save were not seen: number on from the optimizer's own
        # count (Adam keeps one), else from the script's step.
        taken = _steps_taken(state)
        if taken is not None:
            _auto.count = taken
        elif isinstance(step, int) and step >= 0:
            _auto.count = step
    _auto.track(state)
    return _auto


def before_save(path: Any, state: Any, kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The MANIFEST meta a ``ckpt.save`` adds (None: no default ledger)."""
    a = _engage(path, state, kwargs, step=kwargs.get("step"))
    return {META_KEY: a.saved()} if a is not None else None


def after_load(path: Any, state: Any, result: Any, *, restore_rng: bool) -> None:
    """A ``ckpt.load`` returned ``result``: the next optimizer step starts the resume."""
    a = _engage(path, state, {})
    if a is not None:
        a.track(state, replace=True)
        a.loaded(os.path.abspath(os.fsdecode(os.fspath(path))), result, restore_rng)


def rng_restored() -> None:
    """``ckpt.rng.restore_rng`` ran: streams held back at a load are restored now."""
    if _auto is not None:
        _auto.rng_restored()


def stand_down() -> None:
    """A ledger of the script's own exists: the default one records nothing more."""
    OWN_LEDGER[0] = True
    if _auto is not None:
        _auto.close()


def reset() -> None:
    """Forget the process's default ledger (hooks removed, tape closed) and any stand-down:
    the next save or load starts afresh. For a process that runs several independent
    runs in turn (a test session)."""
    global _auto
    from ..context.rng import RESTORE_LISTENERS

    if _auto is not None:
        _auto.close()
        atexit.unregister(_auto.close)
    if rng_restored in RESTORE_LISTENERS:
        RESTORE_LISTENERS.remove(rng_restored)
    if stand_down in ON_OWN_LEDGER:
        ON_OWN_LEDGER.remove(stand_down)
    _auto, OWN_LEDGER[0] = None, False


def active() -> Ledger | None:
    """The default ledger of this process, once a save or load started it."""
    return _auto.ledger if _auto is not None and not OWN_LEDGER[0] else None
