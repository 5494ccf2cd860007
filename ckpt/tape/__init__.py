"""Pure tape framing (spec/tape-format.md §3-§5, §7), shared by ``ckpt.ledger`` and ``replay.tape``."""
