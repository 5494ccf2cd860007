"""Loss-spike rollback with anticipatory routing: the reference run (``ckpt demo rollback``).

``run.main(rec)`` trains the tiny MoE transformer under a ``ckpt.guard.LossGuard`` with a
recorder, a seeded corrupted window of batches injected as a taped fault; ``demo.main``
runs it with and without the spike, replays the tape in force mode and checks the rest.
"""
