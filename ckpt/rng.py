"""RNG streams of a training process: ``isolated()`` and the capture/restore pair.

``with ckpt.rng.isolated(): evaluate(model)`` runs an evaluation (or sampling) without
moving any training stream: Python, numpy, torch CPU, every CUDA device and the
generators passed in are back where they were on exit.
"""

from __future__ import annotations

from .context.rng import capture_rng, isolated, restore_rng

__all__ = ["isolated", "capture_rng", "restore_rng"]
