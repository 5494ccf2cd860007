"""RNG state: Python ``random``, numpy's global state, torch CPU, every CUDA device,
and any ``torch.Generator`` the caller registers.

States are stored as plain msgpack values (ints and bytes), never pickled. Restore is
strict: a state that does not fit (e.g. a CUDA state saved on 2 devices restored on
1) raises instead of warning, because a silently partial restore breaks exactness.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterator, Mapping

from ..errors import StateMismatchError

__all__ = ["capture_rng", "restore_rng", "rng_kinds", "isolated"]


def _np():
    try:
        import numpy

        return numpy
    except ImportError:  # numpy stays optional
        return None


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The state of every RNG stream (Python, numpy, torch CPU, every CUDA device, and the
    ``generators`` given), as the plain values a checkpoint stores."""
    import torch

    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": None,
        "torch_cpu": _tensor_bytes(torch.get_rng_state()),
        "cuda": None,
        "generators": {},
    }
    np = _np()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {
            "bit_generator": str(name),
            "keys": keys.astype("<u4").tobytes(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    # Only when CUDA is already initialised: querying would otherwise create a context
    # (and on a CPU-only box there is nothing to capture).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_tensor_bytes(s) for s in torch.cuda.get_rng_state_all()]
    for name, gen in (generators or {}).items():
        out["generators"][str(name)] = {"device": str(gen.device), "state": _tensor_bytes(gen.get_state())}
    return out


def _tensor_bytes(t: Any) -> bytes:
    import ctypes

    t = t.detach().cpu().contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def _byte_tensor(b: bytes):
    import torch

    # RNG state must be a CPU ByteTensor, whatever map_location the caller used
    # (pytorch/ignite#2076, lanl/hippynn#12).
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


def rng_kinds(state: Mapping[str, Any]) -> list[str]:
    kinds = ["python"]
    if state.get("numpy") is not None:
        kinds.append("numpy")
    kinds.append("torch_cpu")
    if state.get("cuda"):
        kinds.append(f"cuda x{len(state['cuda'])}")
    kinds += [f"generator:{g}" for g in state.get("generators", {})]
    return kinds


#: called after every successful restore_rng (ckpt.ledger.auto registers here; a list,
#: not an import, so this module stays below ckpt.ledger)
RESTORE_LISTENERS: list[Callable[[], None]] = []


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None, *, path: str | None = None) -> list[str]:
    """Restore every captured stream; returns the list of streams restored."""
    import torch

    restored = []
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        restored.append("python")
        nps = state.get("numpy")
        np = _np()
        if nps is not None and np is not None:
            keys = np.frombuffer(nps["keys"], dtype="<u4").astype(np.uint32)
            np.random.set_state((nps["bit_generator"], keys, nps["pos"], nps["has_gauss"], nps["cached_gaussian"]))
            restored.append("numpy")
        torch.set_rng_state(_byte_tensor(state["torch_cpu"]))
        restored.append("torch_cpu")
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise StateMismatchError(f"RNG state does not restore: {e}", path=path, key="rng") from None
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise StateMismatchError(
                f"checkpoint holds CUDA RNG state for {len(cuda)} devices, this process has {have}",
                path=path,
                key="rng/cuda",
            )
        torch.cuda.set_rng_state_all([_byte_tensor(b) for b in cuda])
        restored.append(f"cuda x{len(cuda)}")
    saved_gens = state.get("generators", {})
    for name, gen in (generators or {}).items():
        if name not in saved_gens:
            raise StateMismatchError(f"generator {name!r} was not saved in this checkpoint", path=path, key=f"rng/generators/{name}")
        try:
            gen.set_state(_byte_tensor(saved_gens[name]["state"]))
        except RuntimeError as e:
            raise StateMismatchError(f"generator {name!r} does not restore: {e}", path=path, key=f"rng/generators/{name}") from None
        restored.append(f"generator:{name}")
    for listener in list(RESTORE_LISTENERS):  # the default step ledger: streams a load held back are back
        listener()
    return restored


@contextlib.contextmanager
def isolated(generators: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Run a block without moving any training RNG stream.

    On exit (also on an exception) every stream ``capture_rng`` captures is back where
    it was: Python ``random``, numpy's global state, torch CPU, every CUDA device and
    each generator in ``generators``. Evaluation or sampling inside it draws from the
    same streams as usual, but the training run then continues as if it had never run,
    so where a script evaluates relative to its checkpoints (and whether an evaluation
    runs again after a resume) no longer changes the run. Where CUDA is available it is
    initialised on entry, so that a block that first touches the GPU is covered too.
    """
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        torch.cuda.init()
    state = capture_rng(generators)
    try:
        yield
    finally:
        restore_rng(state, generators)
