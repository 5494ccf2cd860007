"""Private mappings of committed files, protected from truncation by a read lease.

Why: a fresh load is bound by memory, not by the disk. Reading a file into freshly
allocated tensors pays a first-touch page fault per 4 KiB (on the VMs we measure, each
one a host-level fault: ~1-2 GB/s, the same wall ``torch.load`` hits), while a private
mapping of the file uses the page-cache pages that already hold the bytes and copies a
page only when it is written. The catch: a file mapping whose file is truncated
underneath faults with SIGBUS on the next access, which kills the interpreter.

How the mapping is protected (spec/checkpoint-format.md §11.1): the reader takes a
*read lease* (``fcntl(F_SETLEASE, F_RDLCK)``) on the file before mapping it. From then
on, any process (this one included) that opens the file for writing or truncates it is
held by the kernel, for up to ``/proc/sys/fs/lease-break-time`` seconds (45 by
default), and the main thread of this process is sent a signal (``F_SETOWN_EX`` names
it; a blocking system call there is interrupted, and Python retries it after the
handler, PEP 475). The handler, a Python signal handler, so it runs between two
bytecodes of the main thread and never in the middle of its tensor operations, copies
every mapping of that file into anonymous memory, moves the copy over the mapping's
address (``mremap(MREMAP_FIXED)``, one page-table update), and releases the lease; only
then does the truncation proceed, and it no longer reaches the tensors. The bytes kept
are the bytes that were verified: the file could not change while the lease was held.

The handler is process-wide state (one signal disposition), so when it is installed is
the program's choice: :func:`install_handler` (``ckpt.storage.install_lease_handler()``)
installs it explicitly, from the main thread; otherwise the first lease-protected mapping
installs it, on the main thread only (off the main thread nothing is installed: that load
reads into fresh memory). ``CKPT_LEASE_HANDLER=off`` (``ckpt.knobs.lease_handler``)
turns the implicit installation off: a program that owns its signals installs the handler
itself or gets no mappings. ``state(mmap=False)`` never maps, so never installs it.

Where a lease cannot be taken (not the file's owner without CAP_LEASE, a filesystem
without leases such as NFS, leases disabled, the file open for writing somewhere, the
signal already used by the program, the handler not installed and not to be installed
here: off the main thread, or ``CKPT_LEASE_HANDLER=off``), :func:`map_leased` raises
:class:`LeaseUnavailable` and the caller reads into fresh memory instead: never an
unprotected mapping by default.

What remains (documented in the spec): a main thread stuck in one C call for longer
than the lease-break time while another process truncates the file lets the
truncation through (the handler then sees the shorter file and leaves the mapping
alone rather than fault itself); a write into the tensors by another thread while the
handler copies them may be lost; a ``fork``ed child shares the mapping but not the
handler's protection.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import signal
import struct
import threading
import weakref
from typing import Any

from .. import knobs

__all__ = ["map_leased", "map_private", "lease_signal", "install_handler", "handler_installed", "migrations",
           "unchanged", "close_leased", "LeaseUnavailable"]

F_SETOWN_EX = 15
F_OWNER_TID = 0
F_SETSIG = 10
F_SETLEASE = 1024
F_GETLEASE = 1025

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


class LeaseUnavailable(Exception):
    """Why no protected mapping could be made (the caller falls back to reading)."""


def _libc() -> Any:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.mmap.restype = ctypes.c_void_p
    lib.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.mremap.restype = ctypes.c_void_p
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.munmap.restype = ctypes.c_int
    return lib


try:
    _LIBC: Any = _libc()
except (OSError, AttributeError):  # not Linux/glibc: no leases, no mremap
    _LIBC = None


def lease_signal() -> int:
    """The signal lease breaks are delivered with (``CKPT_LEASE_SIGNAL`` overrides it)."""
    forced = knobs.lease_signal()
    if forced is not None:
        return forced
    return int(signal.SIGRTMAX) - 6 if hasattr(signal, "SIGRTMAX") else 0


class _Map(mmap.mmap):
    """An mmap that carries its lease guard: the guard lives exactly as long as the
    mapping (tensors hold the mapping through memoryview slices)."""

    _guard: "_Guard | None"


class _Guard:
    """The lease (an open file description) behind one mapping, and how to detach."""

    __slots__ = ("fd", "addr", "size", "path", "migrated", "__weakref__")

    def __init__(self, fd: int, addr: int, size: int, path: str) -> None:
        self.fd = fd
        self.addr = addr
        self.size = size
        self.path = path
        self.migrated = False

    def broken(self) -> bool:
        """Whether someone is waiting for this lease (a writer or a truncation)."""
        if self.fd < 0:
            return False
        try:
            return fcntl.fcntl(self.fd, F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True

    def migrate(self) -> None:
        """Move the mapping's bytes into anonymous memory at the same address, then
        release the lease. Pages the program wrote (private copies) move as they are."""
        if self.migrated or self.fd < 0:
            return
        if os.fstat(self.fd).st_size < self.size:
            # The kernel already let a truncation through (the lease-break time ran out):
            # copying would fault on the vanished pages. Nothing can be saved; let go.
            self.release()
            return
        anon = _LIBC.mmap(None, self.size, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
        if anon in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap of the copy failed")
        try:
            # Reading the file mapping here is safe: the truncation waits for our lease.
            ctypes.memmove(anon, self.addr, self.size)
        except BaseException:
            _LIBC.munmap(anon, self.size)
            raise
        got = _LIBC.mremap(anon, self.size, self.size, _MREMAP_MAYMOVE | _MREMAP_FIXED, self.addr)
        if got != self.addr:
            err = ctypes.get_errno()
            _LIBC.munmap(anon, self.size)
            raise OSError(err, "mremap over the file mapping failed")
        self.migrated = True
        _MIGRATIONS.append(self.path)
        self.release()

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass
            os.close(fd)
        _LIVE.pop(id(self), None)

    def __del__(self) -> None:  # the mapping is gone: let the lease go with it
        try:
            self.release()
        except Exception:  # interpreter shutdown: modules may already be torn down
            pass


_LIVE: dict[int, "weakref.ref[_Guard]"] = {}  # id -> guard; plain dict ops are atomic
_MIGRATIONS: list[str] = []  # paths whose mappings were moved off their files (tests, logs)
_installed: int | None = None  # the signal our handler is installed for
_install_lock = threading.Lock()


def migrations() -> tuple[str, ...]:
    """Files whose protected mappings were copied away because someone truncated or
    opened them for writing (in this process)."""
    return tuple(_MIGRATIONS)


def _on_break(signum: int, frame: Any) -> None:
    for ref in list(_LIVE.values()):
        g = ref()
        if g is not None and g.broken():
            try:
                g.migrate()
            except OSError:
                # Could not copy (out of memory): keep the lease until the kernel breaks
                # it; the tensors are then exposed, exactly as an unprotected mapping.
                pass


def install_handler() -> int:
    """Install the lease-break handler for :func:`lease_signal` now (idempotent); returns
    the signal. Raises :class:`LeaseUnavailable` off the main thread (Python runs signal
    handlers there only), where the signal is already handled by the program, or
    without leases (not Linux). Explicit: ``CKPT_LEASE_HANDLER=off`` does not stop it."""
    if _LIBC is None or not hasattr(signal, "SIGRTMAX"):
        raise LeaseUnavailable("leases need Linux")
    sig = lease_signal()
    _ensure_handler(sig, explicit=True)
    return sig


def handler_installed() -> bool:
    """Whether this process's lease-break handler is installed (for :func:`lease_signal`)."""
    return _installed is not None and _installed == lease_signal()


def _ensure_handler(sig: int, *, explicit: bool = False) -> None:
    global _installed
    if _installed == sig:
        return
    with _install_lock:
        if _installed == sig:
            return
        if not explicit and knobs.lease_handler() == "off":
            raise LeaseUnavailable("the lease-break handler is not installed (CKPT_LEASE_HANDLER=off; "
                                   "ckpt.storage.install_lease_handler() installs it)")
        if threading.current_thread() is not threading.main_thread():
            raise LeaseUnavailable("the lease-break handler can only be installed from the main thread")
        current = signal.getsignal(sig)
        if current not in (signal.SIG_DFL, None) and current is not _on_break:
            raise LeaseUnavailable(f"signal {sig} is already handled by the program")
        signal.signal(sig, _on_break)
        _installed = sig


def map_leased(fd: int, size: int, path: str) -> mmap.mmap:
    """A private mapping of the open file ``fd`` (``size`` bytes), protected by a read
    lease as described above. Raises :class:`LeaseUnavailable` when it cannot be."""
    if _LIBC is None or not hasattr(signal, "SIGRTMAX"):
        raise LeaseUnavailable("leases need Linux")
    sig = lease_signal()
    _ensure_handler(sig)
    main_tid = threading.main_thread().native_id
    # Our own descriptor: the lease belongs to its open file description, which lives
    # until the mapping dies (the caller closes its handle right after).
    lfd = os.dup(fd)
    try:
        try:
            fcntl.fcntl(lfd, F_SETSIG, sig)
            fcntl.fcntl(lfd, F_SETLEASE, fcntl.F_RDLCK)
            # Taking the lease made the process its owner; direct breaks at the main thread.
            fcntl.fcntl(lfd, F_SETOWN_EX, struct.pack("ii", F_OWNER_TID, main_tid))
        except OSError as e:
            # EAGAIN: open for writing somewhere; EACCES/EPERM: not ours; EINVAL: no leases here
            raise LeaseUnavailable(f"no read lease on {path}: {errno.errorcode.get(e.errno or 0, e.errno)}") from None
        actual = os.fstat(lfd).st_size
        if actual != size:
            # truncated or grown before the lease was taken: the caller's checks say so
            raise LeaseUnavailable(f"file is {actual} bytes, expected {size}")
        m = _Map(lfd, size, access=mmap.ACCESS_COPY)
    except BaseException:
        try:
            fcntl.fcntl(lfd, F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass
        os.close(lfd)
        raise
    probe = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(probe)
    del probe  # (an exported buffer would keep the mmap from ever closing)
    guard = _Guard(lfd, addr, size, path)
    m._guard = guard
    _LIVE[id(guard)] = weakref.ref(guard)
    # A break that arrived between taking the lease and registering the guard found
    # nothing to move; look again now that the guard is registered.
    if guard.broken():
        guard.migrate()
    return m


def unchanged(m: mmap.mmap) -> bool:
    """Whether a mapping from :func:`map_leased` still holds exactly the bytes it held when
    it was made: its lease is held and no one waits for it, or its bytes were moved into
    anonymous memory while the lease held (a break handled in time). False when the
    kernel let a writer or a truncation through (the lease-break time ran out while the
    main thread was stuck in one C call) or the move failed. On the main thread, a break
    signalled before this call has been handled by the time it runs."""
    g = getattr(m, "_guard", None)
    if g is None:
        return False
    return g.migrated or (g.fd >= 0 and not g.broken())


def close_leased(m: mmap.mmap) -> None:
    """Unmap ``m`` and release its lease now (not when the garbage collector finds it)."""
    g = getattr(m, "_guard", None)
    m.close()
    if g is not None:
        g.release()


def map_private(fd: int, size: int) -> mmap.mmap:
    """An unprotected private mapping (``state(unsafe_mmap=True)`` where no lease can be had)."""
    return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
