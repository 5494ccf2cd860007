"""Re-execute a recorded run with its tape as the oracle (verify), forcing the taped
decisions (force), or from a checkpoint with changes into a new tape (fork).

The entry point is ``module:function`` (or ``path/to/file.py:function``) from the tape
header; it is called with the :class:`~replay.recorder.Recorder`, whose ``config``,
``resume_from`` and ``mode`` tell it how to run. The replayer never loads a checkpoint
itself: ``--from`` only sets ``rec.resume_from``, and the entry point loads its state
(with ``ckpt.load``) exactly as it would when resuming for real.

Comparison is per actor and byte-exact: the body the run produces for an event (step,
actor, vector clock, payload) must equal the taped body. Per actor, because threads
may interleave actors differently while each actor's own history is deterministic.
The first difference stops the run (rr's checksum-on-event idea) and is explained by
a :class:`Divergence`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import xxhash

from ckpt.context.env import capture_env, env_diff
from ckpt.knobs import REPLAY_TRUST, replay_trust
from replay import digest as dg
from replay.clock import VectorClock
from replay.errors import DivergenceError, ReplayError
from replay.events import KIND_BY_CODE, KIND_BY_NAME, Event, jsonable
from replay.recorder import Actor, Recorder, ReplayStop, event_from_body
from replay.tape.format import Frame
from replay.tape.reader import EVENT_HEAD, TapeReader, decode_event

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["replay", "record", "fork", "load_entry_point", "resolve_entry_point", "trusted_by_env", "EntryPoint",
           "TRUST_ENV", "ReplayResult", "Divergence", "TensorDiff", "Oracle"]

_ACTOR_CODE = KIND_BY_NAME["actor"].code
_PARAMS_CODE = KIND_BY_NAME["params"].code
_SNAPSHOT_CODE = KIND_BY_NAME["snapshot"].code
_BEGIN_CODE = KIND_BY_NAME["step_begin"].code

Reference = Callable[[int], "Mapping[str, torch.Tensor] | None"]


@dataclass(frozen=True, slots=True)
class TensorDiff:
    name: str
    expected_digest: str | None  # None: the tensor is missing on that side
    actual_digest: str | None
    max_abs_diff: float | None = None  # needs reference values for the step
    elements_differing: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first event a replay produced otherwise than the tape: why, where (step, actor,
    kind, clocks), and both digests."""

    reason: str
    step: int
    actor: str
    kind: str
    clock_expected: VectorClock | None
    clock_actual: VectorClock | None
    expected_digest: str | None
    actual_digest: str | None
    expected: Event | None = None
    actual: Event | None = None
    fields: tuple[tuple[str, Any, Any], ...] = ()
    tensors: tuple[TensorDiff, ...] = ()
    reference_note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason, "step": self.step, "actor": self.actor, "kind": self.kind,
            "clock_expected": self.clock_expected.as_dict() if self.clock_expected else None,
            "clock_actual": self.clock_actual.as_dict() if self.clock_actual else None,
            "expected_digest": self.expected_digest, "actual_digest": self.actual_digest,
            "expected_seq": self.expected.seq if self.expected else None,
            "fields": [{"field": f, "expected": jsonable(a), "actual": jsonable(b)} for f, a, b in self.fields],
            "tensors": [t.to_json() for t in self.tensors],
            "reference_note": self.reference_note,
        }


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """The outcome of a replay: identical or not, how many events were compared, the first
    divergence and the environment differences."""

    tape: str
    mode: str
    identical: bool
    events_compared: int
    last_step: int | None
    divergence: Divergence | None = None
    env_diff: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    stopped_at: int | None = None  # --until
    out_tape: str | None = None  # fork
    # what the entry point returned (None when it stopped early or diverged): an
    # application reads its re-executed result here instead of through a module global
    value: Any = field(default=None, repr=False)

    @property
    def exit_code(self) -> int:
        return 0 if self.identical else DivergenceError.exit_code

    def to_json(self) -> dict[str, Any]:
        return {"tape": self.tape, "mode": self.mode, "identical": self.identical,
                "events_compared": self.events_compared, "last_step": self.last_step,
                "divergence": self.divergence.to_json() if self.divergence else None,
                "env_diff": {k: list(v) for k, v in self.env_diff.items()}, "stopped_at": self.stopped_at,
                "out_tape": self.out_tape}

    def format(self) -> str:
        lines: list[str] = []
        if self.mode == "fork":
            lines.append(f"forked {self.tape} -> {self.out_tape} ({self.events_compared} events recorded)")
        elif self.identical:
            upto = f" up to step {self.stopped_at}" if self.stopped_at is not None else ""
            lines.append(f"IDENTICAL: {self.events_compared} events matched the tape{upto} ({self.mode} mode)")
        else:
            d = self.divergence
            assert d is not None
            lines.append(f"DIVERGED at step {d.step}, actor {d.actor}, event {d.kind} ({self.mode} mode, "
                         f"{self.events_compared} events matched before it)")
            lines.append(f"  {d.reason}")
            lines.append(f"  vector clock  expected {_clk(d.clock_expected)}  actual {_clk(d.clock_actual)}")
            lines.append(f"  digest        expected {d.expected_digest}  actual {d.actual_digest}")
            for f, a, b in d.fields:
                if f != "tensors":
                    lines.append(f"  field {f}: expected {_short(a)}  actual {_short(b)}")
            if d.tensors:
                lines.append("  tensors that differ:")
                for t in d.tensors:
                    extra = ""
                    if t.max_abs_diff is not None:
                        extra = f"  max abs diff {t.max_abs_diff:.6g}  ({t.elements_differing} elements differ)"
                    lines.append(f"    {t.name}  expected {t.expected_digest}  actual {t.actual_digest}{extra}")
                if d.reference_note:
                    lines.append(f"  ({d.reference_note})")
        if self.env_diff:
            lines.append("environment differs from the recording:")
            for k, (a, b) in self.env_diff.items():
                lines.append(f"  {k}: recorded {a!r}  now {b!r}")
        elif self.mode != "fork":
            lines.append("environment: same fingerprint as the recording")
        return "\n".join(lines)


def _clk(c: VectorClock | None) -> str:
    return "-" if c is None else "{" + ", ".join(f"{a}:{n}" for a, n in c.entries) + "}"


def _short(v: Any) -> str:
    s = repr(jsonable(v))
    return s if len(s) <= 120 else s[:117] + "..."


def _digest_of(ev: Event | None) -> str | None:
    if ev is None:
        return None
    p = ev.payload
    if "digest" in p:
        return p["digest"].hex()
    if ev.kind.name in ("loss", "metric"):
        v = p["value"]
        return f"{v!r} (bits {_f64_hex(v)})"
    return xxhash.xxh3_128_hexdigest(ev.raw)


def _f64_hex(v: float) -> str:
    import struct

    return struct.pack(">d", v).hex()


@dataclass(slots=True)
class _Expected:
    seq: int
    code: int
    body: bytes
    step: int


class Oracle:
    """Feeds each actor its taped events in order and compares what the run produces."""

    def __init__(self, reader: TapeReader, *, until: int | None = None, align: bool = False,
                 reference: Reference | None = None, align_snapshot: str | None = None,
                 align_coordinator: str | None = None) -> None:
        self.reader = reader
        self._frames = reader.frames()
        self.names: list[str] = []
        self.queues: dict[int, deque[_Expected]] = {}
        self.until = until
        self.reference = reference
        self.compared = 0
        #: ``progress(compared, estimated_total)``, every 256 events (``ckpt replay``'s bar)
        self.progress: Callable[[int, int], None] | None = None
        self.expected_total = 0
        self.last_step: int | None = None
        self.divergence: Divergence | None = None
        self.stopped = False
        self._align = align
        # Restored from snapshot ``align_snapshot``: each actor's taped history is skipped
        # through its own cut (its ``snapshot`` event of that id), wherever that lies.
        self._align_snapshot = align_snapshot
        # An actor with no cut of that snapshot (left out of it) is taken as done through
        # its events before the coordinator's cut: the rule Recorder.append_cut copies by.
        self._align_coordinator = align_coordinator
        self._coord_cut_seq: int | None = None
        self._aligned: set[int] = set()
        self._done = False
        self.recorder: Recorder | None = None

    # -- reading ahead ---------------------------------------------------------------------
    def _pull(self) -> bool:
        if self._done:
            return False
        try:
            _seg, fr = next(self._frames)
        except StopIteration:
            self._done = True
            return False
        if fr.kind == _ACTOR_CODE:
            decode_event(fr, self.names)
            return True
        step, aid, _n = EVENT_HEAD.unpack_from(fr.body, 0)
        self.queues.setdefault(aid, deque()).append(_Expected(fr.seq, fr.kind, bytes(fr.body), step))
        return True

    def actor_id(self, name: str) -> int:
        while name not in self.names:
            if not self._pull():
                self._fail(Divergence(f"actor {name!r} does not appear in the tape", -1, name, "actor", None, None,
                                      None, None))
        return self.names.index(name)

    def _next(self, aid: int, consume: bool) -> _Expected | None:
        q = self.queues.setdefault(aid, deque())
        while not q:
            if not self._pull():
                return None
        return q.popleft() if consume else q[0]

    # -- hooks called by the recorder (under its lock) ----------------------------------------
    def before(self, actor: Actor, code: int) -> None:
        if self.divergence is not None or self.stopped:
            raise ReplayStop()
        if self.until is not None and actor.current_step > self.until:
            self.stopped = True
            raise ReplayStop()
        if self._align_snapshot is not None and actor.id not in self._aligned:
            self._aligned.add(actor.id)
            self._align_at_snapshot(actor, code)
        elif self._align and actor.id not in self._aligned:
            self._aligned.add(actor.id)
            self._align_actor(actor, code)

    def _align_actor(self, actor: Actor, code: int) -> None:
        # Resumed from a checkpoint: skip this actor's taped history up to the event the
        # resumed run starts with, and take its clock and channel counters from there.
        step = actor.current_step
        skipped: list[_Expected] = []
        while True:
            e = self._next(actor.id, consume=False)
            if e is None:
                kind = KIND_BY_CODE[code].name
                self._fail(Divergence(f"resumed run starts with {kind} at step {step}, which the tape does not hold "
                                      f"for this actor", step, actor.name, kind, None, actor.clock, None, None))
            if e.code == code and e.step == step:
                break
            skipped.append(self._next(actor.id, consume=True))  # type: ignore[arg-type]
        # the run resumes at a step it has just set itself
        actor.continue_after([self._decode(s) for s in skipped], set_step=False)

    def _cut_index(self, aid: int) -> int | None:
        """Index in ``aid``'s queue of its ``snapshot`` event for ``align_snapshot``."""
        while self._pull():  # the cut may lie anywhere: read the whole tape (once)
            pass
        for i, e in enumerate(self.queues.get(aid, ())):
            if e.code == _SNAPSHOT_CODE and self._decode(e).payload["snapshot_id"] == self._align_snapshot:
                return i
        return None

    def _outside_cut(self, aid: int) -> int | None:
        """For an actor with no cut: how many of its events precede the coordinator's cut."""
        if self._coord_cut_seq is None:
            return None
        return sum(1 for e in self.queues.get(aid, ()) if e.seq < self._coord_cut_seq)

    def _find_coordinator_cut(self) -> None:
        # once, before any actor's history is taken off its queue
        if self._coord_cut_seq is not None or self._align_coordinator is None:
            return
        while self._pull():
            pass
        if self._align_coordinator in self.names:
            cid = self.names.index(self._align_coordinator)
            i = self._cut_index(cid)
            if i is not None:
                self._coord_cut_seq = self.queues[cid][i].seq

    def _align_at_snapshot(self, actor: Actor, code: int) -> None:
        # The actor was restored at its cut: its clock, step and channel counters are the
        # ones its snapshot event was taped with; its next event follows that event.
        self._find_coordinator_cut()
        i = self._cut_index(actor.id)
        if i is None:
            n = self._outside_cut(actor.id)
            if n is not None:  # outside the snapshot: its history before the cut is done
                q = self.queues.setdefault(actor.id, deque())
                skipped = [q.popleft() for _ in range(n)]
                actor.continue_after([self._decode(x) for x in skipped], set_step=code != _BEGIN_CODE)
                return
            self._fail(Divergence(f"restored from snapshot {self._align_snapshot!r}, but the tape holds no cut of "
                                  f"this actor for it", actor.current_step, actor.name, "snapshot", None,
                                  actor.clock, None, None))
        q = self.queues[actor.id]
        skipped = [q.popleft() for _ in range(i + 1)]  # type: ignore[operator]
        # a step_begin has just set the step it begins
        actor.continue_after([self._decode(s) for s in skipped], set_step=code != _BEGIN_CODE)

    def peek_decision(self, actor: Actor, code: int) -> dict[str, Any]:
        self.before(actor, code)
        e = self._next(actor.id, consume=False)
        kind = KIND_BY_CODE[code].name
        if e is None or e.code != code:
            got = self._decode(e) if e is not None else None
            self._fail(Divergence(f"force mode: the run asks for a {kind} decision, the tape holds "
                                  f"{got.kind.name if got else 'nothing more'} here", actor.current_step, actor.name,
                                  kind, got.clock if got else None, actor.clock, _digest_of(got), None, expected=got))
        return self._decode(e).payload  # type: ignore[arg-type]

    def diverge_decision(self, actor: Actor, code: int, what: str, key: str, taped: Mapping[str, Any]) -> None:
        e = self._next(actor.id, consume=False)
        got = self._decode(e) if e else None
        kind = KIND_BY_CODE[code].name
        self._fail(Divergence(f"force mode: the run asks for {what!r} key {key!r}, the tape decided "
                              f"{taped.get('what', kind)!r} key {taped.get('key')!r}", actor.current_step, actor.name,
                              kind, got.clock if got else None, actor.clock, _digest_of(got), None, expected=got))

    def check(self, actor: Actor, code: int, body: bytes) -> None:
        e = self._next(actor.id, consume=True)
        if e is not None and e.code == code and e.body == body:
            self.compared += 1
            self.last_step = actor.current_step
            if self.progress is not None and self.compared % 256 == 0:
                self.progress(self.compared, max(self.expected_total, self.compared))
            return
        actual = event_from_body(-1, code, body, actor.names)
        expected = self._decode(e) if e is not None else None
        self._fail(self._explain(actor, expected, actual))

    def finish(self) -> None:
        """After the run returned: anything left on the tape (up to --until) is a divergence."""
        while self._pull():
            pass
        if self._align_snapshot is not None:
            self._find_coordinator_cut()
            # Actors that emitted nothing after the cut: their history up to the cut (or all
            # of it, for an actor outside the snapshot) belongs to the original run.
            for aid in list(self.queues):
                if aid not in self._aligned:
                    i = self._cut_index(aid)
                    q = self.queues[aid]
                    n = self._outside_cut(aid) if i is None else i + 1
                    for _ in range(len(q) if n is None else n):
                        q.popleft()
        for aid, q in self.queues.items():
            for e in q:
                if self.until is None or e.step <= self.until:
                    ev = self._decode(e)
                    self._fail(Divergence("the run ended, but the tape holds more events for this actor",
                                          ev.step, ev.actor, ev.kind.name, ev.clock, None, _digest_of(ev), None,
                                          expected=ev))

    # -- explaining -------------------------------------------------------------------------
    def _decode(self, e: _Expected) -> Event:
        return decode_event(Frame(-1, e.seq, e.code, memoryview(e.body), 0), self.names)

    def _fail(self, d: Divergence) -> None:
        self.divergence = d
        raise DivergenceError(f"diverged at step {d.step}, actor {d.actor}, event {d.kind}: {d.reason}",
                              step=d.step, actor=d.actor, kind=d.kind)

    def _explain(self, actor: Actor, exp: Event | None, act: Event) -> Divergence:
        if exp is None:
            return Divergence("the run produced an event past the end of the tape", act.step, act.actor,
                              act.kind.name, None, act.clock, None, _digest_of(act), actual=act)
        parts = []
        if exp.kind.code != act.kind.code:
            parts.append(f"the tape has {exp.kind.name} here, the run produced {act.kind.name}")
        if exp.step != act.step:
            parts.append(f"step {exp.step} expected, {act.step} produced")
        if exp.clock != act.clock:
            parts.append("vector clocks differ")
        fields: list[tuple[str, Any, Any]] = []
        tensors: tuple[TensorDiff, ...] = ()
        note = ""
        if exp.kind.code == act.kind.code:
            pe, pa = exp.payload, act.payload
            fields = [(k, pe[k], pa[k]) for k in pe if pe[k] != pa[k]]
            if fields:
                parts.append("payload differs in " + ", ".join(f for f, _, _ in fields))
            if exp.kind.code == _PARAMS_CODE:
                tensors, note = self._tensor_diffs(actor, act.step, dict(pe["tensors"]), dict(pa["tensors"]))
        return Divergence("; ".join(parts) or "event differs", act.step, act.actor, act.kind.name, exp.clock,
                          act.clock, _digest_of(exp), _digest_of(act), exp, act, tuple(fields), tensors, note)

    def _tensor_diffs(self, actor: Actor, step: int, exp: dict[str, bytes], act: dict[str, bytes]
                      ) -> tuple[tuple[TensorDiff, ...], str]:
        names = [n for n in exp if exp[n] != act.get(n)] + [n for n in act if n not in exp]
        ref = self.reference(step) if self.reference is not None else None
        live: dict[str, Any] = {}
        for prefix, m in actor.watched:
            live.update((prefix + k, v) for k, v in m.state_dict(keep_vars=True).items())
        out = []
        for n in names:
            mad = cnt = None
            if ref is not None and n in ref and n in live:
                mad, cnt = _abs_diff(ref[n], live[n])
            out.append(TensorDiff(n, exp[n].hex() if n in exp else None, act[n].hex() if n in act else None, mad, cnt))
        if self.reference is None:
            note = "no reference values: pass reference= (or --reference) to get max abs diffs"
        elif ref is None:
            note = f"the reference has no values for step {step}"
        else:
            note = f"max abs diff against the reference values for step {step}"
        return tuple(out), note


def _abs_diff(ref: "torch.Tensor", live: "torch.Tensor") -> tuple[float | None, int | None]:
    from ckpt.diff import tensor_diff  # the one tensor comparison

    d = tensor_diff(ref, live)
    if d.reason and d.max_abs is None:
        return None, None
    return d.max_abs, d.differing


# -- entry points ------------------------------------------------------------------------------
TRUST_ENV = REPLAY_TRUST


@dataclass(frozen=True, slots=True)
class EntryPoint:
    """Where ``module:function`` (or ``file.py:function``) resolves, found without running it."""

    spec: str
    module: str  # the module name, or the file path as given
    attr: str
    file: Path | None  # the source file that would be executed; None when it cannot be found

    def describe(self) -> str:
        return f"{self.spec} -> {self.file if self.file is not None else '(not found)'}"


def resolve_entry_point(spec: str, *, search_path: tuple[str, ...] = ()) -> EntryPoint:
    """Find the file ``spec`` names **without importing anything** (a package's
    ``__init__`` is code too). ``search_path``: directories searched before ``sys.path``;
    the current directory is never added implicitly (spec §14)."""
    if ":" not in spec:
        raise ReplayError(f"entry point must be 'module:function', got {spec!r}")
    mod_name, _, attr = spec.rpartition(":")
    if mod_name.endswith(".py"):
        p = Path(mod_name)
        return EntryPoint(spec, mod_name, attr, p.resolve() if p.is_file() else None)
    loaded = sys.modules.get(mod_name)
    if loaded is not None:
        f = getattr(loaded, "__file__", None)
        return EntryPoint(spec, mod_name, attr, Path(f).resolve() if f else None)
    from importlib.machinery import PathFinder

    where: list[str] | None = [*search_path, *sys.path]
    found = None
    for i, part in enumerate(mod_name.split(".")):
        found = PathFinder.find_spec(part, where)
        if found is None and i == 0:
            # A top-level package installed by a meta-path finder (pip's editable installs):
            # finding a top-level spec runs no code of the package.
            import importlib.util

            try:
                found = importlib.util.find_spec(part)
            except (ImportError, ValueError):
                found = None
        if found is None:
            return EntryPoint(spec, mod_name, attr, None)
        where = list(found.submodule_search_locations or [])
    origin = found.origin if found is not None else None
    return EntryPoint(spec, mod_name, attr, Path(origin).resolve() if origin and origin != "namespace" else None)


def trusted_by_env(ep: EntryPoint, env: Mapping[str, str] | None = None) -> bool:
    """True when ``ep``'s file lies under a directory listed in ``CKPT_REPLAY_TRUST``
    (``os.pathsep``-separated), the documented allow-list of ``ckpt replay``."""
    dirs = replay_trust(env)
    if ep.file is None or not dirs:
        return False
    return any(ep.file.is_relative_to(Path(d).resolve()) for d in dirs)


def load_entry_point(spec: str, *, search_path: tuple[str, ...] = ()) -> Callable[[Recorder], Any]:
    """Import and return ``module:function`` or ``path/to/file.py:function``.

    This runs the module's code. ``search_path`` directories are searched first; the
    current directory is not put on ``sys.path`` (it is there only if the interpreter
    put it there, as ``python -m`` does)."""
    ep = resolve_entry_point(spec, search_path=search_path)
    mod_name, attr = ep.module, ep.attr
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        name = "_ckpt_entry_" + xxhash.xxh3_64_hexdigest(str(path.resolve()).encode())
        module = sys.modules.get(name)
        if module is None:
            s = importlib.util.spec_from_file_location(name, path)
            if s is None or s.loader is None:
                raise ReplayError(f"cannot load entry point file {path}")
            module = importlib.util.module_from_spec(s)
            sys.modules[name] = module
            s.loader.exec_module(module)
    else:
        added = [d for d in search_path if d not in sys.path]
        sys.path[:0] = added
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ReplayError(f"entry point {spec!r}: cannot import {mod_name!r} ({e}); the current directory is "
                              "not searched unless named (ckpt replay --import-path DIR)") from None
        finally:
            for d in added:
                sys.path.remove(d)
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ReplayError(f"entry point {spec!r}: module has no attribute {attr!r}") from None
    return fn  # type: ignore[no-any-return]


def record(entry_point: str, tape: str | os.PathLike[str], *, config: Mapping[str, Any] | None = None,
           resume_from: str | None = None, **opts: Any) -> Path:
    """Run ``entry_point(rec)`` in record mode, writing ``tape``. ``opts`` go to :meth:`Recorder.open`."""
    fn = load_entry_point(entry_point)
    with Recorder.open(str(tape), entry_point=entry_point, config=config, resume_from=resume_from,
                       initial_checkpoint=resume_from, **opts) as rec:
        fn(rec)
    return Path(tape)


def replay(tape: str | os.PathLike[str], *, mode: str = "verify", from_checkpoint: str | None = None,
           until: int | None = None, reference: Reference | None = None, entry_point: str | None = None,
           out: str | os.PathLike[str] | None = None, config_overrides: Mapping[str, Any] | None = None,
           align_snapshot: str | None = None, align_coordinator: str | None = None,
           entry: Callable[[Recorder], Any] | None = None,
           search_path: tuple[str, ...] = (), progress: Callable[[int, int], None] | None = None,
           **writer_opts: Any) -> ReplayResult:
    """Re-execute the run recorded on ``tape``; see the module docstring for the modes.

    ``progress(compared, total)`` is called as events match (``total`` is estimated from
    the tape's step index, and grows if the estimate was short).

    This imports and runs the entry point the tape names (or ``entry_point``): call it
    only on tapes you trust. ``ckpt replay`` asks first (``--trust``). ``search_path``:
    directories to import it from (the current directory is not added implicitly).

    ``align_snapshot`` (verify/force) continues a run restored from that snapshot: each
    actor's taped events before its own cut are taken as done (an actor with no cut of it:
    its events before ``align_coordinator``'s cut, when given). ``entry`` is the function
    to run instead of the tape's entry point (an application that restores its own state
    first); its return value comes back as ``ReplayResult.value``."""
    reader = TapeReader(tape)
    meta = reader.meta
    ep = entry_point or meta.get("entry_point")
    if not ep:
        raise ReplayError("the tape records no entry point; pass entry_point=", path=str(tape))
    config = dict(meta.get("config") or {})
    env = env_diff(meta.get("env") or {}, capture_env())
    if mode == "fork":
        if entry is not None or align_snapshot is not None:
            raise ValueError("entry= and align_snapshot= re-execute a tape: mode verify or force")
        return _fork(reader, ep, config, out, from_checkpoint, config_overrides, writer_opts, search_path)
    if mode not in ("verify", "force"):
        raise ValueError(f"mode must be verify, force or fork, got {mode!r}")
    if config_overrides:
        raise ValueError("config overrides change the run: use mode='fork'")
    fn = entry if entry is not None else load_entry_point(ep, search_path=search_path)
    oracle = Oracle(reader, until=until, align=from_checkpoint is not None, reference=reference,
                    align_snapshot=align_snapshot, align_coordinator=align_coordinator)
    rec = Recorder(None, oracle=oracle, mode=mode, actor=meta.get("default_actor", "main"), config=config,
                   resume_from=from_checkpoint, until=until,
                   param_digest_every=int(meta.get("param_digest_every", 10)), rng_every=int(meta.get("rng_every", 1)),
                   rng_sources=tuple(meta.get("rng_sources", dg.RNG_SOURCES)))
    oracle.recorder = rec
    if progress is not None:
        idx = reader.index()
        oracle.progress, oracle.expected_total = progress, (idx[-1].seq + 1 if idx else 0)
    value: Any = None
    try:
        value = fn(rec)
        if oracle.divergence is None and not oracle.stopped:
            oracle.finish()
    except ReplayStop:
        pass
    except DivergenceError:
        if oracle.divergence is None:  # raised by user code, not by us
            raise
    return ReplayResult(str(tape), mode, oracle.divergence is None, oracle.compared, oracle.last_step,
                        oracle.divergence, env, until, value=value)


def _fork(reader: TapeReader, ep: str, config: dict[str, Any], out: str | os.PathLike[str] | None,
          from_checkpoint: str | None, overrides: Mapping[str, Any] | None, writer_opts: Mapping[str, Any],
          search_path: tuple[str, ...] = ()) -> ReplayResult:
    if out is None:
        raise ValueError("fork writes a new tape: pass out=")
    meta = reader.meta
    new_config = {**config, **(overrides or {})}
    lineage = {"parent_run_id": reader.run_id.hex(), "parent_tape": str(reader.path),
               "parent_config_hash": meta.get("config_hash"), "from_checkpoint": from_checkpoint,
               "changes": dict(overrides or {})}
    fn = load_entry_point(ep, search_path=search_path)
    with Recorder.open(str(out), entry_point=ep, config=new_config, resume_from=from_checkpoint,
                       initial_checkpoint=from_checkpoint, lineage=lineage,
                       actor=meta.get("default_actor", "main"),
                       param_digest_every=int(meta.get("param_digest_every", 10)),
                       rng_every=int(meta.get("rng_every", 1)),
                       rng_sources=tuple(meta.get("rng_sources", dg.RNG_SOURCES)), **writer_opts) as rec:
        value = fn(rec)
        seq = rec.writer.seq if rec.writer is not None else 0
    return ReplayResult(str(reader.path), "fork", True, seq, None, out_tape=str(out), value=value)


def fork(tape: str | os.PathLike[str], out: str | os.PathLike[str], *, from_checkpoint: str | None = None,
         config_overrides: Mapping[str, Any] | None = None, **writer_opts: Any) -> ReplayResult:
    """Start the recorded entry point again (from a checkpoint) with changed config; new tape."""
    return replay(tape, mode="fork", out=out, from_checkpoint=from_checkpoint, config_overrides=config_overrides,
                  **writer_opts)
