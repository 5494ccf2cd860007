"""Capture and restore of everything beside the tensors: RNG, topology, commit, config, env."""
