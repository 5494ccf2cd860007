"""Exact resume inside third-party trainers, one small module each.

* ``ckpt.integrations.hf``: ``CkptTrainer``, a ``transformers.Trainer`` subclass (extra ``[hf]``)
* ``ckpt.integrations.lightning``: a ``CheckpointIO`` plugin and its RNG callback (extra ``[lightning]``)
* ``ckpt.integrations.accelerate``: ``save_state``/``load_state`` for an ``Accelerator`` (extra ``[accelerate]``)
* ``ckpt.integrations.torchtitan``: ``CkptCheckpointManager``, torchtitan's checkpoint manager
  writing ckpt checkpoints through ``ckpt.dcp`` (extra ``[torchtitan]``)
* ``ckpt.integrations.stateful_data``: ``WorkerRNG``, the ``StatefulDataLoader`` workers' RNG in the
  loader state (random augmentation in workers resumed exactly; extra ``[torchdata]``)

``import ckpt`` never imports these modules, and this package imports none of them:
each needs its library installed and is imported by name.
"""

__all__: list[str] = []
