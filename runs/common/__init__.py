"""What the reference runs share.

- ``tiny_lm``: the tiny language model and its synthetic corpus;
- ``chaos``: the seeded fault schedule in logical time (four fault classes), taped once;
- ``report``: named checks, the tape's fault tally, checkpoint verification, wording;
- ``plot``: loss curves with the faults marked.
"""
