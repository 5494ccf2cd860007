"""A plain PyTorch loop with the recorder's few lines, for docs/tape.md and ``ckpt replay``.

``ckpt replay`` re-executes ``main(rec)``: in record mode the recorder writes the tape;
in verify mode every event is compared with the tape as it is produced.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from runs.common.tiny_lm import TinyConfig, TinyLM, make_corpus


def main(rec: Any) -> None:
    cfg = rec.config
    seed = int(cfg.get("seed", 0))
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    tiny = TinyConfig(dim=32, layers=1, seq_len=16)
    model = TinyLM(tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = make_corpus(256, tiny.seq_len, tiny.vocab, seed=seed)
    start = 0
    if rec.resume_from:  # `ckpt replay TAPE --from CHECKPOINT`
        import ckpt

        start = int(ckpt.load(rec.resume_from, {"model": model, "optim": opt}, ledger=False).step) + 1  # the tape checks it
    rec.watch(model)  # parameter digests every K steps (K=10 by default)
    for step in range(start, int(cfg.get("steps", 20))):
        with rec.step(step):  # step begin/end, RNG digests
            ids = torch.randint(0, corpus.shape[0], (8,))
            rec.batch(ids.tolist())
            loss = model.loss(corpus[ids])
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.loss(loss)  # exact float64 bits
            if cfg.get("ckpt_dir") and step % int(cfg.get("ckpt_every", 10)) == 0:
                path = f"{cfg['ckpt_dir']}/step-{step:08d}"
                if not rec.replaying:  # a replay re-executes; it does not rewrite checkpoints
                    import ckpt

                    ckpt.save(path, {"model": model, "optim": opt}, step=step, config=dict(cfg), overwrite=True,
                              ledger=False)  # the tape is this run's record
                rec.checkpoint(f"step-{step:08d}", path)
