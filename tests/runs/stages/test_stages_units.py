"""The pipeline-stage run, in-process (spec/stages.md): the workers are the run's own,
driven by the test acting as ctl over the in-process transport, on a real tape.

- bypass exactness: a bypassed step's activations and outputs equal, bit for bit, the
  model's forward pass with the stage removed (every compression variant);
- recovery: the recovered stage's state equals its source's, tensor for tensor, and a
  damaged recovery checkpoint or a wrong digest is refused;
- compression: the error-feedback residual is carried exactly across exchanges (an
  independent recomputation agrees bit for bit) and every copy ends with one anchor;
- the schedule never removes the last live copy of a stage, and every rejoin has a source.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from replay import TapeReader, check_tape, state_digest
from replay.channel import Endpoint, InProcessNetwork, Message, RecorderSink
from runs.stages import sparseloco as sl
from runs.stages.chaos import make_schedule, plans_at
from runs.stages.config import StagesConfig
from runs.stages.model import Data, build_stage, flat_params, forward_without
from runs.stages.run import open_recorder
from runs.stages.worker import RecoveryError, Worker
import hangs

CFG = StagesConfig(replicas=2, steps=8, corpus_seqs=256, val_seqs=16, transport="threads", chaos=False)


class Job:
    """Workers on an in-process network, recording on one tape; the test plays ctl."""

    def __init__(self, cfg: StagesConfig, tmp: Path, names: list[str] | None = None) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.tape = tmp / "job.tape"
        self.rec = open_recorder(self.tape, cfg)
        self.net = InProcessNetwork(cfg.edges(), actors=cfg.actors)
        self.sink = RecorderSink(self.rec)
        self.eps = {a: Endpoint(self.net.transport(a), sink=self.sink) for a in cfg.actors}
        data = Data(cfg)
        self.w = {n: Worker(cfg, n, self.eps[n], self.sink.actor(n), tmp, data=data) for n in (names or cfg.workers)}
        self.seen: dict[str, list[Message]] = {n: [] for n in self.w}
        for n in self.w:
            self.eps[n].on_deliver(self.seen[n].append)

    def step(self, plans: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Send the plans, run every planned worker's step in a thread, collect the dones."""
        import threading

        errors: list[BaseException] = []

        def go(n: str) -> None:
            try:
                self.w[n].step(self.eps[n].recv_from("ctl").meta)
            except BaseException as e:  # re-raised below
                errors.append(e)
                self.net.kill(n, repr(e))

        for n in sorted(plans):
            self.eps["ctl"].send(n, plans[n])
        ts = [threading.Thread(target=go, args=(n,)) for n in sorted(plans)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(hangs.hang_s(6))  # a hang bound: a thread still running is named below
        stuck = [t.name for t in ts if t.is_alive()]
        assert not stuck, f"HANG: stage threads {stuck} had not finished (a hang bound)"
        if errors:
            raise errors[0]
        return {n: self.eps["ctl"].recv_from(n).meta for n in sorted(plans) if plans[n]["role"] != "down"}

    def close(self) -> None:
        self.rec.close()


def _plan(cfg: StagesConfig, t: int, **over: Any) -> dict[str, dict[str, Any]]:
    plans = plans_at(cfg, make_schedule(cfg.with_(chaos=False)), t)
    for n, changes in over.items():
        plans[n] = {**plans[n], **changes}
    return plans


def _bypass_plans(cfg: StagesConfig, t: int, offline: str = "r0s1", *, eval_: bool = False) -> dict[str, Any]:
    """Replica 0 with inner stage 1 offline at step t: stage 0 sends to stage 2 and back."""
    plans = _plan(cfg, t)
    plans.pop(offline)
    plans["r0s0"] = {**plans["r0s0"], "down": "r0s2", "offline": offline, "bypass_fwd": True, "eval": eval_}
    plans["r0s2"] = {**plans["r0s2"], "up": "r0s0", "offline": offline, "bypass_bwd": True, "eval": eval_}
    for n in ("r0s3",):
        plans[n] = {**plans[n], "offline": offline, "eval": eval_}
    return {n: p for n, p in plans.items() if n.startswith("r0")}


# -- bypass exactness ---------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["shared", "random", "learned", "none"])
def test_a_bypassed_step_is_the_forward_pass_without_the_stage(tmp_path: Path, compression: str) -> None:
    cfg = CFG.with_(compression=compression)
    job = Job(cfg, tmp_path, [cfg.worker(0, j) for j in range(4)])
    before = [copy.deepcopy(job.w[cfg.worker(0, j)].module) for j in range(4)]
    done = job.step(_bypass_plans(cfg, 0, eval_=True))
    job.close()
    data = Data(cfg)
    for mb in range(cfg.microbatches):
        x, y = data.batch(data.ids(0, 0, mb))
        # what stage 2 received (from stage 0, around stage 1) is stage 0's output ...
        (act,) = [m for m in job.seen["r0s2"] if m.meta.get("kind") == "act" and m.meta["mb"] == mb]
        assert act.src == "r0s0" and torch.equal(act.tensors[0], before[0](x))
        # ... and the last stage's input is the forward pass with stage 1 removed
        (act3,) = [m for m in job.seen["r0s3"] if m.meta.get("kind") == "act" and m.meta["mb"] == mb]
        assert torch.equal(act3.tensors[0], forward_without(before[:3], x, skip={1}))
        assert not torch.equal(act3.tensors[0], forward_without(before[:3], x))  # the stage did matter
    # the validation forward (after the step's update) takes the same route: its loss is the
    # updated model-without-stage-1's
    with torch.no_grad():
        xv, yv = data.val_batch()
        logits = forward_without([job.w[cfg.worker(0, j)].module for j in range(4)], xv, skip={1})
        want = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yv.reshape(-1)))
    assert done["r0s3"]["val"] == want
    # on the tape: one bypass per direction, by the two neighbours, and nothing of stage 1
    evs = list(TapeReader(job.tape).events())
    bys = sorted((e.actor, e.payload["direction"], e.payload["src"], e.payload["dst"]) for e in evs
                 if e.kind.name == "bypass")
    assert bys == [("r0s0", "fwd", "r0s0", "r0s2"), ("r0s2", "bwd", "r0s2", "r0s0")]
    assert not [e for e in evs if e.actor == "r0s1" and e.kind.name != "actor"]


def test_first_and_last_stages_are_never_skipped() -> None:
    stages = [build_stage(CFG, j) for j in range(4)]
    x = torch.zeros(1, 4, dtype=torch.long)
    for j in (0, 3):
        with pytest.raises(ValueError, match="never skipped"):
            forward_without(stages, x, skip={j})
    cfg = CFG.with_(chaos=True, p=0.0, edge_p=1.0, steps=6, k=3)
    sched = make_schedule(cfg)
    assert sched.outages and all(o.edge and o.stage in (0, 3) for o in sched.outages)
    o = sched.outages[0]
    plans = plans_at(cfg, sched, o.first + 1)
    mine = {n: p for n, p in plans.items() if n.startswith(f"r{o.replica}")}
    # the replica stalls: its live stages idle, nobody routes around the dead end stage
    assert {p["role"] for p in mine.values()} == {"stall"} and all(p["stall"] == "edge-down" for p in mine.values())
    assert not any(p.get("bypass_fwd") or p.get("bypass_bwd") for p in plans.values())


# -- peer recovery -------------------------------------------------------------------------


def _recovery_job(tmp_path: Path) -> tuple[Job, Worker, Worker]:
    cfg = CFG
    job = Job(cfg, tmp_path, ["r0s1", "r1s1"])
    src, dst = job.w["r1s1"], job.w["r0s1"]
    with torch.no_grad():  # the source has trained on: its state differs everywhere from the target's
        for p in src.module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for p in src.anchor.values():
            p.sub_(0.05)
    for p in src.module.parameters():  # an AdamW state of its own: a step taken, then moved on
        p.grad = torch.randn_like(p)
    src.opt.step()
    src.opt.zero_grad()
    for st in src.opt.state.values():
        st["step"].fill_(7)
        st["exp_avg"].add_(0.25)
        st["exp_avg_sq"].add_(0.25)
    dst.ef["e"].fill_(3.0)
    return job, src, dst


def test_recovered_state_equals_the_source(tmp_path: Path) -> None:
    job, src, dst = _recovery_job(tmp_path)
    assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(src.recovery_named(), dst.recovery_named()))
    job.sink.actor("r1s1").current_step = job.sink.actor("r0s1").current_step = 5
    src.serve("r0s1", 5)
    dst.recover("r1s1", 5)
    job.close()
    mine, theirs = dst.recovery_named(), src.recovery_named()
    assert [n for n, _ in mine] == [n for n, _ in theirs]
    for (n, a), (_, b) in zip(mine, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    assert int(dict(dst.optim_named())["step"]) == 7 and torch.equal(dst.ef["e"], torch.zeros_like(dst.ef["e"]))  # its own residual restarts
    evs = {e.kind.name: e for e in TapeReader(job.tape).events()
           if e.kind.name in ("stage_up", "recovery_sent", "recovery_loaded")}
    sent, loaded = evs["recovery_sent"].payload, evs["recovery_loaded"].payload
    assert loaded["state"] == sent["state"] and loaded["stream"] == sent["stream"]
    assert sent["nbytes"] > 0 and sent["state"] == state_digest(theirs)
    assert evs["stage_up"].payload["source"] == loaded["source"] == "r1s1" and sent["peer"] == "r0s1"
    import ckpt

    ckpt.open(tmp_path / "recovery" / "r0s1-00005").verify()


def test_a_damaged_recovery_is_refused(tmp_path: Path) -> None:
    import ckpt.errors

    job, src, dst = _recovery_job(tmp_path)
    src.serve("r0s1", 2)
    part = next((tmp_path / "recovery" / "r0s1-00002").glob("*.safetensors"))
    raw = bytearray(part.read_bytes())
    raw[-3] ^= 0xFF  # one flipped bit in a tensor
    part.write_bytes(bytes(raw))
    before = [t.clone() for _, t in dst.recovery_named()]
    with pytest.raises(ckpt.errors.CkptError):
        dst.recover("r1s1", 2)
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, dst.recovery_named()))  # all or nothing
    # a recovery order whose digest is not the named checkpoint's state: the load succeeds
    # (the checkpoint itself is sound), the digest check refuses
    src.serve("r0s1", 3)
    job.eps["r1s1"].send("r0s1", {"kind": "recover", "step": 9, "path": "recovery/r0s1-00003", "digest": bytes(16)})
    dst.recover("r1s1", 3)  # step 3's own order: fine
    with pytest.raises(RecoveryError, match="state digest"):
        dst.recover("r1s1", 9)
    job.close()


# -- the compressed replica exchange ---------------------------------------------------------


def test_sparseloco_payload_round_trip_and_bounds() -> None:
    g = torch.Generator().manual_seed(3)
    e = torch.randn(1000, generator=g)
    e[5] = e[6] = 0.0
    p = sl.compress(e, chunk=64, topk=8, bits=2)
    d = sl.decode(p, 1000, chunk=64, topk=8, bits=2)
    assert int((d != 0).sum()) == sl.kept_count(1000, 64, 8) == 15 * 8 + 8
    for c in range(16):
        seg = e[c * 64:(c + 1) * 64]
        kept = set(torch.nonzero(d[c * 64:(c + 1) * 64]).flatten().tolist())
        assert kept == set(seg.abs().topk(min(8, seg.numel())).indices.tolist())
        assert torch.all(torch.sign(d[c * 64:(c + 1) * 64][list(kept)]) == torch.sign(seg[list(kept)]))
    assert p.nbytes == sl.kept_count(1000, 64, 8) * (1 + 2 / 8) + 16 * 4
    with pytest.raises(ValueError, match="do not fit"):
        sl.decode(sl.Payload(p.offs[:-1], p.codes, p.scales), 1000, chunk=64, topk=8, bits=2)
    bad = p.offs.clone()
    bad[-1] = 255
    with pytest.raises(ValueError, match="outside its chunk"):
        sl.decode(sl.Payload(bad, p.codes, p.scales), 1000, chunk=64, topk=8, bits=2)
    with pytest.raises(ValueError, match="uint8"):
        sl.Payload.of([p.offs.to(torch.int32), p.codes, p.scales])


def test_error_feedback_is_carried_exactly_across_exchanges(tmp_path: Path) -> None:
    cfg = CFG.with_(outer_every=1)  # an exchange after every step
    job = Job(cfg, tmp_path)
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {n: [] for n in job.w}
    for n, w in job.w.items():  # what each exchange starts from: (theta, anchor, residual)
        real = w.exchange

        def spy(t: int, parts: list[str], w: Worker = w, real: Any = real, n: str = n) -> None:
            seen[n].append((flat_params(w.module), torch.cat([v.reshape(-1) for v in w.anchor.values()]),
                            w.ef["e"].clone()))
            real(t, parts)

        w.exchange = spy  # type: ignore[method-assign]
    expected: dict[str, torch.Tensor] = {}
    kw = {"chunk": cfg.chunk, "topk": cfg.topk, "bits": cfg.bits}
    for t in range(3):
        job.step(_plan(cfg, t))
        for j in range(cfg.stages):
            names = [cfg.worker(r, j) for r in range(cfg.replicas)]
            sent = []
            for n in names:
                theta, anchor, residual = seen[n][t]
                if t == 0:
                    assert torch.equal(residual, torch.zeros_like(residual))
                else:  # the residual the exchange started from is exactly the one the last one left
                    assert torch.equal(residual, expected[n]), (n, t)
                e = residual * cfg.ef_beta + (anchor - theta)
                c = sl.decode(sl.compress(e, **kw), e.numel(), **kw)
                expected[n] = e - c
                assert torch.equal(job.w[n].ef["e"], expected[n]), (n, t)
                sent.append((anchor, c))
            total = torch.zeros_like(sent[0][1])
            for _, c in sent:
                total += c
            new = sent[0][0] - cfg.outer_lr * (total / len(names))
            for n in names:  # every copy of the stage ends with the same anchor, and adopts it
                w = job.w[n]
                assert torch.equal(torch.cat([v.reshape(-1) for v in w.anchor.values()]), new)
                assert torch.equal(flat_params(w.module), new)
    job.close()
    evs = [e for e in TapeReader(job.tape).events() if e.kind.name in ("merge", "ef_residual")]
    assert len(evs) == 2 * 3 * len(job.w)
    assert check_tape(job.tape) == []


def test_every_rejoin_has_a_steady_source() -> None:
    for seed in range(20):
        cfg = StagesConfig(replicas=2 + seed % 3, steps=60, p=0.2, k=5, edge_p=0.05, seed=seed)
        sched = make_schedule(cfg)
        for t in range(cfg.steps):
            for j in range(cfg.stages):  # never every copy of a stage down at once
                assert any(not sched.down(r, j, t) for r in range(cfg.replicas)), (seed, t, j)
        for o in sched.outages:
            if o.until < cfg.steps:
                assert o.source != o.replica and not sched.down(o.source, o.stage, o.until)
                assert not sched.rejoining(o.source, o.stage, o.until)
            else:
                assert o.source == -1
        assert make_schedule(cfg) == sched  # a pure function of the config
