"""Arrays the native runtime hands to XLA, and the messages that carry them between the caller
and the workers, in 64-byte-aligned memory.

XLA's CPU client computes on an argument in place only when its data is 64-byte aligned; it
copies any other argument on every call of a compiled segment (a fresh buffer, freed later on
one of its own threads). numpy allocates with 16-byte alignment, and an array unpickled from a
message lies at whatever offset the message put it, so without care a worker copies its
parameters at every segment that reads them, and holds the copies for a while after.

In: shapes and dtypes (``empty``), arrays (``aligned``), picklable objects (``send``), and for
each direction of a connection a ``Box``: shared memory the sender writes a message's arrays
into (a call's messages of up to ``BOX_BYTES``, larger ones stream through the socket; the
answers of any size). Out:
C-contiguous arrays whose data starts on a 64-byte boundary; ``recv`` returns the object
``send`` sent, the arrays in its tuples, lists and dicts (carried beside its pickle, not in
it) copied once out of the box into such memory (or, ``borrow``ed, views of the box valid
until the next message: the caller reads its workers' results where they arrived, a worker
its step's arguments; ``owned`` / ``unborrowed`` copy what must outlive the message).
Without a box the arrays' bytes travel through the socket instead (two kernel copies and one
more in ``multiprocessing``'s reader): a worker's 4 MB of results took about 5 ms of the
caller's time per call that way.
"""

from __future__ import annotations

import errno
import functools
import math
import mmap
import os
import pickle
import resource
import select
import socket
import time
import weakref

import numpy as np

from autopar.errors import CollectiveError

ALIGN = 64


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(math.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def zeros(shape, dtype) -> np.ndarray:
    out = empty(shape, dtype)
    out.fill(0)
    return out


def is_aligned(x: np.ndarray) -> bool:
    return x.flags.c_contiguous and x.ctypes.data % ALIGN == 0


def aligned(x) -> np.ndarray:
    """``x`` itself when it is C-contiguous and aligned, else an aligned copy (0-d stays 0-d)."""
    x = np.asarray(x)
    if x.size == 0 or is_aligned(x):
        return x
    out = empty(x.shape, x.dtype)
    np.copyto(out, x)
    return out


PACK = 64 << 10  # arrays smaller than this travel together in one message


class _Array:
    """Where ``send`` took an array out of a message: pickled as a reference to this module's
    one instance (``ARRAY``), so ``recv`` finds its places by identity."""

    def __reduce__(self):
        return "ARRAY"


ARRAY = _Array()
_BY_NAME = frozenset("biufcmM")  # dtype kinds whose ``dtype.str`` names them fully


def _rebuilt(obj, leaf):
    """``obj`` with each array (numpy, not of objects) in its tuples, lists and dict values, at
    any depth, replaced by ``leaf(array)``. Written out for speed, as ``_put`` is: a call's
    message is walked four times per rank (a closure called per node, not per array, took
    3.6 us a walk of the small GPT's)."""
    t = type(obj)
    if t is np.ndarray:
        return obj if obj.dtype.hasobject else leaf(obj)
    if t is tuple:
        return tuple([_rebuilt(x, leaf) for x in obj])
    if t is list:
        return [_rebuilt(x, leaf) for x in obj]
    if t is dict:
        return {k: _rebuilt(v, leaf) for k, v in obj.items()}
    return obj


def _take(obj, arrays: list):
    """``obj`` with each numpy array (not of objects) in its tuples, lists and dict values
    replaced by ``ARRAY`` and appended to ``arrays`` in order. Arrays inside other objects stay
    in them (pickled with them)."""

    def leaf(a):
        arrays.append(a)
        return ARRAY

    return _rebuilt(obj, leaf)


def _put(obj, arrays):
    """``_take`` undone: each ``ARRAY`` in ``obj`` replaced by the next of ``arrays`` (an
    iterator), in the same order."""
    if obj is ARRAY:
        return next(arrays)
    t = type(obj)
    if t is tuple:
        return tuple([_put(x, arrays) for x in obj])
    if t is list:
        return [_put(x, arrays) for x in obj]
    if t is dict:
        return {k: _put(v, arrays) for k, v in obj.items()}
    return obj


def send(conn, obj, box: Box | None = None, any_size: bool = False, flat: bool = False) -> None:
    """Send ``obj`` over a ``multiprocessing`` connection: the pickle of ``obj`` with its arrays
    taken out (``_take``; pickling an array costs ~5 us more each than its place, dtype and
    shape: a small model's step has dozens), with each array's (dtype, shape, bytes), then the
    arrays' bytes. With a ``box`` and arrays of at most ``BOX_BYTES`` in all, or of any size
    with ``any_size`` (a rank's answer, which the caller reads where it arrived: copied out of
    the socket instead, a 4096-wide MLP's 143 MB of new parameters made its step 2.3x slower):
    the bytes are written into the box first, each at an ALIGN-byte offset (a larger box, when
    needed, goes with the message as a descriptor). Else (larger messages stream, so that a
    first call's parameters, sent to every rank, are not held in shared memory once per rank at
    once): the arrays of ``PACK`` bytes or more follow the pickle, each a message of its own,
    then the smaller ones together in one message, each at an ALIGN-byte offset (a step's many
    small arguments cost one system call, not one each). With ``flat``, ``obj`` is a tuple
    whose last item is a list of numpy arrays and whose other items hold none: sent without
    the walk, and ``recv`` returns the same tuple (a step call's walk and the pickling of its
    placeholders took ~20 us per message on this machine)."""
    if flat:
        skeleton, arrays = obj[:-1], obj[-1]
    else:
        arrays = []
        skeleton = _take(obj, arrays)
    meta = [
        (a.dtype.str if a.dtype.kind in _BY_NAME else a.dtype, a.shape, a.nbytes) for a in arrays
    ]
    sizes = [m[2] for m in meta]
    offsets, total = _packing(sizes)
    if box is not None and (any_size or total <= BOX_BYTES):
        fd = box.reserve(total)
        for a, at in zip(arrays, offsets):
            if a.nbytes:  # an empty one needs no box (there may be none yet)
                _write(box, at, a)
        conn.send_bytes(
            pickle.dumps((skeleton, meta, box.size if fd is not None else 0, flat), protocol=5)
        )
        if fd is not None:
            with socket.socket(fileno=os.dup(conn.fileno())) as s:
                socket.send_fds(s, [b"B"], [fd])
            os.close(fd)
        return
    conn.send_bytes(pickle.dumps((skeleton, meta, None, flat), protocol=5))
    small = [a for a in arrays if a.nbytes < PACK]
    for a in arrays:
        if a.nbytes >= PACK:
            conn.send_bytes(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    if small:
        offsets, packed = _packing([a.nbytes for a in small])
        pack = np.empty(packed, np.uint8)
        for a, at in zip(small, offsets):
            pack[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        conn.send_bytes(pack)


def _write(box, at: int, a: np.ndarray) -> None:
    """``a``'s bytes into ``box`` at offset ``at``, in C order."""
    if a.flags.c_contiguous:
        box.mm[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
    else:
        box.array[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a


def _packing(sizes) -> tuple:
    """Offsets of buffers of ``sizes`` packed at ALIGN-byte boundaries, and the bytes in all."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


def _view(buffer: np.ndarray, at: int, meta) -> np.ndarray:
    dtype, shape, n = meta
    return buffer[at : at + n].view(dtype).reshape(shape)


def _flat(skeleton, arrays):
    return (*skeleton, list(arrays))


def _recv_fd(conn) -> int:
    """The descriptor of a grown box, sent beside the message; CollectiveError (the stream
    can no longer be trusted: this side's box is not the sender's) when this process has no
    descriptor left to take it in."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
    except OSError as e:
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        fds = []
    if not fds:  # the kernel dropped it (MSG_CTRUNC): no descriptor was free
        raise no_descriptors(f"pid {os.getpid()} taking in the shared memory of a message")
    return fds[0]


def no_descriptors(what: str) -> CollectiveError:
    """The error for a process out of file descriptors while doing ``what``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return CollectiveError(
        f"no file descriptor left for {what}: the open-files limit (RLIMIT_NOFILE) is {soft}, "
        "and a job's workers inherit it from the process that starts it; raise it (ulimit -n) "
        "or close files that process holds open."
    )


def needs_descriptors(what: str):
    """Decorator: the function's OSError for want of a file descriptor (EMFILE, ENFILE) as
    ``no_descriptors(what)``."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kw):
            try:
                return fn(*args, **kw)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    raise no_descriptors(what) from e
                raise

        return run

    return wrap


def recv(conn, box: Box | None = None, borrow: bool = False):
    """The object ``send`` sent (with the same ``box`` on the other side, or none); its arrays
    are writable and aligned, and their own memory (copied out of the box); with ``borrow``,
    those that came through the box are views of it instead, valid until the next message into
    this box (``Box.lent_out`` says whether any of them is still held)."""
    skeleton, meta, grown, flat = pickle.loads(conn.recv_bytes())
    put = _flat if flat else _put
    sizes = [m[2] for m in meta]
    offsets, _ = _packing(sizes)
    if grown is not None:  # through the box
        assert box is not None, "a message sent through a box is received with its box"
        if grown:
            box.attach(_recv_fd(conn), grown)
        if borrow:  # the views' base: an array of their own, so the box knows
            held = (
                np.frombuffer(box.mm, np.uint8) if box.mm is not None else np.empty(0, np.uint8)
            )  # (all empty)
            box.lent = weakref.ref(held)  # when they are gone
            box.span = (box.start, box.start + held.size)
            _LENDING.add(box)
            return put(
                skeleton, iter([np.ndarray(m[1], m[0], held, at) for at, m in zip(offsets, meta)])
            )
    small = [i for i, n in enumerate(sizes) if n < PACK]
    views: list[np.ndarray | None] = [None] * len(sizes)
    if grown is not None:
        assert box is not None
        held = box.array if box.array is not None else np.empty(0, np.uint8)  # all empty
        for i, n in enumerate(sizes):
            if n >= PACK:
                copy = empty(meta[i][1], meta[i][0])
                copy[...] = _view(held, offsets[i], meta[i])
                views[i] = copy
        if small:
            packed_at, packed = _packing([sizes[i] for i in small])
            pack = empty((max(packed, 1),), np.uint8)
            for i, at in zip(small, packed_at):
                pack[at : at + sizes[i]] = held[offsets[i] : offsets[i] + sizes[i]]
                views[i] = _view(pack, at, meta[i])
        return put(skeleton, iter(views))
    for i, n in enumerate(sizes):
        if n >= PACK:
            raw = empty((n,), np.uint8)
            conn.recv_bytes_into(raw)
            views[i] = _view(raw, 0, meta[i])
    if small:
        offsets, packed = _packing([sizes[i] for i in small])
        pack = empty((max(packed, 1),), np.uint8)
        conn.recv_bytes_into(pack)
        for i, at in zip(small, offsets):
            views[i] = _view(pack, at, meta[i])
    return put(skeleton, iter(views))


_LENDING: weakref.WeakSet[Box] = weakref.WeakSet()  # the boxes ``recv`` lent views of


def _address(x) -> int | None:
    """Where the data of a numpy or (single-device) JAX array starts, else None."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    pointer = getattr(x, "unsafe_buffer_pointer", None)
    try:
        return pointer() if pointer is not None else None
    except Exception:  # noqa: BLE001 - e.g. an array over several devices
        return None


def owned(x):
    """``x``, or an aligned copy of it (of its own type) when its data lies in a box ``recv``
    lent views of: such memory is valid only until that box's next message, so what a process
    keeps past it (a worker's kept results, ``runtime.resident``) must not be there."""
    if not _LENDING:
        return x
    at = _address(x)
    if not at:
        return x
    for box in list(_LENDING):
        if box.span[0] <= at < box.span[1] and box.lent_out:
            if isinstance(x, np.ndarray):
                out = empty(x.shape, x.dtype)
                np.copyto(out, x)
                return out
            import jax.numpy as jnp

            return jnp.array(x, copy=True)
    return x


def unborrowed(obj):
    """``obj`` (as ``recv`` with ``borrow`` returned it) with every array in its tuples, lists
    and dict values that views a lent box replaced by its own copy: what ``recv`` without
    ``borrow`` would have returned."""
    return _rebuilt(obj, owned)


SPIN_SECONDS = 2e-3  # how long ``readable`` polls before it blocks


def readable(conns, timeout: float | None, spin_until: float = 0.0, spin_from: float = 0.0) -> list:
    """The connections of ``conns`` with something to read (or closed), within ``timeout``
    seconds (None: until one has). From ``spin_from`` until ``spin_until`` (by
    ``time.perf_counter()``; before ``spin_from`` it blocks) it polls, yielding the core between
    polls, rather than blocking: a virtual machine's core that blocks idle is slow to wake (on
    this 2-core one a blocking round trip between two cores took 280 us, a polling one 25 us),
    and a step's answer, or a training loop's next call, comes within a few milliseconds. A
    process that yields gives way to any other that has work on its core, but not at once: one
    that blocks leaves the core at once."""
    poller, by_fd = select.poll(), {}
    for c in conns:
        by_fd[c.fileno()] = c
        poller.register(c.fileno(), select.POLLIN)
    wait = spin_from - time.perf_counter()
    if wait > 0:
        events = poller.poll(math.ceil(1e3 * (wait if timeout is None else min(wait, timeout))))
        if events or time.perf_counter() < spin_from:
            return [by_fd[fd] for fd, _ in events]  # came, or ``timeout`` passed first
    events = poller.poll(0)
    while not events and time.perf_counter() < spin_until:
        os.sched_yield()
        events = poller.poll(0)
    if not events and timeout != 0:
        events = poller.poll(None if timeout is None else max(1, int(timeout * 1e3)))
    return [by_fd[fd] for fd, _ in events]


BOX_BYTES = 64 << 20  # messages up to this go through a Box, larger ones the socket


class Box:
    """Shared memory (a memfd mapping) for the arrays of the messages one side of a connection
    sends: the sender's ``reserve`` grows it (a new mapping, its descriptor sent with the next
    message), the receiver ``attach``es what it is sent. A message's arrays are valid in it
    until the next message, so ``recv`` copies them out, or lends views of them (``borrow``):
    ``lent_out`` says whether any is still held."""

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None
        self.size = 0
        self.array: np.ndarray | None = None
        self.start = 0  # the mapping's address
        # a weak reference to the base of the views recv lent
        self.lent: weakref.ref[np.ndarray] | None = None
        self.span = (0, 0)  # the addresses of the memory it lent

    @property
    def lent_out(self) -> bool:
        return self.lent is not None and self.lent() is not None

    def reserve(self, nbytes: int) -> int | None:
        """Make room for ``nbytes``: None if there is, else the new mapping's descriptor (the
        caller sends, then closes it). Grows at least twofold, by whole pages, to at most
        ``BOX_BYTES`` (``send`` sends a larger message through the socket)."""
        if nbytes <= self.size:
            return None
        size = min(max(nbytes, 2 * self.size), max(nbytes, BOX_BYTES))
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create("autopar-wire", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        self._map(fd, size)
        return fd

    def attach(self, fd: int, size: int) -> None:
        self._map(fd, size)
        os.close(fd)

    def _map(self, fd, size):
        self.close()
        self.mm, self.size = mmap.mmap(fd, size), size
        self.array = np.frombuffer(self.mm, np.uint8)
        self.start = self.array.ctypes.data

    def close(self) -> None:
        if self.mm is not None:
            self.array = None
            try:
                self.mm.close()
            except BufferError:  # borrowed views still held: unmapped when they go
                pass
            self.mm, self.size = None, 0
