"""In-place load: all or nothing, in two passes, with no second copy of the state.

``prepare_load`` does everything that can fail on the checkpoint's content or on a
mismatch with the targets, and writes nothing the caller holds:

1. decode and check the structure file and every reference in it (``_statecheck``);
2. plan every tensor: its target must have the saved dtype and shape (``cast=True``
   allows a dtype difference), and a Stateful whose ``state_dict()`` tensors are not its
   live storage is marked to be restored through ``load_state_dict`` (its keys must
   match, so that call cannot fail on them);
3. open every tensor file it reads and keep the handles (a retention that renames
   or deletes the checkpoint meanwhile cannot change what is read), then read what
   pass 2 will read exactly as pass 2 will, through a bounded scratch buffer and
   keeping nothing (pass 1, ``CheckpointReader.check_file``): every chunk hashed, every
   packed span decoded under every rule, every recorded tensor digest compared. Tensors
   that land in fresh memory rather than in a target are read (and verified) in this
   pass.

``PreparedLoad.apply`` then reads the bytes into the targets through the same
handles, hashing them again as they land (pass 2), and applies Statefuls, trees,
data-loader state and RNG streams (RNG last, rolled back if it does not restore).
Pass 2 fails only if a committed file was modified in place between the passes (the
format forbids it; media faults aside). That is detected, raised as
:class:`CheckpointChangedError`, and then the targets may hold a mix: see the spec's
"In-place load" section. Peak memory: the targets, the fresh tensors, one scratch piece.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ._materialize import TensorSource, empty_for, place, resolve
from ._ranges import MappedFile, verify_view
from ._statecheck import check_part, replica_target
from .context.env import capture_env, env_differences
from .context.rng import capture_rng, restore_rng
from .errors import CheckpointChangedError, CkptError, EnvironmentMismatchError, StateMismatchError
from .format import dtypes
from .format.manifest import FileEntry, Manifest, PartEntry, TensorEntry
from .format.tree import TensorRef
from .storage import _lease
from .writer import tensor_memoryview

__all__ = ["load_into", "prepare_load", "PreparedLoad", "LoadResult", "ExactnessWarning"]


class ExactnessWarning(RuntimeWarning):
    """The environment differs from the saving one: a bit-exact claim would not hold."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What ``ckpt.load`` did. Its repr is short: the context (RNG states: tens of KiB),
    the manifest and ``extra`` are left out of it (read them as attributes)."""

    path: str
    id: str
    step: int | None
    part: str
    context: dict[str, Any] = field(repr=False)
    manifest: Manifest = field(repr=False)
    env_differences: tuple[str, ...] = ()
    exact: bool = True
    restored_rng: tuple[str, ...] = ()
    in_place: int = 0
    fresh: int = 0
    extra: Any = field(default=None, repr=False)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _lookup(cur: Any, key: Any) -> Any:
    if isinstance(cur, Mapping):
        return cur.get(key)
    if isinstance(cur, (list, tuple)) and isinstance(key, int) and 0 <= key < len(cur):
        return cur[key]
    return None


def _describe(t: torch.Tensor | TensorEntry) -> str:
    if isinstance(t, TensorEntry):
        return f"{t.dtype}{list(t.shape)}"
    try:
        name = dtypes.dtype_name(t.dtype)
    except (KeyError, ValueError, TypeError):
        name = str(t.dtype)
    return f"{name}{list(t.shape)}"


def _key_shapes(missing: list[str], cur: Mapping[str, Any], unexpected: list[str], saved: Mapping[str, Any],
                pe: PartEntry) -> str:
    """The shapes of the first missing and first unexpected key, so that a changed model
    (another layer count, another width) is told apart from a renamed one at a glance."""
    out = []
    if missing and isinstance(cur.get(missing[0]), torch.Tensor):
        out.append(f"the target's {missing[0]!r} is {_describe(cur[missing[0]])}")
    if unexpected and isinstance(saved.get(unexpected[0]), TensorRef):
        entry = {t.key: t for t in pe.tensors}.get(saved[unexpected[0]].key)
        if entry is not None:
            out.append(f"the checkpoint's {unexpected[0]!r} is {_describe(entry)}")
    return f" ({'; '.join(out)})" if out else ""


class _Plan:
    """Decides, per saved tensor, where its bytes go: an existing tensor or a fresh one."""

    def __init__(self, map_location: Any, cast: bool, path: str) -> None:
        self.map_location = map_location
        self.cast = cast
        self.path = path
        # Keyed by (part, tensor key): tensor keys are unique within a part only (a
        # replicated entry's keys may repeat another part's).
        self.cpu_dest: dict[tuple[str, str], torch.Tensor] = {}  # where the bytes land (CPU)
        self.final: dict[tuple[str, str], torch.Tensor] = {}  # what appears in the result
        self.copy_after: list[tuple[torch.Tensor, torch.Tensor]] = []  # (src cpu, dst)
        self.targets: set[tuple[str, str]] = set()  # bytes that land in memory the caller holds
        self.in_place = 0
        self.fresh = 0
        self._fresh_keys: list[tuple[str, str]] = []

    def walk(self, saved: Any, cur: Any, pe: PartEntry, where: str) -> None:
        self._walk(saved, cur, pe.name, {t.key: t for t in pe.tensors}, where)

    def _walk(self, saved: Any, cur: Any, part: str, entries: Mapping[str, TensorEntry], where: str) -> None:
        if isinstance(saved, TensorRef):
            self._tensor((part, saved.key), cur, entries, where)
        elif isinstance(saved, dict):
            for k, v in saved.items():
                self._walk(v, _lookup(cur, k), part, entries, f"{where}/{k}")
        elif isinstance(saved, (list, tuple)):
            for i, v in enumerate(saved):
                self._walk(v, _lookup(cur, i), part, entries, f"{where}/{i}")

    def tensors_of(self, part: str) -> dict[str, torch.Tensor]:
        """The result tensors of one part, by tensor key (what ``resolve`` looks up)."""
        return {k: t for (p, k), t in self.final.items() if p == part}

    def dest(self, part: str) -> Any:
        return lambda t: tensor_memoryview(self.cpu_dest[(part, t.key)])

    def _tensor(self, key: tuple[str, str], cur: Any, entries: Mapping[str, TensorEntry], where: str) -> None:
        if key in self.final:
            return  # an alias of a tensor already planned
        e = entries[key[1]]
        want = dtypes.torch_dtype(e.dtype)
        if isinstance(cur, torch.Tensor) and cur.layout == torch.strided:
            if tuple(cur.shape) != e.shape or (cur.dtype != want and not self.cast):
                # Never converted silently: a float64 checkpoint into a float32 module
                # would be downcast by copy_/load_state_dict without a word.
                raise StateMismatchError(
                    f"saved tensor is {_describe(e)}, the target is {_describe(cur)}"
                    + ("" if tuple(cur.shape) != e.shape else " (pass cast=True to convert the dtype)"),
                    path=self.path,
                    key=where,
                    saved_dtype=e.dtype,
                    saved_shape=list(e.shape),
                    target_dtype=str(cur.dtype),
                    target_shape=list(cur.shape),
                )
            if any(st == 0 and n > 1 for st, n in zip(cur.stride(), cur.shape)):
                raise StateMismatchError("cannot restore into an expanded (stride-0) tensor in place", path=self.path, key=where)
            self.in_place += 1
            self.final[key] = cur
            self.targets.add(key)
            # Raw bytes may land only in plain memory of the saved dtype: a conj/neg view
            # would read them back transformed, so those go through copy_ (which also
            # performs an opted-in cast) like non-contiguous and non-CPU targets.
            if cur.device.type == "cpu" and cur.dtype == want and cur.is_contiguous() and not cur.is_conj() and not cur.is_neg():
                self.cpu_dest[key] = cur.detach()
            else:
                tmp = empty_for(e)
                self.cpu_dest[key] = tmp
                self.copy_after.append((tmp, cur))
            return
        self.fresh += 1
        out = empty_for(e)
        self.cpu_dest[key] = out
        self.final[key] = out
        self._fresh_keys.append(key)

    def finish(self) -> None:
        with torch.no_grad():
            for src, dst in self.copy_after:
                dst.copy_(src)
        if self.map_location is not None:
            for k in self._fresh_keys:
                self.final[k] = place(self.final[k], self.map_location)


def _check_assign(target: Any, saved: Any, path: str, ckpt_path: str) -> None:
    """Refuse, before anything is written, a tree ``_assign`` could not write in place."""
    if isinstance(target, dict) and isinstance(saved, dict):
        for k, v in saved.items():
            cur = target.get(k)
            if isinstance(cur, (dict, list)) and type(cur) is type(v):
                _check_assign(cur, v, f"{path}/{k}", ckpt_path)
        return
    if isinstance(target, list) and isinstance(saved, list):
        return
    if isinstance(target, torch.Tensor) and isinstance(saved, TensorRef):
        return
    raise StateMismatchError(
        f"cannot load a {type(saved).__name__} into a {type(target).__name__} in place", path=ckpt_path, key=path
    )


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


def _live_storages(module: torch.nn.Module) -> set[int]:
    out = set()
    for t in (*module.parameters(), *module.buffers()):
        if t.numel():
            out.add(t.untyped_storage().data_ptr())
    return out


def _reaches_live(module: torch.nn.Module, cur: Mapping[str, Any]) -> bool:
    """Whether writing into ``state_dict()``'s tensors writes the module's own storage.

    EMA/LoRA-style wrappers return copies (or merged tensors) from ``state_dict()``;
    bytes written there never reach the model, so such modules go through
    ``load_state_dict``. Proven only by storage identity with parameters/buffers.
    """
    live = _live_storages(module)
    for v in cur.values():
        if isinstance(v, torch.Tensor) and v.numel() and v.untyped_storage().data_ptr() not in live:
            return False
    return True


@dataclass(slots=True)
class _Read:
    """One data file of a part: what pass 2 still has to read, through which handle."""

    pe: PartEntry
    index: int  # the file's index in the part (format 2.0: a part may have several)
    handle: Any  # ckpt.storage.ReadHandle
    file: FileEntry
    wanted: set[str]
    whole: bool  # every tensor of the file is wanted: stream the file in order
    done: bool = False  # read in pass 1 (nothing in it lands in a target)
    #: the file mapped under a read lease: pass 1 hashed the mapping, pass 2 copies from it
    mapped: MappedFile | None = None
    mapping: Any = None

    def close(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.mapping is not None:
            mapping, self.mapping = self.mapping, None
            _lease.close_leased(mapping)
        self.handle.close()


@dataclass(slots=True)
class _Entry:
    obj: Any
    saved: Any
    cur: Any
    via_load_state_dict: bool
    part: str  # the part that holds the entry's bytes (a replica's source)


@dataclass
class PreparedLoad:
    """A load that has passed every check and pass 1; :meth:`apply` writes the targets."""

    reader: TensorSource
    pe: PartEntry
    ctx: dict[str, Any]
    plan: _Plan
    entries: dict[str, _Entry]
    reads: list[_Read]
    data: Any
    generators: Mapping[str, Any] | None
    restore_rng_state: bool
    verify: bool
    diffs: list[str]
    _closed: bool = field(default=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for r in self.reads:
                r.close()

    def __enter__(self) -> "PreparedLoad":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _pass2(self) -> None:
        plan = self.plan
        for r in self.reads:
            if r.done:
                continue
            try:
                if r.mapped is not None:
                    # One pass: the bytes pass 1 hashed in the mapping are copied from it.
                    # The lease kept every writer and truncation out meanwhile, or the
                    # break handler moved the verified bytes off the file first (§11).
                    self.reader.stream_file_into(r.pe, r.index, plan.dest(r.pe.name), verify=False, handle=r.mapped)
                    if not _lease.unchanged(r.mapping):
                        raise CkptError(
                            "its read lease was broken and the mapping could not be moved off the file in time "
                            "(the lease-break time passed): the bytes copied may not be the ones verified",
                            path=r.mapped.path,
                        )
                elif r.whole:
                    self.reader.stream_file_into(
                        r.pe, r.index, plan.dest(r.pe.name), verify=self.verify, handle=r.handle
                    )
                else:
                    for t in r.pe.tensors_in(r.index):
                        if t.key in r.wanted:
                            self.reader.read_tensor_bytes_into(
                                r.pe, t, plan.dest(r.pe.name)(t), verify=self.verify, handle=r.handle
                            )
            except (CkptError, OSError) as e:
                raise CheckpointChangedError(
                    f"the file changed after it was verified, while it was copied into the targets "
                    f"({type(e).__name__}: {e}); targets may hold a mix of old and new values",
                    path=os.path.join(self.reader.path, r.file.name),
                    key=getattr(e, "key", None),
                ) from e

    def apply(self) -> LoadResult:
        if self._closed:
            raise CkptError("this prepared load was already applied or closed", path=self.reader.path)
        try:
            self._pass2()
        finally:
            self.close()
        reader, plan, ctx = self.reader, self.plan, self.ctx
        plan.finish()
        for name, ent in self.entries.items():
            result = resolve(ent.saved, plan.tensors_of(ent.part), reader.path)
            if not _stateful(ent.obj):
                _assign(ent.obj, result, name, reader.path)
            elif not (isinstance(ent.obj, torch.nn.Module) and not ent.via_load_state_dict and _all_in_place(result, ent.cur)):
                # Skipped only when every tensor was proven written into the module's
                # own storage; everything else (optimizers, wrappers) goes through it.
                try:
                    ent.obj.load_state_dict(result)
                except (RuntimeError, KeyError, ValueError, TypeError) as e:
                    raise StateMismatchError(f"load_state_dict of {name!r} failed: {e}", path=reader.path, key=name) from None
        if self.data is not None:
            self.data.load_state_dict(resolve(ctx["data"], plan.tensors_of(self.pe.name), reader.path))
        restored: list[str] = []
        # RNG last: nothing above may consume a draw after the streams are restored. A
        # restore that fails halfway is rolled back to the streams as they were.
        if self.restore_rng_state and ctx.get("rng") is not None:
            before = capture_rng(self.generators)
            try:
                restored = restore_rng(ctx["rng"], self.generators, path=reader.path)
            except BaseException:
                restore_rng(before, self.generators, path=reader.path)
                raise
        extra = resolve(ctx.get("extra"), plan.tensors_of(self.pe.name), reader.path) if ctx.get("extra") is not None else None
        return LoadResult(
            path=reader.path,
            id=reader.manifest.id,  # type: ignore[attr-defined]
            step=reader.manifest.step,  # type: ignore[attr-defined]
            part=self.pe.name,
            context=ctx,
            manifest=reader.manifest,  # type: ignore[attr-defined]
            env_differences=tuple(self.diffs),
            exact=not self.diffs,
            restored_rng=tuple(restored),
            in_place=plan.in_place,
            fresh=plan.fresh,
            extra=extra,
        )


def _env_gate(reader: TensorSource, ctx: Mapping[str, Any], exactness: str) -> list[str]:
    if exactness == "off":
        return []
    diffs = env_differences(ctx.get("env") or {}, capture_env())
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
            stacklevel=4,
        )
    return diffs


def _check_rng_targets(reader: TensorSource, ctx: Mapping[str, Any], generators: Mapping[str, Any] | None, restore: bool) -> None:
    rng = ctx.get("rng")
    if not restore or rng is None:
        if generators:
            raise StateMismatchError("generators given but restore_rng=False or no RNG saved", path=reader.path, key="rng")
        return
    saved = rng.get("generators", {})
    for name in generators or {}:
        if name not in saved:
            raise StateMismatchError(f"generator {name!r} was not saved in this checkpoint", path=reader.path, key=f"rng/generators/{name}")
    cuda = rng.get("cuda")
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < len(cuda):
            raise StateMismatchError(
                f"checkpoint holds CUDA RNG state for {len(cuda)} devices, this process has {have}", path=reader.path, key="rng/cuda"
            )


def prepare_load(
    reader: TensorSource,
    state: Mapping[str, Any] | None,
    *,
    part: str | None = None,
    data: Any = None,
    generators: Mapping[str, Any] | None = None,
    map_location: Any = None,
    restore_rng_state: bool = True,
    verify: bool = True,
    exactness: str = "warn",
    cast: bool = False,
) -> PreparedLoad:
    """Every check and pass 1 of an in-place load; nothing the caller holds is written."""
    if exactness not in ("strict", "warn", "off"):
        raise ValueError(f"exactness must be 'strict', 'warn' or 'off', not {exactness!r}")
    pe = reader.part(part)
    tree = reader.tree(pe.name, verify=verify)
    check_part(reader, pe, verify=verify)
    ctx = tree["context"]
    saved_state = tree["state"]
    state = state or {}
    # The exactness gate runs first: under strict, refuse before touching any tensor.
    diffs = _env_gate(reader, ctx, exactness)

    plan = _Plan(map_location, cast, reader.path)
    entries: dict[str, _Entry] = {}
    parts: dict[str, PartEntry] = {pe.name: pe}
    for name, obj in state.items():
        if name not in saved_state:
            raise StateMismatchError(
                f"entry {name!r} is not in this checkpoint (it has {sorted(saved_state)})", path=reader.path, key=name
            )
        src_pe, saved = replica_target(reader, pe, name, saved_state[name], verify=verify)
        parts.setdefault(src_pe.name, src_pe)
        stateful = _stateful(obj)
        cur = obj.state_dict() if stateful else obj
        via_lsd = False
        if isinstance(obj, torch.nn.Module):
            via_lsd = not (isinstance(cur, Mapping) and _reaches_live(obj, cur))
            if isinstance(cur, Mapping) and isinstance(saved, dict) and set(cur) != set(saved):
                missing, unexpected = sorted(set(cur) - set(saved)), sorted(set(saved) - set(cur))
                raise StateMismatchError(
                    f"module {name!r} does not match the checkpoint: missing {missing[:10]}, unexpected {unexpected[:10]}"
                    + _key_shapes(missing, cur, unexpected, saved, src_pe),
                    path=reader.path,
                    key=f"{name}/{(missing or unexpected)[0]}",
                )
        elif not stateful:
            _check_assign(obj, saved, name, reader.path)
        plan.walk(saved, cur, src_pe, name)
        entries[name] = _Entry(obj, saved, cur, via_lsd, src_pe.name)
    if data is not None:
        if ctx.get("data") is None:
            raise StateMismatchError("checkpoint holds no data-loader state", path=reader.path, key="@data")
        plan.walk(ctx["data"], None, pe, "@data")
    if ctx.get("extra") is not None:
        plan.walk(ctx["extra"], None, pe, "@extra")  # LoadResult.extra: its tensors come back fresh
    _check_rng_targets(reader, ctx, generators, restore_rng_state)

    prepared = PreparedLoad(reader, pe, ctx, plan, entries, [], data, generators, restore_rng_state, verify, diffs)
    try:
        for p in parts.values():
            for index in p.data_files():
                entries = p.tensors_in(index)
                wanted = {t.key for t in entries if (p.name, t.key) in plan.cpu_dest}
                if not wanted:
                    continue
                f = p.files[index]
                # Read twice (pass 1 checks, pass 2 copies) when bytes land in targets: a
                # packed file is decoded in pass 1 even without verify (its spans are content).
                checked = verify or f.role == "packed"
                twice = checked and any((p.name, k) in plan.targets for k in wanted)
                handle = reader.open_data_file(p, index, reread=True) if twice else reader.open_data_file(p, index)
                r = _Read(p, index, handle, f, wanted, whole=len(wanted) == len(entries))
                prepared.reads.append(r)
                if not any((p.name, k) in plan.targets for k in wanted):
                    # Nothing here lands in a target: read it (verified) now, once.
                    _read_now(reader, r, plan, verify)
                    r.done = True
                elif checked and _map_for_one_pass(r, reader):
                    # Pass 1 from a leased mapping (nothing read, nothing written): every
                    # chunk hashed in place, every recorded digest compared; pass 2 copies
                    # from the same mapping, so each byte is read from the page cache once
                    # for hashing and once for the copy, not twice through a read each.
                    assert r.mapped is not None
                    verify_view(r.mapped.path, f, r.mapped.view, entries)
                elif checked:
                    # Pass 1, nothing written: read what pass 2 will read, as it will read
                    # it (ckpt._ranges): every chunk hashed, every packed span decoded under
                    # every rule, every recorded digest compared. Pass 2 can then fail only
                    # if the file changes in between.
                    reader.check_file(p, index, None if r.whole else wanted, verify=verify, handle=handle)
    except BaseException:
        prepared.close()
        raise
    return prepared


def _map_for_one_pass(r: _Read, reader: TensorSource) -> bool:
    """Map ``r``'s file under a read lease for a one-pass load (``r.mapped``); False where
    the two-pass read applies: a file other than a plain safetensors file of this
    checkpoint read whole, a handle that cannot map (an object store), no lease to be had
    (``ckpt.storage._lease``), or a load off the main thread, where a lease break is not
    handled until the main thread runs Python again."""
    f = r.file
    if not (r.whole and f.role == "tensors" and f.origin is None and f.size):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    if not r.handle.mappable or r.handle.size() != f.size:
        return False  # no mapping: the two-pass read reports a size that differs, naming the file
    mapping = r.handle.map_private(f.size, require_lease=True)
    if mapping is None:
        return False
    r.mapping = mapping
    r.mapped = MappedFile(os.path.join(reader.path, f.name), mapping, f.size)
    return True


def _read_now(reader: TensorSource, r: _Read, plan: _Plan, verify: bool) -> None:
    if r.whole:
        reader.stream_file_into(r.pe, r.index, plan.dest(r.pe.name), verify=verify, handle=r.handle)
        return
    for t in r.pe.tensors_in(r.index):
        if t.key in r.wanted:
            reader.read_tensor_bytes_into(r.pe, t, plan.dest(r.pe.name)(t), verify=verify, handle=r.handle)


def load_into(reader: TensorSource, state: Mapping[str, Any] | None, **options: Any) -> LoadResult:
    """``prepare_load`` then ``apply``: the targets change only if every check passed."""
    with prepare_load(reader, state, **options) as prepared:
        return prepared.apply()


def _all_in_place(result: Mapping[str, Any], cur: Mapping[str, Any]) -> bool:
    if not isinstance(result, Mapping) or not isinstance(cur, Mapping) or set(result) != set(cur):
        return False
    for k, v in result.items():
        c = cur[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(c, torch.Tensor) and (c is v or (c.data_ptr() == v.data_ptr() and c.shape == v.shape))):
                return False
        elif v != c:
            return False
    return True
