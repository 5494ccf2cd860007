"""Conversions between our checkpoints and other layouts, one module per foreign layout:
``ckpt.convert.hf`` (the Hugging Face layout that ``transformers``' ``from_pretrained``
reads) and ``ckpt.convert.dcp`` (``torch.distributed.checkpoint``'s own ``.metadata`` +
``*.distcp``). A converter reads or writes the foreign files itself: they are not
checkpoint bytes of ours. Nothing here imports torch or transformers at import time."""

from __future__ import annotations

__all__ = ["hf", "dcp"]
