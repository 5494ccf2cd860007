"""Environment fingerprint and the exactness gate that compares two of them.

A bit-exact claim holds only within one environment: torch/CUDA/cuDNN versions,
determinism flags, thread counts and a few env variables all change the bits
(see the environment gate in spec/checkpoint-format.md §8).
"""

from __future__ import annotations

import os
import platform
import sys
import threading
from typing import Any, Mapping

__all__ = ["capture_env", "env_diff", "env_differences", "EXACTNESS_KEYS", "prime"]

_ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
)

#: keys whose difference refuses an exactness claim under ``strict``
EXACTNESS_KEYS = (
    "torch",
    "cuda",
    "cudnn",
    "deterministic_algorithms",
    "deterministic_warn_only",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "allow_tf32_matmul",
    "allow_tf32_cudnn",
    "float32_matmul_precision",
    "num_threads",
    "env",
)


def prime() -> None:
    """Compute, on the calling thread, what ``capture_env`` may otherwise compute on a
    save thread by starting a process: ``platform.platform()`` runs ``uname -p`` the first
    time (``platform.uname().processor``; cached by the platform module afterwards). A
    process started on a background thread can deadlock with a DataLoader forking
    workers meanwhile (see ckpt.context.provenance)."""
    platform.platform()


def _platform() -> str:
    u = platform.uname()
    if "processor" in vars(u) or threading.current_thread() is threading.main_thread():
        return platform.platform()
    # Not primed, on a background thread: the same string without asking ``uname -p``.
    # On Linux that answer ("unknown", or the machine name) never shows in the string.
    libc = "".join(platform.libc_ver()) if u.system == "Linux" else ""
    fields = [u.system, u.release, u.machine] + (["with", libc] if libc else [])
    return "-".join(f.strip().replace(" ", "_").replace("/", "-") for f in fields if f)


def capture_env() -> dict[str, Any]:
    import torch

    try:
        import numpy

        np_version: str | None = numpy.__version__
    except ImportError:
        np_version = None
    from .. import __version__

    cudnn = torch.backends.cudnn
    return {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": _platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn.version() if cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "numpy": np_version,
        "ckpt_replay": __version__,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "allow_tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "allow_tf32_cudnn": bool(cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        # Recorded as data (compared at load), never acted on: not a knob (spec/knobs.md).
        "env": {k: os.environ.get(k) for k in _ENV_VARS},
    }


def env_diff(saved: Mapping[str, Any], current: Mapping[str, Any], keys: Any = None) -> dict[str, tuple[Any, Any]]:
    """The one environment comparison: ``key -> (saved, current)`` for every key whose
    values differ (a missing side is None). A key whose values are both mappings (``env``)
    is compared entry by entry, as ``key.entry``. ``keys`` (default: every key of either
    side, sorted) picks and orders the keys; a tape's, a ledger's and a checkpoint's
    environment gates all read this."""
    if keys is None:
        keys = sorted(set(saved) | set(current))
    out: dict[str, tuple[Any, Any]] = {}
    for k in keys:
        a, b = saved.get(k), current.get(k)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    out[f"{k}.{sub}"] = (a.get(sub), b.get(sub))
        elif a != b:
            out[k] = (a, b)
    return out


def env_differences(saved: Mapping[str, Any], current: Mapping[str, Any], keys=EXACTNESS_KEYS) -> list[str]:
    """Human-readable differences, one per key, e.g. ``torch: 2.12.0 -> 2.13.0``."""
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in env_diff(saved, current, keys).items()]
