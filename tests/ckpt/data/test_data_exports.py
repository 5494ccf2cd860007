"""The public surface of ckpt.data stays exactly what the docs describe."""

from __future__ import annotations

import ckpt.data


def test_all_is_exact_and_importable() -> None:
    assert sorted(ckpt.data.__all__) == sorted([
        "ResumableLoader", "ShardSource", "QuarantinePolicy", "QuarantineRecord", "ResumeInfo", "BatchInfo", "DataEdit",
        "OnQuarantine", "EpochOrder", "sample_seed", "merge_rank_states", "STATE_VERSION",
    ])
    for name in ckpt.data.__all__:
        assert getattr(ckpt.data, name) is not None
    public = {n for n in vars(ckpt.data) if not n.startswith("_") and n != "annotations"}
    assert public == set(ckpt.data.__all__)
