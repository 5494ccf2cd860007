"""The single-process runs: the checkpoint / bit-exact resume demo, the check-resume entry and the recorder example."""
