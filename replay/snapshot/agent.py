"""Chandy-Lamport snapshots over Endpoint channels, written as one checkpoint.

Normative description: spec/snapshot-protocol.md. In short, for snapshot ``name``:

1. The initiator (the coordinator) begins a pending checkpoint, records its local state
   and sends a MARKER on every outgoing channel.
2. A process records its local state at its first MARKER (that channel's state is
   empty) and forwards MARKERs on every outgoing channel.
3. Every other incoming channel records the data messages delivered after the local
   record and before that channel's MARKER.
4. When every incoming channel has its MARKER, the process writes its part (staged
   state + recorded channel state + cut clock) in a background thread and reports the
   part record on the control plane.
5. The coordinator checks the channel accounting across parts and commits the
   checkpoint atomically, or aborts it and removes the temporary directory.

"Recording local state" is a copy of every registered entry into staging buffers; the
write happens off the training loop. The cut clock is the clock of the recorded
``snapshot.record`` event: on the event tape (a ``ClockSink``, one clock per actor) that
event ticks the actor's clock and is the tape's ``snapshot`` event, so a part's cut and
the tape's agree exactly. Snapshots have names, and any number may be in
flight at once: markers, recordings and parts are all keyed by name.

Application-driven snapshots (spec/snapshot-protocol.md §9a) run the same rules with
the cut points chosen by the application: ``scope`` (which channels a snapshot covers;
the others must be quiet), per-snapshot participants and policy exclusions
(``initiate``), ``markers="application"`` (the application hands each MARKER to
``take_marker`` when it decides to), and ``coordinate="manual"`` (``ready``/``commit``/
``finish`` at points the application chose, so every event of the coordinator falls at a
taped position). ``restore(partial=True)`` continues from a snapshot that left
processes out.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import msgpack
import torch

from replay.channel.base import Endpoint, Message, MessageKind, channel_name
from replay.clock import VectorClock
from replay.errors import PeerDiedError, SnapshotError
from replay.snapshot.store import ControlPlane, Pending, SnapshotStore

__all__ = [
    "SnapshotAgent",
    "SnapshotHandle",
    "Outcome",
    "RestoreInfo",
    "StagingPool",
    "CHANNELS_KEY",
    "SNAPSHOT_FORMAT",
    "PART_FORMAT",
]

CHANNELS_KEY = "replay.channels"
"""The reserved top-level entry of every snapshot part: the in-flight messages of its channels."""
SNAPSHOT_FORMAT = "replay-snapshot"
PART_FORMAT = "replay-snapshot-part"
FORMAT_VERSION = 1


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


class StagingPool:
    """Reusable staging buffers, so a snapshot's blocking cost is a copy, not an
    allocation plus first-touch page faults. A buffer goes back to the pool once its
    part is durable; snapshots in flight at once simply hold more buffers."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        key = (tuple(t.shape), t.dtype, t.device)
        with self._lock:
            lst = self._free.get(key)
            buf = lst.pop() if lst else None
        if buf is None:
            buf = torch.empty_like(t, memory_format=torch.contiguous_format)
        buf.copy_(t)
        return buf

    def release(self, tree: Any) -> None:
        if isinstance(tree, torch.Tensor):
            with self._lock:
                free = self._free.setdefault((tuple(tree.shape), tree.dtype, tree.device), [])
                # released twice, a buffer would be handed to two stagings at once: one
                # snapshot's copy would overwrite another's
                if not any(b is tree for b in free):
                    free.append(tree)
        elif isinstance(tree, dict):
            for v in tree.values():
                self.release(v)
        elif isinstance(tree, (list, tuple)):
            for v in tree:
                self.release(v)
        elif isinstance(tree, _Held):
            # a staged Stateful (``_typed``): its buffers come back too. Missed, every later
            # snapshot allocated and first-touched its staging buffers again (the blocking
            # time went from about a memcpy to 3-5x one in bench/snapshot.py)
            self.release(tree.sd)


def _stage(x: Any, pool: StagingPool, key: str) -> Any:
    if isinstance(x, torch.Tensor):
        return pool.copy(x)
    if isinstance(x, dict):
        return {k: _stage(v, pool, f"{key}/{k}") for k, v in x.items()}
    if isinstance(x, list):
        return [_stage(v, pool, f"{key}/{i}") for i, v in enumerate(x)]
    if isinstance(x, tuple):
        return tuple(_stage(v, pool, f"{key}/{i}") for i, v in enumerate(x))
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    raise SnapshotError(f"cannot stage a value of type {type(x).__name__}; register Stateful objects, tensors "
                        "or trees of them and msgpack-able values", key=key)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A snapshot's outcome: committed or not (and why), its parts and the processes excluded."""

    name: str
    committed: bool
    reason: str = ""
    parts: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RestoreInfo:
    """What a restore loaded for one actor: the snapshot, the cut's clock, and the in-flight
    messages re-delivered per channel."""

    name: str
    actor: str
    cut_clock: VectorClock
    inflight: Mapping[str, int]


@dataclass
class _Snap:
    """One snapshot as seen by one process (mutable, touched only by the loop thread
    until it is handed to the writer)."""

    name: str
    pending: Pending
    coordinator: str
    participants: tuple[str, ...]
    excluded: dict[str, str] = field(default_factory=dict)  # part -> reason, left out by policy at initiation
    recorded: bool = False
    step: int = 0
    cut_clock: VectorClock | None = field(default_factory=VectorClock)
    endpoint_state: dict[str, Any] = field(default_factory=dict)
    staged: dict[str, Any] = field(default_factory=dict)
    data: Any = None  # the data field's state, staged at the cut
    rng: dict[str, Any] | None = None
    recording: dict[str, list[Message]] = field(default_factory=dict)
    closed: dict[str, list[Message]] = field(default_factory=dict)
    failed_peers: set[str] = field(default_factory=set)
    blocked_s: float = 0.0
    submitted: bool = False
    local_complete: bool = False  # every channel closed (manual coordination: not written yet)
    dead_seen: dict[str, float] = field(default_factory=dict)  # participant -> when first known dead (ready())
    adopted: Mapping[str, Any] | None = None  # restored and committed already: its MANIFEST meta
    write_done: threading.Event = field(default_factory=threading.Event)


class SnapshotHandle:
    """Returned by ``initiate``; ``wait`` blocks until the coordinator commits or aborts."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()
        self._outcome: Outcome | None = None

    def _finish(self, outcome: Outcome) -> None:
        self._outcome = outcome
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Outcome:
        if not self._done.wait(timeout):
            raise SnapshotError(f"snapshot did not finish within {timeout} s", snapshot=self.name)
        assert self._outcome is not None
        return self._outcome


class SnapshotAgent:
    """Takes part in snapshots on one endpoint; coordinates the ones it initiates.

    ``state`` maps entry names to Stateful objects, tensors, or trees of them; it is
    what a part holds (plus the channel state). Options (keyword-only):
    - ``participants``: every actor of the job (the coordinator waits for all of them);
    - ``excludable``: actors that may be left out of a snapshot when they fail (the
      Decoupled DiLoCo policy for learners); any other failure aborts the snapshot;
    - ``rng``: also capture the process's global RNG streams at the cut (ckpt's
      capture_rng) and restore them;
    - ``deadline_s``: how long a coordinator waits for parts before aborting;
    - ``background``: write parts on a background thread (False writes inline, which
      single-threaded simulations use to stay simple);
    - ``scope``: the peers whose channels snapshots cover (markers, channel state); every
      other channel between included processes must be quiet at the cut (§9a rule 1);
    - ``markers``: ``"endpoint"`` (the endpoint hands MARKERs over at receive calls) or
      ``"application"`` (the application calls :meth:`take_marker`);
    - ``coordinate``: ``"thread"`` (a coordinator thread commits when it can) or
      ``"manual"`` (:meth:`ready`, :meth:`commit`, :meth:`finish`);
    - ``channel_filter``: ``msg -> msg``, applied to each message before it is recorded;
    - ``events``: the EventSink for this agent's events (default: the endpoint's);
    - ``data``, ``config``: the part's data-loader field (a Stateful) and the run's config;
    - ``part_of``: participant -> part name (default: the actor's own name), e.g. the
      restarted incarnations of one worker writing one part name;
    - ``step``: the application's step recorded with this process's part (default: the
      endpoint's ``step``);
    - ``store`` may be None: the protocol runs and nothing is written (a replay).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        state: Mapping[str, Any],
        *,
        store: SnapshotStore,
        control: ControlPlane,
        participants: Sequence[str],
        excludable: Iterable[str] = (),
        rng: bool = False,
        deadline_s: float = 60.0,
        grace_s: float = 5.0,
        background: bool = True,
        poll_s: float = 0.002,
        scope: Iterable[str] | None = None,
        markers: str = "endpoint",
        coordinate: str = "thread",
        channel_filter: Callable[[Message], Message] | None = None,
        events: Any = None,
        data: Any = None,
        config: Any = None,
        part_of: Callable[[str], str] | None = None,
        step: Callable[[], int] | None = None,
    ) -> None:
        if CHANNELS_KEY in state:
            raise SnapshotError(f"state entry name {CHANNELS_KEY!r} is reserved", key=CHANNELS_KEY)
        for k in state:
            if not isinstance(k, str) or not k or k.startswith("@"):
                raise SnapshotError("state entry names must be non-empty str not starting with '@'", key=str(k))
        if endpoint.actor not in participants:
            raise SnapshotError("the endpoint's actor is not among the participants", actor=endpoint.actor)
        if markers not in ("endpoint", "application"):
            raise SnapshotError(f"markers must be 'endpoint' or 'application', got {markers!r}")
        if coordinate not in ("thread", "manual"):
            raise SnapshotError(f"coordinate must be 'thread' or 'manual', got {coordinate!r}")
        self.ep = endpoint
        self.actor = endpoint.actor
        self.state = dict(state)
        self.store = store
        self.control = control
        self.participants = tuple(sorted(participants))
        self.excludable = frozenset(excludable)
        self.capture_rng = rng
        self.deadline_s = deadline_s
        self.grace_s = grace_s
        self.background = background
        self.poll_s = poll_s
        self.scope = None if scope is None else frozenset(scope)
        self.markers = markers
        self.manual = coordinate == "manual"
        self.channel_filter = channel_filter
        self.events = events
        self.data = data
        self.config = config
        self.part_of = part_of or (lambda a: a)
        self.part = self.part_of(self.actor)
        self._step_of = step or (lambda: self.ep.step)
        self.pool = StagingPool()
        self._snaps: dict[str, _Snap] = {}
        self._done: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snap-write-{self.actor}")
        self._coord_threads: list[threading.Thread] = []
        self._last_fail_check = 0.0
        self.stats: dict[str, dict[str, float]] = {}
        self._unconsumed: dict[str, int] = {}
        if markers == "endpoint":
            endpoint.on_control(self._on_marker)
        endpoint.on_deliver(self._on_deliver)
        endpoint.on_peer_failed(self._on_peer_failed)

    def _record(self, kind: str, payload: Mapping[str, Any]) -> VectorClock | None:
        """Record one of this agent's events; returns the taped clock when a sink knows it."""
        if self.events is None:
            return self.ep.record(kind, payload)
        return self.events.record(kind, self.actor, self.ep.clock, self.ep.step, payload)

    # -- public -------------------------------------------------------------------------
    def initiate(self, name: str, *, participants: Sequence[str] | None = None,
                 exclude: Mapping[str, str] | None = None) -> SnapshotHandle:
        """Start snapshot ``name`` with this process as initiator and coordinator.

        ``participants`` (default: the agent's) are the processes this snapshot asks for a
        part; ``exclude`` maps part names left out *by policy* to the reason (each must be
        excludable): they get no marker, and their channels do not record (§9a rule 2)."""
        if name in self._snaps or name in self._done:
            raise SnapshotError("a snapshot with this name already ran here", snapshot=name)
        parts = tuple(sorted(participants)) if participants is not None else self.participants
        if self.actor not in parts:
            raise SnapshotError("the coordinator must take part in its snapshot", snapshot=name, actor=self.actor)
        excluded = dict(exclude or {})
        for a in excluded:
            if not self._excludable(a):
                raise SnapshotError("only an excludable process may be left out of a snapshot", snapshot=name,
                                    actor=a)
        for a, why in sorted(excluded.items()):
            self._record("snapshot.exclude", {"snapshot": name, "actor": a, "reason": why})
        pending = self.store.begin(name) if self.store is not None else Pending("", "")
        parts = tuple(a for a in parts if self.part_of(a) not in excluded)
        s = _Snap(name, pending, self.actor, parts, excluded=excluded)
        self._snaps[name] = s
        handle = SnapshotHandle(name)
        self._record("snapshot.begin", {"snapshot": name, "participants": list(parts), "path": pending.final})
        self._record_local(s, first=None)
        if not self.manual:
            t = threading.Thread(target=self._coordinate, args=(s, handle), name=f"snap-coord-{name}", daemon=True)
            self._coord_threads.append(t)
            t.start()
        return handle

    def _excludable(self, a: str) -> bool:
        return a in self.excludable or any(self.part_of(x) == a for x in self.excludable)

    def offer_marker(self, msg: Message) -> bool:
        """``markers="application"``: offer a MARKER at the endpoint's cut point (where it is
        handed over). One that closes a channel this process records is taken at once:
        what follows it on its channel was sent after the sender's cut and must not be
        recorded. A first marker is left to the application (False): it takes it with
        :meth:`take_marker` at the point it chooses."""
        s = self._snaps.get(str(msg.meta.get("snapshot", "")))
        if s is None or not s.recorded:
            return False
        self._on_marker(msg)
        return True

    def take_marker(self, msg: Message, *, unconsumed: Iterable[Message] = ()) -> None:
        """``markers="application"``: hand over a MARKER at the point the application chose.

        ``unconsumed``: data messages the endpoint delivered to the application that it
        has not consumed at this point; the cut counts them as not yet received (§9a
        rule 3), so their senders send them again after a restore."""
        if self.markers != "application":
            raise SnapshotError("take_marker is for markers='application'; the endpoint hands markers over")
        back: dict[str, int] = {}
        for m in unconsumed:
            if m.kind is MessageKind.DATA:
                back[m.src] = min(back.get(m.src, m.seq), m.seq)
        self._unconsumed = back
        try:
            self._on_marker(msg)
        finally:
            self._unconsumed = {}

    def prewarm(self) -> None:
        """Allocate (and touch) the staging buffers now, so that the first snapshot
        blocks the loop for a copy only, not for allocation and page faults."""
        for key, obj in self.state.items():
            sd = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
            self.pool.release(_stage(sd, self.pool, key))

    def poll(self) -> None:
        """Let snapshots progress without receiving: take in markers, notice failures."""
        self.ep.poll()
        self._check_failures()

    def local_done(self, name: str) -> bool:
        """Has this process finished its local part of snapshot ``name`` (all markers in)?"""
        return name in self._done

    def in_flight(self) -> list[str]:
        return sorted(n for n, s in self._snaps.items() if not s.submitted)

    def mark_failed(self, actor: str, reason: str = "marked failed") -> None:
        """Declare ``actor`` failed for every snapshot (e.g. from the tape's failure event)."""
        self.control.set(f"dead/{actor}", _pack({"by": self.actor, "reason": reason}))
        if actor in self.ep.inbound:
            self._peer_gone(actor)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until this process's parts in flight are written."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in list(self._snaps.values()):
            if s.submitted:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not s.write_done.wait(left):
                    raise SnapshotError("part write did not finish in time", snapshot=s.name, actor=self.actor)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._writer.shutdown(wait=True)
        for t in self._coord_threads:
            t.join(timeout)

    # -- restore --------------------------------------------------------------------------
    def restore(self, name: str, *, partial: bool = False, source: SnapshotStore | None = None,
                announce: bool = True, resume: bool = False, into: Mapping[str, Any] | None = None) -> RestoreInfo:
        """Reload this process's part and queue its recorded in-flight messages.

        Must run before the endpoint delivers anything. A snapshot restores only at the
        process count (and the actor names) it was taken at, unless ``partial``: then it
        may have left processes out (MANIFEST ``excluded``), the job may have processes
        the snapshot has no part for (they rejoin by the application's own recovery), and
        channels to or from a process outside the snapshot start empty (§9a rule 8).
        ``source``: the store to read from (default: the agent's own). ``into``: the objects
        to load the part's entries into (default: the registered state; e.g. loaders for
        entries registered as plain trees). ``announce`` tapes a ``snapshot.restore`` note;
        a run continued under its original tape (force mode with ``align_snapshot``), whose
        history holds no such event, passes False. ``resume``: the process continues right after its
        cut, and the protocol events this process taped after its cut event are taped
        again: a participant's local completion, or, for a manually coordinating
        coordinator, the snapshot is open again (committed already: :meth:`commit` returns
        its outcome and :meth:`finish` tapes its close).
        """
        store = source if source is not None else self.store
        if store is None:
            raise SnapshotError("no store to restore from", snapshot=name)
        meta = store.read_meta(name)
        if meta.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"not a snapshot checkpoint (format {meta.get('format')!r})", snapshot=name)
        if int(meta.get("version", 0)) != FORMAT_VERSION:
            raise SnapshotError(f"unsupported snapshot version {meta.get('version')!r}", snapshot=name)
        included = tuple(meta["parts"])
        mine = {self.part_of(a) for a in self.participants}
        if not partial and len(included) != len(self.participants):
            raise SnapshotError(
                f"snapshot was taken at {len(included)} processes {list(included)}; this job has "
                f"{len(self.participants)} {list(self.participants)}; a snapshot restores only at the process count "
                "it was taken at", snapshot=name)
        if (not partial and set(included) != mine) or not set(included) <= mine:
            raise SnapshotError(f"snapshot processes {sorted(included)} differ from this job's "
                                f"{sorted(mine)}", snapshot=name)
        if self.part not in included:
            raise SnapshotError("the snapshot has no part for this process: it rejoins by recovery", snapshot=name,
                                part=self.part)
        extra = store.read_extra(name, self.part)
        if extra.get("format") != PART_FORMAT or extra.get("snapshot") != name or \
                self.part_of(str(extra.get("actor"))) != self.part:
            raise SnapshotError("part metadata does not describe this process's part", snapshot=name, part=self.part)
        store.load_into(name, self.part, dict(into) if into is not None else self.state, restore_rng=self.capture_rng)
        if self.data is not None:
            self.data.load_state_dict(store.read_entry(name, self.part, "@data"))
        chans = store.read_entry(name, self.part, CHANNELS_KEY)
        excluded = set(meta.get("excluded", ()))
        ep_state = dict(extra["endpoint"])
        if partial:
            # Channels of processes outside the snapshot (left out, or new) start empty.
            inside = {a for a in (*self.ep.outbound, *self.ep.inbound) if self.part_of(a) in included}
            ep_state["next_send"] = {k: int(ep_state["next_send"].get(k, 0)) if k in inside else 0
                                     for k in self.ep.outbound}
            ep_state["next_recv"] = {k: int(ep_state["next_recv"].get(k, 0)) if k in inside else 0
                                     for k in self.ep.inbound}
            chans = {k: v for k, v in chans.items() if k in inside}
        else:
            # Channels to or from excluded processes do not exist in the restored job.
            ep_state["next_send"] = {k: v for k, v in ep_state["next_send"].items()
                                     if k not in excluded or k in self.ep.outbound}
            ep_state["next_recv"] = {k: v for k, v in ep_state["next_recv"].items()
                                     if k not in excluded or k in self.ep.inbound}
        inflight: dict[str, list[Message]] = {}
        for src, msgs in chans.items():
            if src in excluded and src not in self.ep.inbound:
                continue
            inflight[src] = [Message(src, self.actor, int(m["seq"]), VectorClock.decode(m["clock"]),
                                     MessageKind.DATA, m["meta"], tuple(m["tensors"])) for m in msgs]
        self.ep.restore(ep_state, inflight)
        cut = VectorClock.decode(extra["cut_clock"]) if extra.get("cut_clock") is not None else VectorClock()
        if announce:
            self._record("snapshot.restore", {"snapshot": name,
                                              "inflight": {k: len(v) for k, v in inflight.items()}})
        if resume:
            self._resume(name, meta, extra, inflight, store)
        return RestoreInfo(name, self.actor, cut, {k: len(v) for k, v in inflight.items()})

    def _resume(self, name: str, meta: Mapping[str, Any], extra: Mapping[str, Any],
                inflight: Mapping[str, list[Message]], store: SnapshotStore) -> None:
        if extra.get("coordinator") == self.actor and self.manual:
            # Open again, as it was right after the cut; its channel state is what the part
            # holds, and it is committed already.
            s = _Snap(name, Pending(store.path(name) if hasattr(store, "path") else "", ""), self.actor,
                      tuple(a for a in (*self.participants,) if self.part_of(a) in set(meta["parts"])) or
                      (self.actor,))
            s.recorded = s.local_complete = True
            s.closed = {k: list(v) for k, v in inflight.items()}
            s.excluded = dict(extra.get("policy_excluded", {}))
            s.adopted = {**meta, "@path": s.pending.final}
            self._snaps[name] = s
            return
        s = _Snap(name, Pending("", ""), str(extra.get("coordinator", "")), ())
        s.closed = {k: list(v) for k, v in inflight.items()}
        self._record("snapshot.local_done", self._local_done_payload(s))
        self._done.add(name)

    # -- the protocol -------------------------------------------------------------------
    def _peers(self, s: _Snap) -> set[str]:
        """The channels snapshot ``s`` covers on this process: its participants in scope."""
        peers = set(s.participants) - {self.actor}
        return peers if self.scope is None else peers & self.scope

    def _record_local(self, s: _Snap, first: str | None) -> None:
        t0 = time.perf_counter()
        s.recorded = True
        s.step = int(self._step_of())
        # The cut is the clock of the recorded event: on a tape (a ClockSink) that event
        # ticks the actor's one clock and its clock *is* the cut (spec/tape-format.md,
        # kind snapshot), so it is taken from the record call, never read separately
        # (a coordinator thread may tick the same clock at any moment).
        taped = self._record("snapshot.record", {"snapshot": s.name, "first": first})
        s.cut_clock = taped if taped is not None or self.events is None else None
        s.endpoint_state = self.ep.state_dict()
        s.endpoint_state["clock"] = (s.cut_clock or self.ep.clock).encode()
        for src, seq in self._unconsumed.items():  # §9a rule 3
            s.endpoint_state["next_recv"][src] = min(int(s.endpoint_state["next_recv"][src]), int(seq))
        s.staged = {}
        for key, obj in self.state.items():
            sd = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
            s.staged[key] = _typed(obj, _stage(sd, self.pool, key))
        if self.data is not None:
            s.data = _typed(self.data, _stage(self.data.state_dict(), self.pool, "@data"))
        if self.capture_rng:
            from ckpt.context.rng import capture_rng

            s.rng = capture_rng()
        peers = self._peers(s)
        for src in self.ep.inbound:
            if src not in peers:
                continue  # out of scope (quiet, checked at commit) or not in this snapshot
            if src == first:
                s.closed[src] = []
            elif src in self.ep.dead:
                s.closed[src] = []
                s.failed_peers.add(src)
            else:
                s.recording[src] = []
        t1 = time.perf_counter()
        marker = {"snapshot": s.name, "final": s.pending.final, "tmp": s.pending.tmp_dir,
                  "coordinator": s.coordinator, "participants": list(s.participants)}
        for dst in self.ep.outbound:
            if dst in self.ep.dead or dst not in peers:
                continue
            try:
                self.ep.send_control(dst, MessageKind.MARKER, marker)
            except PeerDiedError:
                pass  # the endpoint already ran the failure handlers
        s.blocked_s = time.perf_counter() - t0
        self.stats[s.name] = {"stage_s": t1 - t0, "blocked_s": s.blocked_s}
        self._maybe_finish(s)

    def _on_marker(self, msg: Message) -> None:
        m = msg.meta
        name = str(m.get("snapshot", ""))
        if not name:
            raise SnapshotError("marker without a snapshot name", channel=msg.channel, seq=msg.seq)
        if name in self._done:
            raise SnapshotError("marker for a snapshot that already finished here", channel=msg.channel,
                                seq=msg.seq, snapshot=name)
        expect = min(self.ep.next_recv[msg.src], self._unconsumed.get(msg.src, 1 << 62))
        if msg.seq != expect:
            # FIFO: every data message sent before the marker must have been delivered.
            raise SnapshotError(f"marker overtook data: it follows seq {msg.seq - 1}, delivered up to "
                                f"{expect - 1}", channel=msg.channel, seq=msg.seq, snapshot=name)
        self._record("snapshot.marker", {"snapshot": name, "channel": msg.channel, "seq": msg.seq})
        s = self._snaps.get(name)
        if s is None:
            s = _Snap(name, Pending(str(m["final"]), str(m["tmp"])), str(m["coordinator"]),
                      tuple(m["participants"]))
            self._snaps[name] = s
            self._record_local(s, first=msg.src)
            return
        if msg.src not in s.recording:
            raise SnapshotError("second marker on one channel", channel=msg.channel, seq=msg.seq, snapshot=name)
        s.closed[msg.src] = s.recording.pop(msg.src)
        self._maybe_finish(s)

    def _on_deliver(self, msg: Message) -> None:
        for s in self._snaps.values():
            rec = s.recording.get(msg.src)
            if rec is not None:
                rec.append(_copy_message(self.channel_filter(msg) if self.channel_filter is not None else msg))

    def _on_peer_failed(self, peer: str) -> None:
        self.control.set(f"dead/{peer}", _pack({"by": self.actor, "reason": "transport reported the peer gone"}))
        if not self.manual:  # manual: the application's close() decides, at a point it chose
            self._peer_gone(peer)

    def _peer_gone(self, peer: str) -> None:
        for s in list(self._snaps.values()):
            if peer in s.recording:
                # No marker will come: the channel's state is everything that arrived from
                # the peer after the cut, delivered or still queued, up to its failure.
                rec = s.recording.pop(peer)
                rec.extend(_copy_message(m) for m in self.ep.buffered(peer))
                s.closed[peer] = rec
                s.failed_peers.add(peer)
                self._record("snapshot.peer_failed", {"snapshot": s.name, "peer": peer})
                self._maybe_finish(s)

    def _check_failures(self) -> None:
        now = time.monotonic()
        if now - self._last_fail_check < 0.05:
            return
        self._last_fail_check = now
        for s in list(self._snaps.values()):
            for peer in list(s.recording):
                if self.control.get(f"dead/{peer}") is not None:
                    self._peer_gone(peer)

    def _maybe_finish(self, s: _Snap) -> None:
        if not s.recorded or s.recording or s.submitted:
            return
        s.local_complete = True
        if self.manual and s.coordinator == self.actor:
            return  # written by commit(), taped by finish(): points the application chose
        self._submit(s)

    def _summary(self, s: _Snap) -> dict[str, Any]:
        return {
            "step": s.step,
            "cut_clock": s.cut_clock.encode() if s.cut_clock is not None else None,
            "endpoint": s.endpoint_state,
            "channels": {src: {"first_seq": int(s.endpoint_state["next_recv"][src]), "count": len(msgs)}
                         for src, msgs in sorted(s.closed.items())},
            "failed_peers": sorted(s.failed_peers),
            "policy_excluded": dict(s.excluded),
        }

    @staticmethod
    def _channels_tree(s: _Snap) -> dict[str, Any]:
        return {src: [{"seq": m.seq, "clock": m.clock.encode(), "meta": dict(m.meta), "tensors": list(m.tensors)}
                      for m in msgs] for src, msgs in sorted(s.closed.items())}

    def _local_done_payload(self, s: _Snap, also: Iterable[Sequence[Any]] = ()) -> dict[str, Any]:
        return {"snapshot": s.name, "inflight": {k: len(v) for k, v in s.closed.items()},
                "inflight_refs": [[channel_name(src, self.actor), m.seq] for src, msgs in sorted(s.closed.items())
                                  for m in msgs], "also": [list(r) for r in also]}

    def _submit(self, s: _Snap) -> None:
        s.submitted = True
        tree = dict(s.staged)
        tree[CHANNELS_KEY] = self._channels_tree(s)
        summary = self._summary(s)
        extra = {"format": PART_FORMAT, "version": FORMAT_VERSION, "snapshot": s.name, "actor": self.actor,
                 "coordinator": s.coordinator, **summary}
        self._record("snapshot.local_done", self._local_done_payload(s))
        s.staged = {}
        s.closed = {}
        self._done.add(s.name)
        if self.store is None:  # a replay: the protocol ran, nothing is written
            s.write_done.set()
        elif self.background:
            self._writer.submit(self._write_part, s, tree, extra, summary)
        else:
            self._write_part(s, tree, extra, summary)

    def _write_part(self, s: _Snap, tree: dict[str, Any], extra: dict[str, Any], summary: dict[str, Any]) -> None:
        key = f"snap/{s.name}"
        t0 = time.perf_counter()
        try:
            if self.control.get(f"{key}/outcome") is not None:
                return  # aborted already: write nothing into a directory that may be gone
            self.control.set(f"{key}/writing/{self.actor}", b"1")
            try:
                record = self.store.write_part(s.pending, self.part, tree, step=s.step, extra=extra, rng=s.rng,
                                               data=s.data, config=self.config)
            except Exception as exc:  # any failure to write is reported, never swallowed
                self.control.set(f"{key}/failed/{self.actor}", _pack({"reason": f"part write failed: {exc}"}))
                return
            self.control.set(f"{key}/part/{self.actor}", _pack({"record": record, "summary": summary}))
        finally:
            # (the data state, small, stays out of the pool here: close() may still release it)
            self.pool.release({k: v for k, v in tree.items() if k != CHANNELS_KEY})
            self.stats.setdefault(s.name, {})["write_s"] = time.perf_counter() - t0
            s.write_done.set()

    # -- coordinator --------------------------------------------------------------------
    def _coordinate(self, s: _Snap, handle: SnapshotHandle) -> None:
        key = f"snap/{s.name}"
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.deadline_s
        parts: dict[str, dict[str, Any]] = {}
        excluded: set[str] = set()
        reason = ""
        while True:
            for a in s.participants:
                if a in parts or a in excluded:
                    continue
                raw = self.control.get(f"{key}/part/{a}")
                if raw is not None:
                    parts[a] = _unpack(raw)
                    continue
                failed = self.control.get(f"{key}/failed/{a}") or self.control.get(f"dead/{a}")
                if failed is not None:
                    why = _unpack(failed).get("reason", "failed")
                    if a in self.excludable:
                        excluded.add(a)
                        self.ep.record("snapshot.exclude", {"snapshot": s.name, "actor": a, "reason": why})
                    else:
                        reason = f"participant {a} failed before its part was durable: {why}"
            if reason or len(parts) + len(excluded) == len(s.participants):
                break
            if time.monotonic() > deadline:
                missing = [a for a in s.participants if a not in parts and a not in excluded]
                reason = f"participants {missing} reported no part within {self.deadline_s} s"
                break
            time.sleep(self.poll_s)
        if not reason and not parts:
            reason = "every participant was excluded"
        if not reason:
            reason = _check_accounting(parts, excluded)
        if not reason:
            reason = self._commit(s, parts, excluded)
        if reason:
            self.control.set(f"{key}/outcome", _pack({"committed": False, "reason": reason}))
            self._wait_writers(s, key)
            self.store.abort(s.pending)
            self.ep.record("snapshot.abort", {"snapshot": s.name, "reason": reason, "path": s.pending.final,
                                              "parts": sorted(parts), "excluded": sorted(excluded)})
            outcome = Outcome(s.name, False, reason, tuple(sorted(parts)), tuple(sorted(excluded)))
        else:
            self.control.set(f"{key}/outcome", _pack({"committed": True}))
            self.ep.record("snapshot.commit", {"snapshot": s.name, "path": s.pending.final, "parts": sorted(parts),
                                               "excluded": sorted(excluded)})
            outcome = Outcome(s.name, True, "", tuple(sorted(parts)), tuple(sorted(excluded)))
        self.stats.setdefault(s.name, {})["initiate_to_outcome_s"] = time.perf_counter() - t0
        handle._finish(outcome)

    def _commit(self, s: _Snap, parts: Mapping[str, Mapping[str, Any]], excluded: set[str],
                meta: Mapping[str, Any] | None = None, step: int | None = None) -> str:
        """Commit the checkpoint (MANIFEST last); returns a failure reason or ""."""
        assert self.store is not None
        try:
            name_of = self.part_of
            full = {
                "format": SNAPSHOT_FORMAT,
                "version": FORMAT_VERSION,
                "snapshot": s.name,
                "coordinator": s.coordinator,
                "participants": sorted({*map(name_of, s.participants), *s.excluded}),
                "parts": _first(name_of(s.coordinator), sorted(name_of(a) for a in parts), self.manual),
                "excluded": sorted({*map(name_of, excluded), *s.excluded}),
                "cut": {name_of(a): p["summary"]["cut_clock"] for a, p in sorted(parts.items())
                        if p["summary"]["cut_clock"] is not None},
                "channels": {name_of(a): p["summary"]["channels"] for a, p in sorted(parts.items())},
                **dict(meta or {}),
            }
            if step is None:
                step = max(int(p["summary"]["step"]) for p in parts.values())
            self.store.commit(s.pending, [parts[a]["record"] for a in sorted(parts)], step=step, meta=full)
        except Exception as exc:  # any failure aborts cleanly
            return f"commit failed: {exc}"
        return ""

    # -- manual coordination (§9a rule 5) --------------------------------------------------
    def _open(self, name: str) -> _Snap:
        s = self._snaps.get(name)
        if s is None or s.coordinator != self.actor or not self.manual:
            raise SnapshotError("no snapshot coordinated here by hand under this name", snapshot=name)
        return s

    def markers_in(self, name: str, actors: Iterable[str]) -> bool:
        """Has every one of ``actors`` returned its marker (its channel state is complete)?"""
        s = self._open(name)
        return all(a in s.closed for a in actors)

    def _status(self, s: _Snap, a: str) -> str:
        key = f"snap/{s.name}"
        if self.control.get(f"{key}/part/{a}") is not None:
            return "part"
        if self.control.get(f"{key}/failed/{a}") is not None:
            return "failed"
        return "pending"

    def ready(self, name: str, *, dead: Iterable[str] = ()) -> bool:
        """Can :meth:`commit` decide now? Every participant returned its marker and reported a
        part (or a failed write), or is known dead (``dead``) with no part write announced
        for ``grace_s`` (a part being written while the directory is committed would land
        in it unlisted; a SIGKILLed writer never finishes)."""
        s = self._open(name)
        if s.adopted is not None:
            return True
        dead = set(dead)
        for a in s.participants:
            if a == self.actor:
                continue
            st = self._status(s, a)
            if a in s.closed and st != "pending":
                continue
            if a in dead or self.control.get(f"dead/{a}") is not None:
                if self.control.get(f"snap/{s.name}/writing/{a}") is not None and st == "pending":
                    since = s.dead_seen.setdefault(a, time.monotonic())
                    if time.monotonic() - since < self.grace_s:
                        return False
                continue
            return False
        return True

    def commit(self, name: str, *, dead: Iterable[str] = (),
               meta: Mapping[str, Any] | Callable[[list[str], list[str]], Mapping[str, Any]] | None = None,
               step: int | None = None) -> dict[str, Any]:
        """Write this coordinator's part, check the accounting and commit (or abort).

        Tapes nothing: the application tapes the returned outcome as its decision and
        passes it to :meth:`finish`. A participant without a durable part is excluded when
        it is dead (it must be excludable), and fails the snapshot otherwise. ``meta``: the
        application's MANIFEST meta, or a function of the (parts, excluded) part names;
        ``step``: the checkpoint's step (default: the largest part step)."""
        s = self._open(name)
        if s.adopted is not None:  # restored from it: committed already, nothing to write
            m = s.adopted
            return {"committed": True, "path": str(m["@path"]), "reason": "", "parts": list(m["parts"]),
                    "excluded": list(m["excluded"])}
        if self.store is None:
            raise SnapshotError("a replay writes no snapshot: take commit()'s outcome from the tape", snapshot=name)
        dead = set(dead)
        key = f"snap/{s.name}"
        parts: dict[str, dict[str, Any]] = {}
        excluded: set[str] = set()
        reason = ""
        for a in s.participants:
            if a == self.actor:
                continue
            st = self._status(s, a)
            if a in s.closed and st == "part":
                parts[a] = _unpack(self.control.get(f"{key}/part/{a}"))  # type: ignore[arg-type]
            elif st == "failed" and a not in dead:
                reason = f"{a}: " + str(_unpack(self.control.get(f"{key}/failed/{a}"))["reason"])  # type: ignore[arg-type]
            elif not self._excludable(a):
                reason = reason or f"participant {a} failed before its part was durable"
            else:
                excluded.add(a)
        # the coordinator's channel state: the recorded channels of the included parts
        s.closed = {src: msgs for src, msgs in s.closed.items() if src in parts}
        s.recording = {}
        if not reason:
            tree = dict(s.staged)
            tree[CHANNELS_KEY] = self._channels_tree(s)
            summary = self._summary(s)
            extra = {"format": PART_FORMAT, "version": FORMAT_VERSION, "snapshot": s.name, "actor": self.actor,
                     "coordinator": s.coordinator, **summary}
            try:
                record = self.store.write_part(s.pending, self.part, tree, step=s.step, extra=extra, rng=s.rng,
                                               data=s.data, config=self.config)
                parts[self.actor] = {"record": record, "summary": summary}
            except Exception as exc:  # reported as the outcome, never swallowed
                reason = f"part write failed: {exc}"
            finally:
                self.pool.release({k: v for k, v in tree.items() if k != CHANNELS_KEY})
                self.pool.release(s.data)
                s.staged, s.data = {}, None  # back in the pool: finish() must not release them again
        inside = _first(self.part, sorted(self.part_of(a) for a in parts), True)
        out_ = sorted({*(self.part_of(a) for a in excluded), *s.excluded})
        if not reason:
            reason = _check_accounting(parts, excluded)
        if not reason:
            reason = self._commit(s, parts, excluded, meta(inside, out_) if callable(meta) else meta, step)
        if reason:
            self.control.set(f"{key}/outcome", _pack({"committed": False, "reason": reason}))
            self._wait_writers(s, key)
            self.store.abort(s.pending)
            return {"committed": False, "path": s.pending.final, "reason": reason, "parts": inside, "excluded": out_}
        self.control.set(f"{key}/outcome", _pack({"committed": True}))
        return {"committed": True, "path": s.pending.final, "reason": "", "parts": inside, "excluded": out_}

    def finish(self, name: str, outcome: Mapping[str, Any], *, inflight: Iterable[Sequence[Any]] = ()) -> None:
        """Tape the close of snapshot ``name`` with ``outcome`` (from :meth:`commit`, or from a
        tape in a replay): one ``snapshot.exclude`` per part excluded at the close, this
        coordinator's recorded channel state of the included parts plus ``inflight`` (tape
        references of messages it holds, §9a rule 4), and the commit or abort."""
        s = self._open(name)
        inside = set(outcome["parts"])
        for a in outcome["excluded"]:
            if a not in s.excluded:
                self._record("snapshot.exclude", {"snapshot": name, "actor": a,
                                                  "reason": "failed before its part was durable"})
        s.closed = {src: msgs for src, msgs in s.closed.items() if self.part_of(src) in inside}
        self._record("snapshot.local_done", self._local_done_payload(s, inflight))
        kind = "snapshot.commit" if outcome["committed"] else "snapshot.abort"
        self._record(kind, {"snapshot": name, "path": str(outcome.get("path", "")), "parts": list(outcome["parts"]),
                            "excluded": list(outcome["excluded"]), "reason": str(outcome.get("reason", ""))})
        self.pool.release(s.staged)
        self.pool.release(s.data)
        s.staged, s.closed, s.recording, s.data = {}, {}, {}, None
        s.submitted = True
        s.write_done.set()
        self._done.add(name)
        del self._snaps[name]

    def recorded(self, name: str) -> dict[str, list[Message]]:
        """The channel state recorded so far for ``name``, per source (closed and open)."""
        s = self._snaps.get(name)
        if s is None:
            raise SnapshotError("no open snapshot under this name", snapshot=name)
        return {**{k: list(v) for k, v in s.recording.items()}, **{k: list(v) for k, v in s.closed.items()}}

    def _wait_writers(self, s: _Snap, key: str) -> None:
        # A part being written while the directory is removed could leave a stray file
        # behind; give announced writers a grace period to finish or fail first.
        end = time.monotonic() + self.grace_s
        while time.monotonic() < end:
            busy = [a for a in s.participants
                    if self.control.get(f"{key}/writing/{a}") is not None
                    and self.control.get(f"{key}/part/{a}") is None
                    and self.control.get(f"{key}/failed/{a}") is None
                    and self.control.get(f"dead/{a}") is None]
            if not busy:
                return
            time.sleep(self.poll_s)


def _first(coordinator: str, names: list[str], manual: bool) -> list[str]:
    """Part names in MANIFEST order: a manually coordinated snapshot lists its coordinator's
    part first (the application's own part, e.g. a syncer's), then the others by name."""
    if not manual or coordinator not in names:
        return names
    return [coordinator, *(n for n in names if n != coordinator)]


class _Held:
    """A staged copy handed to the store in place of a live Stateful."""

    __slots__ = ("sd",)

    def __init__(self, sd: Any) -> None:
        self.sd = sd

    def state_dict(self) -> Any:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        self.sd = sd


_HELD_TYPES: dict[type, type] = {}


def _typed(obj: Any, staged: Any) -> Any:
    """A staged Stateful keeps its type's name (module and qualified name), which is what
    ``ckpt`` records for an entry and ``ckpt inspect`` sorts the seven fields by. The
    stand-in class only borrows the name: nothing is imported or run by it on reading."""
    if not callable(getattr(obj, "state_dict", None)):
        return staged
    t = type(obj)
    held = _HELD_TYPES.get(t)
    if held is None:
        held = _HELD_TYPES[t] = type(t.__name__, (_Held,), {"__module__": t.__module__, "__qualname__": t.__qualname__,
                                                            "__slots__": ()})
    return held(staged)


def _copy_message(msg: Message) -> Message:
    # A copy: the application owns delivered tensors and may change them in place.
    return Message(msg.src, msg.dst, msg.seq, msg.clock, msg.kind, dict(msg.meta),
                   tuple(t.detach().clone() for t in msg.tensors))


def _check_accounting(parts: Mapping[str, Mapping[str, Any]], excluded: set[str]) -> str:
    """Every channel between included processes must balance: what the sender had sent
    at its cut equals what the receiver had received at its cut plus what it recorded;
    a channel no snapshot covers (out of ``scope``) must be quiet: nothing in flight."""
    for r, p in sorted(parts.items()):
        covered = p["summary"]["channels"]
        for src in sorted(parts):
            if src == r or src in covered or src in p["summary"]["failed_peers"]:
                continue
            sent = parts[src]["summary"]["endpoint"]["next_send"].get(r)
            got = p["summary"]["endpoint"]["next_recv"].get(src)
            if sent is not None and got is not None and int(sent) != int(got):
                return (f"channel {channel_name(src, r)} is not quiet at the cut: sender had sent {sent}, receiver "
                        f"had received {got}, and no snapshot records it (out of scope)")
        for src, ch in p["summary"]["channels"].items():
            if src not in parts or src in p["summary"]["failed_peers"]:
                continue  # a failed sender's marker never came; its channel ends at the failure
            sent = parts[src]["summary"]["endpoint"]["next_send"].get(r)
            if sent is None:
                return f"channel {channel_name(src, r)} is unknown to its sender"
            if int(sent) != int(ch["first_seq"]) + int(ch["count"]):
                return (f"channel {channel_name(src, r)} does not balance: sender had sent {sent}, receiver had "
                        f"received {ch['first_seq']} and recorded {ch['count']} in flight")
    return ""
