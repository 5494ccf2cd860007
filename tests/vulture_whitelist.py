"""Names that ``vulture`` (``make lint``) takes for unused but that a caller outside this
repository uses: parsed by vulture, never imported. Each line says who uses the name."""

# ruff: noqa
# mypy: ignore-errors

batch_idx  # Lightning calls Callback.on_train_batch_start/_end with it by name (ckpt/integrations/lightning.py)
weights_only  # Lightning's CheckpointIO.load_checkpoint signature (ckpt/integrations/lightning.py)
