"""Shared fixtures. Tests run from the repo root without installation as well."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# An s3:// URL used without the test server (the `s3` fixture) must fail at once, never
# ask the instance-metadata address for credentials (the standard AWS switch).
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def small_state():
    """A tiny model + AdamW with one step taken, so optimizer state exists."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


# --- a real S3-compatible server (moto[server]) on localhost, started by the tests ------


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server in a subprocess on a free port; torn down after the session."""
    pytest.importorskip("obstore", reason="the s3 extra is not installed (pip install 'ckpt-replay[s3]')")
    from s3server import start

    server = start()
    try:
        yield server
    finally:
        server.stop()


class S3Bucket:
    """One fresh bucket on the test server: ``url(key)`` -> ``s3://<bucket>/<key>``;
    ``env`` holds the AWS variables a subprocess needs to reach it."""

    def __init__(self, server, name):
        self.server = server
        self.name = name
        self.env = {**os.environ, **server.env()}

    def url(self, key=""):
        return f"s3://{self.name}/{key}" if key else f"s3://{self.name}"

    def storage(self):
        from ckpt.storage import resolve

        return resolve(self.url())[0]


_buckets = iter(range(1 << 30))


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket, with the standard AWS environment pointing at the test server."""
    import secrets

    from ckpt.storage import forget_backends

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    name = f"ckpt-test-{next(_buckets)}-{secrets.token_hex(3)}"
    s3_server.create_bucket(name)
    forget_backends()
    yield S3Bucket(s3_server, name)
    forget_backends()
