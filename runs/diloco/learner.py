"""A learner: inner AdamW on its own shard, fragments out, merged fragments in.

``LearnerCore`` is the numerics (no I/O). ``run_learner`` is the actor: it never
blocks on the syncer while it has inner steps to run. Everything it does that depends
on timing is one taped decision per step boundary (``inbox``): which arrived messages
it takes in now and how many held-back outgoing messages it lets go. In force mode
the decision comes from the tape and the learner waits for exactly those messages.

Recovery (a replacement incarnation): it waits for the syncer's ``activate`` (which
names the syncer step ``target`` and a healthy peer), asks the peer for its state, and
the peer answers once it has applied a merged fragment of syncer step >= target, so
the state it sends has observed the syncer's clock at activation. Then it rejoins.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ckpt.data import QuarantinePolicy, ResumableLoader
from runs.common.tiny_lm import warmup_cosine
from replay.channel import Message
from runs.diloco import quant
from runs.diloco.chaos import Fault
from runs.diloco.config import DiLoCoConfig
from runs.diloco.fragments import pack_fragments
from replay.channel import Inbox, LocalTape, ref_of
from runs.diloco.merge import model_update
from runs.diloco.model import LearnerShards, build_model, learner_corpus, weighted_loss
from replay.channel import RemoteTape, meta_digest
from replay.watchdog import beat

__all__ = ["LearnerCore", "LearnerCtx", "LearnerOutcome", "LearnerLoop", "Learner", "run_learner"]

SYNCER = "syncer"


class LearnerCore:
    """Model, inner optimiser, scheduler, loader and per-fragment counters of one learner."""

    def __init__(self, cfg: DiLoCoConfig, index: int, theta0: Mapping[str, torch.Tensor],
                 poisoned: Sequence[int] = (), on_quarantine: Callable[[int, Any, str], None] | None = None) -> None:
        self.cfg = cfg
        self.index = index
        self.model = build_model(cfg)
        self.model.load_state_dict(dict(theta0))
        self.model.train()
        # foreach=False: one kernel per tensor, the same code path on every run.
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.inner_lr, weight_decay=cfg.weight_decay,
                                     foreach=False)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(cfg.warmup, cfg.steps))
        self.loader = ResumableLoader(
            LearnerShards(learner_corpus(cfg, index), cfg.shards_per_learner, tuple(poisoned)),
            seed=cfg.seed + 17 * index, global_batch_size=cfg.batch, world_size=1, rank=0,
            quarantine=QuarantinePolicy(fields=(1,), scope="shard"), on_quarantine=on_quarantine,
            seed_sample_rngs=False)  # nothing random per sample; and threads share the global RNGs
        self._it: Any = None
        self.frags = pack_fragments(self.model.named_parameters(), cfg.fragments)
        self.params = dict(self.model.named_parameters())
        self.t = 0
        self.c_tokens = [0] * cfg.fragments
        self.c_steps = [0] * cfg.fragments
        self.applied = [-1] * cfg.fragments  # syncer step of the merged fragment last applied
        self.last_loss = float("nan")
        # compressed communication (cfg.comm_bits < 32): the global fragment as this learner
        # holds it (the syncer mirrors it exactly) and the error-feedback residuals
        # (every learner starts from Theta_0, which the syncer mirrors as "step -1")
        self.anchor: list[list[torch.Tensor] | None] = [None] * cfg.fragments
        self.held_v = [-1] * cfg.fragments  # the syncer step of each anchor
        if cfg.comm_bits != 32:
            self.anchor = [self.fragment(p) for p in range(cfg.fragments)]
        self.resid = [[torch.zeros_like(self.params[n]) for n in f.names] for f in self.frags]
        # model_update "mean"/"rda": per fragment, the global fragment last adopted (the
        # origin of both updates the next merged fragment is combined from; merge.py)
        self.base: list[list[torch.Tensor]] | None = None
        if cfg.model_update != "replace":
            self.base = [self.fragment(p) for p in range(cfg.fragments)]
        self.last_update_norm = 0.0  # the norm of the last model update's step from base

    def train_step(self) -> tuple[list[int], float]:
        batch = None
        while batch is None:
            if self._it is None:
                self._it = iter(self.loader)
            batch = next(self._it, None)
            if batch is None:
                self._it = None
        tokens, weights = batch
        ids = list(self.loader.last_batch.indices) if self.loader.last_batch else []
        loss = weighted_loss(self.model, tokens, weights)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.t += 1
        ntok = int(tokens.shape[0] * (tokens.shape[1] - 1))
        for p in range(self.cfg.fragments):
            self.c_tokens[p] += ntok
            self.c_steps[p] += 1
        self.last_loss = float(loss.detach())
        return ids, self.last_loss

    def fragment(self, p: int) -> list[torch.Tensor]:
        return [self.params[n].detach().clone() for n in self.frags[p].names]

    def outgoing(self, p: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What goes on the wire for fragment p: its parameters (float32), or, compressed,
        the outer gradient ``anchor - theta`` plus the residual, encoded (quant.py), with
        the syncer step of the anchor; the residual keeps what the encoding lost."""
        cfg = self.cfg
        if cfg.comm_bits == 32:
            return {}, self.fragment(p)
        anchor = self.anchor[p]
        if anchor is None:  # no merged fragment yet (a replacement): the parameters, raw
            return {"enc": "raw"}, self.fragment(p)
        out: list[torch.Tensor] = []
        with torch.no_grad():
            for j, n in enumerate(self.frags[p].names):
                v = anchor[j] - self.params[n].detach() + self.resid[p][j]
                e = quant.encode(v, cfg.comm_bits, cfg.comm_block)
                self.resid[p][j] = v - quant.decode(e, cfg.comm_block)
                out += e.tensors()
        return {"enc": cfg.comm_bits, "anchor": self.held_v[p]}, out

    def apply(self, p: int, s: int, tensors: Sequence[torch.Tensor], meta: Mapping[str, Any] | None = None) -> bool:
        """Adopt the merged fragment of syncer step ``s`` unless a newer one is applied (a
        compressed update decodes onto the fragment as this learner holds it, which it
        holds from then on even when its parameters are newer: a replacement's from its
        peer)."""
        if self.cfg.comm_bits != 32:
            enc = (meta or {}).get("enc")
            if enc == "delta":
                base = self.anchor[p]
                if base is None or int((meta or {})["base"]) != self.held_v[p]:
                    raise RuntimeError(f"fragment {p}: an update from syncer step {(meta or {}).get('base')} reached "
                                       f"a learner holding step {self.held_v[p]}")
                tensors = [b + quant.decode(quant.Encoded(int((meta or {})["bits"]), tuple(b.shape), q, sc),
                                            self.cfg.comm_block)
                           for b, q, sc in zip(base, tensors[0::2], tensors[1::2])]
            self.anchor[p] = [t.detach().clone() for t in tensors]
            self.held_v[p] = s
        if s <= self.applied[p]:
            return False
        names = self.frags[p].names
        with torch.no_grad():
            if self.base is None:
                new = list(tensors)
            else:
                new, self.last_update_norm = model_update(
                    self.cfg.model_update, self.cfg.update_alpha, self.base[p],
                    [self.params[n].detach() for n in names], tensors)
                self.base[p] = [t.detach().clone() for t in tensors]
            for n, t in zip(names, new):
                self.params[n].copy_(t)
        self.applied[p] = s
        self.c_tokens[p] = 0
        self.c_steps[p] = 0
        return True

    # -- whole state, for a peer's recovery and for the final digest -------------------
    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        out = [(f"model.{k}", v) for k, v in self.model.state_dict().items()]
        st = self.opt.state_dict()["state"]
        for i in sorted(st):
            for k in sorted(st[i]):
                v = st[i][k]
                if isinstance(v, torch.Tensor):
                    out.append((f"opt.{i}.{k}", v))
        return out

    def export(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The whole state (a peer's recovery, a snapshot part): model, inner optimiser,
        schedule, step, and the model update's bases (``update_base.*``, in the part's
        ``optim`` entry)."""
        named = self.named_state()
        if self.base is not None:
            named += [(f"update_base.{n}", t) for f, ts in zip(self.frags, self.base) for n, t in zip(f.names, ts)]
        sd = self.opt.state_dict()
        meta = {"names": [n for n, _ in named], "param_groups": sd["param_groups"],
                "sched": {k: v for k, v in self.sched.state_dict().items() if k != "lr_lambdas"},
                "t": self.t, "applied": list(self.applied)}
        return meta, [t.detach().clone() for _, t in named]

    def load(self, meta: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        named = dict(zip(meta["names"], tensors))
        self.model.load_state_dict({k[len("model."):]: v for k, v in named.items() if k.startswith("model.")})
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in named.items():
            if k.startswith("opt."):
                _, i, key = k.split(".", 2)
                state.setdefault(int(i), {})[key] = v.clone()
        self.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        sd = self.sched.state_dict()
        sd.update(meta["sched"])
        self.sched.load_state_dict(sd)
        self.t = int(meta["t"])
        self.applied = [int(x) for x in meta["applied"]]
        if self.base is not None:  # the peer's bases: it adopted the global fragments it applied
            self.base = [[named[f"update_base.{n}"].clone() for n in f.names] for f in self.frags]
        if self.cfg.comm_bits != 32:
            # Compressed: the syncer knows exactly which fragment each endpoint holds, and
            # a new one holds none; it sends it every fragment whole first.
            self.anchor = [None] * self.cfg.fragments
            self.held_v = [-1] * self.cfg.fragments
            self.resid = [[torch.zeros_like(self.params[n]) for n in f.names] for f in self.frags]
        self.c_tokens = [0] * self.cfg.fragments
        self.c_steps = [0] * self.cfg.fragments
        # Continue this learner's own data stream at the adopted step.
        ds = self.loader.state_dict()
        spe = self.loader.steps_per_epoch
        ds["epoch"], ds["position"] = self.t // spe, (self.t % spe) * self.cfg.batch
        self.loader.load_state_dict(ds)
        self._it = None


@dataclass
class LearnerCtx:
    cfg: DiLoCoConfig
    actor: str  # tape identity, e.g. "learner-2"
    incarnation: int
    link: Inbox
    theta0: Mapping[str, torch.Tensor]
    faults: Sequence[Fault]
    die: Callable[[], None]  # drop the transport (threads) / SIGKILL (processes)
    remote: RemoteTape | None = None  # set in a learner process: ship the tape log to the syncer
    # a replacement waits for its predecessor to be gone before it records as the same actor
    predecessor_done: Callable[[], None] = lambda: None
    step_delay_s: float = 0.0  # an artificial slowdown (replay on a slower machine)
    # snapshots: writes this learner's part (record mode); None writes nothing (replays)
    parts: Any = None
    # restore: the snapshot (``snapshots.Restored``) whose part this incarnation starts from
    restore: Any = None
    # restore: this endpoint was left out of the snapshot alive: it starts afresh and waits
    # for the syncer's activation, as a replacement does (whatever its incarnation)
    rejoin: bool = False
    # restore: endpoints that start afresh; their state requests in a restored part are void
    dropped: Sequence[str] = ()


@dataclass
class LearnerOutcome:
    actor: str
    incarnation: int
    started_at: int
    died_at: int | None = None
    final_t: int = 0
    state: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)


def _index(actor: str) -> int:
    return int(actor.rsplit("-", 1)[1])


@dataclass
class LearnerLoop:
    """A learner's loop state between two step boundaries (its snapshot part's ``loop``,
    with the outbox and pending requests under ``messages``)."""

    # (release time, meta, tensors, timing) of fragments held back (jitter), oldest first
    outbox: list[tuple[float, dict[str, Any], list[torch.Tensor], dict[str, Any]]] = field(default_factory=list)
    pending: list[Message] = field(default_factory=list)  # state requests not served yet
    jitter_until: int = -1
    jitter_delay: float = 0.0
    step_ema: float = 0.0
    stopped: bool = False
    n_end: int = 0  # end-of-run inbox decisions taken
    notified: int = -1  # the latest syncer step whose activation notice this learner took

    def state_dict(self) -> dict[str, Any]:
        return {"outbox": [{"meta": dict(m), "tensors": [x.clone() for x in ts], "timing": dict(tm)}
                           for _, m, ts, tm in self.outbox],
                "pending": [msg_to_json(m) for m in self.pending], "jitter_until": self.jitter_until,
                "jitter_delay": self.jitter_delay, "step_ema": self.step_ema, "stopped": self.stopped,
                "n_end": self.n_end, "notified": self.notified}

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> "LearnerLoop":
        return cls(outbox=[(0.0, dict(o["meta"]), list(o["tensors"]), dict(o["timing"])) for o in d["outbox"]],
                   pending=[msg_from_json(m) for m in d["pending"]], jitter_until=int(d["jitter_until"]),
                   jitter_delay=float(d["jitter_delay"]), step_ema=float(d["step_ema"]), stopped=bool(d["stopped"]),
                   n_end=int(d["n_end"]), notified=int(d.get("notified", -1)))


class Learner:
    """The learner actor (module docstring): inner steps, taped inbox decisions at every
    step boundary, fragments out, merged fragments in, a peer's state on request."""

    def __init__(self, ctx: LearnerCtx) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.link = ctx.link
        self.tape = ctx.link.tape
        self.me = self.link.name
        self.out = LearnerOutcome(ctx.actor, ctx.incarnation, 0)
        self.poisoned = tuple(int(f.detail["shard"]) for f in ctx.faults if f.kind == "nan")
        self.core: LearnerCore | None = None
        self.loop = LearnerLoop()
        self.marker: list[Message] = []  # a snapshot marker taken in the current inbox decision
        self.resume_key: str | None = None
        # the syncer's first snapshot is taken at the start (syncer.py); its marker is waited
        # for in the first inbox decision, so that every learner's cut is there
        self.first_marker = ctx.incarnation == 0 and ctx.restore is None and bool(self.cfg.snapshot_every)
        from runs.diloco.chaos import learner_names
        from runs.diloco.snapshots import PartViews, snapshot_agent

        self.views = PartViews(ctx.actor)
        self.agent = snapshot_agent(
            self.link, self.views, participants=sorted({"syncer", self.me, *learner_names(self.cfg)}),
            snapshots=ctx.parts, coordinator=False, hub=self.tape.hub if isinstance(self.tape, LocalTape) else None,
            step=lambda: self.core.t if self.core is not None else 0)

    # -- tape and wire helpers ---------------------------------------------------------------
    def quarantined(self, index: int, shard: Any, reason: str) -> None:
        self.tape.detected("nan", self.ctx.actor, {"shard": shard, "sample": index, "reason": reason[:80]})

    def _new_core(self) -> LearnerCore:
        return LearnerCore(self.cfg, _index(self.ctx.actor), self.ctx.theta0, self.poisoned, self.quarantined)

    def ship(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if self.ctx.remote is None:
            return {}, []
        log, ts = self.ctx.remote.drain()
        return {"log": log, "nlog": len(ts)}, ts

    def send_syncer(self, meta: Mapping[str, Any], tensors: Sequence[torch.Tensor], timing: Mapping[str, Any] | None,
                    *, taped: bool = True) -> None:
        link = self.link
        ref = (self.me, SYNCER, link.ep.next_send[SYNCER])
        if taped:
            self.tape.send(ref, SYNCER, meta_digest(meta, tensors))
        extra, log_tensors = self.ship()
        if timing:
            extra["timing"] = dict(timing)
        link.send(SYNCER, {**meta, **extra}, list(tensors) + log_tensors, taped=False)

    def flush_log(self) -> None:
        # After a peer-to-peer send, ship the tape log at once: the peer's log will
        # hold the matching receive, which the tape can only take after this send.
        # Sent by thread learners too (empty), so that channel seqs match the replay's.
        self.send_syncer({"kind": "log"}, [], None, taped=False)

    # -- start: fresh, as a replacement (peer recovery), or from a snapshot part ---------------
    def start(self) -> bool:
        """Build the core; False when this spare was told to stop before it was needed."""
        ctx, link, tape = self.ctx, self.link, self.tape
        if ctx.restore is not None:
            # Before anything is received: the part through the agent, sequence numbers at
            # the cut. The tape lines this actor up right after its cut (the snapshot
            # event): the channel state taped with the cut is its first event again.
            r = ctx.restore
            self.agent.restore(r.name, source=r.store, announce=False, resume=True, partial=True,
                               into=self.views.loaders())
            core = self.core = self._new_core()
            loop = restore_core(core, self.views.joined())
            self.out.started_at = int(loop["started_at"])
            self.loop = LearnerLoop.from_state(loop)
            # a requester that starts afresh asks again (over a channel that starts afresh)
            self.loop.pending = [m for m in self.loop.pending if m.src not in ctx.dropped]
            self.resume_key = str(loop["phase"])
            return True
        if ctx.incarnation == 0 and not ctx.rejoin:
            # Start together: process start-up skew would otherwise let one learner run
            # many rounds ahead before the others exist.
            link.pop(ref_of(link.first_from(SYNCER, ("start",))))
            self.core = self._new_core()
            if self.poisoned:
                tape.inject("nan", ctx.actor, {"shards": list(self.poisoned)})
        else:
            # A hot spare builds its model, optimiser, loader and corpus while it waits, so
            # that on activation only the peer's state is loaded: built after the state had
            # arrived, it cost a replacement process seconds, while its peer ran on.
            core = self.core = self._new_core()
            # A spare idles for as long as the run lasts until it is needed: a wait on the
            # event, with no clock (a fixed deadline failed legitimate long runs, 60 s in
            # the tests). A hang is the run's watchdog's to catch (Threads.join, Workers),
            # and a failed or gone syncer ends the wait (shutdown, PeerDiedError).
            act = link.first_from(SYNCER, ("activate", "stop"), bounded=False)
            t_act = time.monotonic()
            link.pop(ref_of(act))
            if act.meta["kind"] == "stop":
                return False
            ctx.predecessor_done()
            tape.recv(ref_of(act))
            peer = str(act.meta["peer"])
            link.send(peer, {"kind": "state_req", "target": int(act.meta["target"])})
            self.flush_log()
            st = link.first_from(peer, ("state",))
            t_state = time.monotonic()
            link.pop(ref_of(st))
            tape.recv(ref_of(st))
            core.load(st.meta, st.tensors)
            tape.recovered(str(act.meta["fault"]), ctx.actor, ref_of(act), ref_of(st))
            # Tell the syncer where this incarnation starts: a replacement adopts its peer's
            # step and so never sends the fragments of rounds the peer had already sent; the
            # syncer's last-round barrier must know which ones to wait for. (The wall times
            # are for the recovery accounting only.)
            self.send_syncer({"kind": "joined", "started": core.t, "asked_at": int(st.meta.get("asked_at", core.t)),
                              "wait_state_s": t_state - t_act, "load_s": time.monotonic() - t_state},
                             [], None, taped=False)
        self.out.started_at = self.core.t
        return True

    # -- step boundaries ---------------------------------------------------------------------
    def lagging(self) -> bool:
        core, cfg = self.core, self.cfg
        assert core is not None
        need = core.t // cfg.inner_h - cfg.max_lag_rounds
        return need > 0 and any(a < 0 or a // cfg.fragments < need for a in core.applied)

    def take(self, refs: Sequence[Sequence[Any]]) -> None:
        core, link, tape = self.core, self.link, self.tape
        assert core is not None
        for r in refs:
            ref = (str(r[0]), str(r[1]), int(r[2]))
            msg = link.wait_ref(ref)
            link.pop(ref)
            if Inbox.is_marker(msg):  # a snapshot marker (untaped): the cut follows this decision
                self.marker.append(msg)
                continue
            kind = msg.meta["kind"]
            tape.recv(ref)
            if kind == "merged":
                if core.apply(int(msg.meta["p"]), int(msg.meta["s"]), msg.tensors, msg.meta) and \
                        core.base is not None:
                    # the model update's result pinned on the tape (the replay compares it)
                    tape.metric(f"update_norm.p{msg.meta['p']}", core.last_update_norm)
            elif kind == "state_req":
                # the step it was asked at: the recovery accounting's transfer wait
                msg.meta["asked_at"] = core.t  # type: ignore[index]
                self.loop.pending.append(msg)
            elif kind == "notice":  # the syncer activated a replacement that recovers from this learner
                self.loop.notified = max(self.loop.notified, int(msg.meta["target"]))
            elif kind == "stop":
                self.loop.stopped = True

    def boundary(self, key: str, final: bool = False, block: bool = False) -> None:
        """One taped inbox decision. ``block``: first wait for a message or for a held-back
        message to come due (used while lagging and at the end, where there is nothing
        else to do)."""
        link, loop = self.link, self.loop

        def compute() -> dict[str, Any]:
            if self.first_marker:
                link.wait(lambda: any(Inbox.is_marker(m) for m in link.box.values()),
                          "the first snapshot's marker", tick=0.005)
            if final and loop.outbox:
                pass  # at the end everything held back goes out now
            elif block or final:
                link.wait(lambda: bool(link.box) or (bool(loop.outbox) and loop.outbox[0][0] <= time.monotonic()),
                          "a message, or a held-back message to come due", tick=0.005)
            link.poll()
            now = time.monotonic()
            flush = len(loop.outbox) if final else sum(1 for _ in _prefix(loop.outbox, now))
            take = [list(r) for r in link.box.keys()]
            for i, r in enumerate(link.box.values()):
                if Inbox.is_marker(r):
                    # A snapshot marker ends the decision: what arrived after it was sent
                    # after the syncer's cut and must be taken after this learner's cut.
                    take = take[: i + 1]
                    break
            return {"take": take, "flush": flush}

        d = self.tape.decide("inbox", key, compute)
        self.first_marker = False
        for rel, meta, tensors, timing in loop.outbox[: int(d["flush"])]:
            self.send_syncer(meta, tensors, timing)
        del loop.outbox[: int(d["flush"])]
        self.take(d["take"])
        if self.marker:
            self.cut(self.marker.pop(), key)
        self.serve()

    def cut(self, msg: Message, key: str) -> None:
        """This learner's part of a snapshot: at the end of the inbox decision that took
        the marker, i.e. between two step boundaries; a restore resumes at ``serve()``.
        Every message the syncer sent before its cut was taken in this decision or earlier
        (FIFO); what is still boxed was sent after it and is sent again by a restored
        syncer (the agent rolls the cut back over it). No peer-to-peer message is in
        flight between participants: the agent checks it (channels out of scope)."""
        ctx, core = self.ctx, self.core
        assert core is not None
        meta, tensors = core.export()
        loop = self.loop.state_dict()
        loop.update(actor=ctx.actor, incarnation=ctx.incarnation, phase=key, started_at=self.out.started_at,
                    snapshot=str(msg.meta["snapshot"]))
        self.views.refresh({
            "core": {"meta": meta, "tensors": tensors, "c_tokens": list(core.c_tokens), "c_steps": list(core.c_steps),
                     "loader": core.loader.state_dict(), "last_loss": core.last_loss,
                     **({"comm": {"anchor": core.anchor, "held_v": list(core.held_v), "resid": core.resid}}
                        if self.cfg.comm_bits != 32 else {})},
            "loop": loop})
        self.agent.take_marker(msg, unconsumed=list(self.link.box.values()))

    def serve(self) -> None:
        core, loop = self.core, self.loop
        assert core is not None
        for req in list(loop.pending):
            if max(*core.applied, loop.notified) >= int(req.meta["target"]):
                meta, tensors = core.export()
                self.link.send(req.src, {"kind": "state", "asked_at": int(req.meta.get("asked_at", core.t)), **meta},
                               tensors)
                self.flush_log()
                loop.pending.remove(req)

    def lag_loop(self, t: int, w: int) -> None:
        while not self.loop.stopped and self.lagging():  # bounded staleness: wait for the merges this round needs
            self.boundary(f"t{t}.w{w}", block=True)
            w += 1

    # -- the loop ------------------------------------------------------------------------------
    def die(self, t: int) -> None:
        ctx = self.ctx
        self.out.died_at = t
        self.out.final_t = t
        if ctx.remote is not None:
            # Flush the tape log and wait for the syncer to have it before the
            # SIGKILL (a real crash would lose the tail; the replay needs it).
            self.send_syncer({"kind": "dying"}, [], None, taped=False)
            self.link.first_from(SYNCER, ("ack",))
        if ctx.parts is not None:
            # An injected fault lands after a snapshot part this learner is still
            # writing is durable: otherwise whether the snapshot keeps this learner
            # would depend on disk speed, not on the seeded schedule. (A real crash
            # mid-write leaves the learner out; replay.snapshot's tests cover that.)
            self.agent.flush(60.0)
        ctx.die()

    def run(self) -> LearnerOutcome:
        ctx, cfg, tape, out, loop = self.ctx, self.cfg, self.tape, self.out, self.loop
        if not self.start():
            return out
        core, loop = self.core, self.loop
        assert core is not None
        if self.resume_key is not None:
            self.serve()  # the rest of the inbox decision the cut interrupted
            if self.resume_key.startswith("t"):
                t_s, _, w_s = self.resume_key[1:].partition(".w")
                self.lag_loop(int(t_s), int(w_s) + 1 if w_s else 0)
            else:
                loop.n_end += 1
        # An actor's n-th scheduled death (kill or loss, in schedule order: the order the
        # syncer names them) is its incarnation n's, and fires at that incarnation's first
        # step at or after the fault's step. A replacement adopts its peer's step, which may
        # lie before or after the step its predecessor died at: matching the step alone made
        # a replacement die again at a step it passed a second time (and a death whose step
        # it skipped never happened), so how many deaths a run saw depended on timing.
        deaths = [f for f in ctx.faults if f.kind in ("kill", "loss")]
        my_death = deaths[ctx.incarnation] if ctx.incarnation < len(deaths) else None
        speed = cfg.speed_of(_index(ctx.actor))
        while core.t < cfg.steps and not loop.stopped:
            t = core.t
            beat(f"inner step {t}")  # the watchdog's heartbeat (a no-op unless a watched worker process)
            for f in ctx.faults:
                if f.kind == "jitter" and f.step == t:
                    pass
                elif f is my_death and t >= f.step:
                    pass
                else:
                    continue
                tape.inject(f.kind, ctx.actor, {**f.detail, "step": t, "incarnation": ctx.incarnation})
                if f.kind == "jitter":
                    loop.jitter_until, loop.jitter_delay = t + int(f.detail["steps"]), float(f.detail["delay_s"])
                else:
                    self.die(t)
                    return out
            if ctx.step_delay_s:
                time.sleep(ctx.step_delay_s)
            t0 = time.perf_counter()
            tape.begin_step(t)
            ids, loss = core.train_step()
            tape.batch(ids)
            tape.loss(loss)
            tape.end_step()
            out.losses.append((t, loss))
            dt = time.perf_counter() - t0
            if speed < 1.0 and tape.mode == "record":  # a slower machine: each step takes 1/speed as long
                time.sleep(dt * (1.0 / speed - 1.0))
                dt = time.perf_counter() - t0
            loop.step_ema = dt if loop.step_ema == 0.0 else loop.step_ema + cfg.ema_alpha * (dt - loop.step_ema)
            for p in cfg.fragments_due(t):
                enc, tensors = core.outgoing(p)
                meta = {"kind": "frag", "p": p, "t": t, "tokens": core.c_tokens[p], "steps": core.c_steps[p],
                        "inc": ctx.incarnation, "started": out.started_at, **enc}
                delay = loop.jitter_delay if t < loop.jitter_until else 0.0
                loop.outbox.append((time.monotonic() + delay, meta, tensors, {"step_s": loop.step_ema}))
            self.boundary(f"t{t}")
            self.lag_loop(t, 0)
        while not loop.stopped:
            self.boundary(f"end{loop.n_end}", final=True)
            loop.n_end += 1
        out.final_t = core.t
        out.state = [(n, t.detach().clone()) for n, t in core.named_state()]
        tape.params(out.state)
        self.agent.flush(60.0)  # every part this learner took is durable before it says goodbye
        if ctx.remote is not None:
            self.send_syncer({"kind": "bye"}, [], None, taped=False)
        return out


def run_learner(ctx: LearnerCtx) -> LearnerOutcome:
    return Learner(ctx).run()


def restore_core(core: LearnerCore, part: Mapping[str, Any]) -> Mapping[str, Any]:
    """Load a learner's snapshot part into a fresh core; returns the part's loop state."""
    c = part["core"]
    core.load(c["meta"], list(c["tensors"]))
    core.c_tokens = [int(x) for x in c["c_tokens"]]
    core.c_steps = [int(x) for x in c["c_steps"]]
    core.applied = [int(x) for x in c["meta"]["applied"]]  # a snapshot keeps them (load() may not)
    comm = c.get("comm")
    if comm is not None:
        core.anchor = [None if a is None else list(a) for a in comm["anchor"]]
        core.held_v = [int(x) for x in comm["held_v"]]
        core.resid = [list(r) for r in comm["resid"]]
    core.loader.load_state_dict(c["loader"])
    core._it = None
    core.last_loss = float(c["last_loss"])
    return part["loop"]


def msg_to_json(m: Message) -> dict[str, Any]:
    return {"src": m.src, "dst": m.dst, "seq": m.seq, "meta": dict(m.meta), "tensors": [t.clone() for t in m.tensors]}


def msg_from_json(d: Mapping[str, Any]) -> Message:
    from replay import VectorClock

    return Message(str(d["src"]), str(d["dst"]), int(d["seq"]), VectorClock(), meta=dict(d["meta"]),
                   tensors=tuple(d["tensors"]))


def _prefix(outbox: Sequence[tuple[float, Any, Any, Any]], now: float) -> Any:
    for rel, *_ in outbox:
        if rel > now:
            return
        yield rel


def sigkill_self() -> None:  # pragma: no cover - the process ends here
    os.kill(os.getpid(), signal.SIGKILL)
