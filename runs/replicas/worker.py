"""One rank of one replica group: the training loop, the same code when recorded (torchft
``Manager``, a process per rank) and when replayed (taped decisions, a thread per rank).

Per step attempt (spec/replicas.md §1): quorum (torchft; with async quorum the rank
computes meanwhile, as if the quorum were the last one, and recomputes if it changed what
the rank computes; a quorum may heal the rank from a live peer through
``ckpt.stream.TorchftTransport``), the rank's share of the global batch, forward and
backward, one all-reduce of the whole gradient (inside the group first when it has two
ranks, then across the replica groups through the manager), the SDC digests and their
cross-replica comparison, the loss-spike guard's vote, then torchft's commit verdict: a
committed step applies the optimizer and moves the data cursor; an uncommitted one leaves
the replicated state as it was (the named generator is rewound) and its samples go back to
the stream; a spike (or SDC under policy rollback) rolls every replica back together.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import msgpack
import torch

import replay
from ckpt.guard import judge as judge_loss
from replay.sdc import bucket_digests, digest_slots, flip_bit, judge, unpack_slots
from replay.watchdog import beat
from runs.common.tiny_lm import TinyConfig, TinyLM, make_corpus, unlikely_corpus
from runs.replicas.config import ReplicaConfig
from runs.replicas.data import GlobalCursor, share
from runs.replicas.timing import StepClock

__all__ = ["RankState", "RankResult", "Coordinator", "QuorumView", "run_rank", "build_state", "state_digests",
           "step_loss", "ZERO"]

ZERO = bytes(16)
_INIT_LOCK = threading.Lock()  # model init seeds the process-wide generator; replay ranks are threads


@dataclass
class QuorumView:
    key: str  # the quorum's tape key
    members: list[str]  # replica groups, in replica-rank order
    replica_rank: int
    participants: int  # replicas in the quorum (the replica process group's size)
    healed_from: str | None = None  # the source replica when this rank recovered in the quorum
    participating: bool = True  # computes this step (async quorum: a healing replica sits it out)
    prank: int = 0  # its rank among the participating replicas
    pworld: int = 1  # how many replicas compute the step (the gradient is averaged over them)


class Coordinator(Protocol):
    """What a rank asks of torchft (record) or of the tape (replay)."""

    def current_step(self) -> int: ...
    def start_quorum(self, step: int, attempt: int) -> QuorumView | None: ...  # None: still running
    def wait_quorum(self) -> QuorumView: ...
    def intra_sum(self, t: torch.Tensor) -> None: ...
    def allreduce(self, buckets: Sequence[torch.Tensor], key: str, fail_after: bool = False) -> bool: ...
    def sum_collective(self, t: torch.Tensor, join: bool = True) -> bool: ...
    def intra_max(self, t: torch.Tensor) -> None: ...
    def should_commit(self, key: str, local_ok: bool) -> bool: ...
    def die(self) -> None: ...
    def leave(self) -> None: ...


@dataclass
class RankState:
    cfg: ReplicaConfig
    model: TinyLM
    optim: torch.optim.Optimizer
    cursor: GlobalCursor
    gen: torch.Generator  # the named generator "augment", drawn by the step in flight
    gen_ckpt: torch.Generator  # its state at the last commit: what a recovery sends
    corpus: torch.Tensor
    bad: torch.Tensor  # the corrupted text a Spike fault trains on
    guard: Any = None  # the loss-spike guard (ckpt.guard.LossGuard), when the run has one

    def ckpt_state(self) -> dict[str, Any]:
        """What the transport saves and loads (data and generators ride as their own fields;
        a recovering replica also takes its peer's guard window and episodes)."""
        out: dict[str, Any] = {"model": self.model, "optim": self.optim}
        if self.guard is not None:
            out["guard"] = _GuardState(self.guard)
        return out


class _GuardState:
    """The guard's replicated state, for a recovering replica: it must judge the next loss
    exactly as its peers do (same window, same episodes: the same rollback budget)."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self.guard.window), "episodes": [dict(e) for e in self.guard.episodes]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.guard.window = [float(x) for x in sd["window"]]
        self.guard.episodes = [dict(e) for e in sd["episodes"]]


class GuardTape:
    """The guard's tape (``ckpt.guard.TapeSink``) in a replica run: its events go on the
    rank's tape; a rollback is decided once, by the first replica of the quorum (the
    checkpoints' writer), and every rank acts on those bytes (so all load the same
    checkpoint and apply the same data edits: the others follow it as a forced replay
    follows the tape). In force mode every rank takes the taped decision."""

    def __init__(self, sink: Any, coord: "Coordinator", leader: Callable[[], bool]) -> None:
        self.sink = sink
        self.coord = coord
        self.leader = leader

    def record_event(self, kind: int, payload: bytes) -> None:
        self.sink.record_event(kind, payload)

    def decide_event(self, kind: int, compute: Callable[[], bytes]) -> bytes:
        import ckpt.guard

        if self.sink.forced or kind != ckpt.guard.events.ROLLBACK:
            return self.sink.decide_event(kind, compute)
        payload = self.coord.share_bytes(bytes(compute()) if self.leader() else None)
        return self.sink.decide_event(kind, lambda: payload)


@dataclass
class RankResult:
    actor: str
    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    outcome: str = "finished"  # finished | killed | excluded
    recovered_from: list[str] = field(default_factory=list)
    params: bytes = ZERO
    sdc_s: float = 0.0  # seconds this rank spent digesting and judging (bench/replicas.py)
    parts: dict[str, list[float]] = field(default_factory=dict)  # per attempt, seconds per part (timing.PARTS)


def build_state(cfg: ReplicaConfig) -> RankState:
    tcfg = TinyConfig(vocab=cfg.vocab, dim=cfg.dim, heads=4, layers=cfg.layers, seq_len=cfg.seq_len, dropout=0.0)
    with _INIT_LOCK:
        torch.manual_seed(cfg.seed)
        model = TinyLM(tcfg)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    cursor = GlobalCursor(cfg.corpus, seed=cfg.seed, global_batch=cfg.global_batch)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    gen_ckpt = torch.Generator().manual_seed(cfg.seed + 1)
    corpus = make_corpus(cfg.corpus, cfg.seq_len, cfg.vocab, seed=cfg.seed)
    bad = unlikely_corpus(64, cfg.seq_len, cfg.vocab, seed=cfg.seed) if cfg.spikes else corpus
    return RankState(cfg, model, optim, cursor, gen, gen_ckpt, corpus, bad)


def state_digests(st: RankState) -> tuple[bytes, bytes]:
    """(parameters digest, whole replicated state digest): weights, optimizer, cursor, RNG
    (the committed generator state: the step in flight does not count)."""
    named = list(st.model.state_dict().items())
    params = replay.channel.message_digest(msgpack.packb([n for n, _ in named]), [t for _, t in named])
    osd = st.optim.state_dict()
    tensors = [t for _, t in named]
    meta: list[Any] = [[n for n, _ in named], osd["param_groups"], st.cursor.state_dict()]
    for idx in sorted(osd["state"]):
        for k in sorted(osd["state"][idx]):
            v = osd["state"][idx][k]
            if isinstance(v, torch.Tensor):
                tensors.append(v)
                meta.append([idx, k])
            else:
                meta.append([idx, k, v])
    tensors.append(st.gen_ckpt.get_state())
    return params, replay.channel.message_digest(msgpack.packb(meta, use_bin_type=True, default=str), tensors)


class _Flat:
    """The gradient as one flat buffer (plus the loss, last), cut into fixed buckets."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_elems: int) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        n = sum(self.sizes) + 1
        self.buf = torch.zeros(n, dtype=torch.float32)
        self.buckets = [self.buf[i : i + bucket_elems] for i in range(0, n, bucket_elems)]

    def gather(self, loss: torch.Tensor) -> None:
        o = 0
        for p, n in zip(self.params, self.sizes):
            self.buf[o : o + n].copy_(p.grad.reshape(-1) if p.grad is not None else torch.zeros(n))
            o += n
        self.buf[o] = loss.detach()

    def scatter(self) -> float:
        o = 0
        for p, n in zip(self.params, self.sizes):
            p.grad = self.buf[o : o + n].view_as(p).clone()
            o += n
        return float(self.buf[o].item())


def step_loss(st: RankState, ids: list[int], rows: tuple[int, int], participants: int, *,
              corrupt: bool = False) -> torch.Tensor:
    """Sum of the per-sample losses of this rank's rows, scaled so that the manager's
    average over the participants is the mean over the whole global batch."""
    cfg = st.cfg
    g = len(ids)
    # every replica draws the whole global batch's augmentation: the generator stays replicated
    noise = torch.rand(g, cfg.seq_len, generator=st.gen)
    repl = torch.randint(0, cfg.vocab, (g, cfg.seq_len), generator=st.gen)
    lo, hi = rows
    if hi == lo:
        return sum((p.sum() * 0.0 for p in st.model.parameters()), torch.zeros(()))
    batch = st.bad[[i % st.bad.shape[0] for i in ids[lo:hi]]] if corrupt else st.corpus[ids[lo:hi]]
    x = batch[:, :-1].clone()
    m = noise[lo:hi] < cfg.augment
    x[m] = repl[lo:hi][m]
    logits = st.model(x)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1), reduction="sum")
    return ce / cfg.seq_len * (participants / g)


def run_rank(actor: str, group_size: int, st: RankState, coord: Coordinator, sink: Any,
             on_commit: Callable[[int, float], None] | None = None, ckpt_dir: str | None = None) -> RankResult:
    """The loop of rank ``actor`` ("group.rank"); returns when the run's steps are done, or
    when this rank is killed (record: never returns) or excluded. With ``cfg.ckpt_every``,
    periodic checkpoints go to ``ckpt_dir`` (one run directory for all replicas)."""
    cfg = st.cfg
    group, rank = actor.split(".")
    grank = int(rank)
    lead = [False]  # this rank is the first replica's group rank 0: it writes the checkpoints
    mgr = _checkpoints(st, sink, coord, ckpt_dir, lambda: lead[0]) if cfg.ckpt_every else None
    guard = st.guard
    spiked = {(0, s) for f in cfg.spikes for s in range(f.step, f.step + f.span)}
    late_set = set(cfg.late_failures)
    flat = _Flat(list(st.model.parameters()), cfg.bucket_elems)
    res = RankResult(actor, 0)
    clock = StepClock()
    res.parts = clock.parts
    attempt = 0
    prev_members: list[str] | None = None
    prev_view: QuorumView | None = None
    pending: tuple[list[str], list[int]] | None = None  # (members, ids) of an attempt not committed
    faults = {(f.step, f.where): f for f in cfg.sdc_faults if f.actor == actor}
    killed = cfg.kill_step(group)
    while coord.current_step() < cfg.steps:
        clock.start()
        beat(f"quorum for step {coord.current_step()}")  # the watchdog's heartbeat (a no-op unless watched)
        sink.set_step(coord.current_step())
        clock.lap("rest")
        q = coord.start_quorum(coord.current_step(), attempt)
        clock.lap("quorum")
        computed: tuple[list[int], tuple[int, int], int] | None = None
        loss = torch.zeros(())
        if q is None:  # async quorum: compute as if the quorum were the last one, then check
            if prev_view is not None:
                ids = st.cursor.peek()
                rows = _rows(ids, prev_view, group_size, grank)
                loss = _compute(st, ids, rows, prev_view.pworld, st.cursor.position() in spiked)
                computed = (ids, rows, prev_view.pworld)  # the loss is scaled by the participants
                clock.lap("compute")
            q = coord.wait_quorum()
            clock.lap("quorum")
        prev_view = q
        s = coord.current_step()
        key = f"{s}.{attempt}"
        if mgr is not None:
            lead[0] = q.members[0] == group and grank == 0
            mgr.set_writer(lead[0])  # the writer's lock moves with the quorum (waits for the last writer)
            if lead[0] and s == 0 and attempt == 0:
                mgr.save(0)  # a spike always has a checkpoint to roll back to
        ids = st.cursor.peek()
        where = st.cursor.position()
        rows = _rows(ids, q, group_size, grank)
        if q.healed_from:
            res.recovered_from.append(q.healed_from)
        if computed is not None and (q.healed_from or computed != (ids, rows, q.pworld)):
            computed = None  # the quorum changed what this rank computes: again, from the step's start
        gen_before = st.gen_ckpt.get_state()  # the step starts from the committed state (a healed one: its peer's)
        clock.lap("rest")
        if q.members != prev_members:
            old = prev_members or []
            sink.event("membership", q.key, [m for m in q.members if m not in old], [m for m in old if m not in q.members],
                       q.members)
        if pending is not None:
            lost = [m for m in pending[0] if m not in q.members]
            sink.event("data_reassign", cfg.data_policy, lost, pending[1])
            pending = None
        prev_members = q.members
        if killed == s and attempt == 0:
            if sink.inject("sigkill", group, lambda: {"step": s, "group": group}):
                sink.flush(dying=True)
                coord.die()  # record: SIGKILLed here by the orchestrator; replay: the thread ends
                res.outcome, res.steps = "killed", s
                return res
        sink.begin_step(s)
        sink.batch(ids[rows[0] : rows[1]])
        if where in spiked and attempt == 0:
            sink.inject("loss-spike", f"e{where[0]}.s{where[1]}", lambda: {"step": s, "epoch": where[0],
                                                                           "loader_step": where[1]})
        clock.lap("tape")
        if computed is None:
            loss = _compute(st, ids, rows, q.pworld, where in spiked)
            clock.lap("compute")
        flat.gather(loss)
        if group_size > 1:
            coord.intra_sum(flat.buf)
        clock.lap("gather")
        # a fault strikes once, in the first attempt of its step that gets as far as being judged
        # (a rolled-back step that runs again is not hit again; an attempt that failed for another
        # reason, a quorum change say, hands it to the retry: how far an attempt gets is timing)
        f_local = faults.pop((s, "local"), None)  # a wrong computation: what it sends is wrong
        if f_local is not None and not sink.inject("bitflip-local", actor, lambda: _fault_json(f_local)):
            f_local = None
        if f_local is not None:
            flip_bit(flat.buckets[f_local.bucket], f_local.index, f_local.bit)
        t_sdc = time.perf_counter()
        local = bucket_digests(flat.buckets) if cfg.sdc else []  # what this rank sends into the all-reduce
        res.sdc_s += time.perf_counter() - t_sdc
        if cfg.sdc:
            sink.event("sdc_digests", "local", [(f"b{i}", d) for i, d in enumerate(local)])
        clock.lap("sdc")
        late = (actor, s) in late_set and attempt == 0 and bool(sink.inject("late-failure", actor, lambda: {"step": s}))
        ok = coord.allreduce([flat.buf], key, late)  # one all-reduce of the whole gradient: one round trip
        joins = ok or coord.reduced  # failed after its all-reduce completed: joins the exchange to veto
        if group_size > 1:
            # each rank of a group reduces on its own ring; one ring can fail while another completes
            # (a rank that refused its recovery never joins its ring): the group fails together
            failed = torch.tensor([int(not ok)], dtype=torch.int64)
            coord.intra_max(failed)
            ok = not failed[0]
        clock.lap("allreduce")
        if f_local is not None and not ok:
            faults[(s, "local")] = f_local  # not judged: the retry is hit (its injection is taped again)
        discard = odd_me = False
        gl = float(flat.buf[-1]) if ok else math.nan  # the global batch's mean loss, the same on every replica
        reduced: list[bytes] = []
        bad: list[str] = []
        if ok and cfg.sdc:
            f = faults.pop((s, "reduced"), None)
            if f is not None and sink.inject("bitflip-reduced", actor, lambda: _fault_json(f)):
                flip_bit(flat.buckets[f.bucket], f.index, f.bit)
            t_sdc = time.perf_counter()
            reduced = bucket_digests(flat.buckets)
            res.sdc_s += time.perf_counter() - t_sdc
            sink.event("sdc_digests", "reduced", [(f"b{i}", d) for i, d in enumerate(reduced)])
            if cfg.reexec_every and s % cfg.reexec_every == 0:
                again = _reexecute(st, ids, rows, q.pworld, gen_before, flat, group_size, coord, where in spiked)
                bad = [f"b{i}" for i, (a, b) in enumerate(zip(local, again)) if a != b]
                sink.event("sdc_verdict", "reexec", int(not bad), [actor] if bad else [], bad, {"step": s})
        clock.lap("sdc")
        spike_vote = 0
        if guard is not None and ok:
            # every replica judges the same loss with the same (replicated) window; the votes are
            # summed anyway, so that one replica's verdict rolls every replica back together
            c = guard.config
            spike_vote = int(judge_loss(gl, guard.window, min_history=c.min_history, z_threshold=c.z_threshold,
                                        min_scale=c.min_scale).anomalous)
        # One small all-reduce per step on the replica group: the reduced gradient's digests
        # (SDC), every replica's votes and its veto (its step failed). A step is committed by
        # every replica or by none (a group that committed alone could finish a run its peers
        # have not): a replica whose step failed after its all-reduce completed joins and
        # vetoes; one whose all-reduce failed does not join, so the others' exchange fails too.
        # Never skipping a collective the ring ran keeps the ring's collectives in step (a
        # skipped one would pair the others' pending exchange with this rank's next collective).
        clock.lap("rest")
        slots = digest_slots(reduced, q.replica_rank, q.participants)
        x = torch.cat([slots.reshape(-1), torch.tensor([spike_vote, int(bool(bad)), int(not ok)], dtype=torch.int64)])
        xok = coord.sum_collective(x, join=joins)  # always called: the replay's collectives line up by count
        ok = ok and xok and int(x[-1]) == 0
        clock.lap("exchange")
        spike = False
        if ok:
            votes = x[-3:-1]
            if cfg.sdc:
                t_sdc = time.perf_counter()
                rows_d = unpack_slots(x[:-3].view_as(slots))
                v = judge({q.members[i]: rows_d[i] for i in range(q.participants)})
                res.sdc_s += time.perf_counter() - t_sdc
                sink.event("sdc_verdict", "cross-replica", int(v.ok), list(v.odd), [f"b{b}" for b in v.buckets],
                           {"ambiguous": v.ambiguous, **v.detail})
                if not v.ok:
                    odd_me = group in v.odd
                    # the odd replica leaves (exclude) or every replica drops the step (rollback; also
                    # when no majority can say who is wrong)
                    discard = odd_me or cfg.sdc_policy == "rollback" or v.ambiguous
                    sink.detected("sdc", ",".join(v.odd) or "unattributed",
                                  {"step": s, "buckets": list(v.buckets), "policy": cfg.sdc_policy})
            if votes[1] > 0:
                # a replica computed its own gradient wrong (re-execution): what it sent is in the
                # sum every replica received, so every replica drops the step; under policy
                # exclude that replica leaves too
                discard = True
                odd_me = odd_me or (bool(bad) and cfg.sdc_policy == "exclude")
            spike = bool(votes[0])
        if group_size > 1:
            flags = torch.tensor([int(not ok), int(odd_me), int(discard), int(spike)], dtype=torch.int64)
            coord.intra_max(flags)  # a verdict of one rank's ring binds its whole group
            ok, odd_me, discard, spike = not flags[0], bool(flags[1]), bool(flags[2]), bool(flags[3]) and not flags[0]
        # under policy rollback every replica saw the same verdict (the odd one too): all roll back
        sdc_back = guard is not None and ok and discard and not spike and cfg.sdc_policy == "rollback"
        discard = discard or spike
        clock.lap("sdc")
        committed = coord.should_commit(key, ok and not discard)
        clock.lap("commit")
        if committed:
            gl = flat.scatter()
            st.optim.step()
            st.cursor.advance()
            st.gen_ckpt.set_state(st.gen.get_state())
            clock.lap("optim")
            pd, sd = state_digests(st) if cfg.param_every and (s + 1) % cfg.param_every == 0 else (ZERO, ZERO)
            clock.lap("rest")
            sink.event("step_commit", q.key, 1, q.participants, pd, sd)
            sink.loss(gl)
            sink.end_step()
            clock.lap("tape")
            res.losses[s] = gl
            if on_commit is not None:
                on_commit(s, gl)
            attempt = 0
            if guard is not None and guard.after_step(s + 1, loss=gl) is not None:
                raise RuntimeError(f"{actor}: the guard rejected step {s + 1} after the replicas accepted it")
        elif spike or sdc_back:
            # every replica rolls back together: the writer chooses the checkpoint, all load it
            sink.event("step_commit", q.key, 0, q.participants, ZERO, ZERO)
            st.cursor.advance()  # the batch was served, then judged: the data policy's window counts it
            rb = guard.after_step(s + 1, loss=gl) if spike else guard.roll_back(s + 1, rule="sdc", loss=gl)
            if rb is None:
                raise RuntimeError(f"{actor}: the replicas agreed on a loss spike at step {s + 1} that this "
                                   "replica's guard does not see (its guard state diverged)")
            coord.rewind_to(rb.step)
            st.gen.set_state(st.gen_ckpt.get_state())
            st.cursor.reset()
            sink.note(f"{actor} rolled back from step {s + 1} to step {rb.step} ({rb.checkpoint}); "
                      f"{rb.policy} {[e.to_dict() for e in rb.edits]}")
            attempt = 0
        else:
            st.gen.set_state(gen_before)
            sink.event("step_commit", q.key, 0, q.participants, ZERO, ZERO)
            if cfg.data_policy == "drop":
                st.cursor.skip()
            pending = (list(q.members), ids)
            attempt += 1
        clock.lap("rest")
        sink.flush()
        clock.lap("tape")
        clock.end()
        if odd_me and cfg.sdc_policy == "exclude":
            sink.note(f"{actor} excluded after an SDC verdict at step {s}; torchft continues without {group}")
            sink.flush()
            coord.leave()
            res.outcome, res.steps = "excluded", s
            return res
    res.steps = coord.current_step()
    res.params = state_digests(st)[0]
    if mgr is not None:
        mgr.close()
    sink.note(f"{actor} finished at step {res.steps}")
    sink.flush()
    coord.leave()
    return res


def _checkpoints(st: RankState, sink: Any, coord: Coordinator, ckpt_dir: str | None, lead: Callable[[], bool]) -> Any:
    """The rank's ``ckpt.CheckpointManager`` on the run's one checkpoint directory (a
    follower until it is the first replica of a quorum: the replicated state needs one
    copy, and every replica, a joiner too, can roll back to any of them) and, with
    ``cfg.guard``, its loss-spike guard."""
    from ckpt import CheckpointManager
    from ckpt.guard import GuardConfig, LossGuard

    cfg = st.cfg
    if not ckpt_dir:
        raise ValueError("periodic checkpoints (ckpt_every) need a checkpoint directory")
    mgr = CheckpointManager(ckpt_dir, {"model": st.model, "optim": st.optim}, data=st.cursor.loader,
                            generators={"augment": st.gen_ckpt}, config={"replicas": cfg.to_dict()},
                            every_steps=cfg.ckpt_every, ledger=False, writer=False, run_id="replicas", signals=())
    if cfg.guard is not None:
        st.guard = LossGuard(mgr, GuardConfig(**cfg.guard), tape=GuardTape(sink, coord, lead))
    return mgr


def _rows(ids: list[int], q: QuorumView, group_size: int, grank: int) -> tuple[int, int]:
    """This rank's rows of the global batch under quorum ``q`` (none when it sits the step out)."""
    if not q.participating:
        return (0, 0)
    return share(len(ids), q.pworld, q.prank, group_size, grank)


def _compute(st: RankState, ids: list[int], rows: tuple[int, int], participants: int, corrupt: bool) -> torch.Tensor:
    """Forward and backward of this rank's rows, from the step's committed generator state."""
    st.gen.set_state(st.gen_ckpt.get_state())
    st.optim.zero_grad(set_to_none=True)
    loss = step_loss(st, ids, rows, participants, corrupt=corrupt)
    loss.backward()
    return loss


def _fault_json(f: Any) -> dict[str, Any]:
    return {"step": f.step, "where": f.where, "bucket": f.bucket, "index": f.index, "bit": f.bit}


def _reexecute(st: RankState, ids: list[int], rows: tuple[int, int], participants: int, gen_before: torch.Tensor,
               flat: _Flat, group_size: int, coord: Coordinator, corrupt: bool) -> list[bytes]:
    """The step's local gradient computed again under the same inputs and generator state
    (parameters are untouched until the commit): its bucket digests, to compare."""
    after = st.gen.get_state()
    st.gen.set_state(gen_before)
    grads = [p.grad for p in st.model.parameters()]
    st.model.zero_grad(set_to_none=True)
    loss = step_loss(st, ids, rows, participants, corrupt=corrupt)
    loss.backward()
    again = _Flat(flat.params, st.cfg.bucket_elems)
    again.gather(loss)
    if group_size > 1:
        coord.intra_sum(again.buf)
    for p, g in zip(st.model.parameters(), grads):
        p.grad = g
    st.gen.set_state(after)
    return bucket_digests(again.buckets)
