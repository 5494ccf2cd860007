"""Internal tunables, in one place, with environment overrides and a test override.

Limits here are *reader* limits as well: a reader refuses any declared size above
them before allocating (see spec/checkpoint-format.md §Limits).

This module is the one place the packages read environment variables (spec/knobs.md
lists every one; tests/test_env_reads.py refuses a direct read anywhere else). Two kinds:

- :class:`Knobs` fields, read once at import (sizes, bounds, thread counts): a process
  changes them with :func:`override`, not by setting the variable later;
- the functions below the class, read at each call: switches a program or a parent
  process may set after ``ckpt`` is imported (a ledger directory, the progress bars,
  the object-store endpoint), so they keep working when set late.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping

__all__ = ["Knobs", "knobs", "override", "AwsEnv", "aws_env", "ledger_dir", "ledger_verify", "lease_signal",
           "lease_handler", "local_launch", "progress_forced", "replay_trust", "REPLAY_TRUST"]

MiB = 1 << 20
GiB = 1 << 30


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def _env_scale(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    value = float(raw)
    if not value > 0:  # NaN, zero or negative would turn every hang bound into an instant verdict
        raise ValueError(f"{name}={raw!r}: a positive number is required")
    return value


@dataclass(frozen=True, slots=True)
class Knobs:
    #: bytes per digest chunk; 4 MiB keeps Python per-call overhead invisible and
    #: matches efficient I/O request sizes (measured with bench/save_load.py).
    chunk_size: int = _env_int("CKPT_CHUNK_SIZE", 4 * MiB)
    #: zstd level for msgpack structure files; level 3 is cheap on small metadata.
    zstd_level: int = _env_int("CKPT_ZSTD_LEVEL", 3)
    #: request size for reads straight into tensor memory.
    read_request: int = _env_int("CKPT_READ_REQUEST", 16 * MiB)
    #: a durable file being written starts writeback every this many bytes
    #: (sync_file_range), so its closing fsync waits for the tail only; 0 disables.
    writeback_bytes: int = _env_int("CKPT_WRITEBACK_BYTES", 8 * MiB)
    #: how much nicer (lower CPU priority) an asynchronous save's thread runs than the
    #: training loop (bench/async_save.py measures the step slowdown); 0 keeps it equal.
    save_thread_nice: int = _env_int("CKPT_SAVE_NICE", 10)
    # --- hang detectors: a wait past these bounds raises WaitTimeoutError naming what it
    # waited on. They detect a hang, they judge no speed: far above any healthy wait. ---
    #: seconds a save waits for a lock on a checkpoint's temporary directory (a committer
    #: for the part writers still in flight, a part writer for a commit in progress).
    lock_timeout_s: float = _env_float("CKPT_LOCK_TIMEOUT_S", 1800.0)
    #: seconds the training loop waits for the asynchronous save in flight (at the next
    #: save, ``wait()`` or ``close()``) before it reports where the save thread is stuck.
    save_timeout_s: float = _env_float("CKPT_SAVE_TIMEOUT_S", 3600.0)
    # --- format 2.0 writers (spec/format-2.md §V.7): none of these changes what readers accept ---
    #: raw bytes per BPZ1 block: a block is the unit a thread encodes and a reader decodes.
    bpz_block: int = _env_int("CKPT_BPZ_BLOCK", 4 * MiB)
    #: threads encoding BPZ1 blocks while the writing thread writes the previous ones.
    bpz_threads: int = _env_int("CKPT_BPZ_THREADS", 2)
    #: compress=True leaves smaller tensors unencoded (their span headers would not pay).
    compress_min_bytes: int = _env_int("CKPT_COMPRESS_MIN_BYTES", 64 * 1024)
    #: a distributed save of more ranks than this lists parts by reference (part manifests).
    inline_parts_max: int = _env_int("CKPT_INLINE_PARTS_MAX", 16)
    #: a dedup save re-hashes every chunk of a file it shares at least once in this many
    #: consecutive saves that share it (spec/format-2.md §V.4.6; bench/dedup.py measures it).
    dedup_rehash_every: int = _env_int("CKPT_DEDUP_REHASH_EVERY", 1)
    # --- the run lock on an object store (spec/object-storage.md §O.6) ---
    #: seconds between two renewals of a run's lease (one conditional PUT each: 17,280 a day).
    lock_heartbeat_s: float = _env_float("CKPT_LOCK_HEARTBEAT_S", 5.0)
    #: seconds a lease stays in force after its last renewal: a writer whose heartbeat
    #: cannot get through for this long loses the run (six missed renewals by default);
    #: a crashed writer's lock is taken over this long after its last renewal.
    lock_expiry_s: float = _env_float("CKPT_LOCK_EXPIRY_S", 30.0)
    #: cleanup at a manager's start leaves an uncommitted save's files alone until they
    #: are this old (a save without the run's lock may still commit them; §O.6).
    orphan_grace_s: float = _env_float("CKPT_ORPHAN_GRACE_S", 60.0)
    # --- the default step ledger of ckpt.save / ckpt.load (ckpt.ledger.auto) ---
    #: 0 turns the default ledger off for the whole process (CKPT_AUTO_LEDGER=0); a
    #: single call opts out with ckpt.save(..., ledger=False) / ckpt.load(..., ledger=False).
    auto_ledger: int = _env_int("CKPT_AUTO_LEDGER", 1)
    #: the default ledger digests every parameter every this many optimizer steps (a
    #: sample of every parameter is digested at every step); 0: never.
    auto_ledger_params_every: int = _env_int("CKPT_AUTO_LEDGER_PARAMS_EVERY", 10)
    #: CKPT_LEDGER_DIR: where step ledgers go instead of next to the checkpoints (a
    #: manager's in DIR/<run dir name>, the default one's in DIR/<checkpoint's dir name>).
    ledger_dir: str = os.environ.get("CKPT_LEDGER_DIR", "")
    #: CKPT_CHECK_RUN: set by `ckpt check-resume -- COMMAND` to the attempt's run directory;
    #: a step ledger outside it is refused (two runs writing one place would be compared
    #: with themselves).
    check_run_dir: str = os.environ.get("CKPT_CHECK_RUN", "")
    #: CKPT_LEDGER_KILL_AT: set by `ckpt check-resume -- COMMAND` for an attempt told to die
    #: after that step; only the harness's kill switch reads it (ckpt/testing/kill_switch.py); 0: none.
    ledger_kill_at: int = _env_int("CKPT_LEDGER_KILL_AT", 0)
    #: multiplies every hang bound (``replay.watchdog.hang_bound``): the runs', the demos'
    #: and the test suite's. Bounds only catch hangs, never judge speed; raise it on a
    #: machine so loaded that a step can stall for minutes (e.g. ``CKPT_TIMEOUT_SCALE=4``).
    timeout_scale: float = _env_scale("CKPT_TIMEOUT_SCALE", 1.0)
    # --- reader limits (also enforced by writers, so we never write what we refuse) ---
    max_manifest_bytes: int = 64 * MiB
    max_safetensors_header: int = 64 * MiB
    max_state_raw_bytes: int = 1 * GiB
    max_file_bytes: int = 1 << 50
    max_tensor_rank: int = 64
    max_container_len: int = 1 << 24
    max_nesting: int = 256
    # --- the object-store backend (spec/object-storage.md) ---
    #: multipart part size and ranged-read block size: 8-16 MiB is where S3 throughput per
    #: request levels off (AWS guidance) and it matches our chunk sizes.
    s3_part_size: int = _env_int("CKPT_S3_PART_SIZE", 16 * MiB)
    s3_block_size: int = _env_int("CKPT_S3_BLOCK_SIZE", 16 * MiB)
    #: an in-place load from an object store keeps the first pass's bytes in an unlinked
    #: local temporary file, so the second pass does not download them again (0: off).
    s3_spool: bool = os.environ.get("CKPT_S3_SPOOL", "1") != "0"
    #: parallel requests per file (uploads) and per storage (ranged reads).
    s3_concurrency: int = _env_int("CKPT_S3_CONCURRENCY", 8)
    #: arrays and maps one decoded msgpack document may build (spec/checkpoint-format.md
    #: §14): what bounds a document's decoded size, since one input byte is one container.
    max_containers: int = 1 << 21
    #: a str/bin/ext value in a structure file is at most value_ratio times the file on
    #: disk, or value_floor (spec/checkpoint-format.md §7.1): decoding copies each one out
    #: of the decompressed document, so this bounds the copy by the file, not the frame.
    value_ratio: int = 64
    value_floor: int = 64 * MiB
    min_chunk_size: int = 4096
    max_chunk_size: int = 1 * GiB


_current = Knobs()


def knobs() -> Knobs:
    return _current


@contextlib.contextmanager
def override(**changes: float | str) -> Iterator[Knobs]:
    """Temporarily change knobs (tests use small chunk sizes to exercise boundaries)."""
    global _current
    old = _current
    _current = dataclasses.replace(old, **changes)
    try:
        yield _current
    finally:
        _current = old


# --- read at each call (see the module docstring) ------------------------------------------

#: the ``os.pathsep``-separated directories ``ckpt replay`` trusts to import an entry point from
REPLAY_TRUST = "CKPT_REPLAY_TRUST"


def ledger_dir() -> str:
    """``CKPT_LEDGER_DIR``: where a manager's step ledger goes instead of beside its run
    (in ``DIR/<run dir name>``); ``""``: beside the run. (The default ledger of
    ``ckpt.save``/``ckpt.load`` reads :attr:`Knobs.ledger_dir`, fixed at import.)"""
    return os.environ.get("CKPT_LEDGER_DIR", "")


def ledger_verify() -> str | None:
    """``CKPT_LEDGER_VERIFY``: overrides every ``Ledger``'s ``verify`` policy (``strict``,
    ``warn``, ``off``; the ledger refuses anything else); None: the caller's choice stands."""
    return os.environ.get("CKPT_LEDGER_VERIFY") or None


def lease_signal() -> int | None:
    """``CKPT_LEASE_SIGNAL``: the signal number read-lease breaks are delivered with
    (spec/checkpoint-format.md §11.1); None: the default (``SIGRTMAX - 6``)."""
    raw = os.environ.get("CKPT_LEASE_SIGNAL")
    return int(raw) if raw else None


def lease_handler() -> Literal["auto", "off"]:
    """``CKPT_LEASE_HANDLER``: ``auto`` (default) installs the lease-break signal handler
    at the first lease-protected mapping, from the main thread only; ``off`` never
    installs it implicitly: mappings are then protected only after the program called
    ``ckpt.storage.install_lease_handler()``, and loads read into fresh memory otherwise
    (spec/checkpoint-format.md §11.1)."""
    raw = (os.environ.get("CKPT_LEASE_HANDLER") or "auto").strip().lower()
    if raw in ("auto", "1", "on"):
        return "auto"
    if raw in ("off", "0"):
        return "off"
    raise ValueError(f"CKPT_LEASE_HANDLER={raw!r}: 'auto' or 'off' is required")


def progress_forced() -> bool | None:
    """``CKPT_PROGRESS``: ``1`` draws the CLI's progress bars whatever stderr is, ``0``
    never; None (unset or another value): only when stderr is a terminal."""
    raw = os.environ.get("CKPT_PROGRESS")
    return raw == "1" if raw in ("0", "1") else None


def replay_trust(env: Mapping[str, str] | None = None) -> list[str]:
    """The directories :data:`REPLAY_TRUST` lists, in ``env`` (default: this process's
    environment); empty entries dropped."""
    raw = (os.environ if env is None else env).get(REPLAY_TRUST, "")
    return [d for d in raw.split(os.pathsep) if d]


def local_launch() -> tuple[int | None, int | None]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` as a launcher (torchrun, Slurm wrappers) set
    them, recorded in a checkpoint's topology; None where unset or not a number."""
    rank, size = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    return (int(rank) if rank.isdigit() else None, int(size) if size.isdigit() else None)


@dataclass(frozen=True, slots=True)
class AwsEnv:
    """The standard ``AWS_*`` variables the object-store backend itself acts on (the
    client library reads the rest: keys, session token, web identity, instance metadata)."""

    #: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (an S3-compatible server)
    endpoint: str | None
    #: ``AWS_REGION``, else ``AWS_DEFAULT_REGION``
    region: str | None
    #: ``AWS_EC2_METADATA_DISABLED`` is ``1``/``true``: instance metadata is no credential source
    metadata_disabled: bool
    #: a key, a web identity or a container credential endpoint is set
    has_credential_source: bool


_AWS_CREDENTIAL_SOURCES = ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                           "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def aws_env() -> AwsEnv:
    """The ``AWS_*`` settings of :class:`AwsEnv`, read now."""
    env = os.environ
    return AwsEnv(
        endpoint=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        metadata_disabled=env.get("AWS_EC2_METADATA_DISABLED", "").lower() in ("1", "true"),
        has_credential_source=any(env.get(k) for k in _AWS_CREDENTIAL_SOURCES),
    )
