"""The torch side of reading: fresh tensors, in-place restore, applying to Statefuls."""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .context.env import capture_env, env_differences
from .context.rng import restore_rng
from .errors import EnvironmentMismatchError, FormatError, SizeMismatchError, StateMismatchError
from .format import dtypes
from .format.manifest import Manifest, PartEntry, TensorEntry
from .format.tree import DeviceRef, DtypeRef, ReplicaRef, TensorRef
from .reader import CheckpointReader
from .writer import tensor_memoryview

__all__ = ["read_tensor", "materialize_state", "load_into", "LoadResult", "ExactnessWarning"]


class ExactnessWarning(RuntimeWarning):
    """The environment differs from the saving one: a bit-exact claim would not hold."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    path: str
    id: str
    step: int | None
    part: str
    context: dict[str, Any]
    manifest: Manifest
    env_differences: tuple[str, ...] = ()
    exact: bool = True
    restored_rng: tuple[str, ...] = ()
    in_place: int = 0
    fresh: int = 0
    extra: Any = None


def _empty(t: TensorEntry) -> torch.Tensor:
    # Plain allocation. Advising transparent huge pages was tried and measured: in a
    # fresh process it made loads 3-4x slower (THP allocation and compaction cost).
    return torch.empty(t.shape, dtype=dtypes.torch_dtype(t.dtype))


def _place(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    if map_location is None:
        return t
    if callable(map_location):
        return map_location(t)
    return t.to(map_location)


def read_tensor(reader: CheckpointReader, pe: PartEntry, t: TensorEntry, *, map_location: Any, verify: bool) -> torch.Tensor:
    out = _empty(t)
    reader.read_tensor_bytes_into(pe, t, tensor_memoryview(out), verify=verify)
    return _place(out, map_location)


def _resolve(obj: Any, tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    if isinstance(obj, TensorRef):
        try:
            return tensors[obj.key]
        except KeyError:
            raise FormatError("structure refers to a tensor the manifest does not list", path=path, key=obj.key) from None
    if isinstance(obj, DtypeRef):
        try:
            return dtypes.torch_dtype(obj.name)
        except KeyError:
            raise FormatError(f"unknown dtype {obj.name!r}", path=path) from None
    if isinstance(obj, DeviceRef):
        return torch.device(obj.device)
    if isinstance(obj, dict):
        return {k: _resolve(v, tensors, path) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve(v, tensors, path) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_resolve(v, tensors, path) for v in obj)
    return obj


def _replica_target(reader: CheckpointReader, pe: PartEntry, name: str, saved: Any) -> tuple[PartEntry, Any]:
    hops = 0
    while isinstance(saved, ReplicaRef):
        hops += 1
        if hops > 4:
            raise FormatError("replica references form a chain", path=reader.path, key=name)
        pe = reader.part(saved.part)
        saved = reader.tree(pe.name)["state"].get(name)
        if saved is None:
            raise FormatError(f"replica part {pe.name!r} lacks entry {name!r}", path=reader.path, key=name)
    return pe, saved


def _stream_fresh(reader: CheckpointReader, pe: PartEntry, verify: bool) -> dict[str, torch.Tensor]:
    fresh: dict[str, torch.Tensor] = {}

    def dest(t: TensorEntry) -> memoryview:
        out = _empty(t)
        fresh[t.key] = out
        return tensor_memoryview(out)

    reader.stream_part_into(pe, dest, verify=verify)
    return fresh


def _mmap_fresh(reader: CheckpointReader, pe: PartEntry, verify: bool) -> dict[str, torch.Tensor]:
    """Tensors backed by a private (copy-on-write) mapping of the tensor file.

    No copy and no first-touch of anonymous memory: pages come from the page cache as
    they are used. Verification still hashes every byte before anything is returned.
    Writes to the tensors stay private to this process. The caller must not truncate
    or rewrite the file while the tensors live (ckpt never rewrites a committed file);
    a truncated mapping faults with SIGBUS, which is why this path is opt-in.
    """
    f = pe.file("tensors")
    if f is None:
        return {}
    reader._header(pe)  # the safetensors header must agree with the manifest first
    fp = reader._fp(f)
    fd = os.open(fp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        if size != f.size:
            raise SizeMismatchError(f"file is {size} bytes, manifest says {f.size}", path=fp, offset=min(size, f.size))
        mm = mmap.mmap(fd, f.size, access=mmap.ACCESS_COPY) if f.size else None
    finally:
        os.close(fd)
    if mm is None:
        return {t.key: _empty(t) for t in pe.tensors}
    if verify:
        from .reader import _ChunkVerifier

        v = _ChunkVerifier(fp, f)
        v.update(memoryview(mm))
        v.finish()
    base = torch.frombuffer(mm, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for t in pe.tensors:
        dt = dtypes.torch_dtype(t.dtype)
        size_ = dtypes.itemsize(t.dtype)
        view = None
        if t.nbytes and t.offset % size_ == 0:
            try:
                view = base[t.offset : t.offset + t.nbytes].view(dt).view(t.shape)
            except RuntimeError:
                view = None  # a dtype torch cannot view bytes as: copy instead
        if view is None:
            view = _empty(t)
            if t.nbytes:
                tensor_memoryview(view)[:] = memoryview(mm)[t.offset : t.offset + t.nbytes]
        out[t.key] = view
    return out


def materialize_state(
    reader: CheckpointReader, pe: PartEntry, *, map_location: Any, verify: bool, mmap: bool = False
) -> dict[str, Any]:
    tree = reader.tree(pe.name, verify=verify)
    cache: dict[str, dict[str, torch.Tensor]] = {}
    fetch = _mmap_fresh if mmap else _stream_fresh

    def tensors_of(p: PartEntry) -> dict[str, torch.Tensor]:
        if p.name not in cache:
            cache[p.name] = {k: _place(v, map_location) for k, v in fetch(reader, p, verify).items()}
        return cache[p.name]

    out = {}
    for name, saved in tree["state"].items():
        src, saved = _replica_target(reader, pe, name, saved)
        out[name] = _resolve(saved, tensors_of(src), reader.path)
    return out


# --- in-place load -------------------------------------------------------------------------


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _lookup(cur: Any, key: Any) -> Any:
    if isinstance(cur, Mapping):
        return cur.get(key)
    if isinstance(cur, (list, tuple)) and isinstance(key, int) and 0 <= key < len(cur):
        return cur[key]
    return None


class _Plan:
    """Decides, per saved tensor, where its bytes go: an existing tensor or a fresh one."""

    def __init__(self, map_location: Any) -> None:
        self.map_location = map_location
        self.cpu_dest: dict[str, torch.Tensor] = {}  # key -> CPU tensor the bytes land in
        self.final: dict[str, torch.Tensor] = {}  # key -> tensor that appears in the result
        self.copy_after: list[tuple[torch.Tensor, torch.Tensor]] = []  # (src cpu, dst)
        self.in_place = 0
        self.fresh = 0
        self._fresh_keys: list[str] = []

    def walk(self, saved: Any, cur: Any, entries: Mapping[str, TensorEntry]) -> None:
        if isinstance(saved, TensorRef):
            self._tensor(saved.key, cur, entries)
        elif isinstance(saved, dict):
            for k, v in saved.items():
                self.walk(v, _lookup(cur, k), entries)
        elif isinstance(saved, (list, tuple)):
            for i, v in enumerate(saved):
                self.walk(v, _lookup(cur, i), entries)

    def _tensor(self, key: str, cur: Any, entries: Mapping[str, TensorEntry]) -> None:
        if key in self.final:
            return  # an alias of a tensor already planned
        e = entries[key]
        want = dtypes.torch_dtype(e.dtype)
        if isinstance(cur, torch.Tensor) and cur.dtype == want and tuple(cur.shape) == e.shape and cur.layout == torch.strided:
            self.in_place += 1
            self.final[key] = cur
            # Raw bytes may land only in plain memory: a conj/neg view would read them
            # back transformed, so those go through copy_ like non-contiguous targets.
            if cur.device.type == "cpu" and cur.is_contiguous() and not cur.is_conj() and not cur.is_neg():
                self.cpu_dest[key] = cur.detach()
            else:
                tmp = torch.empty(e.shape, dtype=want)
                self.cpu_dest[key] = tmp
                self.copy_after.append((tmp, cur))
            return
        self.fresh += 1
        out = _empty(e)
        self.cpu_dest[key] = out
        self.final[key] = out
        self._fresh_keys.append(key)

    def finish(self) -> None:
        with torch.no_grad():
            for src, dst in self.copy_after:
                try:
                    dst.copy_(src)
                except RuntimeError as e:  # e.g. an expanded (stride-0) target
                    raise StateMismatchError(f"cannot restore into the existing tensor in place: {e}") from None
        if self.map_location is not None:
            for k in self._fresh_keys:
                self.final[k] = _place(self.final[k], self.map_location)


def _assign(target: Any, result: Any, path: str, ckpt_path: str) -> None:
    """Write loaded values into a plain dict/list tree, keeping in-place tensors."""
    if isinstance(target, dict) and isinstance(result, dict):
        for k, v in result.items():
            cur = target.get(k)
            if cur is v and k in target:  # a saved None must still create a missing key
                continue
            if isinstance(cur, (dict, list)) and type(cur) is type(v) and not isinstance(v, tuple):
                _assign(cur, v, f"{path}/{k}", ckpt_path)
            else:
                target[k] = v
        return
    if isinstance(target, list) and isinstance(result, list):
        target[:] = result
        return
    if isinstance(target, torch.Tensor) and target is result:
        return
    raise StateMismatchError(
        f"cannot load a {type(result).__name__} into a {type(target).__name__} in place", path=ckpt_path, key=path
    )


def _tensor_keys(obj: Any, out: set[str], prefix: str = "") -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _tensor_keys(v, out, f"{prefix}/{k}")
    else:
        out.add(prefix)


def load_into(
    reader: CheckpointReader,
    state: Mapping[str, Any] | None,
    *,
    part: str | None = None,
    data: Any = None,
    generators: Mapping[str, Any] | None = None,
    map_location: Any = None,
    restore_rng_state: bool = True,
    verify: bool = True,
    exactness: str = "warn",
) -> LoadResult:
    if exactness not in ("strict", "warn", "off"):
        raise ValueError(f"exactness must be 'strict', 'warn' or 'off', not {exactness!r}")
    pe = reader.part(part)
    tree = reader.tree(pe.name, verify=verify)
    ctx = tree["context"]
    saved_state = tree["state"]
    state = state or {}

    # The exactness gate runs first: under strict, refuse before touching any tensor.
    diffs: list[str] = []
    saved_env = ctx.get("env") or {}
    if exactness != "off":
        diffs = env_differences(saved_env, capture_env())
        topo = ctx.get("topology") or {}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ws = torch.distributed.get_world_size()
        else:
            ws = 1
        if topo.get("world_size", 1) != ws:
            diffs.append(f"world_size: {topo.get('world_size')} -> {ws} (reduction order changes; numerics cannot be bit-identical)")
        if diffs and exactness == "strict":
            raise EnvironmentMismatchError(
                "environment differs from the one that saved; refusing an exactness claim: " + "; ".join(diffs),
                path=reader.path,
                differences=diffs,
            )
        if diffs:
            warnings.warn(
                f"checkpoint {reader.path}: environment differs, resume will not be bit-exact: " + "; ".join(diffs),
                ExactnessWarning,
                stacklevel=3,
            )

    plan = _Plan(map_location)
    currents: dict[str, Any] = {}
    sources: dict[str, tuple[PartEntry, Any]] = {}
    for name, obj in state.items():
        if name not in saved_state:
            raise StateMismatchError(
                f"entry {name!r} is not in this checkpoint (it has {sorted(saved_state)})", path=reader.path, key=name
            )
        src_pe, saved = _replica_target(reader, pe, name, saved_state[name])
        sources[name] = (src_pe, saved)
        cur = obj.state_dict() if _stateful(obj) else obj
        currents[name] = cur
        plan.walk(saved, cur, {t.key: t for t in src_pe.tensors})
    if data is not None:
        plan.walk(ctx.get("data"), None, {t.key: t for t in pe.tensors})

    # Read, part by part. When every tensor of a part is wanted, stream the file in
    # order (one read + one hash pass); otherwise read the wanted ones chunk-verified.
    by_part: dict[str, PartEntry] = {src.name: src for src, _ in sources.values()}
    by_part.setdefault(pe.name, pe)
    for p in by_part.values():
        keys = {t.key for t in p.tensors}
        wanted = keys & set(plan.cpu_dest)
        if not wanted:
            continue
        if wanted == keys:
            reader.stream_part_into(p, lambda t: tensor_memoryview(plan.cpu_dest[t.key]), verify=verify)
        else:
            for t in p.tensors:
                if t.key in wanted:
                    reader.read_tensor_bytes_into(p, t, tensor_memoryview(plan.cpu_dest[t.key]), verify=verify)
    plan.finish()

    for name, obj in state.items():
        src_pe, saved = sources[name]
        result = _resolve(saved, plan.final, reader.path)
        cur = currents[name]
        if _stateful(obj):
            if isinstance(obj, torch.nn.Module) and isinstance(result, Mapping) and _all_in_place(result, cur):
                continue  # every tensor was restored into the module's own storage
            try:
                obj.load_state_dict(result)
            except (RuntimeError, KeyError, ValueError, TypeError) as e:
                raise StateMismatchError(f"load_state_dict of {name!r} failed: {e}", path=reader.path, key=name) from None
        else:
            _assign(obj, result, name, reader.path)

    if data is not None:
        if ctx.get("data") is None:
            raise StateMismatchError("checkpoint holds no data-loader state", path=reader.path, key="@data")
        data.load_state_dict(_resolve(ctx["data"], plan.final, reader.path))

    restored: list[str] = []
    # RNG last: nothing above may consume a draw after the streams are restored.
    if restore_rng_state and ctx.get("rng") is not None:
        restored = restore_rng(ctx["rng"], generators, path=reader.path)
    elif generators:
        raise StateMismatchError("generators given but restore_rng=False or no RNG saved", path=reader.path, key="rng")
    extra = _resolve(ctx.get("extra"), plan.final, reader.path) if ctx.get("extra") is not None else None
    return LoadResult(
        path=reader.path,
        id=reader.manifest.id,
        step=reader.manifest.step,
        part=pe.name,
        context=ctx,
        manifest=reader.manifest,
        env_differences=tuple(diffs),
        exact=not diffs,
        restored_rng=tuple(restored),
        in_place=plan.in_place,
        fresh=plan.fresh,
        extra=extra,
    )


def _all_in_place(result: Mapping[str, Any], cur: Mapping[str, Any]) -> bool:
    if set(result) != set(cur):
        return False
    for k, v in result.items():
        c = cur[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(c, torch.Tensor) and (c is v or (c.data_ptr() == v.data_ptr() and c.shape == v.shape))):
                return False
        elif v != c:
            return False
    return True
