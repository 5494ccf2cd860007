"""Recording a training run onto a tape, and the same API when a run is being replayed.

Add to a plain PyTorch loop::

    with Recorder.open("run.tape", entry_point="train:main", config=cfg) as rec:
        rec.watch(model)                        # parameter digests every 10 steps
        for step, (ids, x, y) in enumerate(loader):
            with rec.step(step):                # step begin/end + RNG digests
                rec.batch(ids)
                loss = loss_fn(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
                rec.loss(loss)                  # exact float64 bits

The same object is handed to an entry point ``main(rec)`` by the replayer, in one of
three modes: ``record`` (write the tape), ``verify`` (every event is compared with the
tape as it is produced; the first difference raises :class:`DivergenceError`) and
``force`` (as verify, and the timing-dependent *decisions* — :meth:`Actor.decide`,
:meth:`Actor.quorum`, :meth:`Actor.merge`, :meth:`Actor.maybe_inject` — return the
taped value without calling ``compute``).

Each event ticks its actor's vector clock. Several actors (a syncer and learners
simulated in one process, threads) share one tape via :meth:`Recorder.actor`.

One clock per actor: an actor's clock is this recorder's, and nothing else keeps one.
Channels that record here (``replay.channel.taping.RecorderSink``) stamp their messages
with the clock of the taped ``send`` event and merge on the taped ``recv``, so the tape's
clocks are the ones that travelled and ``ckpt tape check`` can judge the history (two
clocks per actor, one ticking on every event and one on messages only, could not be
compared). Snapshot bookkeeping taped here (``snapshot``, ``snapshot_channels``,
``snapshot_outcome``) ticks like every event; channel MARKERs themselves are never taped,
so they still neither tick a clock nor consume a channel seq.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from ckpt.context.config import config_hash
from ckpt.context.env import capture_env
from ckpt.tape.payload import pack_msgpack, unpack_msgpack
from replay import digest as dg
from replay.clock import VectorClock
from replay.events import KIND_BY_NAME, Event
from replay.tape.reader import EVENT_HEAD
from replay.tape.writer import TapeWriter

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Recorder", "Actor", "Stamp", "ReplayStop", "MODES", "event_from_body"]

MODES = ("record", "verify", "force")

_K = KIND_BY_NAME
_ACTOR, _BEGIN, _END, _BATCH, _RNG, _LOSS, _METRIC, _PARAMS = (
    _K[n] for n in ("actor", "step_begin", "step_end", "batch", "rng", "loss", "metric", "params"))
_SEND, _RECV, _DECISION, _QUORUM, _MERGE = (_K[n] for n in ("send", "recv", "decision", "quorum", "merge"))
_FINJ, _FDET, _FREC, _CKPT, _SNAP, _NOTE = (
    _K[n] for n in ("fault_injected", "fault_detected", "fault_recovered", "checkpoint", "snapshot", "note"))
_SNAPCH, _SNAPOUT = _K["snapshot_channels"], _K["snapshot_outcome"]
_ONE = struct.Struct("<qHHHQ")  # event head with a one-entry clock: the common case, packed in one call
_F64 = struct.Struct("<d")


class TapeOracle(Protocol):
    """What a verify/force-mode recorder asks of the tape it re-executes (the replayer's
    ``Oracle`` is the implementation). A seam, so that the recorder never imports the
    replayer: the replayer drives the recorder, not the other way round."""

    def actor_id(self, name: str) -> int: ...

    def before(self, actor: "Actor", code: int) -> None: ...

    def check(self, actor: "Actor", code: int, body: bytes) -> None: ...

    def peek_decision(self, actor: "Actor", code: int) -> Any: ...

    def diverge_decision(self, actor: "Actor", code: int, what: str, key: str, taped: Any) -> None: ...


class ReplayStop(BaseException):
    """Raised inside the entry point to end a replay early (``--until`` reached, or after a
    divergence). A BaseException so that a training loop's ``except Exception`` cannot eat it."""


@dataclass(frozen=True, slots=True)
class Stamp:
    """What a message carries: its channel, per-channel seq, payload digest and sender clock."""

    channel: str
    chan_seq: int
    digest: bytes
    clock: VectorClock
    sender: str


def _roundtrip(value: Any) -> Any:
    # Record mode returns what force mode would: the value as the tape reader decodes
    # its msgpack image (tuples become lists; integer map keys stay, as
    # spec/tape-format.md §6.1.1 allows), so code behaves the same in both.
    return unpack_msgpack(pack_msgpack(value))


class _Core:
    """State shared by all actors of one recorder."""

    def __init__(self, writer: TapeWriter | None, oracle: "TapeOracle | None", mode: str, *, param_digest_every: int,
                 rng_every: int, flush_every_step: bool, rng_sources: tuple[str, ...]) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if (writer is None) == (oracle is None):
            raise ValueError("a recorder needs exactly one of a tape writer (record) or an oracle (verify/force)")
        self.writer = writer
        self.oracle = oracle
        self.mode = mode
        self.lock = threading.RLock()
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.top_step: int | None = None
        self.param_digest_every = param_digest_every
        self.rng_every = rng_every
        self.rng_sources = rng_sources
        self.flush_every_step = flush_every_step
        self.watched: list[tuple[str, Any]] = []
        self.actors: dict[str, Actor] = {}

    def id_of(self, name: str) -> int:
        aid = self.ids.get(name)
        if aid is not None:
            return aid
        if self.oracle is not None:
            aid = self.oracle.actor_id(name)  # the tape's numbering, so bodies compare byte for byte
        else:
            aid = len(self.names)
            assert self.writer is not None
            raw = name.encode("utf-8")
            body = EVENT_HEAD.pack(self.top_step or 0, aid, 0) + struct.pack("<H", len(raw)) + raw
            self.writer.actors.append(name)
            self.writer.append(_ACTOR.code, body)
        self.ids[name] = aid
        while len(self.names) <= aid:
            self.names.append("")
        self.names[aid] = name
        return aid


class Actor:
    """One actor's view of the recorder: its own vector clock, step and channel counters."""

    def __init__(self, core: _Core, name: str) -> None:
        self._core = core
        self.name = name
        self._id = core.id_of(name)
        self._counter = 0
        self._others: dict[int, int] = {}  # other actors' clock entries, by id
        self._chan_seq: dict[str, int] = {}
        self.current_step = 0

    @property
    def id(self) -> int:
        """This actor's number on the tape."""
        return self._id

    @property
    def names(self) -> list[str]:
        """Every actor's name, by number (the table a taped event body refers to)."""
        return self._core.names

    @property
    def watched(self) -> list[tuple[str, Any]]:
        """The (prefix, module) pairs whose parameter digests this recorder tapes."""
        return self._core.watched

    # -- the clock -----------------------------------------------------------------------
    @property
    def clock(self) -> VectorClock:
        # Locked: another thread (a snapshot coordinator taping an outcome, a channel's
        # receive) may be merging into this actor's entries while we read them.
        with self._core.lock:
            names = self._core.names
            entries = [(names[i], c) for i, c in self._others.items()]
            if self._counter:
                entries.append((self.name, self._counter))
        return VectorClock(tuple(entries))

    def _set_clock(self, clock: VectorClock) -> None:
        self._counter = clock[self.name]
        self._others = {self._core.id_of(a): c for a, c in clock.entries if a != self.name}

    def continue_after(self, history: Sequence[Event], *, set_step: bool = True) -> None:
        """This actor's next event follows ``history``, its own taped events (a resume or a
        snapshot restore): its clock is the last one's, its channel counters the last
        sends', and its step the last one's unless the caller is about to set it."""
        if not history:
            return
        self._set_clock(history[-1].clock)
        if set_step:
            self.current_step = history[-1].step
        for ev in history:
            if ev.kind.code == _SEND.code:
                p = ev.payload
                self._chan_seq[p["channel"]] = p["chan_seq"]

    def _merge(self, clock: VectorClock) -> None:
        for a, c in clock.entries:
            if a == self.name:
                if c > self._counter:
                    self._counter = c
                continue
            i = self._core.id_of(a)
            if c > self._others.get(i, 0):
                self._others[i] = c

    # -- the one emit path ------------------------------------------------------------------
    def _emit(self, code: int, payload: bytes) -> None:
        core = self._core
        with core.lock:
            oracle = core.oracle
            if oracle is not None:
                oracle.before(self, code)
            self._counter += 1
            if self._others:
                ent = sorted(self._others.items())
                ent.append((self._id, self._counter))
                ent.sort()
                flat = [x for e in ent for x in e]
                body = (EVENT_HEAD.pack(self.current_step, self._id, len(ent)) + struct.pack("<" + "HQ" * len(ent), *flat)
                        + payload)
            else:
                body = _ONE.pack(self.current_step, self._id, 1, self._id, self._counter) + payload
            if oracle is not None:
                oracle.check(self, code, body)
                return
            w = core.writer
            assert w is not None
            if core.top_step is None or self.current_step > core.top_step:
                core.top_step = self.current_step
                w.note_step(self.current_step)
            w.append(code, body)

    def _taped(self, code: int) -> dict[str, Any] | None:
        """Force mode: the payload of the decision the tape holds next for this actor."""
        core = self._core
        if core.mode != "force":
            return None
        assert core.oracle is not None
        with core.lock:
            return core.oracle.peek_decision(self, code)

    # -- steps ------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.current_step = step
        self._emit(_BEGIN.code, b"")
        if self._core.rng_every and step % self._core.rng_every == 0:
            self.rng()

    def end_step(self) -> None:
        core = self._core
        if core.watched and core.param_digest_every and self.current_step % core.param_digest_every == 0:
            self.params()
        self._emit(_END.code, b"")
        if core.writer is not None and core.flush_every_step:
            with core.lock:  # another actor's thread may be appending to the same buffer
                core.writer.flush()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator["Actor"]:
        """``with rec.step(n):`` brackets one optimizer step (no step_end if the body raises)."""
        self.begin_step(step)
        yield self
        self.end_step()

    # -- observations -------------------------------------------------------------------------
    def batch(self, sample_ids: Sequence[int] | "torch.Tensor") -> None:
        ids = sample_ids.tolist() if hasattr(sample_ids, "tolist") else list(sample_ids)
        self._emit(_BATCH.code, struct.pack(f"<I{len(ids)}Q", len(ids), *ids))

    def loss(self, value: float | "torch.Tensor") -> None:
        v = value.item() if hasattr(value, "item") else value
        self._emit(_LOSS.code, _F64.pack(float(v)))

    def metric(self, name: str, value: float | "torch.Tensor") -> None:
        v = value.item() if hasattr(value, "item") else value
        self._emit(_METRIC.code, _METRIC.pack(name, float(v)))

    def rng(self) -> None:
        for source, d in dg.rng_digests(self._core.rng_sources):
            self._emit(_RNG.code, _RNG.pack(source, d))

    def params(self, modules: Sequence[tuple[str, Any]] | None = None, *,
               named: Sequence[tuple[str, Any]] | None = None) -> None:
        """Record parameter digests of the watched modules (or the given (prefix, module)
        pairs), or of ``named`` tensors in their order (a state that is not one module:
        a stage's model, anchor and optimizer tensors, a job's shipped digests)."""
        if named is None:
            mods = modules if modules is not None else self._core.watched
            named = []
            for prefix, m in mods:
                named.extend((prefix + k, v) for k, v in m.state_dict(keep_vars=True).items())
        elif modules is not None:
            raise TypeError("params() takes modules or named tensors, not both")
        total, per = dg.named_digests(list(named))
        self._emit(_PARAMS.code, _PARAMS.pack(total, per))

    def note(self, text: str) -> None:
        self._emit(_NOTE.code, _NOTE.pack(text))

    def event(self, kind: str, *values: Any) -> None:
        """Record one event of a reference run's own kind (codes 25 and up in
        ``replay.events``), its field values in table order. The generic kinds have their
        own methods, and a decision kind would need force-mode handling: both refused."""
        k = KIND_BY_NAME.get(kind)
        if k is None:
            raise KeyError(f"unknown event kind {kind!r}")
        if k.code < 25 or k.decision:
            raise ValueError(f"{kind} is not a run's own record kind: use its Actor method")
        self._emit(k.code, k.pack(*values))

    # -- messages ---------------------------------------------------------------------------------
    def send(self, channel: str, payload: Any = None, *, peer: str, digest: bytes | None = None,
             chan_seq: int | None = None) -> Stamp:
        """Record a send; returns the :class:`Stamp` the message must carry to the receiver.

        The payload is digested (bytes, tensors, mappings of them, msgpack-able data)
        unless a 16-byte ``digest`` is given. ``chan_seq`` defaults to this actor's
        counter for ``channel`` + 1 (channels are numbered from 1, per sender).
        """
        with self._core.lock:
            if self._core.oracle is not None:
                self._core.oracle.before(self, _SEND.code)  # lined up first: its counters may come from the tape
            seq = chan_seq if chan_seq is not None else self._chan_seq.get(channel, 0) + 1
            self._chan_seq[channel] = seq
            d = digest if digest is not None else dg.payload_digest(payload)
            self._emit(_SEND.code, _SEND.pack(channel, seq, peer, d))
            return Stamp(channel, seq, d, self.clock, self.name)

    def recv(self, stamp: Stamp) -> None:
        """Record the delivery of a message: merge its clock, then tick."""
        with self._core.lock:
            if self._core.oracle is not None:
                # a replay lines the actor up first (its clock may be set from the tape):
                # the merge must land on that clock, not be replaced by it
                self._core.oracle.before(self, _RECV.code)
            self._merge(stamp.clock)
            self._emit(_RECV.code, _RECV.pack(stamp.channel, stamp.chan_seq, stamp.sender, stamp.digest))

    # -- decisions (taped in record mode, taken from the tape in force mode) ---------------------
    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any:
        """A timing-dependent choice: computed and taped, or (force mode) read from the tape."""
        taped = self._taped(_DECISION.code)
        if taped is not None:
            if taped["what"] != what or taped["key"] != key:
                self._core.oracle.diverge_decision(self, _DECISION.code, what, key, taped)  # type: ignore[union-attr]
            value = taped["value"]
        else:
            value = _roundtrip(compute())
        self._emit(_DECISION.code, _DECISION.pack(what, key, value))
        return value

    def quorum(self, key: str, minimum: int, compute: Callable[[], Sequence[str]]) -> list[str]:
        taped = self._taped(_QUORUM.code)
        if taped is not None:
            if taped["key"] != key:
                self._core.oracle.diverge_decision(self, _QUORUM.code, "quorum", key, taped)  # type: ignore[union-attr]
            members = list(taped["members"])
        else:
            members = [str(m) for m in compute()]
        self._emit(_QUORUM.code, _QUORUM.pack(key, minimum, members))
        return members

    def merge(self, key: str, compute: Callable[[], tuple[Sequence[Stamp | tuple[str, int]], Any]]
              ) -> tuple[list[tuple[str, int]], Any]:
        """A merge: ``compute`` returns (contributions, weights); contributions are send stamps."""
        taped = self._taped(_MERGE.code)
        if taped is not None:
            if taped["key"] != key:
                self._core.oracle.diverge_decision(self, _MERGE.code, "merge", key, taped)  # type: ignore[union-attr]
            contribs, weights = [tuple(c) for c in taped["contributions"]], taped["weights"]
        else:
            raw, w = compute()
            contribs = [(c.channel, c.chan_seq) if isinstance(c, Stamp) else (str(c[0]), int(c[1])) for c in raw]
            weights = _roundtrip(w)
        self._emit(_MERGE.code, _MERGE.pack(key, contribs, weights))
        return contribs, weights  # type: ignore[return-value]

    def maybe_inject(self, fault: str, target: str, compute: Callable[[], Any]) -> Any:
        """Decide whether to inject ``fault`` into ``target`` (a falsy value means no); taped
        as a decision so force mode replays the same schedule, then a fault_injected event."""
        detail = self.decide("fault:" + fault, target, compute)
        if detail:
            self._emit(_FINJ.code, _FINJ.pack(fault, target, detail))
        return detail

    # -- events a library below replay encodes (ckpt.guard: kinds 48-53) --------------------------
    def record_event(self, kind: str | int, payload: bytes) -> None:
        """Tape one event of ``kind`` whose payload is already encoded: ``ckpt`` cannot
        import this package, so the kinds it owns are encoded there (``ckpt.tape.payload``)
        and handed over as bytes. Refused (``TapeFormatError``) unless the event table's
        decoder reads them; a decision kind goes through :meth:`decide_event`."""
        k = _table_kind(kind)
        if k.decision:
            raise ValueError(f"{k.name} is a decision kind: use decide_event")
        k.unpack(payload)  # a recorder never writes what a reader refuses
        self._emit(k.code, bytes(payload))

    def decide_event(self, kind: str | int, compute: Callable[[], bytes]) -> bytes:
        """A decision of ``kind`` whose payload a library encodes: in force mode the payload
        the tape holds next (``compute`` is not called), otherwise ``compute()``'s; taped
        either way, and returned so the caller acts on what was decided."""
        k = _table_kind(kind)
        if not k.decision:
            raise ValueError(f"{k.name} is not a decision kind: use record_event")
        taped = self._taped(k.code)
        payload = k.pack_map(taped) if taped is not None else bytes(compute())
        k.unpack(payload)
        self._emit(k.code, payload)
        return payload

    # -- faults, checkpoints, snapshots ----------------------------------------------------------
    def fault_detected(self, fault: str, target: str, detail: Any = None) -> None:
        self._emit(_FDET.code, _FDET.pack(fault, target, _roundtrip(detail)))

    def recovered(self, fault: str, target: str, *, target_clock: VectorClock, observed: VectorClock) -> None:
        """``target`` recovered from ``fault`` having observed clock ``observed`` (e.g. the
        peer checkpoint it loaded), which must be >= ``target_clock`` (`tape check` verifies)."""
        with self._core.lock:
            self._merge(observed)
            self._emit(_FREC.code, _FREC.pack(fault, target, target_clock, observed))

    def checkpoint(self, ckpt_id: str, path: str = "") -> None:
        """Mark a committed checkpoint; the tape is fsynced here (always, whatever the knobs)."""
        with self._core.lock:
            self._emit(_CKPT.code, _CKPT.pack(ckpt_id, str(path)))
            if self._core.writer is not None:
                self._core.writer.sync()

    def snapshot(self, snapshot_id: str, inflight: Sequence[Stamp | tuple[str, int]] = ()) -> VectorClock:
        """This actor's part of a distributed snapshot; returns the cut clock."""
        refs = _refs(inflight)
        with self._core.lock:
            self._emit(_SNAP.code, _SNAP.pack(snapshot_id, refs))
            return self.clock

    def snapshot_channels(self, snapshot_id: str, inflight: Sequence[Stamp | tuple[str, int]]) -> None:
        """The recorded channel state of this actor's part of ``snapshot_id``, taped when the
        last marker arrives (Chandy-Lamport knows it only then); completes :meth:`snapshot`."""
        self._emit(_SNAPCH.code, _SNAPCH.pack(snapshot_id, _refs(inflight)))

    def snapshot_outcome(self, snapshot_id: str, *, committed: bool, path: str = "", parts: Sequence[str] = (),
                         excluded: Sequence[str] = (), reason: str = "") -> None:
        """The coordinator's verdict on ``snapshot_id``; a commit fsyncs the tape, like a checkpoint."""
        with self._core.lock:
            self._emit(_SNAPOUT.code, _SNAPOUT.pack(snapshot_id, int(bool(committed)), str(path),
                                                    [str(p) for p in parts], [str(e) for e in excluded], reason))
            if committed and self._core.writer is not None:
                self._core.writer.sync()

    def observe(self, clock: VectorClock) -> None:
        """Merge a clock learnt out of band (a restored snapshot's cut) without an event: the
        actor's next event is then after everything ``clock`` saw, and its clock never goes back."""
        with self._core.lock:
            self._merge(clock)


class Recorder(Actor):
    """The recorder; it is also the default actor (``actor=``, "main" unless told)."""

    def __init__(self, writer: TapeWriter | None = None, *, oracle: "TapeOracle | None" = None, mode: str = "record",
                 actor: str = "main", config: Mapping[str, Any] | None = None, resume_from: str | None = None,
                 until: int | None = None, param_digest_every: int = 10, rng_every: int = 1,
                 rng_sources: Sequence[str] = dg.RNG_SOURCES, flush_every_step: bool = True) -> None:
        core = _Core(writer, oracle, mode, param_digest_every=param_digest_every, rng_every=rng_every,
                     flush_every_step=flush_every_step, rng_sources=tuple(rng_sources))
        self.mode = mode
        self.config: dict[str, Any] = dict(config or {})
        self.resume_from = resume_from
        self.until = until
        self.writer = writer
        super().__init__(core, actor)
        core.actors[actor] = self

    @classmethod
    def open(cls, path: str, *, entry_point: str | None = None, config: Mapping[str, Any] | None = None,
             actor: str = "main", param_digest_every: int = 10, rng_every: int = 1,
             rng_sources: Sequence[str] = dg.RNG_SOURCES, initial_checkpoint: str | None = None, commit: str | None = None,
             lineage: Mapping[str, Any] | None = None, resume_from: str | None = None,
             extra_meta: Mapping[str, Any] | None = None, **writer_opts: Any) -> "Recorder":
        """Create a new tape at ``path`` and a recorder writing to it.

        ``writer_opts`` go to :class:`TapeWriter`: ``segment_bytes``, ``chain``, ``zstd``,
        ``fsync_every``, ``fsync_interval``, ``buffer_bytes``.
        """
        cfg = dict(config or {})
        meta: dict[str, Any] = {
            "entry_point": entry_point,
            "config": cfg,
            "config_hash": config_hash(cfg),
            "commit": commit if commit is not None else _git_commit(),
            "env": capture_env(),
            "initial_checkpoint": initial_checkpoint,
            "lineage": dict(lineage) if lineage else None,
            "param_digest_every": param_digest_every,
            "rng_every": rng_every,
            "rng_sources": list(rng_sources),
            "default_actor": actor,
            "package_version": _package_version(),
        }
        meta.update(extra_meta or {})
        writer = TapeWriter(path, meta, **writer_opts)
        return cls(writer, mode="record", actor=actor, config=cfg, resume_from=resume_from,
                   param_digest_every=param_digest_every, rng_every=rng_every, rng_sources=rng_sources)

    @property
    def replaying(self) -> bool:
        """True in verify and force mode: skip side effects (saving checkpoints), keep the events."""
        return self.mode != "record"

    def append_history(self, frames: Iterable[tuple[int, bytes, Event]]) -> int:
        """Record already-taped events verbatim on this (new) tape, then let every actor
        continue after its own: a run continued from a snapshot starts its tape with the
        history inside the cut (:meth:`append_cut`). ``frames`` are
        ``(kind code, body, decoded event)`` in tape order, actor declarations included;
        actors must be declared in the same order as on the source tape, since bodies
        name them by id. Returns the number of events written."""
        core = self._core
        w = self.writer
        if w is None:
            raise ValueError("append_history records: this recorder replays")
        own: dict[str, list[Event]] = {}
        n = 0
        with core.lock:
            for code, body, ev in frames:
                aid = EVENT_HEAD.unpack_from(body, 0)[1]
                if code == _ACTOR.code:
                    if core.id_of(ev.actor) != aid:
                        raise ValueError(f"actor {ev.actor!r} has id {aid} on the source tape, "
                                         f"{core.id_of(ev.actor)} on this one")
                    continue
                if core.top_step is None or ev.step > core.top_step:  # as _emit: the step index
                    core.top_step = ev.step
                    w.note_step(ev.step)
                w.append(code, body)
                own.setdefault(ev.actor, []).append(ev)
                n += 1
            for name, history in own.items():
                self.actor(name).continue_after(history)
        return n

    def append_cut(self, parent: Any, snapshot: str, *, coordinator: str) -> int:
        """Write onto this new tape the ``parent`` tape's (a ``TapeReader``) history inside
        snapshot ``snapshot``: each actor's events up to and including its own
        ``snapshot`` event of it (an actor with no cut, such as a scheduler, up to the
        ``coordinator``'s), verbatim and in the parent's order (:meth:`append_history`).
        A snapshot cut is consistent, so every receive in this prefix has its send in it.
        This is how a run continued live from a snapshot starts a tape that reads as one
        run that never crashed. Returns the number of events copied."""
        from replay.errors import SnapshotError
        from replay.tape.reader import decode_event

        names: list[str] = []
        frames = [(fr.kind, bytes(fr.body), decode_event(fr, names)) for _seg, fr in parent.frames()]
        cut_at: dict[str, int] = {}
        for i, (code, _body, ev) in enumerate(frames):
            if code == _SNAP.code and ev.payload["snapshot_id"] == snapshot:
                cut_at.setdefault(ev.actor, i)
        if coordinator not in cut_at:
            raise SnapshotError(f"the tape holds no cut of {coordinator} for this snapshot", snapshot=snapshot)
        inside = [f for i, f in enumerate(frames)
                  if f[0] == _ACTOR.code or i <= cut_at.get(f[2].actor, cut_at[coordinator])]
        try:
            return self.append_history(inside)
        except ValueError as exc:
            raise SnapshotError(f"cannot continue this tape: {exc}", snapshot=snapshot) from None

    def actor(self, name: str) -> Actor:
        """The actor called ``name`` (created on first use; same object afterwards)."""
        with self._core.lock:
            a = self._core.actors.get(name)
            if a is None:
                a = self._core.actors[name] = Actor(self._core, name)
            return a

    def watch(self, module: Any, prefix: str = "") -> None:
        """Digest this module's state_dict every ``param_digest_every`` steps (at step end)."""
        self._core.watched.append((prefix, module))

    def flush(self) -> None:
        """Hand the buffered events to the OS now (they then survive a crash of this process)."""
        if self.writer is not None:
            with self._core.lock:  # not under another thread's append
                self.writer.flush()

    def close(self) -> None:
        """Close the tape; until then ``ckpt tape verify`` reports it as not closed."""
        if self.writer is not None:
            with self._core.lock:  # not under another thread's append
                self.writer.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _table_kind(kind: str | int) -> Any:
    from replay.events import kind as lookup

    return lookup(kind)


def _refs(inflight: Sequence[Stamp | tuple[str, int]]) -> list[tuple[str, int]]:
    return [(s.channel, s.chan_seq) if isinstance(s, Stamp) else (str(s[0]), int(s[1])) for s in inflight]


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("ckpt-replay")
    except Exception:  # not installed (run from a checkout): the version is informative only
        return "0+unknown"


def event_from_body(seq: int, code: int, body: bytes, names: Sequence[str]) -> Event:
    """Decode a body produced by :meth:`Actor._emit` (for divergence reports)."""
    from replay.tape.format import Frame
    from replay.tape.reader import decode_event

    return decode_event(Frame(-1, seq, code, memoryview(body), 0), list(names) if code != _ACTOR.code else [])

