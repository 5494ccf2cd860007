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


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    result = yield  # after every plugin's own (the -m selection, pytest-xdist's)
    _xdist_groups(config, items)
    _scale_timeouts(config, items)
    try:
        import torch

        _TORCH_THREADS.append(torch.get_num_threads())  # before any test changed it
        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    return result


def _xdist_groups(config, items) -> None:
    """``--dist loadgroup``: a worker names each ``xdist_group`` test ``NODEID@GROUP``, which
    the controller's scheduler reads to send a group to one worker. pytest-xdist 3.8 sets
    ``item._nodeid``, which pytest 9.2 no longer reads (``Node.nodeid`` is ``str(item._id)``):
    without this every group's tests were spread over the workers and each paid for its
    shared run again."""
    if not getattr(config.option, "loadgroup", False):  # set in each worker by pytest-xdist
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names or "@" in item.nodeid:
            continue
        grouped = f"{item.nodeid}@{'_'.join(names)}"
        if hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(grouped)
        else:
            item._nodeid = grouped


_TORCH_THREADS: list[int] = []


@pytest.fixture(autouse=True)
def _torch_threads():
    """torch's intra-op thread count is per process: a test that pins it (a recording's
    environment) must not leak it into the next test of its process, which a replay compares
    with its recording's (``num_threads``); which test ran before is chance under pytest-xdist."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and _TORCH_THREADS and torch.get_num_threads() != _TORCH_THREADS[0]:
        torch.set_num_threads(_TORCH_THREADS[0])


@pytest.fixture(autouse=True)
def _fresh_default_ledger():
    """ckpt.save/ckpt.load's default step ledger is one per process (torch's global
    optimizer hooks): each test starts with none, as a fresh script would."""
    yield
    mod = sys.modules.get("ckpt.ledger.auto")
    if mod is not None:
        mod.reset()


def _scale_timeouts(config, items) -> None:
    """pytest-timeout's bounds are hang detectors (tests/hangs.py), never speed verdicts:
    a test's ``@pytest.mark.timeout(S)`` can only widen the suite's default (a tighter mark
    failed multi-process tests that were merely slow on a loaded machine), and every bound
    is multiplied by CKPT_TIMEOUT_SCALE."""
    from hangs import scale

    factor = scale()
    try:
        default = float(config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not installed: nothing to scale
        return
    if default <= 0:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        base = float(marker.args[0]) if marker is not None and marker.args else default
        bound = max(base, default) * factor
        if bound != base:
            item.add_marker(pytest.mark.timeout(bound), append=False)


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


# --- long commands that several tests need, run once per session ---------------------------
#: name -> (the command line exactly as the README or docs/*.md shows it, its hang bound in seconds:
#: many times its quiet time, scaled by CKPT_TIMEOUT_SCALE; on expiry its processes' stacks are dumped).
#: ``/tmp/`` in it stands for the run's own scratch directory (as in tests/e2e/test_readme.py).
#: A README/docs block marked ``<!-- example: shared=NAME -->`` shows this command and its output;
#: the tests that check more of the run's claims ask ``shared_runs.get(NAME)`` for the same run,
#: so that a demo of minutes is paid once however many tests read it.
SHARED_RUNS: dict[str, tuple[str, float]] = {
    "demo": ("ckpt demo --out /tmp/demo-real", 1800),
    "stages-quick": ("ckpt demo stages --quick --out /tmp/stages-demo", 1200),
    "rollback-quick": ("ckpt demo rollback --quick --out /tmp/rollback-demo", 600),
    "replicas-quick": ("ckpt demo replicas --quick --out /tmp/replicas-demo", 1200),
}


class SharedRun:
    """One finished run of a :data:`SHARED_RUNS` command: its scratch directory, what it
    printed (stdout and stderr together, as a terminal shows them) and its exit code."""

    def __init__(self, command: str, scratch, output: str, returncode: int) -> None:
        self.command, self.scratch, self.output, self.returncode = command, scratch, output, returncode

    def path(self, shown: str):
        """The real path of a ``/tmp/...`` path as the command line shows it."""
        assert shown.startswith("/tmp/"), shown
        return self.scratch / shown[len("/tmp/"):]


class SharedRuns:
    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._done: dict[str, SharedRun] = {}

    @staticmethod
    def env() -> dict[str, str]:
        """The environment of a README console command: the virtualenv's ``bin`` first on
        PATH, the repository importable, no progress bars, stdout unbuffered."""
        env = dict(os.environ)
        env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
        env["CKPT_PROGRESS"] = "0"
        env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleave in time order, as on a terminal
        env.setdefault("COLUMNS", "120")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
        return env

    @staticmethod
    def command(name: str) -> str:
        assert name in SHARED_RUNS, f"shared run {name!r}: known are {sorted(SHARED_RUNS)}"
        return SHARED_RUNS[name][0]

    def get(self, name: str) -> SharedRun:
        """The run named ``name``, run now if no test of this session ran it yet."""
        import re
        import subprocess

        from hangs import run, scale

        if name not in self._done:
            cmd, bound = self.command(name), SHARED_RUNS[name][1]
            scratch = self._factory.mktemp(f"shared-{name}")
            real = re.sub(r"(?<![\w.])/tmp/", f"{scratch}/", cmd)
            p = run(["bash", "-c", real], cwd=scratch, env=self.env(), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, bound_s=bound * scale())
            self._done[name] = SharedRun(cmd, scratch, p.stdout, p.returncode)
        return self._done[name]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    """:class:`SharedRuns`: ``shared_runs.get("stages-quick")`` runs that command once per session."""
    return SharedRuns(tmp_path_factory)
