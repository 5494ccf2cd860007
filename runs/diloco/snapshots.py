"""Chandy-Lamport snapshots of the reference run, and restoring one under the tape.

The protocol (a star: one syncer, M learners; spec/snapshot-protocol.md §1 for the model):

1. At the start of syncer step ``s`` (``s % snapshot_every == 0``) the syncer takes one
   taped decision: the snapshot's name and its participants. Learners that are dead or
   still recovering are excluded by policy, as Decoupled DiLoCo leaves failed learners
   out (taped as ``fault_detected snapshot-excluded``). It then records its cut (the
   taped ``snapshot`` event; its state is copied), and sends a marker to every
   participant.
2. The marker is an *untaped* message on the data channel, so it neither ticks a clock
   nor changes a taped sequence number, and FIFO puts it after everything the syncer
   sent before its cut. A learner takes it through its taped inbox decision, which
   ends at the marker; its cut is the end of that decision. So a learner's cut always
   falls between two step boundaries (never inside a receive or a merge), its taped
   position is the same in a forced replay, and a restored learner resumes with
   ``serve()`` and the rest of its loop. The learner copies its state, sends its reply
   marker to the syncer, and writes its part on a background thread.
3. The syncer records, per participant, every message that arrives after its cut and
   before that learner's reply marker (the channel state), on top of what was in its
   inbox at the cut. Syncer -> learner channels are empty at a learner's cut (FIFO and
   a decision that takes everything up to the marker), and no peer-to-peer message is
   in flight between participants (a learner in recovery is not one).
4. At the start of each later syncer step a taped decision says whether the snapshot is
   closed: every participant's marker is in and its part durable (or it died and is
   excluded). Closing writes the syncer's part, commits the one multi-part ``ckpt``
   checkpoint (``CkptSnapshotStore``, kind ``snapshot``, meta format
   ``replay-snapshot``), applies the retention policy, and tapes the syncer's channel
   state and the outcome. At most one snapshot is open at a time: a snapshot closes
   within a step or two, and one at a time keeps the learners' cut rule simple (a
   decision ends at *the* marker).

Taped messages that a dead incarnation never received are listed in the syncer's channel
state ("lost"): on the tape a learner's incarnations are one actor, so without them a
later cut would show messages sent inside it and never received.

Restore (``restore.py``): every actor of the snapshot starts from its part in a
fresh thread; the syncer's recorded channel messages and the learners' markers are
re-delivered first; then the run continues in force mode under the original tape, each
actor's tape lined up at its own ``snapshot`` event (``Oracle(align_snapshot=)``).
A snapshot that excluded a learner cannot be continued exactly (that learner's state
is not in it) and is refused.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import msgpack
import torch

from replay import Message
from replay import VectorClock
from replay.errors import SnapshotError

__all__ = ["Snapshots", "snapshot_name", "snapshot_message", "message_from_snapshot", "list_snapshots",
           "restore_syncer_endpoint", "SNAPSHOT_FORMAT", "PART_FORMAT", "part_entries", "join_part"]

SNAPSHOT_FORMAT = "replay-snapshot"  # as replay.snapshot.agent: `ckpt inspect` renders it
PART_FORMAT = "replay-snapshot-part"
FORMAT_VERSION = 1
_UNTAPED_META = ("log", "nlog")


def snapshot_name(s: int) -> str:
    """``step-<syncer step>``: the name ckpt's retention lists (``ckpt.manager``)."""
    from ckpt import checkpoint_name

    return checkpoint_name(s)


def _nsem(msg: Message) -> int:
    return len(msg.tensors) - int(msg.meta.get("nlog", 0))


def snapshot_message(msg: Message, hub: Any) -> dict[str, Any]:
    """A delivered message as a snapshot records it: meta without the shipped tape log
    (already applied), its tensors, and the tape stamp of its send (None if untaped)."""
    from replay import stamp_to_json

    st = hub.stamp((msg.src, msg.dst, msg.seq), wait=False)
    return {"src": msg.src, "dst": msg.dst, "seq": msg.seq,
            "meta": {k: v for k, v in msg.meta.items() if k not in _UNTAPED_META},
            "tensors": [t.detach().clone() for t in msg.tensors[: _nsem(msg)]],
            "stamp": stamp_to_json(st) if st is not None else None}


def message_from_snapshot(d: Mapping[str, Any]) -> Message:
    return Message(str(d["src"]), str(d["dst"]), int(d["seq"]), VectorClock(), meta=dict(d["meta"]),
                   tensors=tuple(d["tensors"]))


class _Held:
    """A copy taken at the cut, handed to ``ckpt.write_part`` as a Stateful: its type
    name is what ``ckpt inspect`` sorts an entry into the seven fields by."""

    __slots__ = ("sd",)

    def __init__(self, sd: Any) -> None:
        self.sd = sd

    def state_dict(self) -> Any:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        self.sd = sd


class OptimizerState(_Held):
    """A learner's inner AdamW state and LR schedule, or the syncer's outer momentum."""


class LoaderState(_Held):
    """A learner's data-loader state (ckpt's data-offsets field)."""


class Messages(_Held):
    """Messages an actor holds at its cut: the syncer's inbox not yet merged, a learner's
    outbox not yet sent and the state requests it has not served."""


def part_entries(actor: str, tree: Mapping[str, Any]) -> tuple[dict[str, Any], LoaderState | None]:
    """The checkpoint entries of one actor's part (spec/snapshot-protocol.md §9a rule 7).

    The in-memory part is one ``diloco`` tree; on disk its parameters are the ``model``
    entry, its optimizer state the ``optim`` entry, the messages it holds the
    ``messages`` entry and a learner's loader state the data field, so ``ckpt inspect``
    shows each of the seven fields where it belongs. What is left (counters, loop
    position, endpoint sequence numbers) stays ``diloco``."""
    d = dict(tree["diloco"])
    rest = {k: v for k, v in tree.items() if k != "diloco"}
    if actor == "syncer":
        model: dict[str, Any] = {"theta": d.pop("theta")}
        optim = OptimizerState({"mom": d.pop("mom")})
        held = Messages({"box": d.pop("box")})
        return {"model": model, "optim": optim, "messages": held, "diloco": d, **rest}, None
    core = dict(d["core"])
    meta = dict(core.pop("meta"))
    named = list(zip(meta["names"], core.pop("tensors")))
    model = {n: t for n, t in named if n.startswith("model.")}
    optim = OptimizerState({"tensors": {n: t for n, t in named if not n.startswith("model.")},
                            "param_groups": meta.pop("param_groups"), "sched": meta.pop("sched")})
    data = LoaderState(core.pop("loader"))
    d["core"] = {**core, "meta": meta}
    loop = dict(d["loop"])
    held = Messages({"outbox": loop.pop("outbox"), "pending": loop.pop("pending")})
    d["loop"] = loop
    return {"model": model, "optim": optim, "messages": held, "diloco": d, **rest}, data


def join_part(actor: str, entries: Mapping[str, Any], data: Any) -> dict[str, Any]:
    """The inverse of :func:`part_entries`: the ``diloco`` tree restore works from."""
    d = dict(entries["diloco"])
    optim = dict(entries["optim"])
    held = dict(entries["messages"])
    if actor == "syncer":
        return {**d, "theta": entries["model"]["theta"], "mom": optim["mom"], "box": held["box"]}
    core = dict(d["core"])
    meta = dict(core["meta"])
    model, inner = entries["model"], optim["tensors"]
    tensors = [model[n] if n in model else inner[n] for n in meta["names"]]
    meta.update(param_groups=optim["param_groups"], sched=optim["sched"])
    d["core"] = {**core, "meta": meta, "tensors": tensors, "loader": data}
    d["loop"] = {**d["loop"], "outbox": held["outbox"], "pending": held["pending"]}
    return d


def _pack(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


class Snapshots:
    """Record mode: where snapshot parts go, how participants report them, what is kept.

    ``root`` holds one ``ckpt`` checkpoint per snapshot (``step-<s>``). ``control`` is
    the control plane (``replay.snapshot.MemoryControl`` for threads, the c10d store for
    processes). Retention is ckpt's :class:`~ckpt.manager.RetentionPolicy`: the last
    ``keep_last`` snapshots plus the newest restorable one (no learner excluded), through
    ``keep_best`` on the ``restorable_step`` metric.
    """

    def __init__(self, root: str | os.PathLike[str], *, control: Any = None, keep_last: int = 2,
                 config: Mapping[str, Any] | None = None) -> None:
        from ckpt import RetentionPolicy
        from replay import CkptSnapshotStore, MemoryControl

        self.root = str(Path(root).absolute())
        self.store = CkptSnapshotStore(self.root)
        self.control = control if control is not None else MemoryControl()
        self.retention = RetentionPolicy(keep_last=keep_last, keep_best=1, best_metric="restorable_step",
                                         best_mode="max")
        # (actor, writer thread); learner threads share this object in threads mode
        self._writers: list[tuple[str, threading.Thread]] = []
        self._writers_lock = threading.Lock()
        self._dead_seen: dict[tuple[str, str], float] = {}
        self.grace_s = 5.0
        self.outcomes: list[dict[str, Any]] = []
        self.config = dict(config) if config is not None else None  # in every part, with its hash
        # snapshots already committed that a continued run restored from: they close again
        # (the restored syncer re-runs the close decision) without writing anything
        self._adopted: dict[str, dict[str, Any]] = {}

    def adopt(self, path: str | os.PathLike[str], meta: Mapping[str, Any]) -> None:
        """The committed snapshot at ``path`` is the one the run was restored from (see
        :func:`continue_run`)."""
        self._adopted[str(meta["snapshot"])] = {**meta, "path": str(Path(path).absolute())}

    # -- learners --------------------------------------------------------------------------
    def begin(self, name: str) -> dict[str, str]:
        p = self.store.begin(name)
        return {"final": p.final, "tmp": p.tmp_dir}

    def write(self, pending: Mapping[str, str], actor: str, tree: Mapping[str, Any], *, step: int,
              clock: Any) -> None:
        """Write a learner's part on a background thread and report it on the control plane."""
        from replay import Pending

        name = os.path.basename(str(pending["final"]))
        key = f"snap/{name}"

        def run() -> None:
            self.control.set(f"{key}/writing/{actor}", b"1")
            try:
                entries, data = part_entries(actor, tree)
                rec = self.store.write_part(Pending(str(pending["final"]), str(pending["tmp"])), actor, entries,
                                            step=step, extra=_extra(name, actor), rng=None, data=data,
                                            config=self.config)
            except Exception as exc:  # reported to the coordinator, which aborts
                self.control.set(f"{key}/failed/{actor}", _pack({"reason": f"part write failed: {exc}"}))
                return
            self.control.set(f"{key}/part/{actor}", _pack({"record": rec, "clock": clock, "step": step}))

        t = threading.Thread(target=run, name=f"snap-part-{actor}", daemon=True)
        with self._writers_lock:  # listed only once started: flush() may join it at once
            t.start()
            self._writers.append((actor, t))

    def flush(self, timeout: float = 60.0, *, actor: str | None = None) -> None:
        """Wait for the part writers started so far (of ``actor`` only, if given)."""
        with self._writers_lock:
            todo = [t for a, t in self._writers if actor is None or a == actor]
        for t in todo:
            t.join(timeout)

    # -- the syncer (coordinator) ---------------------------------------------------------------
    def _status(self, name: str, actor: str) -> str:
        key = f"snap/{name}"
        if self.control.get(f"{key}/part/{actor}") is not None:
            return "part"
        if self.control.get(f"{key}/failed/{actor}") is not None:
            return "failed"
        return "pending"

    def ready(self, snap: Mapping[str, Any], *, dead: set[str]) -> bool:
        from replay import actor_of

        if snap["name"] in self._adopted:
            return True  # every part is in it: it is the snapshot the run was restored from

        for e in snap["participants"]:
            a = actor_of(e)
            st = self._status(snap["name"], a)
            if e in snap["marked"] and st != "pending":
                continue
            if e in dead:
                # A part being written while the directory is committed would land in it
                # unlisted: give a writer that started a grace period to finish (a
                # SIGKILLed process's writer never does).
                if self.control.get(f"snap/{snap['name']}/writing/{a}") is not None:
                    since = self._dead_seen.setdefault((snap["name"], a), time.monotonic())
                    if time.monotonic() - since < self.grace_s:
                        return False
                continue
            return False
        return True

    def close(self, snap: Mapping[str, Any], *, dead: set[str]) -> dict[str, Any]:
        """Write the syncer's part, commit (or abort), apply retention; the taped outcome."""
        from replay import actor_of
        from replay import CHANNELS_KEY, Pending

        name, s = str(snap["name"]), int(snap["s"])
        if name in self._adopted:
            m = self._adopted[name]
            out = {"close": True, "committed": True, "path": m["path"], "reason": "",
                   "parts": list(m["parts"]), "excluded": list(m["excluded"])}
            self.outcomes.append(out)
            return out
        pending = Pending(str(snap["pending"]["final"]), str(snap["pending"]["tmp"]))
        parts: dict[str, dict[str, Any]] = {}
        excluded = [str(a) for a, _ in snap["excluded"]]
        reason = ""
        for e in snap["participants"]:
            a = actor_of(e)
            st = self._status(name, a)
            if e in snap["marked"] and st == "part":
                parts[a] = _unpack(self.control.get(f"snap/{name}/part/{a}"))  # type: ignore[arg-type]
            elif st == "failed" and e not in dead:
                reason = f"{a}: " + str(_unpack(self.control.get(f"snap/{name}/failed/{a}"))["reason"])  # type: ignore[arg-type]
            else:
                excluded.append(a)  # died before its part was durable: left out by policy
        excluded.sort(key=lambda a: int(a.rsplit("-", 1)[1]))
        inside = sorted(parts, key=lambda a: int(a.rsplit("-", 1)[1]))
        part_eps = [e for e in snap["participants"] if actor_of(e) in parts]
        channels = {e: list(snap["recording"][e]) for e in part_eps}
        staged = dict(snap["staged"])
        staged["snapshot"] = {"name": name, "participants": part_eps, "excluded": [list(x) for x in snap["excluded"]],
                              "box_refs": list(snap["box_refs"]), "lost": list(snap["lost"])}
        if not reason:
            try:
                entries, _ = part_entries("syncer", {"diloco": staged, CHANNELS_KEY: channels})
                rec = self.store.write_part(pending, "syncer", entries, step=s, extra=_extra(name, "syncer"), rng=None,
                                            config=self.config)
                counts: dict[str, dict[str, int | None]] = {}
                for e in part_eps:  # taped messages in flight to the syncer at the cut, per learner
                    seqs = [int(m["stamp"]["chan_seq"]) for m in [*snap["staged"]["box"], *snap["recording"][e]]
                            if m["src"] == e and m["stamp"] is not None]
                    counts[actor_of(e)] = {"first_seq": min(seqs) if seqs else None, "count": len(seqs)}
                meta = {"format": SNAPSHOT_FORMAT, "version": FORMAT_VERSION, "snapshot": name,
                        "coordinator": "syncer", "participants": ["syncer", *inside, *excluded],
                        "parts": ["syncer", *inside], "excluded": excluded,
                        "cut": {"syncer": snap["clock"], **{a: p["clock"] for a, p in parts.items()
                                                            if p.get("clock") is not None}},
                        "channels": {"syncer": counts}, "syncer_step": s,
                        "restorable": not excluded,
                        "metrics": {"restorable_step": s if not excluded else -1}}
                self.store.commit(pending, [rec] + [parts[a]["record"] for a in inside], step=s, meta=meta)
            except Exception as exc:  # any failure aborts the snapshot cleanly
                reason = f"commit failed: {exc}"
        if reason:
            self.store.abort(pending)
            out = {"close": True, "committed": False, "path": pending.final, "reason": reason,
                   "parts": ["syncer", *inside], "excluded": excluded}
        else:
            self.apply_retention()
            out = {"close": True, "committed": True, "path": pending.final, "reason": "",
                   "parts": ["syncer", *inside], "excluded": excluded}
        self.outcomes.append(out)
        return out

    def apply_retention(self) -> list[str]:
        """ckpt's one retention routine over the committed snapshots."""
        import ckpt

        return list(ckpt.apply_retention(self.root, self.retention))


def _extra(name: str, actor: str) -> dict[str, Any]:
    return {"format": PART_FORMAT, "version": FORMAT_VERSION, "snapshot": name, "actor": actor,
            "coordinator": "syncer"}


def list_snapshots(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The committed snapshots under ``root``, oldest first, with their meta."""
    import ckpt
    from ckpt import list_checkpoints

    out = []
    for r in list_checkpoints(root):
        if r.committed:
            out.append({"path": r.path, "name": r.name, "step": r.step, "meta": dict(ckpt.open(r.path).meta)})
    return out


def restore_syncer_endpoint(link: Any, hub: Any, parts: Mapping[str, Any]) -> dict[str, Any]:
    """Before anything is received: the syncer's sequence numbers at its cut, its
    recorded channel states and each learner's reply marker queued ahead of anything
    new (the restored syncer records them again, as the original did), and the tape
    stamps of every message sent before the cut and received after it."""
    from replay import actor_of, stamp_from_json
    from replay import CHANNELS_KEY

    part = dict(parts["syncer"]["diloco"])
    chans = parts["syncer"][CHANNELS_KEY]
    name = str(part["snapshot"]["name"])
    for m in [*part["box"], *(m for msgs in chans.values() for m in msgs)]:
        if m["stamp"] is not None:
            hub.register((str(m["src"]), str(m["dst"]), int(m["seq"])), stamp_from_json(m["stamp"]))
    inflight: dict[str, list[Message]] = {}
    for e in part["snapshot"]["participants"]:
        loop = parts[actor_of(e)]["diloco"]["loop"]
        marker_seq = int(loop["endpoint"]["next_send"]["syncer"]) - 1  # its last send before its cut
        msgs = [message_from_snapshot(m) for m in chans.get(e, [])]
        msgs.append(Message(e, "syncer", marker_seq, VectorClock(), meta={"kind": "snapmark", "name": name}))
        inflight[e] = msgs
    link.ep.restore(part["endpoint"], inflight)
    return part
