"""Arrays the native runtime hands to XLA, and the messages that carry them between the caller
and the workers, in 64-byte-aligned memory.

XLA's CPU client computes on an argument in place only when its data is 64-byte aligned; it
copies any other argument on every call of a compiled segment (a fresh buffer, freed later on
one of its own threads). numpy allocates with 16-byte alignment, and an array unpickled from a
message lies at whatever offset the message put it, so without care a worker copies its
parameters at every segment that reads them, and holds the copies for a while after.

In: shapes and dtypes (``empty``), arrays (``aligned``), picklable objects (``send``). Out:
C-contiguous arrays whose data starts on a 64-byte boundary; ``recv`` returns the object
``send`` sent, its arrays' bytes received (pickle protocol 5, out of band) straight into such
memory, one copy after the socket as before.
"""
from __future__ import annotations

import math
import pickle

import numpy as np

ALIGN = 64


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(math.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


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


PACK = 64 << 10    # arrays smaller than this travel together in one message


def send(conn, obj) -> None:
    """Send ``obj`` over a ``multiprocessing`` connection: its pickle, then the bytes of its
    contiguous arrays of ``PACK`` bytes or more, each a message of its own, then the smaller
    ones together in one message, each at an ALIGN-byte offset (a step's many small arguments
    cost one system call, not one each)."""
    buffers = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = [r.nbytes for r in raws]
    small = [i for i, n in enumerate(sizes) if n < PACK]
    offsets, packed = _packing([sizes[i] for i in small])
    conn.send((head, sizes))
    for r in raws:
        if r.nbytes >= PACK:
            conn.send_bytes(r)
    if small:
        pack = bytearray(packed)
        for i, at in zip(small, offsets):
            pack[at:at + sizes[i]] = raws[i]
        conn.send_bytes(pack)


def _packing(sizes) -> tuple:
    """Offsets of buffers of ``sizes`` packed at ALIGN-byte boundaries, and the bytes in all."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


def recv(conn):
    """The object ``send`` sent; its arrays are writable and aligned."""
    head, sizes = conn.recv()
    views = [None] * len(sizes)
    for i, n in enumerate(sizes):
        if n >= PACK:
            views[i] = empty((n,), np.uint8)
            conn.recv_bytes_into(views[i])
    small = [i for i, n in enumerate(sizes) if n < PACK]
    if small:
        offsets, packed = _packing([sizes[i] for i in small])
        pack = empty((max(packed, 1),), np.uint8)
        conn.recv_bytes_into(pack)
        for i, at in zip(small, offsets):
            views[i] = pack[at:at + sizes[i]]
    return pickle.loads(head, buffers=views)
