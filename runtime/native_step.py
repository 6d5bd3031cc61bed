"""A rank's whole step as one compiled executable: its segments and its collectives (XLA
custom calls into autopar's C++ collectives, ``native/src/xla_ffi.cc``) in one jitted function,
so Python runs once per step instead of once per instruction.

In: the worker's ``Comm``, the loaded ``ProgramPayload`` (segments as ``jax.export`` bytes;
collectives as ``Collective``s; the arguments' shapes), the job's device ranks and XLA cache
folder, then per call the rank's argument blocks. Out: the rank's results, as JAX arrays.
With ``payload.packing`` (``runtime.packing``) the small arguments come as two uint8 arrays (the
replicated ones, laid out as the replicated results so that a loop's next call can take that
pack as it is, ``runtime.resident``; the split ones) and the small results go back as two
(replicated, split), unpacked and packed inside the executable.
Every rank's executable is the same: the rank is an argument (slices and partial zeros index
by it) and each custom call gets every group of its partition, picking the one holding its
rank, so rank 0 compiles it into the job's cache and the others load it (``compile_rounds``).
The collectives keep program order on every rank through an int32 token each custom call
takes and returns (a chain XLA cannot reorder); all-reduces are fused into buckets as the
interpreted runner's are (``Program.buckets``, each with its cheapest algorithm by the plan's
prices). The custom calls are a primitive of this module's (``register_targets``) rather
than ``jax.ffi.ffi_call``, whose side effect is a JAX effect that keeps a jitted function off
jit's C++ dispatch (the small GPT's step took 4.8 ms of a worker's time per call through
Python's dispatch, 1.3 ms through C++'s); XLA still sees them as side-effecting, and the
order token the last one returns is an output of the step, so no pass drops or reorders
them. A bucket issued because it is full (not because its result is read) overlaps the
compute after it, as the interpreted runner's (``RuntimeOptions.overlap``): ``all_reduce_start``
hands it to the communicator's own thread and ``all_reduce_done`` takes the result where it
is first read; an optimization barrier ties the next segment's inputs to the start and the done
waits behind the last segment's output, so XLA can move neither across the compute between
them. A collective that fails raises ``CollectiveError`` as the interpreted runner's do. Not
here (``supported`` says why): the Reduction Server, whose reducer ranks serve a step from
Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.errors import CollectiveError
from autopar.graph import Const
from autopar.program import (
    REDUCING,
    WIDENED,
    Collective,
    StepKind,
    bucket_index,
    bucket_key,
    checked_table,
    reduced_bytes,
)

if TYPE_CHECKING:
    from jax.extend.core import Primitive
    from jax.stages import Compiled

_MARK = "autopar CollectiveError:"
_registered: list[Primitive] = []


def register_targets():
    """Register the custom calls with XLA's CPU platform and their primitive with JAX (once
    per process); the primitive."""
    if not _registered:
        import jax
        from jax.extend.core import Primitive
        from jax.interpreters import mlir

        from autopar import _native

        for name, capsule in _native.ffi_targets().items():
            jax.ffi.register_ffi_target(f"autopar_{name}", capsule, platform="cpu")
        prim = Primitive("autopar_collective")
        prim.multiple_results = True
        prim.def_abstract_eval(lambda *operands, results, **_: results)
        mlir.register_lowering(prim, _lower, platform="cpu")
        _registered.append(prim)
    return _registered[0]


def _lower(ctx, *operands, target, results, aliases, attrs):
    """``autopar_<target>`` as an XLA FFI custom call with a side effect; ``attrs``' tuples
    become int64 arrays, their ints int64 scalars."""
    import jax

    del results
    rule = jax.ffi.ffi_lowering(
        target, has_side_effect=True, operand_output_aliases=dict(aliases) if aliases else None
    )
    return rule(
        ctx,
        *operands,
        **{
            k: np.asarray(v, np.int64)
            if isinstance(v, tuple)
            else np.int64(v)
            if isinstance(v, int)
            else v
            for k, v in attrs
        },
    )


def supported(instructions) -> str | None:
    """Why a program of ``instructions`` cannot run as one executable, or None."""
    for ins in instructions:
        if (
            isinstance(ins, Collective)
            and ins.kind == StepKind.ALL_REDUCE
            and ("reduction_server" in (ins.algorithm, *(p[0] for p in ins.prices)))
        ):
            return "its all-reduces may go through a Reduction Server"
    return None


class Tracer:
    """What a whole-step executable's trace keeps while it runs a rank's instructions: the
    registers (``regs``, and ``step``: values every micro-batch of a pipeline stage reads, with
    ``keep`` the registers also written there), the order token, the all-reduce bucket being
    filled and the started ones, and the mesh the collectives' groups come from (its ranks
    shifted by ``offset`` to the job's: a pipeline stage's mesh starts at its first rank).
    ``self.me`` is this rank's position on that mesh, traced (an argument of the step)."""

    fn: Compiled  # the compiled step (a subclass compiles it)

    def _setup(self, comm, mesh, offset, options, buckets, bucket_bytes):
        from autopar.jax_frames import hide_autopar_frames

        hide_autopar_frames()  # the HLO's metadata names the caller's lines, not ours
        self.primitive = register_targets()
        self.comm, self.handle = comm, np.int64(comm.ffi_handle)
        self.mesh, self.offset, self.options = mesh, offset, options
        self.bucket_of = bucket_index(buckets)  # (program.all_reduce_buckets)
        self.bucket_limit = bucket_bytes

    def _begin(self, me, regs, step=None, keep=frozenset()):
        import jax.numpy as jnp

        self.me, self.regs, self.step, self.keep = me, regs, {} if step is None else step, keep
        self.order, self.bucket, self.bucket_bytes = jnp.zeros((), jnp.int32), [], 0
        self.buckets = []  # (tensors, bytes, algorithm) per all-reduce the step makes
        self.started, self.fence, self.latest = {}, None, None
        self.complex = set()  # collectives' results carried as (real, imaginary) pairs
        self.narrowed = {}  # reductions' results carried widened -> their own dtype

    def get(self, r):
        """Register ``r``'s value; a started bucket holding it is awaited here, a bucket not
        issued yet is issued."""
        import jax.numpy as jnp

        if isinstance(r, Const):
            return jnp.asarray(r.value, r.dtype)
        if r in self.started:
            self.put_all(self._finish(self.started[r]))
        elif r not in self.regs and r not in self.step:
            self.put_all(self._flush())
        return self.regs[r] if r in self.regs else self.step[r]

    def put(self, r, value):
        if r in self.complex:  # back from a collective's real pairs
            from jax import lax

            value = lax.complex(value[..., 0], value[..., 1])
        elif r in self.narrowed:
            value = value.astype(self.narrowed[r])
        self.regs[r] = value
        if r in self.keep:
            self.step[r] = value

    def put_all(self, values: dict):
        for r, v in values.items():
            self.put(r, v)

    def run(self, ins, segment=None):
        """One instruction: a segment (``segment``, its deserialised export) or a collective."""
        from jax import lax

        if isinstance(ins, tuple):
            args = [self.get(i) for i in ins[2]]
            if self.fence is not None and args:  # the segment runs after the start
                _, *args = lax.optimization_barrier((self.fence, *args))
                self.fence = None
            outs = segment.call(*args)
            for o, y in zip(ins[3], outs):
                self.put(o, y)
            self.latest = outs[0] if outs else self.latest
            return
        axes = tuple(a for a in ins.axes if self.mesh.axis_size(a) > 1)
        x = self.get(ins.src)
        if not axes:
            self.put(ins.out, x)
            return
        if np.issubdtype(x.dtype, np.complexfloating):  # the collectives move and sum real
            import jax.numpy as jnp  # numbers: a complex value goes as

            x = jnp.stack([jnp.real(x), jnp.imag(x)], -1)  # pairs (a trailing dimension)
            self.complex.add(ins.out)
        elif ins.kind in REDUCING and np.dtype(x.dtype) in WIDENED:  # (comm_scheduler)
            self.narrowed[ins.out] = x.dtype
            x = x.astype(WIDENED[np.dtype(x.dtype)])
        if ins.kind == StepKind.ALL_REDUCE:
            self.put_all(self._defer(ins, x, axes))
        else:
            self.put_all(self._flush())  # every rank issues in program order
            groups, me = self._groups(axes)
            out, self.order = _LOWER[ins.kind](self, ins, x, groups, me, self.order)
            self.put(ins.out, out)

    def settle(self):
        """Issue the bucket and await every start, read or not."""
        self.put_all(self._flush())
        for started in {id(b): b for b in self.started.values()}.values():
            self.put_all(self._finish(started))

    def _defer(self, st, x, axes) -> dict:
        """All-reduces fused as the program's buckets say (``Program.buckets``, as the
        interpreted runner's): one custom call per bucket, issued (started, with ``overlap``)
        when it is full or the next bucket begins, else when one of its results is read
        (``get``); the results that issuing made, by register."""
        members = self.bucket_of.get(st.out, (st.out,))  # not in one: a bucket of its own
        overlap = self.options.overlap
        done = self._flush(overlap) if self.bucket and self.bucket[0][1].out not in members else {}
        self.bucket.append((bucket_key(st, self.mesh), st, x))
        self.bucket_bytes += reduced_bytes(st)
        if self.bucket_bytes >= self.bucket_limit:
            done.update(self._flush(overlap))
        return done

    def _flush(self, start=False) -> dict:
        """Issue the bucket: awaited here (its results, by register), or with ``start``
        handed to the communicator's thread (nothing yet: ``get`` finishes it when read)."""
        import jax.numpy as jnp

        from .comm_scheduler import for_bucket

        if not self.bucket:
            return {}
        items, self.bucket, nbytes, self.bucket_bytes = self.bucket, [], self.bucket_bytes, 0
        (axes, _, _), st, _ = items[0]
        flat = jnp.concatenate([jnp.ravel(x) for _, _, x in items])
        st = for_bucket(st, len(items), nbytes)
        self.buckets.append((len(items), nbytes, st.algorithm))
        groups, me = self._groups(axes)
        if not start:
            flat, self.order = _all_reduce(self, st, flat, groups, me, self.order)
            return _split(items, flat)
        key, self.order = self.call(
            "all_reduce_start",
            (_like(np.int32(0)),),
            flat,
            self.order,
            **groups.attrs(),
            op=st.op,
            algorithm=st.algorithm,
        )
        self.fence = self.order
        started = (key, _like(flat), items)
        self.started.update((s.out, started) for _, s, _ in items)
        return {}

    def _finish(self, started) -> dict:
        """Wait for a started bucket (behind the last segment's output) and split it."""
        key, like, items = started
        flat, self.order = self.call("all_reduce_done", (like,), key, self.order, self.after())
        for _, s, _ in items:
            del self.started[s.out]
        return _split(items, flat)

    def after(self):
        """A value computed last (the latest segment's output), for a call that must not run
        before the compute so far: XLA cannot move it above what it reads."""
        return self.latest if self.latest is not None else self.order

    def _groups(self, axes):
        """The mesh's ranks in groups over ``axes`` (all of them: the executable is every
        rank's), as the job's ranks, and this rank's position in its group (traced, from its
        position on the mesh)."""
        import jax.numpy as jnp

        mesh = self.mesh
        groups = sorted({mesh.group(r, axes)[0] for r in range(mesh.size)})
        where = np.zeros(mesh.size, np.int32)
        for g in groups:
            where[list(g)] = np.arange(len(g))
        return _Groups(
            tuple(r + self.offset for g in groups for r in g), len(groups[0])
        ), jnp.asarray(where)[self.me]

    def call(self, name, results, *operands, aliases=None, **attrs):
        """Custom call ``autopar_<name>``: ``results`` (ShapeDtypeStructs) and the order token
        out, ``operands`` and the order token in."""
        from jax import core

        results = tuple(core.ShapedArray(r.shape, r.dtype) for r in (*results, _TOKEN))
        attrs = tuple(sorted(dict(attrs, comm=self.handle).items()))
        return self.primitive.bind(
            *operands,
            target=f"autopar_{name}",
            results=results,
            aliases=tuple(sorted((aliases or {}).items())),
            attrs=attrs,
        )

    def results(self, out):
        """Run the compiled step's ``out`` (its results, then the order token): the results
        computed, a failed collective raised as ``CollectiveError``."""
        import jax

        try:
            *out, _ = out()
            return jax.block_until_ready(out)
        except Exception as e:  # noqa: BLE001 - XLA's error type varies by jaxlib version
            text = str(e)
            if _MARK in text:
                raise CollectiveError(text.split(_MARK, 1)[1].strip()) from None
            raise

    def scheduled(self) -> str | None:
        """The compiled executable's HLO in the order XLA runs it (None where the backend
        gives no text)."""
        return self.fn.as_text()


class WholeStep(Tracer):
    """Callable: the rank's argument blocks -> its results (see the module docstring)."""

    def __init__(self, comm, payload, ranks=None, cache=None):
        """Compiled here, once for the job's ``ranks`` (``compile_rounds`` through the job's XLA
        cache ``cache``): every rank's executable is the same, its rank an argument."""
        import jax
        from jax import export

        from .native_backend import compile_rounds

        self._setup(comm, payload.mesh, 0, payload.options, payload.buckets, payload.bucket_bytes)
        self.payload = payload
        self.segments = {
            k: export.deserialize(ins[1])
            for k, ins in enumerate(payload.instructions)
            if isinstance(ins, tuple)
        }
        pk, avals = payload.packing, list(payload.in_avals)
        if pk is not None:  # the small arguments in one array (runtime.packing)
            avals = [((pk.head.nbytes,), np.uint8), ((pk.tail.nbytes,), np.uint8)] + [
                avals[i] for i in pk.other_args(len(avals))
            ]
        self.avals = [jax.ShapeDtypeStruct(s, d) for s, d in avals] + [
            jax.ShapeDtypeStruct((), np.int32)
        ]
        lowered = jax.jit(self._step).lower(*self.avals)
        (self.fn,) = compile_rounds(comm, [lowered.compile], list(ranks or [comm.rank]), cache)
        self.rank = np.int32(comm.rank)

    def __call__(self, blocks) -> list:
        """The results as JAX arrays (computed): kept in the worker (``resident``) they go
        back into the next call as they are; numpy arrays that viewed them cost 0.8 ms more
        per call of the small GPT."""
        return self.results(lambda: self.fn(*blocks, self.rank))

    def _step(self, *blocks):
        p, pk = self.payload, self.payload.packing
        *blocks, me = blocks  # this rank, traced: one executable for all
        if pk is not None:
            head, tail, *others = blocks
            blocks = [None] * len(p.inputs)
            for i, x in zip(pk.args, pk.head.unpack(head) + pk.tail.unpack(tail)):
                blocks[i] = x
            for i, x in zip(pk.other_args(len(p.inputs)), others):
                blocks[i] = x
        self._begin(me, dict(zip(p.inputs, blocks)))
        for k, ins in enumerate(p.instructions):
            self.run(ins, self.segments.get(k))
        self.settle()
        out = [self.get(o) for o in p.outputs if not isinstance(o, Const)]
        if pk is not None:
            out = [
                pk.replicated_pack.pack_traced([out[k] for k in pk.replicated]),
                pk.split_pack.pack_traced([out[k] for k in pk.split]),
            ] + [out[k] for k in pk.other_results(len(out))]
        return out + [self.order]


_TOKEN = np.zeros((), np.int32)


def _split(items, flat) -> dict:
    """A bucket's reduced values, by register, out of its flat result."""
    out, at = {}, 0
    for _, s, x in items:
        out[s.out] = flat[at : at + x.size].reshape(x.shape)
        at += x.size
    return out


@dataclass(frozen=True)
class _Groups:
    """A collective's groups: ``table``, every group's ranks one after another, each ``size``
    long (the custom call picks the one holding its rank)."""

    table: tuple
    size: int

    def attrs(self) -> dict:
        return {"ranks": self.table, "group": self.size}


def _like(x, shape=None):
    import jax

    return jax.ShapeDtypeStruct(x.shape if shape is None else shape, x.dtype)


def _all_reduce(step, st, x, groups, me, order):
    return step.call(
        "all_reduce",
        (_like(x),),
        x,
        order,
        aliases={0: 0},
        **groups.attrs(),
        op=st.op,
        algorithm=st.algorithm,
    )


def _all_gather(step, st, x, groups, me, order):
    import jax.numpy as jnp

    n = groups.size
    out, order = step.call("all_gather", (_like(x, (n,) + x.shape),), x, order, **groups.attrs())
    if st.dim == 0:
        return out.reshape((n * x.shape[0],) + x.shape[1:]), order
    return jnp.concatenate([out[i] for i in range(n)], axis=st.dim), order


def _reduce_scatter(step, st, x, groups, me, order):
    import jax.numpy as jnp

    n, d = groups.size, st.dim
    blocks = x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1 :])
    # rank j's block j-th, each in x's own order: the result needs no transposing back (moving
    # ``dim`` to the front and back made auto_parallel's mlp-large step, a reduce-scatter along
    # the features, 7 ms slower than Megatron's all-reduce; this way they take the same)
    front = jnp.moveaxis(blocks, d, 0)
    shape = front.shape[1:]
    out, order = step.call(
        "reduce_scatter",
        (_like(x, shape),),
        front.reshape((-1,) + shape[1:]),
        order,
        **groups.attrs(),
        op=st.op,
    )
    return out, order


def _all_to_all(step, st, x, groups, me, order):
    import jax.numpy as jnp

    n = groups.size
    parts = jnp.stack(jnp.split(x, n, axis=st.dst_dim))  # block j goes to rank j
    out, order = step.call("all_to_all", (_like(parts),), parts, order, **groups.attrs())
    return jnp.concatenate([out[i] for i in range(n)], axis=st.dim), order


def _slice(step, st, x, groups, me, order):
    from jax import lax

    c = x.shape[st.dim] // groups.size
    return lax.dynamic_slice_in_dim(x, me * c, c, axis=st.dim), order


def _partial_zero(step, st, x, groups, me, order):
    import jax.numpy as jnp

    return jnp.where(me == 0, x, jnp.zeros_like(x)), order


_LOWER = checked_table(
    {
        StepKind.SLICE: _slice,
        StepKind.PARTIAL_ZERO: _partial_zero,
        StepKind.ALL_REDUCE: _all_reduce,
        StepKind.ALL_GATHER: _all_gather,
        StepKind.REDUCE_SCATTER: _reduce_scatter,
        StepKind.ALL_TO_ALL: _all_to_all,
    },
    StepKind,
    "whole-step executable",
)
