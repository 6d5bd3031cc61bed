"""One rank of a native job (started by ``runtime.launcher.Job``; not for direct use).

In (argv): the folder of the caller's ``autopar`` package (checked against the one imported
here), the caller's control socket, rank, size, the inherited segment descriptor, host ids,
timeout, whether ranks of different hosts use TCP, the TCP rendezvous address, whether large
messages may go single-copy ("1"/"0", the Comm's ``direct``), this rank's IPv4 address (its
host's: where it listens for TCP links); the job token in ``AUTOPAR_JOB_TOKEN``. Out: replies
on the control socket: ("ready",) once the links are up, then per ("call", (module, name),
args, box, dropped boxes[, arrays]) an ("ok", result) (("ok", head, arrays) from a ``flat``
function) or ("error", kind, message, traceback text); kind
is "CollectiveError" for any autopar CollectiveError, else the exception's type name. Calls
and replies travel as ``runtime.wire`` messages (their arrays in shared memory, aligned: one
``wire.Box`` for the calls, and the replies into the box the call names, one of as many as the
caller still holds arrays of). A function marked ``borrows`` (a pipeline's stage runner) reads
its arguments' arrays in the call's box, any other gets copies (``wire.unborrowed``). One marked
``flat`` (the step runner) is called ``fn(comm, arrays, *args)`` with the call's arrays as one
list of views of the box, and returns ``(head, arrays)``: no array in ``head``, none in
``args`` (``wire.send``'s ``flat``: neither message is walked). Exits when the caller closes
the socket or goes away.

Before anything else a rank is set up for speed: pinned to a core of its own when the job has
no more ranks than cores (``_pin``), and malloc told to keep freed memory (``tune_malloc``).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import traceback
from multiprocessing.connection import Client

from autopar.errors import CollectiveError
from autopar.runtime import wire

ANSWERS: dict = {}  # the boxes this rank answers into, by the index calls name


@functools.cache
def _resolve(name: tuple):
    """The function a call names: (module, qualified name)."""
    module, qualname = name
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8


def tune_malloc() -> bool:
    """Set glibc's malloc for speed: buffers up to 32 MB come from one heap that is never
    trimmed, so a step reuses the pages of the step before instead of mapping fresh ones (a
    GPT step took 3,500 page faults, about a tenth of its time, without). Not done when the
    environment sets ``MALLOC_MMAP_THRESHOLD_`` (memory measurements set it so freed memory
    leaves the resident count). False where the C library has no mallopt."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt(_M_ARENA_MAX, 1)
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest
    mallopt(_M_TRIM_THRESHOLD, 1 << 40)
    mallopt(_M_TOP_PAD, 64 << 20)
    return True


def _pin(rank: int, size: int) -> None:
    """One core per rank when the job has no more ranks than this process may use (the
    ranks of a job are this host's): a rank's compute then never migrates or shares a core,
    and XLA runs it on one thread (more would only take turns on that core)."""
    cores = sorted(os.sched_getaffinity(0))
    if size <= len(cores):
        for tid in os.listdir("/proc/self/task"):  # every thread: a warm worker (forkserver)
            os.sched_setaffinity(int(tid), {cores[rank]})  # has XLA's already
        xla_flags(single_threaded=True)


def xla_flags(single_threaded: bool) -> None:
    """Set this process's XLA_FLAGS for one rank, before JAX starts its backend (flags are read
    once): one CPU device (a caller's ``--xla_force_host_platform_device_count``, inherited,
    made every rank's step 1.2-1.4x slower: the same executable pinned to one core, 36-44 ms
    with one device against 43-57 with four), and, when ``single_threaded``, Eigen on one
    thread (a pinned rank's other threads would only take turns on its core) and XLA's
    sequential schedule (``ONE_THREAD_FLAGS``)."""
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if single_threaded:
        flags.append("--xla_cpu_multi_thread_eigen=false")
        flags += ONE_THREAD_FLAGS if _jaxlib_minor() == (0, 10) else []
    os.environ["XLA_FLAGS"] = " ".join(flags)


# XLA's default CPU schedule orders a step's operations for thunks run concurrently on a
# thread pool, which a rank on one thread does not have: the sequential one ran the small GPT's
# step 1.14-1.17x faster on one core (the medium GPT's 1.00x) and a rank's whole step 1.04x
# (paired turns of two processes, 20 rounds). Set only for the jaxlib it was measured on: XLA
# aborts a process whose XLA_FLAGS name a flag it does not know, and a per-compile option of
# this name is accepted but not applied.
ONE_THREAD_FLAGS = ["--xla_cpu_enable_concurrency_optimized_scheduler=false"]


def _jaxlib_minor() -> tuple:
    """jaxlib's (major, minor) version; () if it cannot be read. From ``jaxlib.version``
    (a worker's start: 5 ms here, where the package metadata took 40)."""
    try:
        from jaxlib.version import __version__

        return tuple(int(p) for p in __version__.split(".")[:2])
    except (ImportError, ValueError):
        return ()


def _imported_elsewhere(package: str) -> str | None:
    """Why this worker's ``autopar`` is not the caller's (in ``package``), or None."""
    init = sys.modules["autopar"].__file__
    assert init is not None  # a regular package (its __init__.py), not a namespace one
    mine = os.path.dirname(os.path.abspath(init))
    if os.path.realpath(mine) == os.path.realpath(package):
        return None
    return (
        f"the worker imported autopar from {mine}, the caller from {package}; start the "
        "job from the process that imported the package you mean to run"
    )


def main(argv):
    package, address, rank, size, fd, hosts, timeout, tcp, rendezvous, direct, ip, streams = argv
    rank, size, fd = int(rank), int(size), int(fd)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        tune_malloc()
    xla_flags(single_threaded=False)
    _pin(rank, size)
    token = os.environ.pop("AUTOPAR_JOB_TOKEN")
    try:
        conn = Client(address, family="AF_UNIX", authkey=token.encode())
    except (FileNotFoundError, ConnectionRefusedError):
        return 1  # the caller gave the job up before this rank connected
    conn.send(rank)
    try:
        elsewhere = _imported_elsewhere(package)
        if elsewhere:
            raise ImportError(elsewhere)
        from autopar import _native

        comm = _native.Comm(
            rank,
            size,
            fd,
            [int(h) for h in hosts.split(",")],
            float(timeout),
            tcp == "1",
            direct == "1",
        )
        os.close(fd)
        if rendezvous:
            comm.connect_tcp(rendezvous, token, ip, int(streams))
    except Exception as e:  # noqa: BLE001 - reported to the caller
        conn.send(("failed", rank, f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready",))
    incoming = wire.Box()
    while True:
        try:
            # a training loop's next call comes soon after this one's answer: poll for it
            # (wire.readable) rather than let this core idle
            wire.readable([conn], None, time.perf_counter() + wire.SPIN_SECONDS)
            msg = wire.recv(conn, incoming, borrow=True)
        except CollectiveError as e:  # the call's memory could not be taken in: the job fails
            print(f"autopar worker: {e}", file=sys.stderr, flush=True)
            try:  # (the caller may have failed the job already)
                wire.send(conn, _error(e), box=None, any_size=True)
            except OSError:
                pass
            return 1
        except (EOFError, OSError):  # the caller closed the job or is gone
            return _caller_gone()
        _, name, args, at, drop, *arrays = msg  # a flat call's arrays: [the list]
        for i in drop:  # boxes the caller holds no views of and no longer uses
            ANSWERS.pop(i).close()
        box = ANSWERS.setdefault(at, wire.Box())
        flat = False
        try:
            fn = _resolve(name)
            # the arguments' arrays are views of the call's shared memory, valid until the
            # next call: a function marked ``borrows`` or ``flat`` reads them there (a step's
            # argument blocks go to XLA in place, not copied first), any other gets copies
            flat = getattr(fn, "flat", False)
            if flat:
                head, out = fn(comm, *arrays, *args)
                reply = ("ok", head, out)
            else:
                reply = (
                    "ok",
                    fn(comm, *(args if getattr(fn, "borrows", False) else wire.unborrowed(args))),
                )
        except Exception as e:  # noqa: BLE001 - reported to the caller
            flat, reply = False, _error(e)
        try:
            wire.send(conn, reply, box, any_size=True, flat=flat)  # one rank's answer, any size
        except (BrokenPipeError, ConnectionResetError):
            return _caller_gone()  # (interrupted or killed mid-call: nothing to print)
        except Exception as e:  # noqa: BLE001 - e.g. a result pickle cannot carry
            wire.send(conn, _error(e), box, any_size=True)


def _error(e) -> tuple:
    kind = "CollectiveError" if isinstance(e, CollectiveError) else type(e).__name__
    return ("error", kind, str(e), traceback.format_exc())


def _caller_gone() -> int:
    """The caller closed the job, or went away without closing it: its own XLA cache folder
    goes with this rank (the caller removes it on close)."""
    from .native_backend import remove_private_cache

    remove_private_cache()
    return 0
