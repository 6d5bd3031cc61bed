"""A whole step's small arguments and results, packed: two arrays each way per rank.

Each array that crosses between the caller and a worker costs Python work on both sides (a
slice, a place in the message, a conversion into XLA or out of it: 5-10 us each on this
machine), and a small model's step has dozens (the small GPT: 18 arguments, 17 results, its
executable ~0.5 ms). So the native runner packs the arguments and results smaller than
``resident.RESIDENT_BYTES`` (the ones never kept in the workers) into uint8 arrays, the
replicated ones apart from the split ones each way, and the whole-step executable unpacks its
arguments and packs its results itself, inside XLA.

In: the (local shape, dtype) of the arrays (``Pack.of``), then arrays (numpy: ``ArgPacker``,
``views``, ``copies``; traced JAX values: ``unpack``, ``pack_traced``). Out: a uint8 buffer
holding each array's bytes at an ALIGN-byte offset, and the arrays back as views of it, copies
or traced values.
``Packing`` says which of a step's arguments and results travel packed and where the rest go.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

from . import wire


@dataclass(frozen=True)
class Pack:
    """The layout of a pack: per array its local shape and dtype and its byte offset."""

    items: tuple  # (shape, numpy dtype) per array
    offsets: tuple
    sizes: tuple  # bytes per array
    nbytes: int

    @classmethod
    def of(cls, avals) -> Pack:
        items = tuple((tuple(s), np.dtype(d)) for s, d in avals)
        sizes = tuple(math.prod(s) * d.itemsize for s, d in items)
        offsets, total = wire._packing(sizes)
        return cls(items, tuple(offsets), sizes, total)

    def views(self, buffer: np.ndarray) -> list:
        """The arrays in ``buffer`` (a pack's bytes), as views of it."""
        return [
            buffer[at : at + n].view(dtype).reshape(shape)
            for (shape, dtype), at, n in zip(self.items, self.offsets, self.sizes)
        ]

    def copies(self, buffer: np.ndarray, writeable: bool = True) -> tuple:
        """The arrays in ``buffer`` (a pack's bytes), views of one copy of it that is theirs
        alone (one copy, not one per array; read-only unless ``writeable``), and that copy."""
        own = buffer.copy()
        own.flags.writeable = writeable
        return [
            np.ndarray(shape, dtype, own, at)
            for (shape, dtype), at in zip(self.items, self.offsets)
        ], own

    def run_of(self, arrays: Pack):
        """Where in this pack the arrays of ``arrays`` first lie in a row (the same shapes and
        dtypes, so at the same offsets from the first): its first index, or None."""
        n = len(arrays.items)
        return next(
            (
                j
                for j in range(len(self.items) - n + 1)
                if n and self.items[j : j + n] == arrays.items
            ),
            None,
        )

    def placed_as(self, arrays: Pack, j: int) -> Pack:
        """``arrays`` (``run_of`` this pack is ``j``) laid out in a buffer of this pack's size
        at the offsets its arrays ``j``... have here."""
        n = len(arrays.items)
        return Pack(arrays.items, self.offsets[j : j + n], arrays.sizes, self.nbytes)

    def unpack(self, buffer) -> list:
        """The arrays in ``buffer``, a traced uint8 value (inside a jitted function)."""
        from jax import lax

        out = []
        for (shape, dtype), at in zip(self.items, self.offsets):
            raw = lax.slice(buffer, (at,), (at + math.prod(shape) * dtype.itemsize,))
            if dtype == np.bool_:
                x = raw != 0
            elif dtype.kind == "c":  # XLA bitcasts no complex: two real parts
                part = np.dtype(f"f{dtype.itemsize // 2}")
                pair = lax.bitcast_convert_type(raw.reshape(-1, 2, part.itemsize), part)
                x = lax.complex(pair[:, 0], pair[:, 1])
            elif dtype.itemsize == 1:
                x = lax.bitcast_convert_type(raw, dtype)
            else:
                x = lax.bitcast_convert_type(raw.reshape(-1, dtype.itemsize), dtype)
            out.append(x.reshape(shape))
        return out

    def pack_traced(self, values):
        """``values`` (traced, in order, of this pack's shapes and dtypes) as one traced uint8
        buffer of ``nbytes``."""
        import jax.numpy as jnp
        from jax import lax

        parts, end = [], 0
        for (_shape, dtype), at, v in zip(self.items, self.offsets, values):
            if at > end:
                parts.append(jnp.zeros((at - end,), jnp.uint8))
            if dtype.kind == "c":
                v = jnp.stack([jnp.real(v), jnp.imag(v)], -1)
            raw = (
                v.astype(jnp.uint8) if dtype == np.bool_ else lax.bitcast_convert_type(v, jnp.uint8)
            ).reshape(-1)
            parts.append(raw)
            end = at + raw.size
        if self.nbytes > end:
            parts.append(jnp.zeros((self.nbytes - end,), jnp.uint8))
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)


class ArgPacker:
    """The caller's argument packs of one step, per rank a head (the replicated arguments) and
    a tail (its blocks of the split ones), in buffers it reuses call after call (``wire.send``
    copies a call's message out of them before the call returns). The replicated arguments
    are copied once, into rank 0's head, and it then into the others' at once (per argument one
    copy, not a slice, a view and a copy per rank: the small GPT's 16 parameters took 50 us of
    the caller's 0.3 ms per call to pack twice).

    A training loop passes back the very arrays the step's last call returned out of its
    replicated results' pack (``returned``), and when the step takes them in a row as they lie
    there (``Packing.run``), the head is laid out as that pack: they are copied as one block;
    and when the workers kept that pack (its ``key``; the arrays then read-only views of the
    caller's copy, so unchanged), nothing is: each rank's head is its own kept pack."""

    def __init__(self, packing: Packing, nranks: int):
        self.heads = [wire.zeros((packing.head.nbytes,), np.uint8) for _ in range(nranks)]
        self.tails = [wire.zeros((packing.tail.nbytes,), np.uint8) for _ in range(nranks)]
        self._head = packing.head.views(self.heads[0])
        self._tails = [packing.tail.views(t) for t in self.tails]
        self._run = packing.run
        self._returned: tuple[list, np.ndarray, int | None] | None = None

    def returned(self, arrays: list, buffer: np.ndarray, key: int | None = None) -> None:
        """The replicated results' arrays the last call returned, views of ``buffer``; ``key``:
        the key the workers kept their own copies of that pack under (``runtime.resident``),
        None when they did not."""
        self._returned = (arrays, buffer, key)

    def fill(self, replicated, split) -> tuple:
        """Every rank's pack of ``replicated`` (the replicated arguments, whole, any array or
        scalar) and ``split`` (per rank, its blocks of the split arguments) -> (per rank
        ``[head, tail]``, None), or (per rank ``[tail]``, key) when each rank's head is the
        pack it kept under key."""
        found, self._returned = self._find_returned(replicated), None  # a failed call
        buffer, key = found or (None, None)  # leaves the next one to copy
        if key is None:
            if buffer is None:
                for dst, x in zip(self._head, replicated):
                    np.copyto(dst, x, casting="unsafe")  # as ``dst[...] = x`` casts
            else:
                np.copyto(self.heads[0], buffer)
            for head in self.heads[1:]:
                np.copyto(head, self.heads[0])
        for views, blocks in zip(self._tails, split):
            for dst, x in zip(views, blocks):
                np.copyto(dst, x, casting="unsafe")
        if key is None:
            return [[h, t] for h, t in zip(self.heads, self.tails)], None
        return [[t] for t in self.tails], key

    def _find_returned(self, replicated):
        """(buffer, key) of the last call's replicated results' pack if ``replicated`` are its
        arrays as the head lays them out (the same objects: whatever was written into them
        is in that buffer), else None."""
        if not self._returned or self._run is None:
            return None
        arrays, buffer, key = self._returned
        j = self._run
        if all(map(operator.is_, arrays[j : j + len(replicated)], replicated)):
            return buffer, key
        return None


@dataclass(frozen=True)
class Packing:
    """Which arguments and (non-constant) results of a whole step travel packed: a rank gets
    ``[head, tail, *the other arguments]`` (the head: the replicated arguments, laid out as
    the replicated results' pack when those lie in a row there from result ``run`` on, a
    training loop's parameters; the tail: the split ones) and answers ``[replicated results'
    pack, split results' pack, *the other results]`` (the others in their order)."""

    args: tuple  # argument indices in the head, then in the tail, in order
    head: Pack
    tail: Pack
    run: int | None  # the replicated results' pack's index of the head's first
    replicated: tuple  # result indices in the replicated results' pack
    replicated_pack: Pack
    split: tuple  # result indices in the split results' pack
    split_pack: Pack

    @classmethod
    def plan(
        cls, arg_avals, packed_args, replicated_args, result_avals, result_split, packed_results
    ):
        """The packing of the arguments ``packed_args`` and the results ``packed_results``
        (indices, the arguments in the order they are to be packed: the ``replicated_args``
        replicated ones first) of a step with those local (shape, dtype)s; ``result_split``:
        per result, whether it is split (rank 0 answers the replicated ones)."""
        rep = tuple(k for k in packed_results if not result_split[k])
        split = tuple(k for k in packed_results if result_split[k])
        rep_pack = Pack.of([result_avals[k] for k in rep])
        head = Pack.of([arg_avals[i] for i in packed_args[:replicated_args]])
        run = rep_pack.run_of(head)
        return cls(
            tuple(packed_args),
            head if run is None else rep_pack.placed_as(head, run),
            Pack.of([arg_avals[i] for i in packed_args[replicated_args:]]),
            run,
            rep,
            rep_pack,
            split,
            Pack.of([result_avals[k] for k in split]),
        )

    def other_args(self, n: int) -> list:
        packed = set(self.args)
        return [i for i in range(n) if i not in packed]

    def other_results(self, n: int) -> list:
        packed = set(self.replicated) | set(self.split)
        return [k for k in range(n) if k not in packed]
