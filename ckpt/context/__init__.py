"""Capture and restore of everything beside the tensors: RNG, topology, commit, config, env."""

from __future__ import annotations


def prime(code_dir: str | None = None) -> None:
    """Capture now, on the calling thread, what a save would otherwise capture by starting
    a process (the commit through ``git``, the platform through ``uname -p``). A process
    started on a background save thread deadlocks with a DataLoader that forks workers
    meanwhile (ckpt.context.provenance): a manager calls this on the training loop's
    thread before handing a save to its background thread."""
    from . import env, provenance

    provenance.prime(code_dir)
    env.prime()
