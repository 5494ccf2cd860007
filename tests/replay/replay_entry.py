"""Entry points re-executed by the replay tests (loaded by file path, not collected).

``TAMPER`` lets a test change a *replay* (never the recording): flip one parameter bit
at a step, stop early, add an event, or make the machine "slower".
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

TAMPER: dict[str, Any] = {}
CALLS = {"quorum_compute": 0}


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        t.view(-1).view(torch.int32)[index] ^= 1 << bit


def train(rec: Any) -> None:
    """A plain loop with the recorder's few lines; resumes via ckpt when rec.resume_from is set."""
    cfg = rec.config
    seed_all(cfg.get("seed", 0))
    model, opt = build()
    start = 0
    if rec.resume_from:
        import ckpt

        info = ckpt.load(rec.resume_from, {"model": model, "optim": opt})
        start = int(info.step) + 1
    rec.watch(model)
    steps = TAMPER.get("steps", cfg["steps"]) if rec.mode != "record" else cfg["steps"]
    for step in range(start, steps):
        with rec.step(step):
            ids = [(step * 4 + i) % 97 for i in range(4)]
            rec.batch(ids)
            g = torch.Generator().manual_seed(10_000 + step)
            x = torch.randn(4, 4, generator=g)
            y = torch.randn(4, 2, generator=g)
            loss = torch.nn.functional.mse_loss(model(x) + 0.01 * torch.randn(4, 2), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.loss(loss)
            if rec.mode != "record" and TAMPER.get("flip_at") == step:
                flip_bit(dict(model.named_parameters())[TAMPER["tensor"]], TAMPER["index"], TAMPER["bit"])
            if rec.mode == "record" and cfg.get("dump_at") == step:
                from safetensors.torch import save_file

                save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, cfg["dump_path"])
            if rec.mode != "record" and TAMPER.get("extra_note_at") == step:
                rec.note("surprise")
            if cfg.get("ckpt_every") and step % cfg["ckpt_every"] == 0:
                path = f"{cfg['ckpt_dir']}/step-{step:05d}"
                if not rec.replaying:  # a replay re-executes; it does not rewrite the checkpoints
                    import ckpt

                    ckpt.save(path, {"model": model, "optim": opt}, step=step, config=cfg)
                rec.checkpoint(f"step-{step:05d}", path)  # every mode: the marker is part of the history


def fake_now(learner: int, step: int) -> float:
    """Arrival time of a learner's push: what a wall clock would say on this machine."""
    slow = TAMPER.get("slow", 0.0)
    return (learner * 7 + step * 3) % 10 / 10.0 + (slow if learner == 2 else 0.0)


def syncer(rec: Any) -> None:
    """A syncer and three learners in one process: pushes, a timing-based quorum, a merge."""
    cfg = rec.config
    seed_all(cfg.get("seed", 0))
    learners = [rec.actor(f"learner-{i}") for i in range(3)]
    weights = torch.zeros(3)
    for step in range(cfg["steps"]):
        with rec.step(step):
            stamps = []
            for i, lr in enumerate(learners):
                lr.current_step = step
                delta = torch.full((3,), float(i + step))
                stamps.append(lr.send(f"push/{i}", delta, peer="main"))
            for s in stamps:
                rec.recv(s)

            def decide_quorum() -> list[str]:
                CALLS["quorum_compute"] += 1
                return [f"learner-{i}" for i in range(3) if fake_now(i, step) < cfg["grace"]]

            members = rec.quorum(f"step-{step}", 1, decide_quorum)
            contribs, w = rec.merge(f"step-{step}", lambda: (
                [s for s, i in zip(stamps, range(3)) if f"learner-{i}" in members], [1.0 / len(members)] * len(members)))
            for (ch, _seq), wt in zip(contribs, w):
                i = int(ch.split("/")[1])
                weights += wt * torch.full((3,), float(i + step))
            rec.metric("w0", weights[0])
