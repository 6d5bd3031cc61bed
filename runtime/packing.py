"""A whole step's small arguments and results, packed: one array each way per rank.

Each array that crosses between the caller and a worker costs Python work on both sides (a
slice, a place in the message, a conversion into XLA or out of it: 5-10 us each on this
machine), and a small model's step has dozens (the small GPT: 18 arguments, 17 results, its
executable ~0.5 ms). So the native runner packs the arguments and results smaller than
``resident.RESIDENT_BYTES`` (the ones never kept in the workers) into one uint8 array each,
and the whole-step executable unpacks its arguments and packs its results itself, inside XLA.

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
    items: tuple                 # (shape, numpy dtype) per array
    offsets: tuple
    sizes: tuple                 # bytes per array
    nbytes: int

    @classmethod
    def of(cls, avals) -> "Pack":
        items = tuple((tuple(s), np.dtype(d)) for s, d in avals)
        sizes = tuple(math.prod(s) * d.itemsize for s, d in items)
        offsets, total = wire._packing(sizes)
        return cls(items, tuple(offsets), sizes, total)

    def views(self, buffer: np.ndarray) -> list:
        """The arrays in ``buffer`` (a pack's bytes), as views of it."""
        return [buffer[at:at + n].view(dtype).reshape(shape)
                for (shape, dtype), at, n in zip(self.items, self.offsets, self.sizes)]

    def copies(self, buffer: np.ndarray) -> tuple:
        """The arrays in ``buffer`` (a pack's bytes), views of one copy of it that is theirs
        alone (one copy, not one per array), and that copy."""
        own = buffer.copy()
        return [np.ndarray(shape, dtype, own, at)
                for (shape, dtype), at in zip(self.items, self.offsets)], own

    def runs_of(self, head: "Pack", n: int) -> tuple:
        """Where in this pack the first ``n`` arrays of ``head`` lie in a row, as they do there
        (the same shapes and dtypes, so at the same offsets from the first): their indices."""
        want = head.items[:n]
        return tuple(j for j in range(len(self.items) - n + 1)
                     if n and self.items[j:j + n] == want)

    def unpack(self, buffer) -> list:
        """The arrays in ``buffer``, a traced uint8 value (inside a jitted function)."""
        from jax import lax
        out = []
        for (shape, dtype), at in zip(self.items, self.offsets):
            raw = lax.slice(buffer, (at,), (at + math.prod(shape) * dtype.itemsize,))
            if dtype == np.bool_:
                x = raw != 0
            elif dtype.kind == "c":            # XLA bitcasts no complex: two real parts
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
        for (shape, dtype), at, v in zip(self.items, self.offsets, values):
            if at > end:
                parts.append(jnp.zeros((at - end,), jnp.uint8))
            if dtype.kind == "c":
                v = jnp.stack([jnp.real(v), jnp.imag(v)], -1)
            raw = (v.astype(jnp.uint8) if dtype == np.bool_ else
                   lax.bitcast_convert_type(v, jnp.uint8)).reshape(-1)
            parts.append(raw)
            end = at + raw.size
        if self.nbytes > end:
            parts.append(jnp.zeros((self.nbytes - end,), jnp.uint8))
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)


class ArgPacker:
    """The caller's argument packs of one step, one per rank, in buffers it reuses call after
    call (``wire.send`` copies a call's message out of them before the call returns). The
    replicated arguments come first in the pack (``Packing.plan``), so they are copied once,
    into rank 0's pack, and its first bytes then into the others' at once: per argument one
    copy, not a slice, a view and a copy per rank (the small GPT's 16 parameters took 50 us of
    the caller's 0.3 ms per call to pack twice). When they are the very arrays the step's last
    call returned out of its replicated results' pack (``results``; ``returned``), in a row as
    in this pack (a training loop's parameters), they are copied as one block."""

    def __init__(self, pack: Pack, replicated: int, nranks: int, results: Pack | None = None):
        self.replicated = replicated
        end = pack.offsets[replicated] if replicated < len(pack.items) else pack.nbytes
        self.buffers = [wire.zeros((pack.nbytes,), np.uint8) for _ in range(nranks)]
        self.views = [pack.views(b) for b in self.buffers]
        self.heads = [b[:end] for b in self.buffers]
        self._runs = results.runs_of(pack, replicated) if results is not None else ()
        self._offsets = results.offsets if results is not None else ()
        self._returned = None

    def returned(self, arrays: list, buffer: np.ndarray) -> None:
        """The replicated results' arrays the last call returned, views of ``buffer``."""
        self._returned = (arrays, buffer)

    def fill(self, replicated, split) -> list:
        """Every rank's pack of ``replicated`` (the replicated arguments, whole, any array or
        scalar) and ``split`` (per rank, its blocks of the split arguments), in pack order."""
        if not self._fill_returned(replicated):
            for dst, x in zip(self.views[0], replicated):
                np.copyto(dst, x, casting="unsafe")       # as ``dst[...] = x`` casts
        for head in self.heads[1:]:
            np.copyto(head, self.heads[0])
        n = self.replicated
        for views, blocks in zip(self.views, split):
            for dst, x in zip(views[n:], blocks):
                np.copyto(dst, x, casting="unsafe")
        return self.buffers

    def _fill_returned(self, replicated) -> bool:
        """Copy ``replicated`` into the first pack as one block if they are returned arrays
        in a row (the same objects: whatever was written into them is in their buffer)."""
        if not self._returned or not self._runs:
            return False
        arrays, buffer = self._returned
        for j in self._runs:
            if arrays[j] is replicated[0] and \
                    all(map(operator.is_, arrays[j:j + self.replicated], replicated)):
                at = self._offsets[j]
                np.copyto(self.heads[0], buffer[at:at + self.heads[0].size])
                return True
        return False


@dataclass(frozen=True)
class Packing:
    """Which arguments and (non-constant) results of a whole step travel packed: a rank gets
    ``[argument pack, *the other arguments]`` and answers ``[replicated results' pack, split
    results' pack, *the other results]`` (the others in their order)."""
    args: tuple                  # argument indices in the argument pack, in order
    arg_pack: Pack
    replicated: tuple            # result indices in the replicated results' pack
    replicated_pack: Pack
    split: tuple                 # result indices in the split results' pack
    split_pack: Pack

    @classmethod
    def plan(cls, arg_avals, packed_args, result_avals, result_split, packed_results):
        """The packing of the arguments ``packed_args`` and the results ``packed_results``
        (indices, the arguments in the order they are to be packed: ``ArgPacker`` wants the
        replicated ones first) of a step with those local (shape, dtype)s; ``result_split``:
        per result, whether it is split (rank 0 answers the replicated ones)."""
        rep = tuple(k for k in packed_results if not result_split[k])
        split = tuple(k for k in packed_results if result_split[k])
        return cls(tuple(packed_args), Pack.of([arg_avals[i] for i in packed_args]),
                   rep, Pack.of([result_avals[k] for k in rep]),
                   split, Pack.of([result_avals[k] for k in split]))

    def other_args(self, n: int) -> list:
        packed = set(self.args)
        return [i for i in range(n) if i not in packed]

    def other_results(self, n: int) -> list:
        packed = set(self.replicated) | set(self.split)
        return [k for k in range(n) if k not in packed]
