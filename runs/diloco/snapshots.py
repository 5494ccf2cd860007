"""The DiLoCo run's snapshots: what a part holds, where snapshots go, what is kept.

The protocol is the library's (``replay.snapshot.SnapshotAgent``, application-driven:
spec/snapshot-protocol.md §9a, which also states this run's rules). Here:

- the part layout (§9a): :func:`part_entries` splits an actor's state tree into the
  checkpoint entries ``model``, ``optim``, ``messages``, ``diloco`` (and a learner's data
  field), :func:`join_part` joins them back; :class:`PartViews` registers them with an
  agent, computed once per cut and collected again on a restore;
- :class:`Snapshots` (record mode): the root, the store, the control plane, and ckpt's
  retention over the committed snapshots;
- :func:`snapshot_agent`: an actor's agent, wired to its inbox and the tape hub;
- :class:`Restored`: a committed snapshot a run continues from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from replay import VectorClock
from replay.channel import Message, TapeSinkEvents
from replay.snapshot import CHANNELS_KEY, CkptSnapshotStore, MemoryControl, SnapshotAgent
from replay.channel import actor_of, stamp_from_json, stamp_to_json
from replay.errors import SnapshotError

__all__ = ["Snapshots", "PartViews", "Restored", "snapshot_agent", "snapshot_name", "snapshot_message",
           "message_from_snapshot", "list_snapshots", "part_entries", "join_part", "SNAPSHOT_FORMAT", "PART_FORMAT",
           "STAMP_KEY"]

SNAPSHOT_FORMAT = "replay-snapshot"  # the library's (replay.snapshot.agent): `ckpt inspect` renders it
PART_FORMAT = "replay-snapshot-part"
FORMAT_VERSION = 1
_UNTAPED_META = ("log", "nlog")
STAMP_KEY = "@stamp"  # a recorded message's tape stamp, so a restored syncer can take it in


def snapshot_name(s: int) -> str:
    """``step-<syncer step>``: the name ckpt's retention lists (``ckpt.manager``)."""
    from ckpt import checkpoint_name

    return checkpoint_name(s)


def _nsem(msg: Message) -> int:
    return len(msg.tensors) - int(msg.meta.get("nlog", 0))


def snapshot_message(msg: Message, hub: Any) -> dict[str, Any]:
    """A held message as a part records it: meta without the shipped tape log (already
    applied), its tensors, and the tape stamp of its send (None if untaped)."""
    st = hub.stamp((msg.src, msg.dst, msg.seq), wait=False)
    return {"src": msg.src, "dst": msg.dst, "seq": msg.seq,
            "meta": {k: v for k, v in msg.meta.items() if k not in _UNTAPED_META},
            "tensors": [t.detach().clone() for t in msg.tensors[: _nsem(msg)]],
            "stamp": stamp_to_json(st) if st is not None else None}


def message_from_snapshot(d: Mapping[str, Any]) -> Message:
    return Message(str(d["src"]), str(d["dst"]), int(d["seq"]), VectorClock(), meta=dict(d["meta"]),
                   tensors=tuple(d["tensors"]))


def recorded_form(hub: Any) -> Callable[[Message], Message]:
    """The agent's ``channel_filter`` on the syncer: a message in a recorded channel state
    keeps no shipped tape log (it was applied on delivery; re-applying it would tape its
    events twice) and carries its tape stamp under :data:`STAMP_KEY`."""
    def form(msg: Message) -> Message:
        st = hub.stamp((msg.src, msg.dst, msg.seq), wait=False)
        meta = {k: v for k, v in msg.meta.items() if k not in _UNTAPED_META}
        meta[STAMP_KEY] = stamp_to_json(st) if st is not None else None
        return Message(msg.src, msg.dst, msg.seq, msg.clock, msg.kind, meta, tuple(msg.tensors[: _nsem(msg)]))

    return form


# -- the part layout ------------------------------------------------------------------------


class _Entry:
    """One entry of a part, registered with the agent: its state is computed at the cut
    (``PartViews``), and on a restore what is read back is collected for the actor. Its
    type name is what ``ckpt inspect`` sorts the entry into the seven fields by."""

    def __init__(self, views: "PartViews", key: str) -> None:
        self._views = views
        self._key = key

    def state_dict(self) -> Any:
        # None before any cut: a restore then reads into fresh tensors (ckpt.load)
        return self._views.entry(self._key)

    def load_state_dict(self, sd: Any) -> None:
        self._views.loaded[self._key] = sd


class Weights(_Entry):
    """An actor's parameters: a learner's model tensors, the syncer's global fragments."""


class OptimizerState(_Entry):
    """A learner's inner AdamW state and LR schedule, or the syncer's outer momentum."""


class LoaderState(_Entry):
    """A learner's data-loader state (ckpt's data-offsets field)."""


class Messages(_Entry):
    """Messages an actor holds at its cut: the syncer's inbox not yet merged, a learner's
    outbox not yet sent and the state requests it has not served."""


class Tree(dict):  # type: ignore[type-arg]
    """A learner's loader state as ``part_entries`` returns it: a mapping, and a Stateful."""

    def state_dict(self) -> dict[str, Any]:
        return dict(self)


class _Plain(_Entry):
    """Collects the plain ``diloco`` entry on a restore (it is written as a plain tree)."""


def part_entries(actor: str, tree: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The checkpoint entries of one actor's part (spec/snapshot-protocol.md §9a).

    The in-memory part is one ``diloco`` tree; on disk its parameters are the ``model``
    entry, its optimizer state the ``optim`` entry, the messages it holds the
    ``messages`` entry and a learner's loader state the data field, so ``ckpt inspect``
    shows each of the seven fields where it belongs. What is left (counters, loop
    position, bookkeeping) stays ``diloco``. Returns (entries as plain trees, the data
    field as a :class:`Tree` or None)."""
    d = dict(tree["diloco"])
    rest = {k: v for k, v in tree.items() if k != "diloco"}
    if actor == "syncer":
        optim = {"mom": d.pop("mom")}
        if "comm" in d:  # compressed communication: what each learner holds, as the syncer mirrors it
            optim["comm"] = d.pop("comm")
        return {"model": {"theta": d.pop("theta")}, "optim": optim, "messages": {"box": d.pop("box")},
                "diloco": d, **rest}, None
    core = dict(d["core"])
    meta = dict(core.pop("meta"))
    named = list(zip(meta["names"], core.pop("tensors")))
    model = {n: t for n, t in named if n.startswith("model.")}
    optim = {"tensors": {n: t for n, t in named if not n.startswith("model.")},
             "param_groups": meta.pop("param_groups"), "sched": meta.pop("sched")}
    if "comm" in core:  # compressed communication: the held fragments and residuals
        optim["comm"] = core.pop("comm")
    data = Tree(core.pop("loader"))
    d["core"] = {**core, "meta": meta}
    loop = dict(d["loop"])
    held = {"outbox": loop.pop("outbox"), "pending": loop.pop("pending")}
    d["loop"] = loop
    return {"model": model, "optim": optim, "messages": held, "diloco": d, **rest}, data


def join_part(actor: str, entries: Mapping[str, Any], data: Any) -> dict[str, Any]:
    """The inverse of :func:`part_entries`: the ``diloco`` tree an actor restores from."""
    d = dict(entries["diloco"])
    optim = dict(entries["optim"])
    held = dict(entries["messages"])
    if actor == "syncer":
        return {**d, "theta": entries["model"]["theta"], "mom": optim["mom"], "box": held["box"],
                **({"comm": optim["comm"]} if "comm" in optim else {})}
    core = dict(d["core"])
    meta = dict(core["meta"])
    model, inner = entries["model"], optim["tensors"]
    tensors = [model[n] if n in model else inner[n] for n in meta["names"]]
    meta.update(param_groups=optim["param_groups"], sched=optim["sched"])
    d["core"] = {**core, "meta": meta, "tensors": tensors, "loader": data,
                 **({"comm": optim["comm"]} if "comm" in optim else {})}
    d["loop"] = {**d["loop"], "outbox": held["outbox"], "pending": held["pending"]}
    return d


class PartViews:
    """An actor's part, registered with its agent: ``refresh(tree)`` right before the cut
    (the agent stages each entry then), ``joined()`` after a restore."""

    def __init__(self, actor: str) -> None:
        self.actor = actor
        self._entries: dict[str, Any] = {}
        self._data: Any = None
        self.diloco: dict[str, Any] = {}  # registered as a plain tree: ``ckpt inspect`` shows "other"
        self.loaded: dict[str, Any] = {}
        learner = actor != "syncer"
        self.state: dict[str, Any] = {"model": Weights(self, "model"), "optim": OptimizerState(self, "optim"),
                                      "messages": Messages(self, "messages"), "diloco": self.diloco}
        self.data = LoaderState(self, "@data") if learner else None

    def refresh(self, tree: Mapping[str, Any]) -> None:
        self._entries, data = part_entries(self.actor, {"diloco": tree})
        self._data = data.state_dict() if data is not None else None
        self.diloco.clear()
        self.diloco.update(self._entries["diloco"])

    def entry(self, key: str) -> Any:
        return self._data if key == "@data" else self._entries.get(key)

    def loaders(self) -> dict[str, Any]:
        """What a restore loads the entries into (the plain ``diloco`` entry included)."""
        return {**{k: v for k, v in self.state.items() if k != "diloco"}, "diloco": _Plain(self, "diloco")}

    def joined(self) -> dict[str, Any]:
        return join_part(self.actor, self.loaded, self.loaded.get("@data"))


# -- record mode: where snapshots go and what is kept -------------------------------------------


class Snapshots:
    """Record mode: ``root`` holds one ``ckpt`` checkpoint per snapshot (``step-<s>``);
    ``control`` is the control plane (``MemoryControl`` for threads, the c10d store for
    processes). Retention is ckpt's :class:`~ckpt.manager.RetentionPolicy`: the last
    ``keep_last`` snapshots (every committed snapshot is restorable: ``continue_run``,
    spec §9a) plus the newest one that continues exactly under the run's own tape too
    (``restore_run``: it left no learner out alive), through ``keep_best`` on the
    ``exact_step`` metric."""

    def __init__(self, root: str | os.PathLike[str], *, control: Any = None, keep_last: int = 2,
                 config: Mapping[str, Any] | None = None) -> None:
        from ckpt import RetentionPolicy

        self.root = str(Path(root).absolute())
        self.store = CkptSnapshotStore(self.root)
        self.control = control if control is not None else MemoryControl()
        self.retention = RetentionPolicy(keep_last=keep_last, keep_best=1, best_metric="exact_step",
                                         best_mode="max")
        self.outcomes: list[dict[str, Any]] = []
        self.config = dict(config) if config is not None else None  # in every part, with its hash

    def committed(self, outcome: Mapping[str, Any]) -> None:
        """After a commit (or an abort) of the coordinator: note it, apply retention."""
        self.outcomes.append({"close": True, **outcome})
        if outcome["committed"]:
            self.apply_retention()

    def apply_retention(self) -> list[str]:
        """ckpt's one retention routine over the committed snapshots."""
        import ckpt

        return list(ckpt.apply_retention(self.root, self.retention))


def snapshot_agent(link: Any, views: PartViews, *, participants: Sequence[str], snapshots: Snapshots | None,
                   coordinator: bool, hub: Any = None, control: Any = None, excludable: Sequence[str] = (),
                   step: Callable[[], int] | None = None) -> SnapshotAgent:
    """An actor's agent: application markers (taken through the actor's taped decisions)
    and, on the syncer, manual coordination; learners' channels other than the syncer's
    are out of scope (quiet at every cut). ``snapshots`` None (a replay): nothing written."""
    store = snapshots.store if snapshots is not None else None
    ctl = control if control is not None else (snapshots.control if snapshots is not None else MemoryControl())
    agent = SnapshotAgent(
        link.ep, views.state, store=store, control=ctl, participants=participants, excludable=excludable,
        markers="application", coordinate="manual", scope=None if coordinator else ("syncer",),
        channel_filter=recorded_form(hub) if coordinator else None, events=TapeSinkEvents(link.tape, hub),
        data=views.data, config=snapshots.config if snapshots is not None else None, part_of=actor_of,
        grace_s=5.0, step=step)
    link.on_marker = agent.offer_marker
    return agent


# -- restore ----------------------------------------------------------------------------------------


@dataclass
class Restored:
    """A committed snapshot a run continues from: its meta, its store, the syncer's
    bookkeeping (``diloco`` entry) and each included learner's loop position."""

    path: str
    name: str
    meta: dict[str, Any]
    store: CkptSnapshotStore
    syncer: dict[str, Any]
    learners: dict[str, dict[str, Any]] = field(default_factory=dict)  # actor -> its part's "diloco" entry
    # taped messages inside the cut that were never received inside it, to and from each
    # learner the snapshot left out (``restore.unreceived``): in flight for ever on the tape
    lost_to: dict[str, list[list[Any]]] = field(default_factory=dict)
    lost_from: dict[str, list[list[Any]]] = field(default_factory=dict)

    @property
    def excluded(self) -> list[str]:
        return [str(a) for a in self.meta.get("excluded", ())]

    @property
    def policy(self) -> dict[str, str]:
        """Learners left out by the syncer's policy at the cut: actor -> "dead" / "recovering"."""
        return {str(a): str(w) for a, w in self.syncer["snapshot"]["excluded"]}

    @property
    def rejoin(self) -> list[str]:
        """Left-out learners that were alive at the cut without their state in the snapshot
        (recovering, or dead before their part was durable): their endpoint starts afresh
        and recovers from a healthy peer, as a replacement does live (spec §9a)."""
        return [a for a in self.excluded if self.policy.get(a) != "dead"]

    def endpoint(self, actor: str) -> str | None:
        return self.syncer["book"]["active"].get(actor)

    def incarnations(self, names: Sequence[str]) -> tuple[dict[str, int], set[str]]:
        """Which incarnation of each learner starts (from its part, afresh to rejoin, or the
        next spare of a learner dead at the cut), and the endpoints that start afresh."""
        first: dict[str, int] = {}
        rejoin: set[str] = set()
        spare_used = dict(self.syncer["book"]["spare_used"])
        for a in names:
            e = self.endpoint(a)
            if a in self.learners:
                k = int(self.learners[a]["loop"]["incarnation"])
                if _incarnation(e or "") != k or actor_of(e or "") != a:
                    raise SnapshotError(f"{a}: the part is of incarnation {k}, the syncer's cut has {e}",
                                        snapshot=self.name)
                first[a] = k
            elif a in self.rejoin:
                assert e is not None
                first[a] = _incarnation(e)
                rejoin.add(e)
            else:  # dead at the cut: its next spare (if any) is activated when the plan says
                first[a] = _incarnation(e) + 1 if e is not None else int(spare_used[a]) + 1
        return first, rejoin

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Restored":
        """Read a committed snapshot's meta; refuses one that is not a DiLoCo snapshot."""
        path = str(Path(path).absolute())
        # The parts of a gloo run were written by processes of a larger world; restored as
        # threads of one process they differ in world size by design, and exactness is
        # what the forced continuation proves event by event: no environment gate here.
        store = CkptSnapshotStore(os.path.dirname(path), exactness="off")
        name = os.path.basename(path)
        meta = store.read_meta(name)
        if meta.get("format") != SNAPSHOT_FORMAT or int(meta.get("version", 0)) != FORMAT_VERSION or \
                "syncer" not in meta.get("parts", ()):
            raise SnapshotError(f"not a DiLoCo snapshot (format {meta.get('format')!r} version "
                                f"{meta.get('version')!r})", snapshot=name, path=path)
        syncer = store.read_entry(name, "syncer", "diloco")
        learners = {p: store.read_entry(name, p, "diloco") for p in meta["parts"] if p != "syncer"}
        return cls(path, name, dict(meta), store, syncer, learners)

    @property
    def step(self) -> int:
        return int(self.syncer["s"])

    def register_stamps(self, hub: Any) -> None:
        """The tape stamps of every message the syncer holds or recorded at the cut: a
        restored syncer takes them in (a taped receive looks its send's stamp up)."""
        box = self.store.read_entry(self.name, "syncer", "messages")["box"]
        chans = self.store.read_entry(self.name, "syncer", CHANNELS_KEY)
        for m in [*box, *(dict(m, src=src, dst="syncer", stamp=m["meta"].get(STAMP_KEY))
                          for src, msgs in chans.items() for m in msgs)]:
            if m.get("stamp") is not None:
                hub.register((str(m["src"]), str(m["dst"]), int(m["seq"])), stamp_from_json(m["stamp"]))


def _incarnation(endpoint: str) -> int:
    """``learner-2~1`` -> 1 (the inverse of ``replay.channel.endpoint_name``)."""
    _, _, k = endpoint.partition("~")
    return int(k) if k else 0


def list_snapshots(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The committed snapshots under ``root``, oldest first, with their meta."""
    import ckpt
    from ckpt import list_checkpoints

    out = []
    for r in list_checkpoints(root):
        if r.committed:
            out.append({"path": r.path, "name": r.name, "step": r.step, "meta": dict(ckpt.open(r.path).meta)})
    return out
