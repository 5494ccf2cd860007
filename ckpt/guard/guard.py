"""``LossGuard``: loss-spike detection and rollback for a ``CheckpointManager``
(spec/loss-guard.md is normative; the numbers in comments are its sections).

Usage::

    mgr = CheckpointManager(run_dir, {"model": model, "optim": opt, "sched": sched},
                            data=loader, every_steps=25)
    guard = LossGuard(mgr, GuardConfig(z_threshold=6.0, policy="skip", skip_after=2))
    mgr.resume() or mgr.save(0)            # step 0 saved: a spike always has a target
    step = mgr.start_step
    while step < total:
        for batch in loader:
            loss = train_step(batch)        # forward, backward, opt.step(), sched.step()
            step += 1
            rb = guard.after_step(step, loss=loss)   # instead of mgr.after_step
            if rb is not None or step == total:      # rolled back: the state is rb.step's
                break
        step = mgr.start_step if rb is not None else step
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from ..data._edits import DataEdit
from ..errors import CkptError, GuardConfigError, GuardError, NoRollbackTargetError, RollbackLimitError
from . import events as ev
from .config import GuardConfig
from .routing import RoutingController
from .rule import Verdict, judge

if TYPE_CHECKING:  # pragma: no cover
    from ..manager import CheckpointManager, StepCall

__all__ = ["LossGuard", "Rollback", "TapeSink", "STATE_VERSION", "MAX_ROUTING_STATE"]

STATE_VERSION = 1
#: routing cache bytes a checkpoint's meta carries at most (spec §5); larger caches are
#: not saved, and a resume inside the replayed window routes afresh (with a warning)
MAX_ROUTING_STATE = 8 << 20


class TapeSink(Protocol):
    """A tape the guard's events also go to; ``replay.Recorder`` is one. ``decide_event``
    returns the payload to act on: in a forced replay, the taped one."""

    def record_event(self, kind: int, payload: bytes) -> None: ...

    def decide_event(self, kind: int, compute: Callable[[], bytes]) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Rollback:
    """One episode (§3): the run is back at ``step``, the state of checkpoint ``checkpoint``."""

    episode: int
    detected: int
    step: int
    checkpoint: str
    checkpoint_id: str
    policy: str
    edits: tuple[DataEdit, ...]
    discarded: tuple[str, ...]
    fallbacks: tuple[str, ...]
    verdict: Verdict
    warmed: tuple[tuple[int, int], ...] = ()


class _NoTarget(Exception):
    pass


def _loss_value(loss: Any) -> float:
    if hasattr(loss, "detach"):
        return float(loss.detach().double().item())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    raise TypeError(f"loss must be a number or a one-element tensor, got {type(loss).__name__}")


class LossGuard:
    """Judges every step's loss (§2) and rolls a spike back (§3) for ``manager``.

    ``manager``'s ``data=`` must be a ``ckpt.data.ResumableLoader`` (the data policy edits
    its order). ``tape``: a recorder (``replay.Recorder``) the episode also goes to; under
    ``ckpt replay --mode force`` its taped decisions are followed. ``model`` and
    ``forward(batch)``: the MoE model and how to run it on a batch, for the routing
    warmup (``config.warmup_batches``). ``generators``: RNG generators the warmup must
    leave untouched besides the global streams (default: the manager's).
    """

    def __init__(self, manager: CheckpointManager, config: GuardConfig | None = None, *, tape: TapeSink | None = None,
                 model: Any = None, forward: Callable[[Any], Any] | None = None,
                 generators: Mapping[str, Any] | None = None) -> None:
        cfg = config if config is not None else GuardConfig()
        if not isinstance(cfg, GuardConfig):
            raise GuardConfigError(f"config must be a GuardConfig, got {type(cfg).__name__}")
        loader = getattr(manager, "data", None)
        if not all(callable(getattr(loader, m, None)) for m in ("edit", "upcoming", "slots_between", "peek")):
            raise GuardConfigError("the guard's data policy edits the manager's data order: its data= must be a "
                                   f"ckpt.data.ResumableLoader, got {type(loader).__name__}", key="data")
        if cfg.warmup_batches and (model is None or forward is None):
            raise GuardConfigError(f"GuardConfig.warmup_batches={cfg.warmup_batches} needs model= (the MoE model) "
                                   "and forward= (how to run it on a batch)", key="warmup_batches")
        if manager.hook is not None:
            raise GuardError("this CheckpointManager already has a LossGuard", path=manager.run_dir)
        self.manager = manager
        self.config = cfg
        self.loader = loader
        self.tape = tape
        self.forward = forward
        self.generators = dict(generators if generators is not None else manager.generators)
        self.window: list[float] = []
        #: every episode of the run so far (spec §5); a rollback does not roll these back
        self.episodes: list[dict[str, Any]] = []
        self._cursor = loader.cursor
        self._step = manager.start_step
        self._closed = False
        #: retention keeps a rollback target at or below this step (§8; ``retention_floor``)
        self._floor: int | None = None
        self.routing: RoutingController | None = None
        if cfg.warmup_batches:
            self.routing = RoutingController(model, self._current_batch, self._record, self._decide)
            self.routing.install()
        # the manager's after_step without its refusal: how an accepted step is saved
        self._step_call: StepCall = manager.attach(self)
        if manager.last_load is not None:
            self._restore(manager.last_load, rewound=False)

    # -- the loop's call ---------------------------------------------------------------------
    def after_step(self, step: int, *, loss: Any, batch: Any = None, metrics: Mapping[str, Any] | None = None,
                   extra: Any = None) -> Rollback | None:
        """Call once per optimizer step, after it, in place of ``manager.after_step``.
        Returns ``None`` for an accepted step (then saved if due), or the ``Rollback`` of
        an episode: the run's state is then that of ``rollback.step`` (continue there and
        call ``iter()`` on the loader again)."""
        if self._closed:
            raise CkptError("the LossGuard is closed", path=self.manager.run_dir)
        value = _loss_value(loss)
        cursor = self.loader.cursor
        cfg = self.config
        verdict = judge(value, self.window, min_history=cfg.min_history, z_threshold=cfg.z_threshold,
                        min_scale=cfg.min_scale)
        if verdict.anomalous:
            rb = self._episode(step, verdict, batch, loss, cursor)
            if rb is not None:
                return rb
        self._accept(step, value, cursor)
        self._floor = step - cfg.lookback  # retention keeps a target for the next spike (§8)
        self._step_call(step, batch=batch, loss=loss, metrics=metrics, extra=extra)
        return None

    def roll_back(self, step: int, *, rule: str, loss: Any = float("nan"), batch: Any = None,
                  data_policy: bool = False) -> Rollback:
        """An episode that another detector asked for (spec §3.1): silent data corruption
        found in step ``step`` (``rule="sdc"``), say. The step is not accepted; the run
        rolls back to the newest checkpoint before it that verifies and loads, exactly as
        for a spike. The data is not at fault, so the data policy applies only with
        ``data_policy=True`` (earlier episodes' edits are carried forward either way).
        The tape's ``spike`` event names ``rule`` with the step's loss; the rollback
        budget is the same."""
        if self._closed:
            raise CkptError("the LossGuard is closed", path=self.manager.run_dir)
        if not isinstance(rule, str) or not rule or rule in ("robust_z", "nonfinite"):
            raise GuardConfigError(f"roll_back needs the name of the detector that asked for it, got {rule!r}",
                                   key="rule")
        value = _loss_value(loss)
        cfg = self.config
        verdict = Verdict(True, rule, value, 0.0, 0.0, 0.0, 0.0, cfg.z_threshold, tuple(self.window))
        rb = self._episode(step, verdict, batch, loss, self.loader.cursor, data_policy=data_policy)
        if rb is None:  # on_no_checkpoint="continue": there is nothing to roll back to
            raise NoRollbackTargetError(f"{rule} at step {step}: no checkpoint to roll back to", path=self.manager.run_dir,
                                        step=step)
        return rb

    def _accept(self, step: int, value: float, cursor: tuple[int, int]) -> None:
        if math.isfinite(value):
            self.window.append(value)
            del self.window[: -self.config.window]
        if self.routing is not None and self.routing.cache:
            served = self.loader.slots_between(self._cursor, cursor)
            self.routing.trained(self.loader.upcoming(served, start=self._cursor))
        self._cursor = cursor
        self._step = step

    # -- an episode (§3) -----------------------------------------------------------------------
    def _episode(self, step: int, verdict: Verdict, batch: Any, loss: Any, cursor: tuple[int, int], *,
                 data_policy: bool = True) -> Rollback | None:
        cfg, mgr = self.config, self.manager
        if mgr.ledger is not None:
            mgr.ledger.step(step, batch=batch, loss=loss, done=False)  # the step happened; it is not saved
        self._record(verdict, step)
        cause = {"nonfinite": "non-finite loss", "robust_z": "loss spike"}.get(verdict.rule, verdict.rule)
        what = f"{cause} at step {step} " \
               f"(loss {verdict.value!r}, median {verdict.median:.6g}, robust z {verdict.score:.3g})"
        if len(self.episodes) >= cfg.max_rollbacks:
            self._record(ev.Refused("limit", {"episodes": len(self.episodes), "max_rollbacks": cfg.max_rollbacks}),
                         step)
            raise RollbackLimitError(f"{what}: {len(self.episodes)} rollbacks already, the limit "
                                     f"(GuardConfig.max_rollbacks={cfg.max_rollbacks}); the run stops rather than "
                                     "roll back again", path=mgr.run_dir, step=step)
        before = step - cfg.lookback
        present = [r.step for r in mgr.checkpoints() if r.committed]
        if not mgr.candidates(lambda r: r.step < before):
            self._record(ev.Refused("no-checkpoint", {"before": before, "checkpoints": present}), step)
            if cfg.on_no_checkpoint == "continue":
                return None
            raise NoRollbackTargetError(f"{what}: no committed checkpoint before step {before} to roll back to "
                                        f"(checkpoints at steps {present or 'none'}); save step 0 before the loop "
                                        "(manager.save(0)) so a spike always has a target", path=mgr.run_dir,
                                        step=step)
        done: dict[str, Any] = {}

        def compute() -> bytes:
            rw = mgr.rewind(before=before)
            if rw is None:
                raise _NoTarget()
            done["rw"] = rw
            edits = self._carry_forward() + (self._policy(rw.result, cursor) if data_policy else [])
            return self._rollback_payload(rw, edits)

        try:
            payload = self._decide(ev.ROLLBACK, compute)
        except _NoTarget:
            self._record(ev.Refused("no-checkpoint", {"before": before, "checkpoints": present,
                                                      "why": "none of them loads"}), step)
            raise NoRollbackTargetError(f"{what}: no checkpoint before step {before} loads (checkpoints at steps "
                                        f"{present}; see the ResumeFallbackWarnings)", path=mgr.run_dir,
                                        step=step) from None
        rec = ev.decode_payload(ev.ROLLBACK, payload)
        assert isinstance(rec, ev.RollbackEvent)
        edits = tuple(DataEdit.from_dict(e) for e in rec.edits)
        rw = done.get("rw")
        if rw is None:  # a forced replay: the tape chose the checkpoint and the edits
            rw = mgr.rewind(step=rec.to_step)
            if rw is None:
                raise GuardError(f"the taped rollback of step {step} goes to {rec.ckpt_name}, which does not load here",
                                 path=mgr.run_dir, step=step)
            for e in edits:
                self.loader.edit(e)
        if mgr.ledger is not None:
            mgr.ledger.record_guard(step, rec)
        self.episodes.append({"episode": rec.episode, "detected": step, "to_step": rec.to_step,
                              "checkpoint": rec.ckpt_name, "policy": rec.policy, "edits": [e.to_dict() for e in edits]})
        self._restore(rw.result, rewound=True)
        warmed = self._warmup(step) if self.routing is not None else ()
        return Rollback(rec.episode, step, rec.to_step, rec.ckpt_name, rec.ckpt_id, rec.policy, edits,
                        rec.discarded, rec.fallbacks, verdict, warmed)

    def _rollback_payload(self, rw: Any, edits: Sequence[DataEdit]) -> bytes:
        return ev.encode_payload(ev.RollbackEvent(
            len(self.episodes) + 1, rw.step, rw.result.id, rw.name, self.config.policy,
            tuple(e.to_dict() for e in edits), rw.discarded, rw.fallbacks))[1]

    def _carry_forward(self) -> list[DataEdit]:
        """Step 6: the edits of earlier episodes that the loaded data state lacks (it
        predates them), applied again in order; edits of finished epochs are moot."""
        out = []
        have = set(self.loader.edits)
        for episode in self.episodes:
            for d in episode["edits"]:
                e = DataEdit.from_dict(d)
                if e in have or e.epoch < self.loader.epoch:
                    continue
                self.loader.edit(e)
                have.add(e)
                out.append(e)
        return out

    def _policy(self, result: Any, cursor: tuple[int, int]) -> list[DataEdit]:
        """Step 7 (§4): the offending window, counted from the loaded cursor, as edits."""
        cfg, loader = self.config, self.loader
        start = loader.cursor
        n_p = loader.slots_between(start, self._cursor)
        n_t = loader.slots_between(start, cursor)
        lo = max(0, n_p - cfg.skip_before)
        window = loader.upcoming(n_t + cfg.skip_after, start=start)[lo:]
        by_epoch: dict[int, list[int]] = {}
        for epoch, s in window:
            by_epoch.setdefault(epoch, []).append(s)
        out = []
        for epoch, steps in by_epoch.items():
            if cfg.policy == "skip":
                edit = DataEdit(epoch, tuple(steps))
            else:
                edit = DataEdit(epoch, tuple(steps), "defer", cfg.reorder_delay)
            loader.edit(edit)
            out.append(edit)
        return out

    # -- anticipatory routing (§7) ---------------------------------------------------------------
    def _warmup(self, step: int) -> tuple[tuple[int, int], ...]:
        import torch

        from ..context.rng import isolated
        from ..ledger.digest import rng_digests

        assert self.routing is not None and self.forward is not None
        peeked = self.loader.peek(self.config.warmup_batches)
        keys = tuple((info.epoch, info.step) for info, _ in peeked)
        before = tuple(rng_digests(self.generators))
        with torch.no_grad(), isolated(self.generators):
            self.routing.warm([((i.epoch, i.step), b) for i, b in peeked], self.forward)
        after = tuple(rng_digests(self.generators))
        if after != before:
            moved = [n for (n, a), (_, b) in zip(before, after) if a != b]
            raise GuardError(f"the routing warmup moved the training RNG streams {moved}", step=step)
        self._record(ev.Warmup(keys, before), step)
        return keys

    def _current_batch(self) -> tuple[int, int] | None:
        info = self.loader.last_batch
        return None if info is None else (info.epoch, info.step)

    # -- the tapes -----------------------------------------------------------------------------
    def _record(self, rec: ev.GuardRecord, step: int | None = None) -> None:
        at = self._step + 1 if step is None else step
        if self.manager.ledger is not None:
            self.manager.ledger.record_guard(at, rec)
        if self.tape is not None:
            code, payload = ev.encode_payload(rec)
            self.tape.record_event(code, payload)

    def _decide(self, kind: int, compute: Callable[[], bytes]) -> bytes:
        """A decision: the recorder's (taped; forced in a forced replay), else computed.
        The ledger records rollbacks itself (after the load); routing here."""
        payload = self.tape.decide_event(kind, compute) if self.tape is not None else compute()
        if kind == ev.ROUTING and self.manager.ledger is not None:
            self.manager.ledger.record_guard(self._step + 1, ev.decode_payload(kind, payload))
        return payload

    # -- the manager's hook (ckpt.manager.StepHook) and the state (§5) ---------------------------
    def retention_floor(self) -> int | None:
        return self._floor

    def before_save(self, step: int) -> Mapping[str, Any]:
        """The checkpoint's ``meta.guard`` (§5): the window, the episodes, the routing cache."""
        routing: list[Any] = []
        if self.routing is not None and self.routing.cache:
            routing = self.routing.state()
            size = sum(len(e[4]) for e in routing)
            if size > MAX_ROUTING_STATE:
                import warnings

                warnings.warn(f"routing cache of {size} bytes not saved (limit {MAX_ROUTING_STATE}): a resume inside "
                              "the replayed window routes those batches afresh", RuntimeWarning, stacklevel=4)
                routing = []
        return {"guard": {"version": STATE_VERSION, "window": list(self.window), "episodes": list(self.episodes),
                          "routing": routing}}

    def on_restore(self, result: Any) -> None:
        """``manager.resume()`` loaded ``result``: take the guard's state from it."""
        self._restore(result, rewound=False)

    def _restore(self, result: Any, *, rewound: bool) -> None:
        """From a loaded checkpoint's ``meta.guard``: the window always; the episodes and
        the routing cache on a resume only (a rollback keeps its own, §5)."""
        raw = (result.manifest.meta or {}).get("guard") if result is not None else None
        state = raw if isinstance(raw, dict) and raw.get("version") == STATE_VERSION else {}
        window = state.get("window") or []
        if not isinstance(window, list) or not all(isinstance(x, float) for x in window):
            raise GuardError("meta.guard.window of the loaded checkpoint is not a list of floats",
                             path=getattr(result, "path", None), key="meta/guard/window")
        self.window = window[-self.config.window:]
        if not rewound:
            episodes = state.get("episodes") or []
            if not isinstance(episodes, list) or not all(isinstance(e, dict) for e in episodes):
                raise GuardError("meta.guard.episodes of the loaded checkpoint is not a list of maps",
                                 path=getattr(result, "path", None), key="meta/guard/episodes")
            self.episodes = [dict(e) for e in episodes]
        if self.routing is not None:
            if rewound:
                self.routing.clear()
            else:
                self.routing.load(state.get("routing") or [])
        self._cursor = self.loader.cursor
        self._step = int(result.step or 0)

    def close(self) -> None:
        """Detach from the manager (``manager.after_step`` works again) and uninstall the routing."""
        if self._closed:
            return
        self._closed = True
        if self.routing is not None:
            self.routing.uninstall()
        self.manager.detach(self)

    def __enter__(self) -> LossGuard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
