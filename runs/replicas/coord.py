"""The two coordinators of a rank: torchft's ``Manager`` (recording) and the tape (replay).

:class:`FtCoordinator` is the engine: a torchft ``Manager`` per rank with per-step quorum
from the lighthouse, a reconfigurable ``ProcessGroupGloo`` across the replica groups, live
recovery through ``ckpt.stream.TorchftTransport``, and torchft's commit protocol. What
torchft decides (each quorum, each all-reduce outcome, each commit verdict, what went over
the wire in a recovery) is taped as a decision where it is decided.

:class:`ReplayCoordinator` reads those decisions back (force mode) and does what torchft
did with them: it configures the same torchft ``ProcessGroupGloo`` for each taped quorum
(same ranks, same world size, so gloo reduces in the same order and the sums come out bit
for bit), streams the same state through the same transport, averages as the manager does
(sum, then divide by the number of participants), and commits when the tape says so.

With ``cfg.async_quorum`` (the default, torchft's ``use_async_quorum``) the quorum runs on
torchft's quorum thread while the rank computes its forward and backward pass; what that
thread decides (the quorum, the bytes of a recovery) is held back and taped by the rank's
own thread when it waits for the quorum, so the order of a rank's events never depends
on timing. A replica that heals sits that step out (torchft's async rule: it contributes
zeros, the step is averaged over the replicas that were already at the step) and joins
the next one with its peer's state.

The torchft internals touched: ``Manager._client`` is wrapped so that the quorum torchft
received (members, ranks, recovery plan) is taped before the manager acts on it (torchft
exposes only parts of it publicly), and with async quorum a healing replica's received
state is applied when the rank waits for the quorum (``Manager._apply_pending_state_dict``,
what torchft's own synchronous path does), before its step draws from the restored RNG.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ckpt.errors import CkptError
from ckpt.stream import TorchftTransport
from replay import ReplayError
from runs.replicas.config import ReplicaConfig
from runs.replicas.tapeio import recovery_channel, roundtrip as _roundtrip
from runs.replicas.worker import QuorumView, RankState, state_digests

__all__ = ["FtCoordinator", "ReplayCoordinator", "Rendezvous", "TapedTransport", "intra_group"]


def _never() -> Any:
    raise RuntimeError("force mode: this decision must come from the tape")


def intra_group(store: Any, group: str, rank: int, size: int, timeout_s: float) -> Any:
    """The fixed gloo group of one replica group's ranks (the intra-group reduction)."""
    if size == 1:
        return None
    return dist.ProcessGroupGloo(dist.PrefixStore(f"intra/{group}", store), rank, size,
                                 timedelta(seconds=timeout_s))


class TapedTransport(TorchftTransport):
    """The checkpoint-stream transport with the run's tape hooks: who sent what to whom,
    the bytes on the wire (a decision: they carry a timestamped checkpoint), and a
    damaged stream refused on receipt."""

    def __init__(self, owner: "_Base", pg: Any, **kw: Any) -> None:
        super().__init__(pg, on_sent=owner._sent, on_received=owner._received, **kw)
        self.owner = owner

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        try:
            return super().recv_checkpoint(src_rank, metadata, step, timeout)
        except CkptError as e:
            o = self.owner
            src = o.peer(src_rank)
            o.qsink.event("sdc_verdict", "stream", 0, [src], [], {"step": step, "error": str(e)})
            o.qsink.detected("stream-corrupt", src, {"step": step, "error": type(e).__name__})
            raise


class _Deferred:
    """The sink torchft's quorum thread tapes through: every call is computed at once and
    held until the rank's own thread drains it (where the rank waits for the quorum), so
    a rank's events are taped in one order whatever the threads' timing."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self._held: list[tuple[str, tuple]] = []
        self._lock = threading.Lock()

    def _hold(self, method: str, *args: Any) -> None:
        with self._lock:
            self._held.append((method, args))

    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any:
        v = _roundtrip(compute())
        self._hold("decide", what, key, v)
        return v

    def inject(self, fault: str, target: str, compute: Callable[[], Any]) -> Any:
        v = _roundtrip(compute())
        self._hold("inject", fault, target, v)
        return v

    def quorum(self, key: str, minimum: int, members: Callable[[], Sequence[str]]) -> list[str]:
        m = [str(x) for x in members()]
        self._hold("quorum", key, minimum, m)
        return m

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method not in ("set_step", "send", "recv", "event", "detected"):
            raise AttributeError(method)
        return lambda *args: self._hold(method, *args)

    def drain(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for method, args in held:
            if method in ("decide", "inject", "quorum"):
                v = args[-1]
                getattr(self.sink, method)(*args[:-1], lambda v=v: v)
            else:
                getattr(self.sink, method)(*args)


class _Base:
    def __init__(self, actor: str, group_size: int, st: RankState, sink: Any) -> None:
        self.actor = actor
        self.group, r = actor.split(".")
        self.grank = int(r)
        self.group_size = group_size
        self.st = st
        self.cfg: ReplicaConfig = st.cfg
        self.sink = sink
        self.qsink: Any = sink  # what the quorum and recovery code tapes through
        self.members: list[str] = []
        self.view: QuorumView | None = None
        self.reduced = False  # the last all-reduce itself completed for this rank's ring
        self._src: str | None = None
        self._rx: dict[str, Any] = {}
        self.intra: Any = None
        self.timeout = timedelta(seconds=self.cfg.timeout_s)

    def peer(self, replica_rank: int) -> str:
        return f"{self.members[replica_rank]}.{self.grank}"

    def _tamper(self) -> Any:
        faults = [f for f in self.cfg.sdc_faults if f.actor == self.actor and f.where == "stream"]
        if not faults:
            return None
        f = faults[0]
        fired = [False]

        def flip(i: int, b: bytearray) -> None:
            # once: the replica heals at the retry from an intact stream
            if i == f.index and self.view is not None and not fired[0] and self.qsink.inject(
                    "bitflip-stream", self.actor, lambda: {"frame": f.index, "bit": f.bit}):
                fired[0] = True
                b[len(b) // 2] ^= 1 << (f.bit % 8)

        return flip

    def _tamper_received(self) -> Any:
        """SdcFault(where="received"): the first stream this rank receives is hit in transit."""
        faults = [f for f in self.cfg.sdc_faults if f.actor == self.actor and f.where == "received"]
        if not faults:
            return None
        f = faults[0]
        fired = [False]

        def flip(i: int, b: bytearray) -> None:
            if i == 0 and not fired[0] and self.qsink.inject("bitflip-received", self.actor,
                                                             lambda: {"segment": 0, "bit": f.bit}):
                fired[0] = True
                b[len(b) // 2] ^= 1 << (f.bit % 8)

        return flip

    def _drain(self) -> None:
        if isinstance(self.qsink, _Deferred):
            self.qsink.drain()

    # -- taping a quorum as torchft decided it ------------------------------------------------
    def _tape_quorum(self, key: str, detail: Any) -> dict[str, Any]:
        d = self.qsink.decide("torchft-quorum", key, detail)
        self.members = list(d["members"])
        self.qsink.set_step(int(d["max_step"]))
        qkey = f"q{d['quorum_id']}"
        self.qsink.quorum(qkey, self.cfg.min_replicas, lambda: self.members)
        src = self.peer(d["src"]).split(".")[0] if d["heal"] else None
        # who computes this step: with a synchronous quorum every member (a healing one
        # loads its peer's state first); with an async one the replicas already at the
        # step (torchft's max_replica_rank / max_world_size), a healing one sits it out
        prank = d.get("prank", d["replica_rank"])
        pworld = int(d.get("pworld", d["world"]))
        self.view = QuorumView(qkey, self.members, int(d["replica_rank"]), int(d["world"]), src,
                               participating=prank is not None, prank=int(prank or 0), pworld=pworld)
        return d

    # -- the transport's hooks (torchft's quorum thread while recording) ---------------------
    def _sent(self, dst_rank: int, step: int, info: Any) -> None:
        peer = self.peer(dst_rank)
        link = f"{self.actor}->{peer}@{step}"
        wire = self.qsink.decide("recovery-stream", link, lambda: {"stream": info.digest, "nbytes": info.nbytes})
        state = state_digests(self.st)[1]  # the committed state (the step in flight does not touch it)
        self.qsink.send(recovery_channel(self.actor, peer), peer, bytes(wire["stream"]), link)
        self.qsink.event("recovery_sent", peer, bytes(wire["stream"]), state, int(wire["nbytes"]))

    def _received(self, src_rank: int, step: int, info: Any) -> None:
        src = self.peer(src_rank)
        link = f"{src}->{self.actor}@{step}"
        wire = self.qsink.decide("recovery-stream", link, lambda: {"stream": info.digest, "nbytes": info.nbytes})
        self.qsink.recv(link)
        self._src, self._rx = src, wire

    def _load(self, received: Any) -> None:
        self._drain()  # the quorum and the receipt come first on the tape
        received.load(self.st.ckpt_state())
        self.st.gen.set_state(self.st.gen_ckpt.get_state())
        self.st.cursor.reset()
        state = state_digests(self.st)[1]
        self.sink.event("recovery_loaded", self._src or "", bytes(self._rx["stream"]), state)

    def intra_sum(self, t: torch.Tensor) -> None:
        self.intra.allreduce([t]).wait()

    def intra_max(self, t: torch.Tensor) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.intra.allreduce([t], opts).wait()


class _QuorumTap:
    """Stands in for ``Manager._client``: forwards, and tapes each quorum result first."""

    def __init__(self, client: Any, owner: "FtCoordinator") -> None:
        self._client = client
        self._owner = owner

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        q = self._client._quorum(*args, **kwargs)
        self._owner._on_quorum(q)
        return q

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class FtCoordinator(_Base):
    """torchft drives: Manager, lighthouse quorum, ProcessGroupGloo, TorchftTransport."""

    def __init__(self, actor: str, group_size: int, st: RankState, sink: Any, *, lighthouse: str, store: Any,
                 store_port: int, before_quorum: Callable[[int], None] | None = None) -> None:
        super().__init__(actor, group_size, st, sink)
        from torchft.manager import Manager

        # the orchestration's wait before each step's quorum request (a joiner due by then)
        self._before_quorum = before_quorum
        from torchft.process_group import ProcessGroupGloo

        self.qsink = _Deferred(sink)
        self.pg = ProcessGroupGloo(timeout=self.timeout)
        self.transport = TapedTransport(self, self.pg, timeout=self.timeout, data=st.cursor.loader,
                                        generators={"augment": st.gen_ckpt}, config={"replicas": self.cfg.to_dict()},
                                        tamper=self._tamper(), tamper_received=self._tamper_received())
        self.intra = intra_group(store, self.group, self.grank, group_size, self.cfg.timeout_s)
        self._key = "0.0"
        self._xkey, self._exchanges = "0.0", 0  # the step attempt's small all-reduces: "s.a#n"
        self.manager = Manager(pg=self.pg, load_state_dict=self._load, state_dict=st.ckpt_state,
                               min_replica_size=self.cfg.min_replicas, use_async_quorum=self.cfg.async_quorum,
                               timeout=self.timeout, quorum_timeout=timedelta(seconds=120),
                               connect_timeout=timedelta(seconds=60), rank=self.grank, world_size=group_size,
                               store_addr="127.0.0.1", store_port=store_port, lighthouse_addr=lighthouse,
                               replica_id=self.group, hostname="127.0.0.1", checkpoint_transport=self.transport,
                               init_sync=False, heartbeat_interval=timedelta(milliseconds=100))
        self.manager._client = _QuorumTap(self.manager._client, self)
        self._lighthouse, self._store = lighthouse, store

    def announce(self) -> None:
        """Tell the lighthouse this replica is alive, and wait for its answer. The manager's
        own heartbeats run on a thread of torchft's and say nothing of when the first one
        arrives; the lighthouse forms a quorum at once when every replica it has heard from
        has asked, so one that no heartbeat announced yet would be left out."""
        from torchft._torchft import LighthouseClient
        from torchft.manager import REPLICA_ID_KEY

        replica_id = self._store.get(REPLICA_ID_KEY).decode()  # the group's id, as its manager registered it
        LighthouseClient(self._lighthouse, connect_timeout=timedelta(seconds=60)).heartbeat(
            replica_id, timeout=timedelta(seconds=self.cfg.timeout_s))

    def _on_quorum(self, q: Any) -> None:
        members = [rid.split(":", 1)[0] for rid in q.replica_ids]
        detail = {"quorum_id": int(q.quorum_id), "members": members, "replica_rank": int(q.replica_rank),
                  "world": int(q.replica_world_size), "max_step": int(q.max_step), "heal": bool(q.heal),
                  "src": q.recover_src_replica_rank, "dsts": [int(x) for x in q.recover_dst_replica_ranks]}
        if self.cfg.async_quorum:  # torchft's participating rank and world in async mode
            detail["prank"] = q.max_replica_rank
            detail["pworld"] = int(q.max_world_size)
        self._tape_quorum(self._key, lambda: detail)

    def current_step(self) -> int:
        return int(self.manager.current_step())

    def start_quorum(self, step: int, attempt: int) -> QuorumView | None:
        self._key = f"{step}.{attempt}"
        self.view = None
        if self._before_quorum is not None:
            self._before_quorum(step)
        self.manager.start_quorum()
        if self.cfg.async_quorum:
            return None  # on torchft's quorum thread while this rank computes
        return self.wait_quorum()

    def wait_quorum(self) -> QuorumView:
        m = self.manager
        m.wait_quorum()
        self._drain()
        if m._healing:
            # as torchft's synchronous path does: the received state is applied now, so the
            # step's RNG draws come from the peer's committed state (async quorum only)
            m._apply_pending_state_dict()
            m._healing = False
        self._drain()
        assert self.view is not None, "torchft finished the quorum without one"
        return self.view

    def allreduce(self, buckets: Sequence[torch.Tensor], key: str, fail_after: bool = False) -> bool:
        m = self.manager
        try:
            works = [m.allreduce(b) for b in buckets]
            for w in works:
                w.wait()
        except Exception as e:  # torchft normally swallows and reports; be sure
            m.report_error(e)
        # the collective itself completed here (the rank may still fail after it: a late failure);
        # such a rank joins the step's exchange with its veto, so the ring's collectives stay in step
        self.reduced = m.errored() is None
        if fail_after and m.errored() is None:  # it completed here and everywhere; then this rank fails
            m.report_error(RuntimeError("injected: the all-reduce completed, then this rank failed"))
        ok = m.errored() is None
        self._xkey, self._exchanges = key, 0
        return bool(self.sink.decide("allreduce", key, lambda: ok))

    def sum_collective(self, t: torch.Tensor, join: bool = True) -> bool:
        # on the replica group itself, not through Manager.allreduce: that zeroes what a
        # replica sitting the step out sends, and its digests are as real as anyone's.
        # A rank whose all-reduce itself failed does not join (join=False): its ring is broken
        # anyway; a rank that failed after its all-reduce completed joins and vetoes the step
        # in the exchanged values. The outcome is taped either way.
        m = self.manager
        self._exchanges += 1
        ok = join
        if ok:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            try:
                self.pg.allreduce([t], opts).wait()
            except Exception as e:  # a member died in it: the step fails as an all-reduce would
                m.report_error(e)
                ok = False
        return bool(self.sink.decide("exchange", f"{self._xkey}#{self._exchanges}", lambda: ok))

    def share_bytes(self, payload: bytes | None) -> bytes:
        """What the first replica of the quorum (its group rank 0) passes in, to every rank:
        over the replica group of group rank 0, then inside each group. The others pass None."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM

        def spread(t: torch.Tensor) -> None:  # every rank but the source adds zeros
            if self.grank == 0:
                self.pg.allreduce([t], opts).wait()
            if self.intra is not None:
                self.intra.allreduce([t], opts).wait()

        n = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
        spread(n)
        buf = torch.zeros(int(n.item()), dtype=torch.uint8)
        if payload is not None:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        spread(buf)
        return buf.numpy().tobytes()

    def rewind_to(self, step: int) -> None:
        """After a rollback every replica is at ``step`` again (torchft's own state-dict API)."""
        m = self.manager
        m.load_state_dict({"step": int(step), "batches_committed": int(m.batches_committed())})

    def should_commit(self, key: str, local_ok: bool) -> bool:
        m = self.manager
        if not local_ok and m.errored() is None:
            m.report_error(RuntimeError("step discarded by this replica (SDC verdict)"))
        c = bool(m.should_commit())
        return bool(self.sink.decide("commit", key, lambda: c))

    def die(self) -> None:
        while True:  # the orchestrator SIGKILLs every rank of the group here
            time.sleep(1.0)

    def leave(self) -> None:
        self.manager.shutdown(wait=False)


class ReplayCoordinator(_Base):
    """The tape drives: taped quorums, outcomes and verdicts; torchft's gloo group and our
    transport move the bytes as they did in the recorded run."""

    def __init__(self, actor: str, group_size: int, st: RankState, sink: Any, *, store: Any, store_port: int,
                 rdv: "Rendezvous") -> None:
        super().__init__(actor, group_size, st, sink)
        self.rdv = rdv
        self._xkey, self._exchanges, self._ops = "0.0", 0, 0
        from torchft.process_group import ProcessGroupGloo

        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=max(60.0, self.cfg.timeout_s)))
        self.transport = TapedTransport(self, self.pg, timeout=self.timeout, data=st.cursor.loader,
                                        generators={"augment": st.gen_ckpt}, config={"replicas": self.cfg.to_dict()},
                                        tamper=self._tamper(), tamper_received=self._tamper_received())
        self.intra = intra_group(store, self.group, self.grank, group_size, 600.0)
        self.port = store_port
        self.step = 0
        self.batches = 0
        self.qid: int | None = None
        self.errored = False

    def current_step(self) -> int:
        return self.step

    def start_quorum(self, step: int, attempt: int) -> QuorumView:
        d = self._tape_quorum(f"{step}.{attempt}", _never)
        self.errored = False
        if d["quorum_id"] != self.qid:
            self.qid = int(d["quorum_id"])
            self._ops = 0
            self.pg.configure(f"localhost:{self.port}/torchft/{self.qid}/{self.grank}", self.group,
                              int(d["replica_rank"]), int(d["world"]))
        max_step = int(d["max_step"])
        try:
            if d["dsts"]:
                self.transport.send_checkpoint(list(d["dsts"]), max_step,
                                               {"user": {"default": self.st.ckpt_state()},
                                                "torchft": {"step": self.step, "batches_committed": self.batches}},
                                               self.timeout)
            if d["heal"]:
                got = self.transport.recv_checkpoint(int(d["src"]), self.transport.metadata(), max_step, self.timeout)
                self.step = int(got["torchft"]["step"])
                self.batches = int(got["torchft"]["batches_committed"])
                self._load(got["user"]["default"])
        except CkptError:
            self.errored = True  # as torchft: the step runs, fails and is retried
        assert self.view is not None
        return self.view

    def wait_quorum(self) -> QuorumView:
        assert self.view is not None
        return self.view

    def _completed(self, what: str, ok: bool) -> bool:
        # a collective is the n-th one on the replica group since it was configured: the same
        # n on every member of the ring, whatever each member's step attempt is called
        self._ops += 1
        return self.rdv.any_completed((self.qid, self.grank, self._ops), what, self.actor, ok,
                                      [f"{m}.{self.grank}" for m in self.members])

    def allreduce(self, buckets: Sequence[torch.Tensor], key: str, fail_after: bool = False) -> bool:
        ok = bool(self.sink.decide("allreduce", key, _never))
        self._xkey, self._exchanges = key, 0
        # the collective ran if any member of this rank's ring completed it (then every member
        # took part, a member that failed afterwards too): replay it exactly then
        self.reduced = self._completed(f"all-reduce of step attempt {key}", ok)
        if self.reduced:
            v = self.view
            n = v.pworld if v is not None else 1
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            for b in buckets:  # Manager.allreduce: SUM on the replica group, then / participants
                if v is not None and not v.participating:
                    b.zero_()  # a replica that is not participating sends zeros
                self.pg.allreduce([b], opts).wait()
                b /= n
        if not ok:
            self.errored = True
        return ok

    def sum_collective(self, t: torch.Tensor, join: bool = True) -> bool:
        self._exchanges += 1
        what = f"{self._xkey}#{self._exchanges}"
        ok = bool(self.sink.decide("exchange", what, _never))
        if self._completed(f"exchange {what}", ok):
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            self.pg.allreduce([t], opts).wait()
        return ok

    def share_bytes(self, payload: bytes | None) -> bytes:
        raise RuntimeError("force mode: what the replicas agreed on comes from the tape")

    def rewind_to(self, step: int) -> None:
        self.step = int(step)

    def should_commit(self, key: str, local_ok: bool) -> bool:
        c = bool(self.sink.decide("commit", key, _never))
        if c:
            self.step += 1
            self.batches += self.view.pworld if self.view is not None else 0
        return c

    def die(self) -> None:
        return None

    def leave(self) -> None:
        return None


class Rendezvous:
    """Where the replay's rank threads learn what their ring's other members taped for
    one collective: a collective that completed for one member ran with every member
    (allreduce needs them all), so each replays it if any member's taped outcome says it
    completed, the members that failed after it too. A member that never reaches it
    (killed in the recorded run: its thread has ended) counts as not completed."""

    def __init__(self, wait_s: float = 300.0) -> None:
        self._cond = threading.Condition()
        self._seen: dict[tuple, dict[str, bool]] = {}
        self._ended: set[str] = set()
        self.wait_s = wait_s  # only a tape whose collectives do not line up ever waits this long

    def any_completed(self, k: tuple, what: str, actor: str, ok: bool, ring: Sequence[str]) -> bool:
        with self._cond:
            self._seen.setdefault(k, {})[actor] = ok
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: all(a in self._seen[k] or a in self._ended for a in ring),
                                       timeout=self.wait_s):
                missing = [a for a in ring if a not in self._seen[k] and a not in self._ended]
                raise ReplayError(f"{actor}: collective #{k[2]} of quorum {k[0]} ({what}) was never reached by "
                                  f"{missing} in {self.wait_s:.0f} s: the tape's collectives do not line up across "
                                  "the ring (a partially failed collective this replay cannot re-execute)")
            return any(self._seen[k].get(a, False) for a in ring)

    def ended(self, actor: str) -> None:
        with self._cond:
            self._ended.add(actor)
            self._cond.notify_all()
