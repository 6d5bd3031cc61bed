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


def send(conn, obj) -> None:
    """Send ``obj`` over a ``multiprocessing`` connection: its pickle, then each contiguous
    array's bytes as a message of its own."""
    buffers = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    conn.send((head, [r.nbytes for r in raws]))
    for r in raws:
        conn.send_bytes(r)


def recv(conn):
    """The object ``send`` sent; its arrays are writable and aligned."""
    head, sizes = conn.recv()
    views = []
    for n in sizes:
        buf = empty((n,), np.uint8)
        if n:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        views.append(buf)
    return pickle.loads(head, buffers=views)
