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

The one torchft internal touched: ``Manager._client`` is wrapped so that the quorum torchft
received (members, ranks, recovery plan) is taped before the manager acts on it; torchft
exposes only parts of it publicly.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ckpt.errors import CkptError
from ckpt.stream import TorchftTransport
from runs.replicas.config import ReplicaConfig
from runs.replicas.tapeio import recovery_channel
from runs.replicas.worker import QuorumView, RankState, state_digests

__all__ = ["FtCoordinator", "ReplayCoordinator", "TapedTransport", "intra_group"]


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
            o.sink.event("sdc_verdict", "stream", 0, [src], [], {"step": step, "error": str(e)})
            o.sink.detected("stream-corrupt", src, {"step": step, "error": type(e).__name__})
            raise


class _Base:
    def __init__(self, actor: str, group_size: int, st: RankState, sink: Any) -> None:
        self.actor = actor
        self.group, r = actor.split(".")
        self.grank = int(r)
        self.group_size = group_size
        self.st = st
        self.cfg: ReplicaConfig = st.cfg
        self.sink = sink
        self.members: list[str] = []
        self.view: QuorumView | None = None
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

        def flip(i: int, b: bytearray) -> None:
            if i == f.index and self.view is not None and self.sink.inject(
                    "bitflip-stream", self.actor, lambda: {"frame": f.index, "bit": f.bit}):
                b[len(b) // 2] ^= 1 << (f.bit % 8)

        return flip

    # -- taping a quorum as torchft decided it ------------------------------------------------
    def _tape_quorum(self, key: str, detail: Any) -> dict[str, Any]:
        d = self.sink.decide("torchft-quorum", key, detail)
        self.members = list(d["members"])
        self.sink.set_step(int(d["max_step"]))
        qkey = f"q{d['quorum_id']}"
        self.sink.quorum(qkey, self.cfg.min_replicas, lambda: self.members)
        src = self.peer(d["src"]).split(".")[0] if d["heal"] else None
        self.view = QuorumView(qkey, self.members, int(d["replica_rank"]), int(d["world"]), src)
        return d

    # -- the transport's hooks (torchft's quorum thread while recording) ---------------------
    def _sent(self, dst_rank: int, step: int, info: Any) -> None:
        peer = self.peer(dst_rank)
        link = f"{self.actor}->{peer}@{step}"
        wire = self.sink.decide("recovery-stream", link, lambda: {"stream": info.digest, "nbytes": info.nbytes})
        state = state_digests(self.st)[1]
        self.sink.send(recovery_channel(self.actor, peer), peer, bytes(wire["stream"]), link)
        self.sink.event("recovery_sent", peer, bytes(wire["stream"]), state, int(wire["nbytes"]))

    def _received(self, src_rank: int, step: int, info: Any) -> None:
        src = self.peer(src_rank)
        link = f"{src}->{self.actor}@{step}"
        wire = self.sink.decide("recovery-stream", link, lambda: {"stream": info.digest, "nbytes": info.nbytes})
        self.sink.recv(link)
        self._src, self._rx = src, wire

    def _load(self, received: Any) -> None:
        received.load(self.st.ckpt_state())
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
                 store_port: int) -> None:
        super().__init__(actor, group_size, st, sink)
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.pg = ProcessGroupGloo(timeout=self.timeout)
        self.transport = TapedTransport(self, self.pg, timeout=self.timeout, data=st.cursor,
                                        generators={"augment": st.gen}, config={"replicas": self.cfg.to_dict()},
                                        tamper=self._tamper())
        self.intra = intra_group(store, self.group, self.grank, group_size, self.cfg.timeout_s)
        self._key = "0.0"
        self.manager = Manager(pg=self.pg, load_state_dict=self._load, state_dict=st.ckpt_state,
                               min_replica_size=self.cfg.min_replicas, use_async_quorum=False, timeout=self.timeout,
                               quorum_timeout=timedelta(seconds=120), connect_timeout=timedelta(seconds=60),
                               rank=self.grank, world_size=group_size, store_addr="127.0.0.1", store_port=store_port,
                               lighthouse_addr=lighthouse, replica_id=self.group, hostname="127.0.0.1",
                               checkpoint_transport=self.transport, init_sync=False,
                               heartbeat_interval=timedelta(milliseconds=100))
        self.manager._client = _QuorumTap(self.manager._client, self)

    def _on_quorum(self, q: Any) -> None:
        members = [rid.split(":", 1)[0] for rid in q.replica_ids]
        detail = {"quorum_id": int(q.quorum_id), "members": members, "replica_rank": int(q.replica_rank),
                  "world": int(q.replica_world_size), "max_step": int(q.max_step), "heal": bool(q.heal),
                  "src": q.recover_src_replica_rank, "dsts": [int(x) for x in q.recover_dst_replica_ranks]}
        self._tape_quorum(self._key, lambda: detail)

    def current_step(self) -> int:
        return int(self.manager.current_step())

    def start_quorum(self, step: int, attempt: int) -> QuorumView:
        self._key = f"{step}.{attempt}"
        self.view = None
        self.manager.start_quorum()
        assert self.view is not None, "torchft returned from start_quorum without a quorum"
        return self.view

    def allreduce(self, buckets: Sequence[torch.Tensor], key: str) -> bool:
        m = self.manager
        try:
            works = [m.allreduce(b) for b in buckets]
            for w in works:
                w.wait()
        except Exception as e:  # torchft normally swallows and reports; be sure
            m.report_error(e)
        ok = m.errored() is None
        return bool(self.sink.decide("allreduce", key, lambda: ok))

    def sum_collective(self, t: torch.Tensor) -> bool:
        m = self.manager
        if m.errored() is not None:
            return False
        m.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait()
        return m.errored() is None

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

    def __init__(self, actor: str, group_size: int, st: RankState, sink: Any, *, store: Any, store_port: int) -> None:
        super().__init__(actor, group_size, st, sink)
        from torchft.process_group import ProcessGroupGloo

        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=max(60.0, self.cfg.timeout_s)))
        self.transport = TapedTransport(self, self.pg, timeout=self.timeout, data=st.cursor,
                                        generators={"augment": st.gen}, config={"replicas": self.cfg.to_dict()},
                                        tamper=self._tamper())
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
        return self.view

    def allreduce(self, buckets: Sequence[torch.Tensor], key: str) -> bool:
        ok = bool(self.sink.decide("allreduce", key, _never))
        if ok:
            n = self.view.participants if self.view is not None else 1
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            for b in buckets:  # Manager.allreduce: SUM on the replica group, then / participants
                self.pg.allreduce([b], opts).wait()
                b /= n
        else:
            self.errored = True
        return ok

    def sum_collective(self, t: torch.Tensor) -> bool:
        if self.errored:
            return False
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.pg.allreduce([t], opts).wait()
        return True

    def should_commit(self, key: str, local_ok: bool) -> bool:
        c = bool(self.sink.decide("commit", key, _never))
        if c:
            self.step += 1
            self.batches += self.view.participants if self.view is not None else 0
        return c

    def die(self) -> None:
        return None

    def leave(self) -> None:
        return None
