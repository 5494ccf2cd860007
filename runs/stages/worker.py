"""One pipeline stage of one replica: the worker loop of spec/stages.md §3.

The worker acts only on ctl's plans and receives only with ``Endpoint.recv_from``, so its
taped history is a function of the plans and of the messages' contents: the same in a
process over gloo, in a thread over the in-process transport, and in every replay.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

import ckpt
from replay import Actor, state_digest
from replay.channel import Endpoint, Message, message_digest
from runs.stages import sparseloco as sl
from runs.stages.config import StagesConfig
from runs.stages.model import Data, build_stage, flat_params, lr_factor, set_flat_params

__all__ = ["Worker", "LoopState", "RecoveryError", "ProtocolError", "CTL"]

CTL = "ctl"


class ProtocolError(RuntimeError):
    """A message that the protocol of spec/stages.md does not allow here."""


class RecoveryError(RuntimeError):
    """A peer recovery loaded a state whose digest is not its source's."""


class LoopState:
    """The worker's loop position, a snapshot entry of its own (Stateful)."""

    def __init__(self) -> None:
        self.down = False
        self.until = 0
        self.steps_done = 0

    def state_dict(self) -> dict[str, Any]:
        return {"down": self.down, "until": self.until, "steps_done": self.steps_done}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.down, self.until, self.steps_done = bool(d["down"]), int(d["until"]), int(d["steps_done"])


@dataclass
class StepReport:
    loss: float | None = None
    val: float | None = None


class Worker:
    def __init__(self, cfg: StagesConfig, name: str, ep: Endpoint, actor: Actor, run_dir: str | os.PathLike[str],
                 *, data: Data | None = None) -> None:
        self.cfg = cfg
        self.name = name
        self.replica, self.stage = int(name[1:].split("s")[0]), int(name.split("s")[1])
        self.ep = ep
        self.actor = actor
        self.run_dir = Path(run_dir)
        self.data = data if data is not None else Data(cfg)
        self.module = build_stage(cfg, self.stage)
        # the inner optimizer as users write it (spec/stages.md §3); its lr follows lr_factor
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.0)
        self.anchor = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        self.ef = {"e": torch.zeros(sum(p.numel() for p in self.module.parameters()))}
        self.loop = LoopState()
        self.timeout = cfg.io_timeout_s
        self.last = self.stage == cfg.stages - 1
        self.first = self.stage == 0

    # -- state ---------------------------------------------------------------------------
    def entries(self) -> dict[str, Any]:
        """What a snapshot part holds (spec/stages.md §8)."""
        return {"model": self.module, "optim": self.opt, "anchor": self.anchor, "ef": self.ef, "loop": self.loop}

    def recovery_state(self) -> dict[str, Any]:
        return {"model": self.module, "optim": self.opt, "anchor": self.anchor}

    def recovery_named(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors a peer recovery moves, in digest order (spec/stages.md §7)."""
        out = [(f"model.{k}", v) for k, v in self.module.state_dict().items()]
        out += [(f"anchor.{k}", v) for k, v in self.anchor.items()]
        out += [(f"optim.{k}", v) for k, v in self.optim_named()]
        return out

    def optim_named(self) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's tensors in a fixed order (for digests): its step count, then
        both moments by parameter name (zeros before the first step, as AdamW starts)."""
        st = self.opt.state
        params = list(self.module.named_parameters())
        step = next((int(st[p]["step"]) for _, p in params if p in st), 0)
        out = [("step", torch.tensor(step, dtype=torch.int64))]
        for key, slot in (("m", "exp_avg"), ("v", "exp_avg_sq")):
            out += [(f"{key}.{n}", st[p][slot] if p in st else torch.zeros_like(p, memory_format=torch.contiguous_format))
                    for n, p in params]
        return out

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.recovery_named(), ("ef.e", self.ef["e"])]

    # -- the loop ---------------------------------------------------------------------------
    def recv(self, src: str, kind: str, step: int, mb: int | None = None) -> Message:
        msg = self.ep.recv_from(src, timeout=self.timeout)
        m = msg.meta
        if m.get("kind") != kind or (kind != "stop" and m.get("step") != step) or (mb is not None and m.get("mb") != mb):
            raise ProtocolError(f"{self.name}: expected {kind} step {step} mb {mb} from {src}, got {dict(m)}")
        return msg

    def run(self, *, on_plan: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        """Follow plans until ctl says stop; then tape the final state's digests."""
        while True:
            msg = self.ep.recv_from(CTL, timeout=None if self.loop.down else self.timeout)
            plan = msg.meta
            if plan.get("kind") == "stop":
                break
            if plan.get("kind") != "plan":
                raise ProtocolError(f"{self.name}: expected a plan from ctl, got {dict(plan)}")
            if on_plan is not None:
                on_plan(plan)
            self.step(plan)
        self.actor.current_step = int(msg.meta["step"])
        self.actor.params(named=self.named_state())

    def step(self, plan: Mapping[str, Any]) -> None:
        t = int(plan["step"])
        a = self.actor
        a.current_step = t
        if plan["role"] == "down":
            a.event("stage_down", t, int(plan["until"]))
            self.loop.down, self.loop.until = True, int(plan["until"])
            return
        if self.loop.down and not plan["recover_from"]:
            raise ProtocolError(f"{self.name}: a plan for step {t} while offline, without a recovery")
        for target in plan["serve"]:
            self.serve(target, t)
        if plan["recover_from"]:
            self.recover(str(plan["recover_from"]), t)
        a.begin_step(t)
        rep = StepReport()
        busy = plan["role"] == "run"
        if busy:
            rep.loss = self.train(t, plan)
        else:
            a.event("stage_stall", str(plan["stall"]))
        if plan["xchg"]:
            self.exchange(t, list(plan["xchg"]))
        if plan["eval"]:
            rep.val = self.evaluate(t, plan)
        a.end_step()
        self.loop.steps_done += int(busy)
        done: dict[str, Any] = {"kind": "done", "step": t, "busy": busy}
        if self.last and rep.loss is not None:
            done["loss"] = rep.loss
        if self.last and rep.val is not None:
            done["val"] = rep.val
        self.ep.send(CTL, done)

    # -- one training step through the pipeline ------------------------------------------------
    def _send(self, dst: str, meta: dict[str, Any], tensor: torch.Tensor, plan: Mapping[str, Any], direction: str,
              taped: list[bool]) -> None:
        if not taped[0] and plan[f"bypass_{direction}"]:
            self.actor.event("bypass", str(plan["offline"]), self.name, dst, direction)
            taped[0] = True
        self.ep.send(dst, meta, [tensor.detach().contiguous()])

    def train(self, t: int, plan: Mapping[str, Any]) -> float | None:
        cfg, up, down = self.cfg, str(plan["up"]), str(plan["down"])
        for group in self.opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(cfg, t)
        fwd_taped, bwd_taped = [False], [False]
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        losses: list[float] = []
        for mb in range(cfg.microbatches):
            ids = self.data.ids(self.replica, t, mb)
            if self.first:
                self.actor.batch(ids)
                x = self.data.batch(ids)[0]
            else:
                x = self.recv(up, "act", t, mb).tensors[0].requires_grad_(True)
            y = self.module(x)
            if self.last:
                targets = self.data.batch(ids)[1]
                loss = nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]), targets.reshape(-1))
                (loss / cfg.microbatches).backward()
                losses.append(float(loss.detach()))
                self._send(up, {"kind": "grad", "step": t, "mb": mb}, x.grad, plan, "bwd", bwd_taped)
            else:
                self._send(down, {"kind": "act", "step": t, "mb": mb}, y, plan, "fwd", fwd_taped)
                saved.append((x, y))
        if not self.last:
            for mb in range(cfg.microbatches):
                g = self.recv(down, "grad", t, mb).tensors[0]
                x, y = saved[mb]
                y.backward(g)
                if not self.first:
                    self._send(up, {"kind": "grad", "step": t, "mb": mb}, x.grad, plan, "bwd", bwd_taped)
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), cfg.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return sum(losses) / len(losses) if losses else None

    @torch.no_grad()
    def evaluate(self, t: int, plan: Mapping[str, Any]) -> float | None:
        up, down = str(plan["up"]), str(plan["down"])
        x, targets = self.data.val_batch()
        if not self.first:
            x = self.recv(up, "act", t, -1).tensors[0]
        y = self.module(x)
        if not self.last:
            self.ep.send(down, {"kind": "act", "step": t, "mb": -1}, [y.contiguous()])
            return None
        return float(nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]), targets.reshape(-1)))

    # -- the compressed replica exchange (spec/stages.md §6) -----------------------------------
    def exchange(self, t: int, participants: list[str]) -> None:
        cfg = self.cfg
        if self.name not in participants:
            raise ProtocolError(f"{self.name}: an exchange at step {t} without this stage: {participants}")
        theta = flat_params(self.module)
        anchor = torch.cat([v.reshape(-1) for v in self.anchor.values()])
        e = sl.error_feedback(self.ef["e"], anchor, theta, cfg.ef_beta)
        mine = sl.compress(e, chunk=cfg.chunk, topk=cfg.topk, bits=cfg.bits)
        n = e.numel()
        dec = lambda p: sl.decode(p, n, chunk=cfg.chunk, topk=cfg.topk, bits=cfg.bits)  # noqa: E731
        self.ef["e"] = e - dec(mine)
        others = [p for p in participants if p != self.name]
        for peer in others:
            self.ep.send(peer, {"kind": "xchg", "step": t, "n": n}, mine.tensors())
        got: dict[str, sl.Payload] = {self.name: mine}
        refs: list[tuple[str, int]] = []
        for peer in others:
            msg = self.recv(peer, "xchg", t)
            if msg.meta.get("n") != n:
                raise ProtocolError(f"{self.name}: {peer}'s update has {msg.meta.get('n')} values, this stage {n}")
            got[peer] = sl.Payload.of(msg.tensors)
            refs.append((msg.channel, msg.seq + 1))
        total = torch.zeros(n)
        for p in participants:  # one order everywhere: every copy ends with the same anchor
            total += dec(got[p])
        new_anchor = anchor - cfg.outer_lr * (total / len(participants))
        i = 0
        for k, v in self.anchor.items():
            v.copy_(new_anchor[i:i + v.numel()].view_as(v))
            i += v.numel()
        set_flat_params(self.module, new_anchor)
        key = f"xchg/s{self.stage}/{t}"
        self.actor.merge(key, lambda: (refs, [1.0 / len(participants)] * len(participants)))
        self.actor.event("ef_residual", key, state_digest([("e", self.ef["e"])]),
                         sl.kept_count(n, cfg.chunk, cfg.topk), n, mine.nbytes)

    # -- peer recovery (spec/stages.md §7) ---------------------------------------------------
    def serve(self, target: str, t: int) -> None:
        rel = f"recovery/{target}-{t:05d}"
        # One stage's state, written by this process alone (this_rank_only: under the job's
        # process group every worker writes its own recoveries).
        ckpt.save(self.run_dir / rel, self.recovery_state(), step=t, config={"stages": self.cfg.to_dict()},
                  this_rank_only=True, ledger=False)
        named = self.recovery_named()
        digest = state_digest(named)
        msg = self.ep.send(target, {"kind": "recover", "step": t, "path": rel, "digest": digest})
        # every run's peer-recovery pair (spec/tape-format.md §6): what carried the state is the
        # message; nbytes the state's tensor bytes (the checkpoint's own size depends on the
        # topology it records, which a replay as threads does not share)
        nbytes = sum(v.numel() * v.element_size() for _, v in named)
        self.actor.event("recovery_sent", target, message_digest(msg.meta_bytes(), msg.tensors), digest, nbytes)

    def recover(self, src: str, t: int) -> None:
        msg = self.recv(src, "recover", t)
        ckpt.load(self.run_dir / str(msg.meta["path"]), self.recovery_state(), restore_rng=False, ledger=False)
        self.ef["e"].zero_()  # the source's residual is its own (spec/stages.md §7)
        digest = state_digest(self.recovery_named())
        if digest != bytes(msg.meta["digest"]):
            raise RecoveryError(f"{self.name} loaded {msg.meta['path']} from {src}: state digest {digest.hex()}, "
                                f"the source saved {bytes(msg.meta['digest']).hex()}")
        self.actor.event("recovery_loaded", src, message_digest(msg.meta_bytes(), msg.tensors), digest)
        self.actor.event("stage_up", src)
        self.loop.down = False
