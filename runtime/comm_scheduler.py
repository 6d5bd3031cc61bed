"""The collectives of one step of the interpreted native runner, issued in program order by one
background thread (``CommScheduler``), all-reduces fused into buckets (``for_bucket`` picks a
bucket's algorithm from the plan's prices), and the step table that runs one collective, slice
or partial zero on a rank's block (``_step``).

In: the worker's ``Comm``, the mesh, the program's all-reduce buckets and the size they were
cut at, whether buckets overlap the compute after them, the thread collectives run on and the job's Reduction Server ranks. Out: the steps'
results as 64-byte-aligned numpy arrays (``runtime.wire``), per bucket (tensors, bytes,
algorithm) in ``buckets``.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future

import numpy as np

from autopar.program import (
    REDUCING,
    WIDENED,
    StepKind,
    bucket_index,
    bucket_key,
    checked_table,
    reduced_bytes,
)

from . import wire


def contiguous(x):
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)."""
    return np.asarray(x, order="C")


class CommScheduler:
    """The collectives of one step, issued by one background thread in program order (every
    rank must issue them in the same order). All-reduces are deferred and fused as the
    program's ``buckets`` say (``program.all_reduce_buckets``: Horovod's tensor fusion, DDP's
    buckets): one flat buffer per bucket, issued when it holds ``bucket_bytes``, the next bucket
    begins or a later instruction reads one of its results, reduced with
    the cost table's algorithm for the bucket's size; the compute that follows runs while a
    bucket is reduced (``overlap``; False waits for each bucket as it is issued)."""

    def __init__(self, comm, mesh, buckets, bucket_bytes, overlap=True, *, thread, reducers=()):
        self.comm, self.mesh, self.overlap, self.limit = comm, mesh, overlap, bucket_bytes
        self.bucket_of = bucket_index(buckets)  # (program.all_reduce_buckets)
        self.thread, self.reducers = thread, list(reducers)
        self.bucket, self.key, self.bytes = [], None, 0
        self.futures = {}  # register -> (future of the flat result, offset, shape)
        self.buckets = []  # (tensors, bytes, algorithm) per all-reduce call issued
        self.last = None  # the future of the latest bucket issued

    def all_reduce(self, st, x):
        key = bucket_key(st, self.mesh)  # (program.py: the one bucket rule)
        if key is None:  # no axis of size > 1: nothing to exchange
            done = Future()
            done.set_result(np.ravel(x))
            self.futures[st.out] = (done, 0, x.shape, x.dtype)
            return
        members = self.bucket_of.get(st.out, (st.out,))  # not in one: a bucket of its own
        if self.bucket and self.bucket[0][0].out not in members:
            self.flush()
        self.bucket.append((st, x))
        self.key, self.bytes = key, self.bytes + reduced_bytes(st)
        if self.bytes >= self.limit:
            self.flush()

    def flush(self):
        if not self.bucket:
            return
        items, self.bucket, self.bytes = self.bucket, [], 0
        # a fresh buffer in the dtype the bucket is reduced in (int8 and int16 tensors share an
        # int32 one), reduced in place, each tensor starting on an aligned boundary (its result
        # is a view XLA reads in place); the padding is zeros
        dtype = self.key[1]
        pad = wire.ALIGN // dtype.itemsize
        offsets = np.cumsum([0] + [-(-x.size // pad) * pad for _, x in items])
        flat = wire.empty((int(offsets[-1]),), dtype)
        for (_, x), at, end in zip(items, offsets, offsets[1:]):
            flat[at : at + x.size] = np.ravel(x)
            flat[at + x.size : end] = 0
        st = for_bucket(items[0][0], len(items), flat.nbytes)
        fut = self.last = self.thread.submit(_step, self.comm, st, flat, self.mesh, self.reducers)
        if not self.overlap:
            fut.result()
        self.buckets.append((len(items), flat.nbytes, st.algorithm))
        for (st, x), at in zip(items, offsets):
            self.futures[st.out] = (fut, int(at), x.shape, x.dtype)

    def wait(self, reg):
        if any(st.out == reg for st, _ in self.bucket):
            self.flush()
        fut, offset, shape, dtype = self.futures.pop(reg)
        flat = fut.result()
        out = flat[offset : offset + int(np.prod(shape))].reshape(shape)
        return out if out.dtype == dtype else wire.aligned(out.astype(dtype))  # narrowed back

    def run(self, st, x):
        """Any other step, in order after the pending all-reduces: on this thread when none is
        in flight (a hand-off to the comm thread and back costs more than a small collective)."""
        self.flush()
        if self.last is None or self.last.done():
            return _step(self.comm, st, x, self.mesh, self.reducers)
        return self.thread.submit(_step, self.comm, st, x, self.mesh, self.reducers).result()

    def close(self):
        """Issue what is pending and wait until every collective of the step is done."""
        self.flush()
        self.thread.submit(lambda: None).result()


def for_bucket(st, tensors: int, nbytes: int):
    """The all-reduce ``st`` for a bucket of ``tensors`` fused into ``nbytes``: the plan priced
    each tensor alone, so a bucket of several takes the algorithm its prices make cheapest
    for the bucket's size."""
    if tensors == 1:
        return st
    return dataclasses.replace(st, algorithm=min(st.prices, key=lambda p: p[1] + p[2] * nbytes)[0])


@functools.cache
def _group(mesh, rank, axes):
    return mesh.group(rank, axes)


def _step(comm, st, x, mesh, reducers):
    x = wire.aligned(x)  # see _all_to_all
    axes = tuple(a for a in st.axes if mesh.axis_size(a) > 1)
    if not axes:
        return x
    ranks, me = _group(mesh, comm.rank, axes)
    if st.kind in REDUCING and x.dtype in WIDENED:
        y = _STEPS[st.kind](comm, st, x.astype(WIDENED[x.dtype]), ranks, me, reducers)
        return wire.aligned(y.astype(x.dtype))
    if np.iscomplexobj(x):  # the collectives move and sum real numbers: a complex
        part = np.dtype(f"f{x.dtype.itemsize // 2}")  # value goes as (real, imaginary)
        y = _STEPS[st.kind](
            comm, st, x.view(part).reshape(x.shape + (2,)), ranks, me, reducers
        )  # pairs, a trailing dimension
        return np.ascontiguousarray(y).view(x.dtype).reshape(y.shape[:-1])
    return _STEPS[st.kind](comm, st, x, ranks, me, reducers)


def _slice(comm, st, x, ranks, me, reducers):
    c = x.shape[st.dim] // len(ranks)
    return wire.aligned(np.take(x, range(me * c, (me + 1) * c), axis=st.dim))


def _partial_zero(comm, st, x, ranks, me, reducers):
    return x if me == 0 else wire.zeros(x.shape, x.dtype)


def _all_reduce(comm, st, x, ranks, me, reducers):
    servers = reducers if st.algorithm == "reduction_server" else []
    comm.all_reduce(x, ranks, st.op, st.algorithm, servers)  # in place: the scheduler hands it
    return x  # a fresh buffer


def _all_gather(comm, st, x, ranks, me, reducers):
    n = len(ranks)
    out = wire.empty((n,) + x.shape, x.dtype)
    comm.all_gather(x, out, ranks)
    if st.dim == 0:  # the blocks already lie in order: no second copy
        return out.reshape((n * x.shape[0],) + x.shape[1:])
    return wire.aligned(np.concatenate(list(out), axis=st.dim))


def _reduce_scatter(comm, st, x, ranks, me, reducers):
    front = wire.aligned(np.moveaxis(x, st.dim, 0))
    out = wire.empty((front.shape[0] // len(ranks),) + front.shape[1:], x.dtype)
    comm.reduce_scatter(front, out, ranks)
    return wire.aligned(np.moveaxis(out, 0, st.dim))


def _all_to_all(comm, st, x, ranks, me, reducers):
    # block j goes to rank j; both buffers 64-byte aligned, as XLA's are: a single-copy read
    # into a destination 4-16 bytes past its source modulo 4 KiB runs 4x slower (4K aliasing),
    # and ranks forked from one server allocate alike (autopar.tools.bench.zeros)
    parts = wire.aligned(np.stack(np.split(x, len(ranks), axis=st.dst_dim)))
    out = wire.empty(parts.shape, parts.dtype)
    comm.all_to_all(parts, out, ranks)
    return wire.aligned(np.concatenate(list(out), axis=st.dim))


_STEPS = checked_table(
    {
        StepKind.SLICE: _slice,
        StepKind.PARTIAL_ZERO: _partial_zero,
        StepKind.ALL_REDUCE: _all_reduce,
        StepKind.ALL_GATHER: _all_gather,
        StepKind.REDUCE_SCATTER: _reduce_scatter,
        StepKind.ALL_TO_ALL: _all_to_all,
    },
    StepKind,
    "native runtime",
)
