"""Invariants over a recorded history, in the style of Jepsen's Elle: nothing is
re-executed; the tape is checked for histories that cannot have happened, and every
violation names the events that witness it.

Rules (spec/tape-format.md §8):

=========================  ==============================================================
clock-monotonic            each actor's clocks strictly increase, its own entry included
duplicate-send             a (channel, chan_seq) is sent twice
recv-without-send          a receive has no earlier send of the same (channel, chan_seq)
recv-not-after-send        the send's clock is not before the receive's clock
recv-payload-mismatch      the receive's digest or peer disagrees with the send's
duplicate-recv             a message is delivered twice
merge-unknown-contribution a merged contribution names no earlier send
merge-not-after-send       a contribution did not happen-before its merge
merge-applied-twice        a contribution is merged twice (same or another merge)
quorum-below-minimum       fewer distinct members than the quorum's minimum
quorum-duplicate-member    a member listed twice
recovery-before-target     a recovery observed a clock not >= its target clock
snapshot-duplicate         one actor recorded the same snapshot twice
snapshot-inconsistent      some actor's cut has seen more of actor i than i's own cut
snapshot-orphan            a message received before its receiver's cut, sent after its sender's
snapshot-inflight-missing  a message crossing the cut is not in the recorded channel state
snapshot-inflight-spurious recorded channel state lists a message that did not cross the cut
snapshot-channels-early    channel state taped for a snapshot the actor has not recorded yet
snapshot-part-missing      a committed snapshot lists a part whose cut or channel state is not taped
stage-send-while-offline   a pipeline stage sends between its stage_down and its stage_up
stage-up-mismatch          a stage_up with no stage_down before it, or not at that outage's end,
                           or without its actor's recovery_loaded of that step from its source
bypass-outside-outage      a bypass names a stage that is not offline at that step
bypass-window              an outage's bypasses cover neither none nor all of its window, or the
                           gradient bypasses differ from the activation bypasses
commit-without-quorum      a step committed under a quorum this actor never taped, or one without it
recovery-without-source    a worker loaded a recovery state nobody sent it (replicas, stages)
recovery-state-mismatch    a recovered worker's state or stream digest differs from what its source sent
replica-state-diverged     two replicas committed the same step with different parameter digests
rollback-not-before-detection  a rollback's target step is not below its event's step
rollback-without-spike     a rollback has no spike event of its actor and step before it
routing-replay-uncached    a routing replay has no earlier routing event for its layer and batch
routing-replay-mismatch    a routing replay's digest differs from the cached routing's
=========================  ==============================================================

The pipeline-stage rules (spec/stages.md §9) read each stage's outage windows from its own
``stage_down`` / ``stage_up`` events: a window is ``[first, until)`` of the ``stage_down``.

Snapshots taped by a Chandy-Lamport participant come in two phases (spec §8.1): the
``snapshot`` event is the cut (its clock), the later ``snapshot_channels`` event the
recorded channel state, and the coordinator's ``snapshot_outcome`` names the parts. A
committed snapshot is checked over its parts only (excluded, failed actors are out of
the cut); an aborted one for consistency only (a dead participant's channel state is
not complete); a missing channel state is judged only where the receiver taped one.

Several tapes (one per process, spec §2.1) are checked as one history: their events are
merged in order of the sum of their clock entries, which extends happens-before (if
``e -> f`` then every entry of ``f``'s clock is >= ``e``'s and one is greater).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from replay.clock import Order
from replay.errors import ReplayError
from replay.events import Event
from replay.tape.reader import TapeReader

__all__ = ["Violation", "check_events", "check_tape", "check_tapes", "merge_histories", "RULES"]

RULES = ("clock-monotonic", "duplicate-send", "recv-without-send", "recv-not-after-send", "recv-payload-mismatch",
         "duplicate-recv", "merge-unknown-contribution", "merge-not-after-send", "merge-applied-twice",
         "quorum-below-minimum", "quorum-duplicate-member", "recovery-before-target", "snapshot-duplicate",
         "snapshot-inconsistent", "snapshot-orphan", "snapshot-inflight-missing", "snapshot-inflight-spurious",
         "snapshot-channels-early", "snapshot-part-missing", "stage-send-while-offline", "stage-up-mismatch",
         "bypass-outside-outage", "bypass-window", "commit-without-quorum",
         "recovery-without-source", "recovery-state-mismatch", "replica-state-diverged", "rollback-not-before-detection",
         "rollback-without-spike", "routing-replay-uncached", "routing-replay-mismatch")


@dataclass(frozen=True, slots=True)
class Violation:
    """An invariant the tape breaks: the rule, a message naming it, and the events involved."""

    rule: str
    message: str
    events: tuple[Event, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "message": self.message,
                "events": [{"seq": e.seq, "actor": e.actor, "step": e.step, "kind": e.kind.name,
                            "clock": e.clock.as_dict()} for e in self.events]}

    def format(self) -> str:
        refs = "; ".join(f"seq {e.seq} {e.actor} step {e.step} {e.kind.name} {e.clock!r}" for e in self.events)
        return f"[{self.rule}] {self.message}\n    events: {refs}"


def check_events(events: Iterable[Event]) -> list[Violation]:
    """The invariant violations in a sequence of events (what ``check_tape`` runs on a tape's events)."""
    out: list[Violation] = []
    last: dict[str, Event] = {}
    sends: dict[tuple[str, int], Event] = {}
    recvs: dict[tuple[str, int], Event] = {}
    merged: dict[tuple[str, int], Event] = {}
    snaps: dict[str, dict[str, Event]] = {}
    chans: dict[str, dict[str, Event]] = {}
    outcomes: dict[str, Event] = {}
    stages = _Stages()
    quorums: dict[tuple[str, str], Event] = {}  # (actor, key) -> its quorum event
    sent_state: dict[tuple[str, str, int], Event] = {}  # (source, peer, step) -> recovery_sent
    spikes: dict[tuple[str, int], Event] = {}
    committed_params: dict[tuple[int, int], Event] = {}  # (step, rollbacks before it) -> first step_commit
    rollbacks_of: dict[str, int] = {}
    routed: dict[tuple[str, str, int, int], Event] = {}

    def v(rule: str, msg: str, *evs: Event) -> None:
        out.append(Violation(rule, msg, tuple(evs)))

    for ev in events:
        k = ev.kind.name
        if k == "actor":
            continue
        prev = last.get(ev.actor)
        if prev is not None and (prev.clock.compare(ev.clock) is not Order.BEFORE
                                 or ev.clock[ev.actor] <= prev.clock[ev.actor]):
            v("clock-monotonic", f"{ev.actor}'s clock {ev.clock!r} does not follow its previous {prev.clock!r}",
              prev, ev)
        last[ev.actor] = ev
        if k in _STAGE_KINDS:
            stages.see(ev, v)
        if k == "send":
            p = ev.payload
            key = (p["channel"], p["chan_seq"])
            if key in sends:
                v("duplicate-send", f"message {key[0]}#{key[1]} sent twice", sends[key], ev)
            else:
                sends[key] = ev
        elif k == "recv":
            p = ev.payload
            key = (p["channel"], p["chan_seq"])
            snd = sends.get(key)
            if snd is None:
                v("recv-without-send", f"receive of {key[0]}#{key[1]} has no earlier send", ev)
            else:
                if snd.clock.compare(ev.clock) is not Order.BEFORE:
                    v("recv-not-after-send", f"send of {key[0]}#{key[1]} did not happen-before its receive", snd, ev)
                sp = snd.payload
                if sp["digest"] != p["digest"] or p["peer"] != snd.actor:
                    v("recv-payload-mismatch", f"receive of {key[0]}#{key[1]} disagrees with the send "
                      f"(digest or sender)", snd, ev)
            if key in recvs:
                v("duplicate-recv", f"message {key[0]}#{key[1]} delivered twice", recvs[key], ev)
            else:
                recvs[key] = ev
        elif k == "merge":
            seen_here: set[tuple[str, int]] = set()
            for ch, s in ev.payload["contributions"]:
                key = (ch, s)
                if key in seen_here:
                    v("merge-applied-twice", f"contribution {ch}#{s} listed twice in merge {ev.payload['key']!r}", ev)
                    continue
                seen_here.add(key)
                snd = sends.get(key)
                if snd is None:
                    v("merge-unknown-contribution", f"merge {ev.payload['key']!r} applies {ch}#{s}, never sent", ev)
                elif snd.clock.compare(ev.clock) is not Order.BEFORE:
                    v("merge-not-after-send", f"contribution {ch}#{s} did not happen-before merge "
                      f"{ev.payload['key']!r}", snd, ev)
                if key in merged:
                    v("merge-applied-twice", f"contribution {ch}#{s} already applied by merge "
                      f"{merged[key].payload['key']!r}", merged[key], ev)
                else:
                    merged[key] = ev
        elif k == "quorum":
            p = ev.payload
            members = p["members"]
            if len(set(members)) != len(members):
                v("quorum-duplicate-member", f"quorum {p['key']!r} lists a member twice: {members}", ev)
            if len(set(members)) < p["minimum"]:
                v("quorum-below-minimum", f"quorum {p['key']!r} has {len(set(members))} members, minimum "
                  f"{p['minimum']}", ev)
            quorums[(ev.actor, p["key"])] = ev
        elif k == "step_commit":
            p = ev.payload
            if p["committed"]:
                q = quorums.get((ev.actor, p["quorum"]))
                group = ev.actor.split(".", 1)[0]
                if q is None:
                    v("commit-without-quorum", f"{ev.actor} committed step {ev.step} under quorum {p['quorum']!r}, "
                      "which it never taped", ev)
                elif group not in q.payload["members"]:
                    v("commit-without-quorum", f"{ev.actor} committed step {ev.step} under quorum {p['quorum']!r}, "
                      f"whose members {q.payload['members']} do not list its group {group!r}", q, ev)
                if p["params"] != bytes(16):  # a digest was taken: every replica's must be the same
                    # (per timeline: after its n-th rollback a replica re-commits steps anew)
                    first = committed_params.setdefault((ev.step, rollbacks_of.get(ev.actor, 0)), ev)
                    if first.payload["params"] != p["params"]:
                        v("replica-state-diverged", f"{ev.actor} committed step {ev.step} with parameters "
                          f"{p['params'].hex()}, {first.actor} with {first.payload['params'].hex()}: the replicas "
                          "no longer hold one state", first, ev)
        elif k == "recovery_sent":
            sent_state[(ev.actor, ev.payload["peer"], ev.step)] = ev
        elif k == "recovery_loaded":
            p = ev.payload
            src = sent_state.get((p["source"], ev.actor, ev.step))
            if src is None:
                v("recovery-without-source", f"{ev.actor} loaded a recovery state from {p['source']} at step "
                  f"{ev.step} that {p['source']} never sent it", ev)
            elif src.payload["state"] != p["state"] or src.payload["stream"] != p["stream"]:
                v("recovery-state-mismatch", f"{ev.actor} recovered from {p['source']} at step {ev.step} with state "
                  f"{p['state'].hex()} (stream {p['stream'].hex()}), the source sent {src.payload['state'].hex()} "
                  f"(stream {src.payload['stream'].hex()})", src, ev)
        elif k == "fault_recovered":
            p = ev.payload
            if p["observed"].compare(p["target_clock"]) not in (Order.AFTER, Order.EQUAL):
                v("recovery-before-target", f"{p['target']} recovered from {p['fault']!r} observing "
                  f"{p['observed']!r}, not >= target {p['target_clock']!r}", ev)
        elif k == "snapshot":
            sid = ev.payload["snapshot_id"]
            cut = snaps.setdefault(sid, {})
            if ev.actor in cut:
                v("snapshot-duplicate", f"{ev.actor} recorded snapshot {sid!r} twice", cut[ev.actor], ev)
            else:
                cut[ev.actor] = ev
        elif k == "snapshot_channels":
            sid = ev.payload["snapshot_id"]
            mine = chans.setdefault(sid, {})
            if ev.actor in mine:
                v("snapshot-duplicate", f"{ev.actor} recorded the channel state of snapshot {sid!r} twice",
                  mine[ev.actor], ev)
            elif ev.actor not in snaps.get(sid, {}):
                v("snapshot-channels-early", f"{ev.actor} recorded the channel state of snapshot {sid!r} before its "
                  f"cut", ev)
            else:
                mine[ev.actor] = ev
        elif k == "spike":
            spikes[(ev.actor, ev.step)] = ev
        elif k == "rollback":
            p = ev.payload
            rollbacks_of[ev.actor] = rollbacks_of.get(ev.actor, 0) + 1
            if p["to_step"] >= ev.step:
                v("rollback-not-before-detection", f"rollback at step {ev.step} goes to step {p['to_step']}, not "
                  "before it", ev)
            if (ev.actor, ev.step) not in spikes:
                v("rollback-without-spike", f"rollback at step {ev.step} has no spike event of {ev.actor} before it",
                  ev)
        elif k == "routing":
            p = ev.payload
            routed[(ev.actor, p["layer"], p["epoch"], p["batch"])] = ev
        elif k == "routing_replay":
            p = ev.payload
            cached = routed.get((ev.actor, p["layer"], p["epoch"], p["batch"]))
            if cached is None:
                v("routing-replay-uncached", f"{p['layer']} replayed a routing for epoch {p['epoch']} batch "
                  f"{p['batch']} that was never cached", ev)
            elif cached.payload["digest"] != p["digest"]:
                v("routing-replay-mismatch", f"{p['layer']} trained epoch {p['epoch']} batch {p['batch']} with "
                  "experts other than the cached ones", cached, ev)
        elif k == "snapshot_outcome":
            sid = ev.payload["snapshot_id"]
            if sid in outcomes:
                v("snapshot-duplicate", f"snapshot {sid!r} has two outcomes", outcomes[sid], ev)
            else:
                outcomes[sid] = ev
    for sid in [*snaps, *(s for s in outcomes if s not in snaps)]:
        _check_cut(sid, snaps.get(sid, {}), chans.get(sid, {}), outcomes.get(sid), sends, recvs, v)
    stages.finish(v)
    return out


_STAGE_KINDS = frozenset({"send", "stage_down", "stage_up", "recovery_loaded", "bypass"})


class _Stages:
    """The pipeline-stage rules (spec/stages.md §9): outage windows, bypasses, recoveries."""

    def __init__(self) -> None:
        self.open: dict[str, Event] = {}  # actor -> its stage_down not yet followed by a stage_up
        self.windows: list[tuple[str, int, int, Event, Event | None]] = []  # actor, first, until, down, up
        self.bypasses: list[Event] = []
        self.loaded: dict[tuple[str, int], Event] = {}  # (actor, step) -> its recovery_loaded

    def see(self, ev: Event, v: Any) -> None:
        k = ev.kind.name
        if k == "send":
            down = self.open.get(ev.actor)
            if down is not None:
                p = ev.payload
                v("stage-send-while-offline", f"{ev.actor} sent {p['channel']}#{p['chan_seq']} at step {ev.step} while "
                  f"offline (down since step {down.payload['first']})", down, ev)
        elif k == "stage_down":
            if ev.actor in self.open:
                v("stage-up-mismatch", f"{ev.actor} went down again without a stage_up", self.open[ev.actor], ev)
                self._close(ev.actor, None)
            self.open[ev.actor] = ev
        elif k == "stage_up":
            down = self.open.get(ev.actor)
            if down is None:
                v("stage-up-mismatch", f"{ev.actor} came up at step {ev.step} without going down", ev)
            else:
                # the state it comes up with is a peer recovery, loaded at this step from the
                # source it names (the recovery rules check that load against its source)
                got = self.loaded.get((ev.actor, ev.step))
                if ev.step != down.payload["until"]:
                    v("stage-up-mismatch", f"{ev.actor} came up at step {ev.step}, its outage ends at step "
                      f"{down.payload['until']}", down, ev)
                elif got is None or got.payload["source"] != ev.payload["source"]:
                    v("stage-up-mismatch", f"{ev.actor} came up at step {ev.step} with the state of "
                      f"{ev.payload['source']} without loading a recovery from it at that step",
                      down, *([got] if got else []), ev)
                self._close(ev.actor, ev)
        elif k == "recovery_loaded":
            self.loaded[(ev.actor, ev.step)] = ev
        else:  # bypass
            self.bypasses.append(ev)

    def _close(self, actor: str, up: Event | None) -> None:
        down = self.open.pop(actor)
        p = down.payload
        self.windows.append((actor, int(p["first"]), int(p["until"]), down, up))

    def finish(self, v: Any) -> None:
        for actor in list(self.open):
            self._close(actor, None)
        by_stage: dict[str, list[tuple[int, int, Event, Event | None]]] = {}
        for actor, first, until, down, up in self.windows:
            by_stage.setdefault(actor, []).append((first, until, down, up))
        fwd: dict[tuple[str, int], set[int]] = {}  # (stage, window first) -> steps bypassed
        bwd: dict[tuple[str, int], set[int]] = {}
        for b in self.bypasses:
            p = b.payload
            x = p["offline"]
            w = next(((f, u) for f, u, _, _ in by_stage.get(x, ()) if f <= b.step < u), None)
            if w is None:
                v("bypass-outside-outage", f"{b.actor} routed {p['direction']} around {x} at step {b.step}, when {x} "
                  f"was not offline", b)
                continue
            (fwd if p["direction"] == "fwd" else bwd).setdefault((x, w[0]), set()).add(b.step)
        for x, ws in by_stage.items():
            for first, until, down, up in ws:
                f, g = fwd.get((x, first), set()), bwd.get((x, first), set())
                window = set(range(first, until))
                if up is None and f:  # the tape ended inside the outage: judge what it holds
                    window = set(range(first, max(f) + 1))
                if f and f != window:
                    miss = sorted(window - f)
                    v("bypass-window", f"{x}'s outage {first}..{until - 1} is bypassed at some steps only "
                      f"(not at {miss[:8]})", down, *([up] if up else []))
                if g != f:
                    v("bypass-window", f"{x}'s outage {first}..{until - 1}: gradient bypasses at steps {sorted(g)[:8]} "
                      f"differ from activation bypasses at {sorted(f)[:8]}", down, *([up] if up else []))


def _check_cut(sid: str, cut: dict[str, Event], chans: dict[str, Event], outcome: Event | None,
               sends: dict[tuple[str, int], Event], recvs: dict[tuple[str, int], Event], v: Any) -> None:
    complete = True  # is the recorded channel state complete (else judge consistency only)?
    if outcome is not None:
        o = outcome.payload
        if o["committed"]:
            for a in o["parts"]:
                if a not in cut or a not in chans:
                    v("snapshot-part-missing", f"snapshot {sid!r} committed with part {a}, whose "
                      f"{'cut' if a not in cut else 'channel state'} is not on the tape", outcome,
                      *([cut[a]] if a in cut else []))
            cut = {a: e for a, e in cut.items() if a in o["parts"]}
        else:
            complete = False
            cut = {a: e for a, e in cut.items() if a not in o["excluded"]}
    # Two-phase snapshots (any channel state or outcome taped): a receiver's channel state
    # is known once its snapshot_channels event is taped. Single-phase: the snapshot event.
    two_phase = bool(chans) or outcome is not None
    known = set(chans) if two_phase else set(cut)
    # A cut is consistent iff no actor's cut has seen more of actor i than i's own cut
    # (Mattern): C_j[i] <= C_i[i] for all i, j in the cut. The witnesses are the orphan
    # messages: received before the receiver's cut but sent after the sender's.
    for j, ej in cut.items():
        for i, ei in cut.items():
            if i != j and ej.clock[i] > ei.clock[i]:
                v("snapshot-inconsistent", f"snapshot {sid!r}: {j}'s cut has seen {i}:{ej.clock[i]}, beyond {i}'s "
                  f"own cut {i}:{ei.clock[i]}", ei, ej)
    recorded = {tuple(r) for e in cut.values() for r in e.payload["inflight"]}
    recorded |= {tuple(r) for a, e in chans.items() if a in cut for r in e.payload["inflight"]}
    for key, snd in sends.items():
        si = cut.get(snd.actor)
        receiver = snd.payload["peer"]
        rj = cut.get(receiver)
        if si is None or rj is None:
            continue
        sent_before = snd.clock[snd.actor] <= si.clock[snd.actor]
        rcv = recvs.get(key)
        recv_before = rcv is not None and rcv.clock[receiver] <= rj.clock[receiver]
        if recv_before and not sent_before:
            v("snapshot-orphan", f"snapshot {sid!r}: {key[0]}#{key[1]} received before {receiver}'s cut but sent "
              f"after {snd.actor}'s", si, snd, rcv, rj)
        crossing = sent_before and not recv_before
        if crossing and key not in recorded and complete and receiver in known:
            v("snapshot-inflight-missing", f"snapshot {sid!r}: {key[0]}#{key[1]} crosses the cut but is not in the "
              f"recorded channel state", si, snd, rj)
        elif key in recorded and not crossing:
            v("snapshot-inflight-spurious", f"snapshot {sid!r}: channel state lists {key[0]}#{key[1]}, which does "
              f"not cross the cut", si, snd, rj)
    for key in recorded:
        if key not in sends:
            v("snapshot-inflight-spurious", f"snapshot {sid!r}: channel state lists {key[0]}#{key[1]}, never sent",
              *cut.values())


def _decoded(events: Iterable[Event]) -> Iterator[Event]:
    """Every payload decoded before its event is judged: a malformed one is a corrupt tape
    (``TapeFormatError``), whether or not a rule happens to read that kind."""
    for ev in events:
        ev.payload
        yield ev


def check_tape(path: str | os.PathLike[str], *, readers: list[TapeReader] | None = None) -> list[Violation]:
    """Check every invariant over the tape at ``path`` (which must read cleanly).

    ``readers``: the reader is appended to it, so a caller can tell afterwards whether
    the tape was closed (``reader.closed``, tape-format.md §5.5) without reading it twice."""
    r = TapeReader(path)
    if readers is not None:
        readers.append(r)
    return check_events(_decoded(r.events()))  # streamed to the end: the reader then knows how the tape ends


def merge_histories(histories: Sequence[Sequence[Event]], names: Sequence[str] = ()) -> list[Event]:
    """One history from several tapes' events (one tape per process, spec §2.1).

    Each actor must have its events on one tape only (``ReplayError`` names the two
    tapes otherwise). The merge orders events by the sum of their clock entries, then by
    tape and seq: a linear extension of happens-before that keeps every actor's order.
    """
    owner: dict[str, int] = {}
    keyed: list[tuple[int, int, int, Event]] = []
    for t, evs in enumerate(histories):
        for ev in evs:
            if ev.kind.name == "actor":
                continue  # declarations are per tape (a tape declares every actor its clocks name)
            first = owner.setdefault(ev.actor, t)
            if first != t:
                label = names if len(names) == len(histories) else [f"#{i}" for i in range(len(histories))]
                raise ReplayError(f"actor {ev.actor!r} has events on two tapes ({label[first]} and {label[t]}): "
                                  "per-process tapes must hold disjoint actors", seq=ev.seq)
            keyed.append((sum(c for _, c in ev.clock.entries), t, ev.seq, ev))
    keyed.sort(key=lambda x: x[:3])
    return [x[3] for x in keyed]


def check_tapes(paths: Sequence[str | os.PathLike[str]], *, readers: list[TapeReader] | None = None
                ) -> list[Violation]:
    """Check the invariants over the history the tapes at ``paths`` record together
    (one tape: exactly :func:`check_tape`, in tape order). ``readers`` as in :func:`check_tape`."""
    if len(paths) == 1:
        return check_tape(paths[0], readers=readers)
    histories = []
    for p in paths:
        r = TapeReader(p)
        if readers is not None:
            readers.append(r)
        histories.append(list(_decoded(r.events())))
    return check_events(merge_histories(histories, [str(p) for p in paths]))
