"""Counter-based seed derivation: every random choice of the loader is a pure function.

The loader never keeps a stateful generator. Each random quantity (a round key of the
epoch permutation, the seed of one sample's augmentation RNG, a replacement candidate
for a quarantined sample) is ``mix64(tag, *counters)``: SplitMix64's finaliser folded
over 64-bit words. That makes every quantity addressable in O(1) from its counters
(seed, epoch, position, attempt) and identical on every platform and torch version,
because it is plain integer arithmetic on Python ints.

The tags keep the streams apart: a sample seed can never equal a round key, even for
equal counters.
"""

from __future__ import annotations

__all__ = [
    "M64",
    "TAG_PERMUTATION",
    "TAG_SAMPLE",
    "TAG_COLLATE",
    "TAG_RESAMPLE",
    "TAG_LOADER",
    "splitmix64",
    "mix64",
    "mix64_continue",
    "sample_seed",
    "resample_index",
]

M64 = (1 << 64) - 1

# Domain-separation tags (ASCII of the stream name; any distinct constants would do,
# but they are part of the order's definition: changing one changes every run).
TAG_PERMUTATION = 0x7065726D  # "perm"
TAG_SAMPLE = 0x73616D70  # "samp"
TAG_COLLATE = 0x636F6C6C  # "coll"
TAG_RESAMPLE = 0x72657361  # "resa"
TAG_LOADER = 0x6C6F6164  # "load"

_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a bijective 64-bit mixer."""
    x = (x + _GOLDEN) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def mix64(*words: int) -> int:
    """Hash a sequence of non-negative integers below 2**64 to one 64-bit integer."""
    return mix64_continue(0, *words)


def mix64_continue(h: int, *words: int) -> int:
    """``mix64(*a, *b) == mix64_continue(mix64(*a), *b)``: hash a shared prefix once."""
    for w in words:
        if w < 0 or w > M64:
            raise ValueError(f"mix64 word must be in [0, 2^64), got {w}")
        h = splitmix64(h ^ w)
    return h


def sample_seed(seed: int, epoch: int, position: int, attempt: int = 0) -> int:
    """The 64-bit seed of the RNGs used while fetching global position ``position``.

    ``attempt`` is 0 for the sample first drawn at that position and k for its k-th
    replacement, so a replacement's augmentation does not depend on how much RNG the
    rejected candidates consumed (or whether they were skipped without being read).
    """
    return mix64(TAG_SAMPLE, seed, epoch, position, attempt)


def resample_index(seed: int, epoch: int, position: int, attempt: int, num_samples: int) -> int:
    """The candidate tried at ``attempt`` (>= 1) when earlier ones were quarantined.

    Uniform up to a modulo bias of ``num_samples / 2**64``, which is negligible.
    """
    return mix64(TAG_RESAMPLE, seed, epoch, position, attempt) % num_samples
