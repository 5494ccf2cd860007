"""The syncer: quorum, adaptive grace, token-weighted merge, Nesterov outer SGD.

Syncer step ``s`` merges fragment ``p = s % P`` of round ``r = s // P``. In record
mode it waits until at least K learners have an unmerged contribution for ``p`` from
round ``r`` or later (the quorum; a learner that is ahead has its contributions merged
in round order, and one round of staleness is still merged), then for the stragglers it
expects, up to the adaptive grace window ("Eq. 3")::

    grace = clamp(gamma * (tau * xi_step - xi_quorum - xi_sync), 0, cap)

with EMAs (alpha = ``ema_alpha``) of the learners' inner-step time (``xi_step``), the
time from a fragment's first arrival to its quorum (``xi_quorum``) and the merge time
(``xi_sync``). All of that is wall-clock, so the outcome is one taped decision per
step (``sync``: contributions, members, stragglers, weights, detected deaths,
activations, receivers); quorum and merge events follow it. A death detected while the
step waits for its quorum is acted on at once: that decision is then an *interim* plan
(deaths and the replacements activated, nothing merged; the activated replacement's peer
is sent a ``notice``), and the step takes its next decision (key ``s<N>.<k>``). In
force mode the plans are read from the tape and the syncer waits for exactly the
contributions they name.

The merge (float64, participants in learner order)::

    w_m   = c_tokens * (c_tokens / c_steps)        token weighting, "quantity x quality"
    avg   = sum_m (w_m / sum w) * theta_m
    delta = Theta_p - avg                          outer gradient, anchored at Theta_p
    v     = mu * v + delta
    Theta_p <- Theta_p - lr * (delta + mu * v)     Nesterov
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from replay.channel import Message
from runs.diloco import quant
from runs.diloco.chaos import Schedule
from runs.diloco.config import DiLoCoConfig
from runs.diloco.fragments import pack_fragments
from replay.channel import Inbox
from runs.diloco.merge import average
from runs.diloco.model import build_model, eval_loss
from replay.channel import LocalTape, LogApplier, MsgRef, actor_of
from replay.errors import HangError, SnapshotError
from replay.watchdog import hang_bound
from runs.diloco.snapshots import (STAMP_KEY, PartViews, Restored, message_from_snapshot, snapshot_agent,
                                   snapshot_message, snapshot_name)

__all__ = ["SyncerCore", "SyncerCtx", "SyncerOutcome", "SyncerBook", "Syncer", "run_syncer", "grace_window"]


class SyncerCore:
    """Global fragments Theta_p and their outer momentum."""

    def __init__(self, cfg: DiLoCoConfig, theta0: Mapping[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.model = build_model(cfg)
        self.model.load_state_dict(dict(theta0))
        self.model.eval()
        self.frags = pack_fragments(self.model.named_parameters(), cfg.fragments)
        params = dict(self.model.named_parameters())
        self.theta = [[params[n].detach().clone() for n in f.names] for f in self.frags]
        self.mom = [[torch.zeros_like(t) for t in ts] for ts in self.theta]
        self.shrink: list[float] = []  # per merge: |merged outer gradient| / mean |learner's|

    def merge(self, p: int, contribs: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
        total = math.fsum(weights)
        if not contribs or total <= 0.0:
            return [t.clone() for t in self.theta[p]]
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        rda = None
        if self.cfg.merge == "rda":
            # the learners' outer gradients (theta - learner), averaged radially-directionally
            rda = average("rda", [[cur.to(torch.float64) - c[j].to(torch.float64)
                                   for j, cur in enumerate(self.theta[p])] for c in contribs], weights)
        new = []
        # how much shorter the merged outer gradient is than the learners' own (their mean
        # norm): disagreeing directions shrink a plain mean, and with it the outer step
        grads = [[cur.to(torch.float64) - c[j].to(torch.float64) for j, cur in enumerate(self.theta[p])]
                 for c in contribs]
        own = math.fsum((w / total) * math.sqrt(math.fsum(float((g * g).sum()) for g in gs))
                        for w, gs in zip(weights, grads))
        deltas = []
        for j, cur in enumerate(self.theta[p]):
            if rda is not None:
                delta = rda[j]
            else:
                acc = torch.zeros(cur.shape, dtype=torch.float64)
                for w, c in zip(weights, contribs):
                    acc += (w / total) * c[j].to(torch.float64)
                delta = cur.to(torch.float64) - acc
            deltas.append(delta)
            v = mu * self.mom[p][j].to(torch.float64) + delta
            self.mom[p][j] = v.to(torch.float32)
            upd = cur.to(torch.float64) - lr * (delta + mu * v)
            self.theta[p][j] = upd.to(torch.float32)
            new.append(self.theta[p][j].clone())
        merged = math.sqrt(math.fsum(float((d * d).sum()) for d in deltas))
        if own > 0:
            self.shrink.append(merged / own)
        return new

    def val_loss(self, corpus: torch.Tensor) -> float:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for f, ts in zip(self.frags, self.theta):
                for n, t in zip(f.names, ts):
                    params[n].copy_(t)
        return eval_loss(self.model, corpus)

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for f, ts, ms in zip(self.frags, self.theta, self.mom):
            out += [(f"theta.{n}", t) for n, t in zip(f.names, ts)]
            out += [(f"momentum.{n}", m) for n, m in zip(f.names, ms)]
        return out


class SyncerComm:
    """The syncer's side of compressed communication (``cfg.comm_bits`` < 32, quant.py).

    Learners send outer gradients against the fragment they hold; the syncer mirrors, per
    endpoint and fragment, exactly what that learner holds (the versions of the last few
    syncer steps: a contribution names the one it is anchored at) and sends back the
    encoded difference between the global fragment and that mirror, which also corrects
    the previous send's error. An endpoint it mirrors nothing for (new, or a replacement)
    is sent the fragment whole. The global fragments stay full precision."""

    KEEP = 8  # mirrored versions per endpoint and fragment (bounded staleness needs far fewer)

    def __init__(self, cfg: DiLoCoConfig, core: "SyncerCore", first: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.core = core
        self.hist: dict[str, list[dict[int, list[torch.Tensor]]]] = {}  # endpoint -> per fragment: step -> tensors
        self.held: dict[str, list[int | None]] = {}  # endpoint -> per fragment: the step it holds
        if cfg.comm_bits != 32:  # the first incarnations start from Theta_0: "step -1"
            for e in first:
                self.hist[e] = [{-1: [t.clone() for t in ts]} for ts in core.theta]
                self.held[e] = [-1] * cfg.fragments

    def contribution(self, p: int, m: Message) -> list[torch.Tensor]:
        ts = list(m.tensors[: _nsem(m)])
        enc = m.meta.get("enc")
        if self.cfg.comm_bits == 32 or enc is None or enc == "raw":
            return ts
        base = self.hist.get(m.src, [{}] * self.cfg.fragments)[p].get(int(m.meta["anchor"]))
        if base is None:
            raise RuntimeError(f"{m.src}: a contribution anchored at syncer step {m.meta['anchor']} of fragment {p}, "
                               "which the syncer no longer mirrors")
        return [b - quant.decode(quant.Encoded(int(enc), tuple(b.shape), q, sc), self.cfg.comm_block)
                for b, q, sc in zip(base, ts[0::2], ts[1::2])]

    def outgoing(self, e: str, p: int, s: int, theta_p: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        cfg = self.cfg
        if cfg.comm_bits == 32:
            return {}, list(theta_p)
        hist = self.hist.setdefault(e, [{} for _ in range(cfg.fragments)])
        held = self.held.setdefault(e, [None] * cfg.fragments)
        prev = held[p]
        if prev is None:
            new, enc, out = [t.clone() for t in theta_p], {"enc": "full"}, [t.clone() for t in theta_p]
        else:
            base = hist[p][prev]
            es = [quant.encode(t - b, cfg.comm_bits, cfg.comm_block) for t, b in zip(theta_p, base)]
            new = [b + quant.decode(x, cfg.comm_block) for b, x in zip(base, es)]
            enc, out = {"enc": "delta", "bits": cfg.comm_bits, "base": prev}, [t for x in es for t in x.tensors()]
        hist[p][s] = new
        held[p] = s
        for old in sorted(hist[p])[: -self.KEEP]:
            del hist[p][old]
        return enc, out

    def forget(self, e: str) -> None:
        """``e`` is gone (dead, or restarting afresh): it holds nothing any more. Its
        mirrored versions stay: contributions it sent before may still be merged."""
        self.held.pop(e, None)

    def state_dict(self) -> dict[str, Any]:
        return {"hist": {e: [sorted(h.items()) for h in hs] for e, hs in sorted(self.hist.items())},
                "held": {e: list(v) for e, v in sorted(self.held.items())}}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.hist = {str(e): [{int(k): list(v) for k, v in h} for h in hs] for e, hs in d["hist"].items()}
        self.held = {str(e): [None if x is None else int(x) for x in v] for e, v in d["held"].items()}


def grace_window(cfg: DiLoCoConfig, xi_step: float, xi_quorum: float, xi_sync: float) -> float:
    g = cfg.grace_gamma * (cfg.overlap_tau * xi_step - xi_quorum - xi_sync)
    return min(max(g, 0.0), cfg.grace_cap_s)


class _Ema:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)

    def get(self) -> float:
        return self.value or 0.0


@dataclass
class SyncerCtx:
    cfg: DiLoCoConfig
    link: Inbox
    theta0: Mapping[str, torch.Tensor]
    schedule: Schedule
    spares: Mapping[str, Sequence[str]]  # actor -> replacement endpoints, in order
    val: torch.Tensor
    applier: LogApplier | None = None  # learners in other processes ship their tape logs
    on_step: Callable[[int, dict[str, Any]], None] | None = None
    # called at the end of every syncer step with the core (snapshots, tests)
    after_step: Callable[[int, "SyncerCore"], None] | None = None
    # endpoints known dead by the orchestrator (a process's exit code), besides what the
    # transport reports; record mode only
    dead_probe: Callable[[], Sequence[str]] | None = None
    # snapshots (record mode): the store, control plane and retention (``snapshots.Snapshots``);
    # None in a replay, which runs the protocol and tapes its events but writes nothing
    snapshots: Any = None
    # waits until a dead endpoint's thread has ended (so the tape holds all it received)
    endpoint_gone: Callable[[str], None] | None = None
    # restore: the snapshot to start from (at the syncer's cut)
    restore: Restored | None = None


@dataclass
class SyncerOutcome:
    steps: int = 0
    val: list[tuple[int, float]] = field(default_factory=list)
    merged: list[dict[str, Any]] = field(default_factory=list)  # one per merged contribution
    plans: list[dict[str, Any]] = field(default_factory=list)
    step_wall: list[float] = field(default_factory=list)  # monotonic time each step ended
    state: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    deaths: list[tuple[int, str]] = field(default_factory=list)
    activations: list[tuple[int, str]] = field(default_factory=list)
    # for the goodput accounting (report.py), record mode: when each endpoint's death was
    # first known (monotonic s), and each replacement's recovery as it reported it
    dead_wall: dict[str, float] = field(default_factory=dict)
    joins: list[dict[str, Any]] = field(default_factory=list)
    # payload bytes of the fragments: learners -> syncer (merged contributions) and back
    bytes_up: int = 0
    bytes_down: int = 0
    # per merge: the merged outer gradient's norm over the learners' mean norm (and members)
    shrink: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SyncerBook:
    """Who the syncer is talking to and what it has seen: everything besides the global
    fragments that a restored syncer needs (its snapshot part's ``book``)."""

    active: dict[str, str]  # actor -> its current endpoint
    recovering: set[str] = field(default_factory=set)  # activated, not yet contributing
    dead_since: dict[str, int] = field(default_factory=dict)  # actor -> syncer step its death was processed
    deaths_seen: dict[str, int] = field(default_factory=dict)
    spare_used: dict[str, int] = field(default_factory=dict)
    byes: set[str] = field(default_factory=set)  # endpoints that said goodbye (processes)
    joined: dict[str, int] = field(default_factory=dict)  # actor -> inner step its incarnation started at
    exhausted: list[set[str]] = field(default_factory=list)  # per fragment: sent their last contribution
    gone: list[str] = field(default_factory=list)  # endpoints whose death was processed
    lost: list[list[Any]] = field(default_factory=list)  # taped messages to gone endpoints never received
    ema: list[float | None] = field(default_factory=lambda: [None, None, None])  # xi_step, xi_quorum, xi_sync

    @classmethod
    def fresh(cls, names: Sequence[str], fragments: int) -> "SyncerBook":
        return cls(active={a: a for a in names}, spare_used={a: 0 for a in names},
                   exhausted=[set() for _ in range(fragments)])

    def state_dict(self) -> dict[str, Any]:
        return {"active": dict(self.active), "recovering": sorted(self.recovering),
                "dead_since": sorted(self.dead_since.items()), "deaths_seen": sorted(self.deaths_seen.items()),
                "spare_used": sorted(self.spare_used.items()), "byes": sorted(self.byes),
                "joined": sorted(self.joined.items()), "exhausted": [sorted(x) for x in self.exhausted],
                "gone": list(self.gone), "lost": [list(x) for x in self.lost], "ema": list(self.ema)}

    @classmethod
    def from_state(cls, b: Mapping[str, Any]) -> "SyncerBook":
        return cls(active=dict(b["active"]), recovering=set(b["recovering"]),
                   dead_since={str(k): int(v) for k, v in b["dead_since"]},
                   deaths_seen={str(k): int(v) for k, v in b["deaths_seen"]},
                   spare_used={str(k): int(v) for k, v in b["spare_used"]}, byes=set(b["byes"]),
                   joined={str(k): int(v) for k, v in b["joined"]}, exhausted=[set(x) for x in b["exhausted"]],
                   gone=list(b["gone"]), lost=[list(x) for x in b["lost"]], ema=list(b["ema"]))


class Syncer:
    """The syncer actor: one taped plan, quorum and merge per syncer step (module docstring)."""

    def __init__(self, ctx: SyncerCtx) -> None:
        self.ctx = ctx
        self.cfg = cfg = ctx.cfg
        self.link = ctx.link
        tape = ctx.link.tape
        assert isinstance(tape, LocalTape)
        self.tape = tape
        self.force = tape.mode == "force"
        self.core = SyncerCore(cfg, ctx.theta0)
        self.comm = SyncerComm(cfg, self.core, first=[f"learner-{i}" for i in range(cfg.learners)])
        self.out = SyncerOutcome()
        self.names = [f"learner-{i}" for i in range(cfg.learners)]
        self.book = SyncerBook.fresh(self.names, cfg.fragments)
        self.xi_step, self.xi_quorum, self.xi_sync = (_Ema(cfg.ema_alpha) for _ in range(3))
        self.detected: list[str] = []  # endpoints reported dead, not yet in a plan (record mode)
        self.first_arrival: dict[int, float] = {}
        self.snap: dict[str, Any] = {}  # the open snapshot (at most one): name, participants, refs
        self.s0 = 0
        self._rejoin: list[str] = []  # restore: learners left out alive, activated again at the start
        self._cut_step = 0  # the syncer step of the snapshot being cut (its part's step)
        self._lost_later: dict[str, list[list[Any]]] = {}  # restore: an endpoint dead at the cut -> its lost
        self.link.on_dead = self.on_dead
        self.link.on_arrival = self.on_arrival
        # a learner process's tape log is applied on delivery, before the snapshot agent
        # records the message (a recorded message then knows its send's tape stamp)
        self.link.ep.on_deliver(self._apply_log)
        endpoints = [*self.names, *(e for a in self.names for e in ctx.spares.get(a, ()))]
        self.views = PartViews("syncer")
        self.agent = snapshot_agent(self.link, self.views, participants=["syncer", *endpoints],
                                    snapshots=ctx.snapshots, coordinator=True, hub=tape.hub, excludable=endpoints,
                                    step=lambda: self._cut_step)
        if ctx.restore is not None:
            self._restore(ctx.restore)

    @property
    def _emas(self) -> tuple[_Ema, _Ema, _Ema]:
        return (self.xi_step, self.xi_quorum, self.xi_sync)

    def book_state(self) -> dict[str, Any]:
        self.book.ema = [e.value for e in self._emas]
        return self.book.state_dict()

    # -- arrivals ----------------------------------------------------------------------
    def on_dead(self, endpoint: str) -> None:
        if not self.force and endpoint not in self.detected:
            self.detected.append(endpoint)
            self.out.dead_wall.setdefault(endpoint, time.monotonic())

    def _apply_log(self, msg: Message) -> None:
        if "log" in msg.meta and self.ctx.applier is not None:
            nlog = int(msg.meta.get("nlog", 0))
            self.ctx.applier.add(actor_of(msg.src), list(msg.meta["log"]),
                                 list(msg.tensors[len(msg.tensors) - nlog:]) if nlog else [])

    def on_arrival(self, msg: Message) -> bool:
        b = self.book
        kind = msg.meta.get("kind")
        if STAMP_KEY in msg.meta:  # re-delivered from a restored channel state (its stamp is registered)
            del msg.meta[STAMP_KEY]  # type: ignore[attr-defined]
        if kind == "dying":  # a learner process about to be killed: it waits for this ack
            self.out.dead_wall.setdefault(msg.src, time.monotonic())
            self.link.send(msg.src, {"kind": "ack"}, taped=False)
            return True
        if kind == "log":
            return True
        if kind == "joined":
            if b.active.get(actor_of(msg.src)) == msg.src:
                b.joined[actor_of(msg.src)] = int(msg.meta["started"])
            self.out.joins.append({"endpoint": msg.src, "started": int(msg.meta["started"]),
                                   "asked_at": int(msg.meta.get("asked_at", msg.meta["started"])),
                                   "wait_state_s": float(msg.meta.get("wait_state_s", 0.0)),
                                   "load_s": float(msg.meta.get("load_s", 0.0)), "wall": time.monotonic()})
            return True
        if kind == "bye":
            b.byes.add(msg.src)
            return True
        if kind == "frag":
            timing = msg.meta.get("timing") or {}
            if "step_s" in timing:
                self.xi_step.add(float(timing["step_s"]))
            self.first_arrival.setdefault(int(msg.meta["p"]), time.monotonic())
            if actor_of(msg.src) in b.recovering and b.active.get(actor_of(msg.src)) == msg.src:
                b.recovering.discard(actor_of(msg.src))
        return False

    def candidates(self, p: int, rnd: int) -> tuple[dict[str, MsgRef], set[str]]:
        """Eligible contributions (latest per learner, at most one round stale) and the
        learners whose contribution is of this round or later (they count for the quorum)."""
        stale: dict[str, MsgRef] = {}
        fresh: dict[str, MsgRef] = {}
        for ref, m in self.link.box.items():  # arrival order = send order per learner
            if m.meta.get("kind") == "frag" and int(m.meta["p"]) == p:
                r = int(m.meta["t"]) // self.cfg.inner_h
                if r < rnd - 1 or not all(bool(torch.isfinite(t).all()) for t in m.tensors[: _nsem(m)]):
                    continue
                a = actor_of(m.src)
                if r >= rnd:
                    fresh.setdefault(a, ref)  # the round due now; a learner ahead keeps the rest for later
                else:
                    stale[a] = ref  # one round late: still merged if nothing fresher came
        return {**stale, **fresh}, set(fresh)

    # -- the plan (one taped decision per step, after interim ones) ------------------------------------------
    def plan_now(self, s: int, p: int) -> dict[str, Any]:
        cfg, ctx, b = self.cfg, self.ctx, self.book
        t0 = time.monotonic()
        quorum_at: float | None = None
        quorum_set: set[str] = set()
        grace = 0.0
        final = s // cfg.fragments == cfg.rounds - 1
        while True:
            self.link.poll(wait_s=0.002)
            if ctx.dead_probe is not None:
                for e in ctx.dead_probe():
                    self.on_dead(e)
            if self.detected:
                # A death is acted on when it is detected, not when this step's quorum is
                # complete (up to H/P inner steps later, while the dead learner's slot runs
                # no step): when a replacement can be activated now, this decision ends
                # here as an interim plan (deaths and activations only); the step then
                # takes its next decision (step()).
                dead, activate, seen = self._deaths(s, final)
                if activate:
                    for e in seen:
                        self.detected.remove(e)
                    return {"p": p, "interim": True, "dead": dead, "activate": activate}
            cand, fresh = self.candidates(p, s // cfg.fragments)
            now = time.monotonic()
            dead_now = {actor_of(e) for e in self.detected if b.active.get(actor_of(e)) == e}
            # Near the end a learner may have sent its last contribution for p already
            # (a recovered learner skips the rounds its peer had done): it cannot count.
            # Nor can a replacement that adopted its peer's step after this round's send
            # of p: it never sends it, and its next one (a later round) waits for this
            # very merge (bounded staleness), so counting it deadlocked the step whenever
            # the others alive were fewer than the quorum (its peer served it late).
            sends_at = cfg.send_step(p, s // cfg.fragments)
            able = [a for a in b.active if a not in b.recovering and a not in dead_now and a not in b.exhausted[p]
                    and (b.joined.get(a, 0) <= sends_at or a in fresh)]
            need = max(1, min(cfg.quorum, len(able)))
            if final:
                # The last round is a barrier, not a race: it waits for every live learner,
                # recovering ones included, with no grace limit. Without it a learner that
                # is still catching up (a replacement, a straggler) is told to stop after
                # however many steps the wall clock allowed it, so how far it got would
                # depend on machine load. With it, every live learner ends at cfg.steps.
                last_send = cfg.last_send(p)
                unknown = [a for a in b.active if a in b.recovering and a not in b.joined and a not in dead_now]
                waiting = [a for a in b.active if a not in dead_now and a not in b.exhausted[p]
                           and b.joined.get(a, 0) <= last_send]
                if not unknown and len(fresh) >= need and all(a in fresh for a in waiting):
                    quorum_at, quorum_set = quorum_at or now, quorum_set or set(cand)
                    break
            elif quorum_at is None and len(fresh) >= need:
                quorum_at, quorum_set = now, set(cand)
                self.xi_quorum.add(now - self.first_arrival.get(p, t0))
                grace = grace_window(cfg, self.xi_step.get(), self.xi_quorum.get(), self.xi_sync.get())
            if quorum_at is not None and not final:
                if all(a in fresh for a in able) or now >= quorum_at + grace:
                    break
            # a hang bound, not a speed verdict: a relaunch on a loaded machine may take
            # minutes to send its first update (10x the I/O timeout, times CKPT_TIMEOUT_SCALE)
            if now - t0 > hang_bound(cfg.io_timeout_s):
                raise HangError(f"syncer step {s}: no quorum of {cfg.quorum} for fragment {p} within "
                                f"{hang_bound(cfg.io_timeout_s):.0f} s (have {sorted(cand)})")
        members = sorted(cand, key=_order)
        weights = []
        for a in members:
            m = self.link.box[cand[a]]
            tok, st = float(m.meta["tokens"]), float(m.meta["steps"])
            weights.append(tok * (tok / st) if st > 0 else 0.0)
        dead, activate, seen = self._deaths(s, final)
        for e in seen:
            self.detected.remove(e)
        will_be_dead = {*b.dead_since, *dead}
        send_to = sorted([e for a, e in b.active.items() if a not in will_be_dead] + [x[1] for x in activate])
        return {"p": p, "minimum": need, "contribs": [list(cand[a]) for a in members], "members": members,
                "stragglers": sorted(set(members) - quorum_set, key=_order), "weights": weights,
                "dead": dead, "activate": activate, "send_to": send_to, "grace_s": grace,
                "quorum_wait_s": (quorum_at or t0) - t0}

    def _deaths(self, s: int, final: bool) -> tuple[list[str], list[list[str]], list[str]]:
        """The deaths detected so far (actors), the replacements due now ([actor, spare,
        peer endpoint]) and the detected endpoints this accounts for (consumed by the plan
        that takes it)."""
        ctx, b = self.ctx, self.book
        seen = list(self.detected)
        dead = sorted({actor_of(e) for e in seen if b.active.get(actor_of(e)) == e}, key=_order)
        activate = []
        will_be_dead = dict(b.dead_since)
        for a in dead:
            will_be_dead[a] = s
        for a, since in sorted(will_be_dead.items(), key=lambda x: _order(x[0])):
            # In the last round a death is replaced at once: the round is a barrier that
            # waits for every live learner, so a learner that dies (deaths fire before its
            # last round's sends) is detected inside it, and "rejoin_after steps later"
            # would fall after the end, leaving it unrecovered depending on when the
            # syncer got there.
            due = s >= since + ctx.schedule.rejoin_after or final
            if due and b.spare_used[a] < len(ctx.spares.get(a, ())):
                healthy = [x for x in sorted(b.active, key=_order) if x not in b.recovering and x not in will_be_dead]
                if not healthy:
                    continue
                peer = self._peer(healthy)
                activate.append([a, ctx.spares[a][b.spare_used[a]], b.active[peer]])
        return dead, activate, seen

    # -- snapshots -------------------------------------------------------------------------
    def _dead(self) -> set[str]:
        return set(self.detected) | set(self.book.gone)

    def snapshot_begin(self, s: int) -> None:
        """The syncer's cut, at the start of syncer step ``s`` (a round boundary), and its
        markers to every participant. Learners that are dead or still recovering (not yet
        joined) are excluded by policy (Decoupled DiLoCo): their state is not in it."""
        ctx, b, tape, link = self.ctx, self.book, self.tape, self.link

        def compute() -> dict[str, Any]:
            dead_eps = set(self.detected)
            # a replacement that announced where it starts has its state and is in its loop:
            # its recovery messages are done, so it can take part
            parts = sorted((e for a, e in b.active.items() if (a not in b.recovering or a in b.joined)
                            and e not in dead_eps), key=lambda e: _order(actor_of(e)))
            inside = {actor_of(e) for e in parts}
            excluded = [[a, "recovering" if a in b.recovering else "dead"] for a in self.names if a not in inside]
            return {"name": snapshot_name(s), "participants": parts, "excluded": excluded}

        d = tape.decide("snapshot", f"begin:s{s}", compute)
        name = str(d["name"])
        parts = [str(e) for e in d["participants"]]
        link.poll()  # everything a dead endpoint sent is in the box (it ended before its death was processed)
        box = [snapshot_message(m, tape.hub) for m in link.box.values()]
        # what was boxed at the cut from a participant or a dead endpoint (the box of a
        # live non-participant depends on timing, and it is outside the cut anyway)
        box_refs = [[m["src"], m["stamp"]] for m in box if m["stamp"] is not None
                    and (m["src"] in parts or m["src"] in b.gone)]
        info = {"name": name, "participants": parts, "excluded": [list(x) for x in d["excluded"]],
                "box_refs": box_refs, "lost": [list(x) for x in b.lost]}
        self.views.refresh({"s": s, "theta": self.core.theta, "mom": self.core.mom, "book": self.book_state(),
                            "box": box, "schedule": ctx.schedule.to_json(), "snapshot": info,
                            **({"comm": self.comm.state_dict()} if self.cfg.comm_bits != 32 else {})})
        self._cut_step = s
        self.agent.initiate(name, participants=["syncer", *parts], exclude={str(a): str(w) for a, w in d["excluded"]})
        self.snap.clear()
        self.snap.update({**info, "s": s})

    def snapshot_close(self, s: int, final: bool) -> None:
        """One taped decision per syncer step while a snapshot is open: closed or not yet.
        Closing writes the syncer's part (its state at the cut and the recorded channel
        states) and commits the checkpoint once every participant's part is durable."""
        ctx, snap, tape, link, agent = self.ctx, self.snap, self.tape, self.link, self.agent
        name = snap["name"]

        def ready() -> bool:
            return ctx.snapshots is None or agent.ready(name, dead=self._dead())

        def compute() -> dict[str, Any]:
            if final or self.cfg.snapshot_wait:
                link.wait(ready, f"snapshot {name}: every participant's marker and part")
            else:
                link.poll()
            if not ready():
                return {"close": False}
            policy = {str(a): str(w) for a, w in snap["excluded"]}

            def exact(excluded: list[str]) -> bool:
                # restorable: every snapshot (continue_run); exact: also under this run's own
                # tape (restore_run), i.e. it left out no learner alive (spec §9a)
                return all(policy.get(a) == "dead" for a in excluded)

            def meta(parts: list[str], excluded: list[str]) -> dict[str, Any]:
                s_, ok = int(snap["s"]), exact(excluded)
                return {"syncer_step": s_, "restorable": True, "exact": ok,
                        "metrics": {"restorable_step": s_, "exact_step": s_ if ok else -1}}

            out = agent.commit(name, dead=self._dead(), meta=meta, step=int(snap["s"]))
            out["exact"] = bool(out["committed"]) and exact(list(out["excluded"]))
            assert ctx.snapshots is not None
            ctx.snapshots.committed(out)
            return {"close": True, **out}

        d = tape.decide("snapshot", f"close:{name}:{'end' if final else f's{s}'}", compute)
        if not d["close"]:
            return
        inside = set(d["parts"])
        need = [e for e in snap["participants"] if actor_of(e) in inside]
        link.wait(lambda: agent.markers_in(name, need), f"snapshot {name}: markers")
        # a participant that died before its marker is out of the cut: what was boxed from
        # it at the cut depends on timing, and is not listed; messages to dead incarnations
        # that they never received stay in flight for ever (their actor lives on)
        refs = {(str(r["channel"]), int(r["chan_seq"])) for src, r in snap["box_refs"]
                if src in need or src not in snap["participants"]}
        refs |= {(str(c), int(q)) for c, q in snap["lost"]}
        agent.finish(name, d, inflight=sorted(refs))
        snap.clear()

    def _restore(self, r: Restored) -> None:
        """Start at the cut of snapshot ``r``: its part loaded through the agent, the
        endpoint at its cut with the recorded channel states queued first, the snapshot
        open again (committed already: the syncer closes it again as it did)."""
        self.agent.restore(r.name, source=r.store, announce=False, resume=True, partial=True,
                           into=self.views.loaders())
        tree = self.views.joined()
        self.core.theta = [list(ts) for ts in tree["theta"]]
        self.core.mom = [list(ms) for ms in tree["mom"]]
        self.book = SyncerBook.from_state(tree["book"])
        for e, v in zip(self._emas, self.book.ema):
            e.value = v
        self.s0 = int(tree["s"])
        if "comm" in tree:
            self.comm.load_state_dict(tree["comm"])
        info = tree["snapshot"]
        self.snap.update({"name": info["name"], "s": self.s0, "participants": list(info["participants"]),
                          "excluded": [list(x) for x in info["excluded"]], "box_refs": list(info["box_refs"]),
                          "lost": [list(x) for x in info["lost"]]})
        # Left-out learners (spec §9a): one that was alive starts afresh and is activated
        # again; what it held or was sent is gone with it (in flight for ever on the tape),
        # so its inbox messages are dropped and the taped ones join the lost list.
        self._rejoin = list(r.rejoin)
        gone_now = {r.endpoint(a) for a in self._rejoin}
        for a in self._rejoin:
            self._add_lost([*r.lost_to.get(a, []), *r.lost_from.get(a, [])])
            self.comm.forget(str(r.endpoint(a)))
        for a, why in r.policy.items():
            e = r.endpoint(a)
            if why == "dead" and e is not None:  # its death is processed after the cut
                self._lost_later[e] = list(r.lost_to.get(a, []))
        for m in tree["box"]:
            msg = message_from_snapshot(m)
            if msg.src not in gone_now:
                self.link.box[(msg.src, msg.dst, msg.seq)] = msg

    def _peer(self, healthy: Sequence[str]) -> str:
        """The healthy learner a replacement recovers from: among those that will not die
        again (a peer that dies before serving the state would leave the replacement
        waiting), the one furthest behind (its latest contribution's step, in the inbox or
        merged). A replacement adopts its peer's step, so the steps between the death and
        that step are never run: the nearest peer loses the fewest. Ties: learner order."""
        latest: dict[str, int] = {}
        for m in self.link.box.values():
            if m.meta.get("kind") == "frag":
                latest[actor_of(m.src)] = max(latest.get(actor_of(m.src), -1), int(m.meta["t"]))
        for m in self.out.merged:
            latest[m["actor"]] = max(latest.get(m["actor"], -1), int(m["t"]))
        sched = self.ctx.schedule
        safe = [x for x in healthy if self.book.deaths_seen.get(x, 0) >= sched.deaths(x)]
        return min(safe or healthy, key=lambda x: (latest.get(x, -1), _order(x)))

    def _add_lost(self, refs: Sequence[Sequence[Any]]) -> None:
        have = {(str(c), int(q)) for c, q in self.book.lost}
        for c, q in refs:
            if (str(c), int(q)) not in have:
                have.add((str(c), int(q)))
                self.book.lost.append([str(c), int(q)])

    def _reactivate(self) -> None:
        """Restore: every learner the snapshot left out alive recovers from a healthy peer."""
        b = self.book
        for a in self._rejoin:
            healthy = [x for x in sorted(b.active, key=_order) if x not in b.recovering and x not in self._rejoin]
            if not healthy:
                raise SnapshotError(f"{a} cannot rejoin: no learner of the snapshot is healthy", snapshot=self.snap["name"])
            peer = self._peer(healthy)
            self.link.send(b.active[a], {"kind": "activate", "target": self.s0, "peer": b.active[peer],
                                         "fault": "snapshot-excluded"})
            b.recovering.add(a)
            b.joined.pop(a, None)
            self.out.activations.append((self.s0, a))

    # -- one syncer step ---------------------------------------------------------------------
    def process_deaths(self, s: int, plan: Mapping[str, Any]) -> None:
        ctx, b, tape = self.ctx, self.book, self.tape
        for a in plan["dead"]:
            e_dead = b.active.get(a)
            if e_dead is not None:
                if ctx.endpoint_gone is not None:
                    ctx.endpoint_gone(e_dead)
                if ctx.applier is not None:
                    ctx.applier.pump()
                b.gone.append(e_dead)
                lost = []
                for r in tape.hub.unreceived_to(e_dead):
                    st = tape.hub.stamp(r, wait=False)
                    assert st is not None
                    lost.append([st.channel, st.chan_seq])
                self._add_lost([*lost, *self._lost_later.pop(e_dead, [])])
            b.deaths_seen[a] = b.deaths_seen.get(a, 0) + 1
            kind = _death_kind(ctx.schedule, a, b.deaths_seen[a])
            tape.detected(kind, a, {"syncer_step": s, "endpoint": b.active.get(a)})
            if e_dead is not None:
                self.comm.forget(e_dead)
            b.active.pop(a, None)
            b.recovering.discard(a)
            b.dead_since[a] = s
            self.out.deaths.append((s, a))
        for a, spare, peer in plan["activate"]:
            kind = _death_kind(ctx.schedule, a, b.deaths_seen.get(a, 1))
            self.link.send(spare, {"kind": "activate", "target": s, "peer": peer, "fault": kind})
            if plan.get("interim"):
                # The peer serves the replacement once it has observed the activation (a
                # message the syncer sent after it): in a full plan the merged fragment of
                # this step, sent next; an interim plan merges nothing yet, so the peer is
                # told now and serves at its next step boundary.
                self.link.send(peer, {"kind": "notice", "target": s})
            b.spare_used[a] += 1
            b.active[a] = spare
            b.joined.pop(a, None)
            b.recovering.add(a)
            b.dead_since.pop(a, None)
            self.out.activations.append((s, a))

    def merge_step(self, s: int, key: str, plan: Mapping[str, Any]) -> None:
        cfg, tape, link = self.cfg, self.tape, self.link
        p = int(plan["p"])
        # the effective minimum: K, or fewer at the very end (see plan_now)
        tape.quorum(key, int(plan["minimum"]), plan["members"])
        refs = [(str(r[0]), str(r[1]), int(r[2])) for r in plan["contribs"]]
        msgs = []
        for ref in refs:
            msgs.append(link.wait_ref(ref))
            tape.recv(ref)
            self.out.bytes_up += sum(t.numel() * t.element_size() for t in msgs[-1].tensors[: _nsem(msgs[-1])])
        _, weights = tape.merge(key, refs, plan["weights"])
        theta_p = self.core.merge(p, [self.comm.contribution(p, m) for m in msgs], [float(w) for w in weights])
        if self.core.shrink:
            self.out.shrink.append((len(msgs), self.core.shrink[-1]))
        for ref, m in zip(refs, msgs):
            if int(m.meta["t"]) // cfg.inner_h == cfg.rounds - 1:
                self.book.exhausted[p].add(actor_of(m.src))
            self.out.merged.append({"s": s, "actor": actor_of(m.src), "inc": int(m.meta["inc"]),
                                    "t": int(m.meta["t"]), "started": int(m.meta["started"]),
                                    "steps": int(m.meta["steps"])})
            # this contribution and every older one of that learner for p are spent: the
            # older ones are taped as received (and dropped), so no taped message stays
            # "in flight" for ever (a snapshot would have to list it)
            for r2 in sorted(r for r, x in link.box.items() if r[0] == ref[0] and r[2] <= ref[2]
                             and x.meta.get("kind") == "frag" and int(x.meta["p"]) == p):
                if r2 != ref:
                    tape.recv(r2)
                link.pop(r2)
        for e in plan["send_to"]:
            enc, tensors = self.comm.outgoing(e, p, s, theta_p)
            link.send(e, {"kind": "merged", "s": s, "p": p, **enc}, tensors)
            self.out.bytes_down += sum(t.numel() * t.element_size() for t in tensors)

    def step(self, s: int) -> None:
        cfg, ctx, tape = self.cfg, self.ctx, self.tape
        p = s % cfg.fragments
        key = f"s{s}"
        # a snapshot first tries to close at the step after the one it began at (a
        # restored one: it began at the step the run continues from)
        if self.snap and int(self.snap["s"]) < s:
            self.snapshot_close(s, final=False)
        # every snapshot_every syncer steps from step 1 (the earliest round boundary after a
        # merge; one open snapshot at a time, so a step that finds one open takes none)
        if cfg.snapshot_every and s % cfg.snapshot_every == 1 % cfg.snapshot_every and s > 0 and not self.snap:
            self.snapshot_begin(s)
        tape.begin_step(s)
        plan = tape.decide("sync", key, lambda: self.plan_now(s, p))
        n = 0
        while plan.get("interim"):  # deaths acted on while the step waited (plan_now)
            self.process_deaths(s, plan)
            n += 1
            plan = tape.decide("sync", f"{key}.{n}", lambda: self.plan_now(s, p))
        self.first_arrival.pop(p, None)
        t_merge = time.monotonic()
        self.process_deaths(s, plan)
        self.merge_step(s, key, plan)
        self.xi_sync.add(time.monotonic() - t_merge)
        if s % max(cfg.eval_every, 1) == 0 or s == cfg.syncer_steps - 1:
            v = self.core.val_loss(ctx.val)
            tape.metric("val_loss", v)
            self.out.val.append((s, v))
        tape.end_step()
        self.out.steps = s + 1
        self.out.plans.append({**plan, "s": s})
        self.out.step_wall.append(time.monotonic())
        if ctx.after_step is not None:
            ctx.after_step(s, self.core)
        if ctx.on_step is not None:
            ctx.on_step(s, plan)

    def start(self) -> None:
        if self.ctx.restore is not None:
            self._reactivate()  # otherwise at the restored cut (__init__)
            return
        for a in self.names:
            self.link.send(a, {"kind": "start"}, taped=False)
        if self.cfg.snapshot_every:
            # The first snapshot is taken before anything happens, and every learner
            # waits for its marker in its first inbox decision (learner.py), before its
            # first possible death (faults fire at inner step >= 1). So one snapshot
            # with every learner in it exists whatever the machine load; later ones may
            # exclude a learner that is dead or still recovering.
            self.snapshot_begin(0)

    def finish(self) -> None:
        ctx, b, link = self.ctx, self.book, self.link
        if self.snap:
            self.snapshot_close(self.cfg.syncer_steps, final=True)

        # Every replacement activated so far recovers before anybody is told to stop: its
        # peer serves the state request only while it runs, and "stop" (syncer -> peer) and
        # the request (replacement -> peer) travel on different channels, so without this a
        # peer could stop first and leave the replacement waiting (the end-of-run hang).
        def recovered_or_dead() -> bool:
            if ctx.dead_probe is not None:
                for e in ctx.dead_probe():
                    self.on_dead(e)
            return all(a in b.joined or e in self.detected for a, e in b.active.items() if a in b.recovering)

        link.wait(recovered_or_dead, "every replacement's recovery before the stop", tick=0.005)
        for a, e in sorted(b.active.items(), key=lambda x: _order(x[0])):
            link.send(e, {"kind": "stop"})
        for a, eps in ctx.spares.items():
            for e in eps[b.spare_used[a]:]:
                link.send(e, {"kind": "stop"}, taped=False)
        self.out.state = [(n, t.clone()) for n, t in self.core.named_state()]
        self.tape.params(self.out.state)
        if ctx.applier is not None:
            link.wait(lambda: all(e in b.byes or e in self.detected for e in b.active.values()),
                      "every learner's goodbye")
            ctx.applier.pump()

    def run(self) -> SyncerOutcome:
        self.start()
        for s in range(self.s0, self.cfg.syncer_steps):
            self.step(s)
        self.finish()
        return self.out


def run_syncer(ctx: SyncerCtx) -> SyncerOutcome:
    return Syncer(ctx).run()


def _nsem(m: Message) -> int:
    return len(m.tensors) - int(m.meta.get("nlog", 0))


def _order(actor: str) -> int:
    return int(actor.rsplit("-", 1)[1])


def _death_kind(schedule: Schedule, actor: str, nth: int) -> str:
    kinds = [f.kind for f in schedule.faults if actor in f.targets and f.kind in ("kill", "loss")]
    return kinds[nth - 1] if 0 < nth <= len(kinds) else "kill"
