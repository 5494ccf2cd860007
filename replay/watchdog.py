"""A progress watchdog for multi-process (and multi-thread) runs: a hang names itself.

A run that waits on a peer waits on an event (a message, a commit, a process exit), never
on a clock. What a clock is still good for is noticing that *nothing* happens any more:
the watchdog does that, and only that, and when it fires it leaves evidence:

- each worker process calls :func:`arm` once (``runs.common.procs.Workers`` does it in every
  worker it starts) and :func:`beat` at each unit of progress (a step, a message), with a
  short label of what it does next (``"all_reduce step 3"``);
- the orchestrator runs a :class:`Watchdog` over those heartbeats (and, optionally, a
  progress probe of its own: a tape's event count). When no heartbeat and no probe value
  has changed for ``stall_s`` seconds it sends SIGUSR1 to every live worker (each one's
  ``faulthandler`` writes all its threads' Python stacks to ``<name>.stacks``), writes its
  own threads' stacks, and writes ``hang.txt``: per worker, alive or its exit code, the age
  and label of its last heartbeat, and the ``torch.distributed`` call its stacks wait in.
  Then :meth:`Watchdog.check` (and :meth:`Watchdog.wait`) raise :class:`HangError`
  naming that file, and the workers are killed so that nothing stays blocked.

``stall_s`` is a hang bound, not a speed verdict: :func:`hang_bound` makes one from the
quiet machine's time for the slowest unit of progress (at least 10x it), scaled by the one
knob ``CKPT_TIMEOUT_SCALE`` (``ckpt.knobs``) for machines loaded beyond that.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping

from .errors import HangError

__all__ = ["hang_bound", "arm", "beat", "armed_dir", "Watchdog", "HangReport", "WorkerState", "waiting_in",
           "STALL_FLOOR_S"]

STALL_FLOOR_S = 120.0
"""The smallest stall a run's watchdog accepts by default (before the scale): process start-up
with torch imports alone takes tens of seconds on a loaded 2-core machine."""
#: a heartbeat record is this many bytes, written in place (a reader never sees half of one
#: that matters: the sequence number comes first and the label is padded).
_RECORD = 160


def hang_bound(quiet_s: float, *, floor_s: float = STALL_FLOOR_S) -> float:
    """Seconds after which a wait that takes ``quiet_s`` on a quiet machine is a hang:
    ``max(10 * quiet_s, floor_s)`` times the ``CKPT_TIMEOUT_SCALE`` knob."""
    from ckpt.knobs import knobs

    return max(10.0 * float(quiet_s), float(floor_s)) * knobs().timeout_scale


# --- the worker's side --------------------------------------------------------------------------

_armed: dict[str, Any] = {}


def arm(out_dir: str | os.PathLike[str], name: str) -> None:
    """Make this process a watched worker called ``name``: SIGUSR1 writes every thread's
    Python stacks to ``out_dir/<name>.stacks`` (appended), and :func:`beat` writes
    ``out_dir/<name>.beat``. Call once, early in the worker (before any collective)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    safe = _safe(name)
    stacks = open(d / f"{safe}.stacks", "a", encoding="utf-8")  # kept open: faulthandler writes its fd
    stacks.write(f"# {name} pid {os.getpid()}\n")
    stacks.flush()
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    fd = os.open(d / f"{safe}.beat", os.O_RDWR | os.O_CREAT, 0o644)
    _armed.update(dir=str(d), name=name, stacks=stacks, fd=fd, seq=0, lock=threading.Lock())
    beat("armed")


def armed_dir() -> str | None:
    """The watchdog directory this process was armed with (None: not a watched worker)."""
    return _armed.get("dir")


def beat(where: str = "") -> None:
    """Progress: this worker got past something and goes on to ``where`` (a short label
    the hang report shows if nothing follows). A no-op in a process never armed."""
    if not _armed:
        return
    with _armed["lock"]:
        _armed["seq"] += 1
        rec = f"{_armed['seq']} {os.getpid()} {where}".replace("\n", " ")[: _RECORD - 1].ljust(_RECORD - 1) + "\n"
        os.pwrite(_armed["fd"], rec.encode("utf-8", "replace")[:_RECORD], 0)


# --- the orchestrator's side --------------------------------------------------------------------


@dataclass
class WorkerState:
    """What the report says of one watched worker."""

    name: str
    pid: int | None
    exitcode: int | None  # None: still running (or a thread)
    beats: int  # heartbeats seen (0: never armed, or never got that far)
    label: str  # its last heartbeat's label
    quiet_s: float  # seconds since its last heartbeat changed
    waiting_in: str  # the torch.distributed call its stacks wait in ("" unknown)
    answered: bool = True  # False: alive but wrote no stacks on SIGUSR1 (stopped, or stuck in the kernel)


@dataclass
class HangReport:
    """The watchdog fired: ``path`` is ``hang.txt``; ``stuck`` the workers alive and silent."""

    path: Path
    stall_s: float
    workers: list[WorkerState] = field(default_factory=list)

    @property
    def stuck(self) -> list[str]:
        """The workers alive when it fired (each one waits, or is the one they wait for)."""
        return [w.name for w in self.workers if w.exitcode is None]

    @property
    def unresponsive(self) -> list[str]:
        """Alive workers that wrote no stacks when asked: stopped, or stuck in the kernel."""
        return [w.name for w in self.workers if w.exitcode is None and not w.answered]

    def error(self) -> HangError:
        def state(w: WorkerState) -> str:
            if not w.answered:
                return f"{w.name} (no stacks: stopped?; last beat: {w.label or '-'})"
            return f"{w.name} ({'waiting in ' + w.waiting_in if w.waiting_in else w.label or 'no heartbeat'})"

        stuck = ", ".join(state(w) for w in self.workers if w.exitcode is None) or "none alive"
        gone = ", ".join(f"{w.name} exit {w.exitcode}" for w in self.workers if w.exitcode not in (None, 0))
        msg = f"no progress for {self.stall_s:.0f} s; stuck: {stuck}" + (f"; ended: {gone}" if gone else "")
        return HangError(msg + f"; stacks and report in {self.path}", report=str(self.path))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "worker"


#: frames of these files are the collective or wait itself; the first other frame is its caller
_DIST = re.compile(r"torch[/\\]distributed[/\\]|torchft[/\\]")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def waiting_in(stacks_text: str) -> str:
    """The ``torch.distributed`` (or torchft) call the last stack dump in ``stacks_text``
    waits in, with its caller: ``"all_reduce (from train.py:42 step)"``; ``""`` if none.
    faulthandler prints the innermost frame first; every thread of the dump is searched."""
    last = re.split(r"^# .* pid \d+$", stacks_text, flags=re.M)[-1]
    found = []
    for thread in re.split(r"\n(?=(?:Current thread|Thread) 0x)", last):
        frames = [m.groupdict() for m in _FRAME.finditer(thread)]
        for i, f in enumerate(frames):
            if _DIST.search(f["file"]):
                # the outermost consecutive torch.distributed frame that is not a decorator's
                # wrapper or a private helper is the public call (all_reduce, recv, barrier)
                j = i
                while j + 1 < len(frames) and _DIST.search(frames[j + 1]["file"]):
                    j += 1
                public = [k for k in range(i, j + 1) if frames[k]["fn"] != "wrapper" and not frames[k]["fn"].startswith("_")]
                call = frames[public[-1] if public else i]["fn"]
                caller = frames[j + 1] if j + 1 < len(frames) else None
                where = f" (from {os.path.basename(caller['file'])}:{caller['line']} {caller['fn']})" if caller else ""
                found.append(call + where)
                break
    return "; ".join(dict.fromkeys(found))


class Watchdog:
    """Watches the heartbeats in ``out_dir`` (and ``progress()``, a probe of the
    orchestrator's own) and fires after ``stall_s`` seconds in which none changed.

    Use as a context manager around the run; name each worker with :meth:`watch`
    (its pid: it gets SIGUSR1 and is killed after the dump). :meth:`wait` waits on a
    condition and raises :class:`HangError` once the watchdog has fired; :meth:`check`
    raises it if it has. ``on_hang`` runs in the watchdog's thread after the report is
    written (e.g. to close the orchestrator's endpoint so that its blocked receive ends)."""

    def __init__(self, out_dir: str | os.PathLike[str], *, stall_s: float, name: str = "orchestrator",
                 progress: Callable[[], Hashable] | None = None,
                 on_hang: Callable[[HangReport], None] | None = None, kill: bool = True) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s must be positive, got {stall_s!r}")
        self.dir = Path(out_dir)  # made when the watchdog fires (workers' arm() makes it too)
        self.stall_s = float(stall_s)
        self.name = name
        self.progress = progress
        self.on_hang = on_hang
        self.kill = kill
        self.report: HangReport | None = None
        self.fired = threading.Event()
        self._pids: dict[str, Any] = {}  # name -> pid, or a Process-like object with .pid/.exitcode
        self._seen: dict[str, tuple[bytes, float]] = {}
        self._probe: tuple[Any, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- setup ---------------------------------------------------------------------------
    def watch(self, name: str, proc: Any = None) -> None:
        """Watch worker ``name``: ``proc`` is its process (``.pid``, ``.exitcode``), its pid,
        or None for a thread of this process (its stacks are in the orchestrator's dump)."""
        with self._lock:
            self._pids[name] = proc
            self._seen.setdefault(name, (b"", time.monotonic()))

    def last_beat(self, name: str) -> tuple[int, str]:
        """Worker ``name``'s heartbeats so far and its last label ((0, "") before any)."""
        parts = self._read_beat(name).decode("utf-8", "replace").strip().split(" ", 2)
        if not parts or not parts[0].isdigit():
            return 0, ""
        return int(parts[0]), parts[2].strip() if len(parts) > 2 else ""

    def start(self) -> "Watchdog":
        if self._thread is None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name=f"watchdog:{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def discard(self) -> None:
        """After a run that did not hang: remove the heartbeat and stacks files of the
        watched workers (and the directory, if that leaves it empty). A fired watchdog's
        evidence is never removed."""
        if self.report is not None:
            return
        with self._lock:
            names = list(self._pids)
        for n in names:
            for ext in ("beat", "stacks"):
                try:
                    os.unlink(self.dir / f"{_safe(n)}.{ext}")
                except OSError:
                    pass
        try:
            self.dir.rmdir()
        except OSError:  # not empty (someone else's files) or never made
            pass

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the run's side ------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`HangError` (naming the report) if the watchdog has fired."""
        if self.report is not None:
            raise self.report.error()

    def wait(self, predicate: Callable[[], bool], cond: threading.Condition | None = None, *,
             poll_s: float = 0.5) -> None:
        """Wait until ``predicate()`` holds; with ``cond`` (held by the caller, notified on
        every change) wait on it, else poll. Raises :class:`HangError` once fired."""
        while not predicate():
            self.check()
            if cond is not None:
                cond.wait(poll_s)
            else:
                self.fired.wait(poll_s)
        return None

    # -- the watchdog's thread -----------------------------------------------------------
    def _progressed(self) -> bool:
        now = time.monotonic()
        moved = False
        with self._lock:
            names = list(self._pids)
        for n in names:
            rec = self._read_beat(n)
            if self.last_beat(n)[0] <= 1:
                # Starting (imports, model build): no heartbeat of its own yet, so the CPU
                # time it burns is its progress. From its first beat on, only beats count
                # (a worker blocked in a collective burns none; one polling would).
                rec += b"cpu %d" % _cpu_ticks(self._pids.get(n))
            old = self._seen.get(n)
            if old is None or rec != old[0]:
                self._seen[n] = (rec, now)
                moved = moved or old is not None
        if self.progress is not None:
            try:
                v = self.progress()
            except Exception:  # a probe that fails says nothing about progress
                v = self._probe[0] if self._probe else None
            if self._probe is None or v != self._probe[0]:
                moved = moved or self._probe is not None
                self._probe = (v, now)
        return moved

    def _read_beat(self, name: str) -> bytes:
        try:
            with open(self.dir / f"{_safe(name)}.beat", "rb") as f:
                return f.read(_RECORD)
        except OSError:
            return b""

    def _run(self) -> None:
        tick = min(1.0, self.stall_s / 10)
        self._progressed()
        last = time.monotonic()
        while not self._stop.wait(tick):
            if self._progressed():
                last = time.monotonic()
            elif time.monotonic() - last >= self.stall_s:
                self._fire(time.monotonic() - last)
                return

    def _fire(self, quiet: float) -> None:
        with self._lock:
            procs = dict(self._pids)
        live: dict[str, int] = {}
        for n, p in procs.items():
            pid = p if isinstance(p, int) else getattr(p, "pid", None)
            code = None if isinstance(p, int) or p is None else p.exitcode
            if pid is not None and code is None and _alive(pid):
                live[n] = pid
        self.dir.mkdir(parents=True, exist_ok=True)
        sizes = {n: self._size(n) for n in live}
        for pid in live.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        # each live worker appends its dump; wait for the files to grow (bounded: a
        # stopped or dying process never writes), then settle
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(self._size(n) <= sizes[n] for n in live):
            time.sleep(0.1)
        time.sleep(0.2)
        own = self.dir / f"{_safe(self.name)}.stacks"
        with open(own, "a", encoding="utf-8") as f:
            f.write(f"# {self.name} pid {os.getpid()}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        now = time.monotonic()
        workers = []
        for n, p in procs.items():
            pid = p if isinstance(p, int) else getattr(p, "pid", None)
            code = None if isinstance(p, int) or p is None else p.exitcode
            if isinstance(p, int) and not _alive(p):
                code = -1
            rec = self._seen.get(n, (b"", now))
            beats, label = self.last_beat(n)
            text = self._read(self.dir / f"{_safe(n)}.stacks") if p is not None else ""
            answered = n not in live or self._size(n) > sizes[n]
            workers.append(WorkerState(n, pid, code, beats, label, now - rec[1], waiting_in(text), answered))
        path = self.dir / "hang.txt"
        lines = [f"watchdog {self.name}: no progress for {quiet:.0f} s (bound {self.stall_s:.0f} s)",
                 f"stacks: {self.dir}/<name>.stacks (SIGUSR1 faulthandler dumps), {own.name} for this process", ""]
        for w in workers:
            state = "alive" if w.exitcode is None else f"exit {w.exitcode}"
            lines.append(f"{w.name:<16} pid {w.pid}  {state:<8} beats {w.beats:<5} last {w.quiet_s:.0f} s ago: "
                         f"{w.label or '-'}" + (f"  waiting in {w.waiting_in}" if w.waiting_in else "")
                         + ("" if w.answered else "  NO STACKS: did not answer SIGUSR1 (stopped, or stuck in the kernel)"))
        own_wait = waiting_in(self._read(own))
        if own_wait:
            lines.append(f"{self.name:<16} pid {os.getpid()}  (this process) waiting in {own_wait}")
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        self.report = HangReport(path, self.stall_s, workers)
        print(f"watchdog: no progress for {quiet:.0f} s; report in {path}", file=sys.stderr, flush=True)
        if self.kill:  # nothing stays blocked: a peer that is gone ends every wait on it
            for pid in live.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.fired.set()
        if self.on_hang is not None:
            self.on_hang(self.report)

    def _size(self, name: str) -> int:
        try:
            return os.path.getsize(self.dir / f"{_safe(name)}.stacks")
        except OSError:
            return 0

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""


def _cpu_ticks(proc: Any) -> int:
    """User plus system CPU time of a process so far, in clock ticks (0 when unknown)."""
    pid = proc if isinstance(proc, int) else getattr(proc, "pid", None)
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

