"""The object-store compression benchmark's path: ckpt -> bandwidth-capped proxy -> moto.

``bench/compress.py --s3`` measures compressed against uncompressed saves and loads through
``bench/throttle.py`` (a token-bucket TCP proxy) in front of the test S3 server. This checks
that the path works end to end, fast (a cap far above what the test moves): a compressed and
an uncompressed checkpoint saved and loaded through the proxy only, every float dtype
exactly, and the bytes counted by the proxy (so they did not bypass it). The object-store
sink keeps its buffers until upload, so this also covers the encoder's fresh-buffer path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import ckpt

# multi-process runs, subprocesses or heavy imports: `make check` leaves them out
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _throttle():
    spec = importlib.util.spec_from_file_location("ckpt_bench_throttle", REPO / "bench" / "throttle.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_compressed_and_plain_checkpoints_round_trip_through_the_capped_proxy(s3, monkeypatch) -> None:
    from ckpt.storage import forget_backends

    proxy = _throttle().start(s3.server.endpoint, 2000, thread=True)  # 2 GB/s: never the limit here
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        forget_backends()
        g = torch.Generator().manual_seed(1)
        state = {"m": {str(dt).split(".")[1]: (torch.randn(70001, generator=g) * 0.02).to(dt)
                       for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}}
        a = ckpt.save(s3.url("run/packed"), state, compress=True)
        b = ckpt.save(s3.url("run/plain"), state)
        stored = sum(f.size for f in ckpt.open(a.path).part().files)
        for info in (a, b):
            r = ckpt.open(info.path)
            r.verify()
            back = r.state()
            for k, t in state["m"].items():
                assert back["m"][k].dtype == t.dtype and torch.equal(back["m"][k], t)
        raw = sum(t.numel() * t.element_size() for t in state["m"].values())
        assert stored < raw  # it did compress
        c = proxy.counters
        assert c is not None and c.connections >= 1
        assert c.up >= stored + raw and c.down >= stored + raw  # both saves up, both loads (and verifies) down
    finally:
        proxy.stop()
        forget_backends()
