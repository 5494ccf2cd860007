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

CHANNELS_KEY = "replay.channels"  # the reserved top-level entry of every part
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
                self._free.setdefault((tuple(tree.shape), tree.dtype, tree.device), []).append(tree)
        elif isinstance(tree, dict):
            for v in tree.values():
                self.release(v)
        elif isinstance(tree, (list, tuple)):
            for v in tree:
                self.release(v)


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
    name: str
    committed: bool
    reason: str = ""
    parts: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RestoreInfo:
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
    recorded: bool = False
    step: int = 0
    cut_clock: VectorClock = field(default_factory=VectorClock)
    endpoint_state: dict[str, Any] = field(default_factory=dict)
    staged: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    recording: dict[str, list[Message]] = field(default_factory=dict)
    closed: dict[str, list[Message]] = field(default_factory=dict)
    failed_peers: set[str] = field(default_factory=set)
    blocked_s: float = 0.0
    submitted: bool = False
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
      single-threaded simulations use to stay simple).
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
    ) -> None:
        if CHANNELS_KEY in state:
            raise SnapshotError(f"state entry name {CHANNELS_KEY!r} is reserved", key=CHANNELS_KEY)
        for k in state:
            if not isinstance(k, str) or not k or k.startswith("@"):
                raise SnapshotError("state entry names must be non-empty str not starting with '@'", key=str(k))
        if endpoint.actor not in participants:
            raise SnapshotError("the endpoint's actor is not among the participants", actor=endpoint.actor)
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
        self.pool = StagingPool()
        self._snaps: dict[str, _Snap] = {}
        self._done: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snap-write-{self.actor}")
        self._coord_threads: list[threading.Thread] = []
        self._last_fail_check = 0.0
        self.stats: dict[str, dict[str, float]] = {}
        endpoint.on_control(self._on_marker)
        endpoint.on_deliver(self._on_deliver)
        endpoint.on_peer_failed(self._on_peer_failed)

    # -- public -------------------------------------------------------------------------
    def initiate(self, name: str) -> SnapshotHandle:
        """Start snapshot ``name`` with this process as initiator and coordinator."""
        if name in self._snaps or name in self._done:
            raise SnapshotError("a snapshot with this name already ran here", snapshot=name)
        pending = self.store.begin(name)
        s = _Snap(name, pending, self.actor, self.participants)
        self._snaps[name] = s
        handle = SnapshotHandle(name)
        self.ep.record("snapshot.begin", {"snapshot": name, "participants": list(self.participants),
                                          "path": pending.final})
        t = threading.Thread(target=self._coordinate, args=(s, handle), name=f"snap-coord-{name}", daemon=True)
        self._coord_threads.append(t)
        self._record_local(s, first=None)
        t.start()
        return handle

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
    def restore(self, name: str, *, announce: bool = True) -> RestoreInfo:
        """Reload this process's part and queue its recorded in-flight messages.

        Must run before the endpoint delivers anything. A snapshot restores only at the
        process count (and the actor names) it was taken at. ``announce`` tapes a
        ``snapshot.restore`` note; a run continued under its original tape (force mode
        with ``align_snapshot``), whose history holds no such event, passes False.
        """
        meta = self.store.read_meta(name)
        if meta.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"not a snapshot checkpoint (format {meta.get('format')!r})", snapshot=name)
        if int(meta.get("version", 0)) != FORMAT_VERSION:
            raise SnapshotError(f"unsupported snapshot version {meta.get('version')!r}", snapshot=name)
        included = tuple(meta["parts"])
        if len(included) != len(self.participants):
            raise SnapshotError(
                f"snapshot was taken at {len(included)} processes {list(included)}; this job has "
                f"{len(self.participants)} {list(self.participants)}; a snapshot restores only at the process count "
                "it was taken at", snapshot=name)
        if set(included) != set(self.participants):
            raise SnapshotError(f"snapshot processes {sorted(included)} differ from this job's "
                                f"{list(self.participants)}", snapshot=name)
        extra = self.store.read_extra(name, self.actor)
        if extra.get("format") != PART_FORMAT or extra.get("snapshot") != name or extra.get("actor") != self.actor:
            raise SnapshotError("part metadata does not describe this process's part", snapshot=name, part=self.actor)
        self.store.load_into(name, self.actor, self.state, restore_rng=self.capture_rng)
        chans = self.store.read_entry(name, self.actor, CHANNELS_KEY)
        excluded = set(meta.get("excluded", ()))
        ep_state = dict(extra["endpoint"])
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
        cut = VectorClock.decode(extra["cut_clock"])
        if announce:
            self.ep.record("snapshot.restore", {"snapshot": name, "inflight": {k: len(v) for k, v in inflight.items()}})
        return RestoreInfo(name, self.actor, cut, {k: len(v) for k, v in inflight.items()})

    # -- the protocol -------------------------------------------------------------------
    def _record_local(self, s: _Snap, first: str | None) -> None:
        t0 = time.perf_counter()
        s.recorded = True
        s.step = self.ep.step
        # The cut is the clock of the recorded event: on a tape (a ClockSink) that event
        # ticks the actor's one clock and its clock *is* the cut (spec/tape-format.md,
        # kind snapshot), so it is taken from the record call, never read separately
        # (a coordinator thread may tick the same clock at any moment).
        s.cut_clock = self.ep.record("snapshot.record", {"snapshot": s.name, "first": first})
        s.endpoint_state = self.ep.state_dict()
        s.endpoint_state["clock"] = s.cut_clock.encode()
        s.staged = {}
        for key, obj in self.state.items():
            sd = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
            s.staged[key] = _stage(sd, self.pool, key)
        if self.capture_rng:
            from ckpt.context.rng import capture_rng

            s.rng = capture_rng()
        for src in self.ep.inbound:
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
            if dst in self.ep.dead:
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
        if msg.seq != self.ep.next_recv[msg.src]:
            # FIFO: every data message sent before the marker must have been delivered.
            raise SnapshotError(f"marker overtook data: it follows seq {msg.seq - 1}, delivered up to "
                                f"{self.ep.next_recv[msg.src] - 1}", channel=msg.channel, seq=msg.seq, snapshot=name)
        self.ep.record("snapshot.marker", {"snapshot": name, "channel": msg.channel, "seq": msg.seq})
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
                rec.append(_copy_message(msg))

    def _on_peer_failed(self, peer: str) -> None:
        self.control.set(f"dead/{peer}", _pack({"by": self.actor, "reason": "transport reported the peer gone"}))
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
                self.ep.record("snapshot.peer_failed", {"snapshot": s.name, "peer": peer})
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
        s.submitted = True
        channels = {src: [{"seq": m.seq, "clock": m.clock.encode(), "meta": dict(m.meta), "tensors": list(m.tensors)}
                          for m in msgs] for src, msgs in sorted(s.closed.items())}
        tree = dict(s.staged)
        tree[CHANNELS_KEY] = channels
        summary = {
            "step": s.step,
            "cut_clock": s.cut_clock.encode(),
            "endpoint": s.endpoint_state,
            "channels": {src: {"first_seq": int(s.endpoint_state["next_recv"][src]), "count": len(msgs)}
                         for src, msgs in sorted(s.closed.items())},
            "failed_peers": sorted(s.failed_peers),
        }
        extra = {"format": PART_FORMAT, "version": FORMAT_VERSION, "snapshot": s.name, "actor": self.actor,
                 "coordinator": s.coordinator, **summary}
        self.ep.record("snapshot.local_done", {
            "snapshot": s.name, "inflight": {k: len(v) for k, v in s.closed.items()},
            "inflight_refs": [[channel_name(src, self.actor), m.seq] for src, msgs in sorted(s.closed.items())
                              for m in msgs]})
        s.staged = {}
        s.closed = {}
        self._done.add(s.name)
        if self.background:
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
                record = self.store.write_part(s.pending, self.actor, tree, step=s.step, extra=extra, rng=s.rng)
            except Exception as exc:  # any failure to write is reported, never swallowed
                self.control.set(f"{key}/failed/{self.actor}", _pack({"reason": f"part write failed: {exc}"}))
                return
            self.control.set(f"{key}/part/{self.actor}", _pack({"record": record, "summary": summary}))
        finally:
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
            try:
                meta = {
                    "format": SNAPSHOT_FORMAT,
                    "version": FORMAT_VERSION,
                    "snapshot": s.name,
                    "coordinator": s.coordinator,
                    "participants": list(s.participants),
                    "parts": sorted(parts),
                    "excluded": sorted(excluded),
                    "cut": {a: p["summary"]["cut_clock"] for a, p in sorted(parts.items())},
                    "channels": {a: p["summary"]["channels"] for a, p in sorted(parts.items())},
                }
                step = max(int(p["summary"]["step"]) for p in parts.values())
                self.store.commit(s.pending, [parts[a]["record"] for a in sorted(parts)], step=step, meta=meta)
            except Exception as exc:
                reason = f"commit failed: {exc}"
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


def _copy_message(msg: Message) -> Message:
    # A copy: the application owns delivered tensors and may change them in place.
    return Message(msg.src, msg.dst, msg.seq, msg.clock, msg.kind, dict(msg.meta),
                   tuple(t.detach().clone() for t in msg.tensors))


def _check_accounting(parts: Mapping[str, Mapping[str, Any]], excluded: set[str]) -> str:
    """Every channel between included processes must balance: what the sender had sent
    at its cut equals what the receiver had received at its cut plus what it recorded."""
    for r, p in sorted(parts.items()):
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
