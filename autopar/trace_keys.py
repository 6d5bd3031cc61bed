"""PRNG keys inside a traced step, as the uint32 data they are made of.

``jax.random`` wraps every key, a raw ``jax.random.PRNGKey`` or a typed ``jax.random.key``, into
a value of a key dtype (``key<fry>``), which has no array dtype to shard, price or send. The
tracer (``autopar.trace``) therefore keeps such a value as its physical data (uint32, the key's
shape followed by the implementation's key shape, e.g. ``(2,)`` for threefry) and replaces each
operation on keys by the operations JAX itself lowers it to: ``random_bits``, ``random_split``,
``random_fold_in`` and ``random_seed`` by their implementation's functions on the data (the same
ones JAX's lowering calls, so the bits are identical), ``random_wrap`` and ``random_unwrap`` by
nothing, and the structural operations a program applies to arrays of keys (slicing ``split``'s
result, squeezing, reshaping, broadcasting, concatenating, selecting) by the same operation on
the data with the key's trailing dimensions carried along. The random bits that come out are
ordinary uint32 arrays the planner lays out like any other. Their threefry counters
(``iota_2x32_shape``: each element's row-major place, as two uint32 words) are built from one
small iota per dimension, scaled and broadcast (``counters``), so that a device making its
block of a split dropout mask makes only its block's counters, not the whole mask's.

In: an equation of a jaxpr (``involves_keys``, ``physical_rule``). Out: whether it reads or
makes keys, and a function of the physical operands returning the physical results, which the
tracer traces and inlines in its place (``trace._Builder.emit``). Typed keys among the step's
arguments and results reach the tracer as their data (``compiler.key_args``); ``trace`` itself
refuses them (``RuleError``).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from .errors import RuleError


def is_key(aval) -> bool:
    """Whether ``aval`` (an abstract value) holds PRNG keys."""
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def involves_keys(eqn) -> bool:
    """Whether ``eqn`` reads or makes a key-typed value."""
    return any(is_key(v.aval) for v in (*eqn.invars, *eqn.outvars))


def _trailing(aval) -> tuple:
    return tuple(aval.dtype._impl.key_shape) if is_key(aval) else ()


def counters(builder, eqn, ins, src, scope) -> list:
    """``iota_2x32_shape``: every element's row-major place in ``shape`` as (high, low) uint32
    words, as JAX makes them; below 2**32 elements the high word is zero and the low one the sum
    over dimensions of a 1-d iota times the dimension's stride, broadcast (elementwise and
    broadcast operators: any dimension may be split, a device makes its block). A larger shape
    (a dropout mask over a whole batch of attention scores) is the same sum in 64 bits: per
    dimension a constant table of each place's stride multiple as (high, low) words,
    broadcast, added word by word with the low words' carry."""
    shape = tuple(eqn.params["shape"])
    if not shape:
        return builder.add_node(eqn, ins, src, scope)
    return builder.emit(lambda: counter_words(shape), [], src, scope)


def counter_words(shape, wide: bool = False) -> list:
    """``[high, low]``: every element's row-major place in ``shape`` as ``iota_2x32_shape``
    gives it, from elementwise and broadcast operators (``counters``); ``wide``: the 64-bit
    sum even below 2**32 elements."""
    if math.prod(shape) < 2**32 and not wide:
        low = None
        for d, n in enumerate(shape):
            place = lax.iota(np.uint32, n) * np.uint32(math.prod(shape[d + 1 :]))
            place = lax.broadcast_in_dim(place, shape, (d,))
            low = place if low is None else low + place
        return [lax.full(shape, 0, np.uint32), low]
    high = low = None
    for d, n in enumerate(shape):
        wide_place = np.arange(n, dtype=np.uint64) * np.uint64(math.prod(shape[d + 1 :]))
        lo = lax.broadcast_in_dim(
            (wide_place & np.uint64(0xFFFFFFFF)).astype(np.uint32), shape, (d,)
        )
        hi = lax.broadcast_in_dim((wide_place >> np.uint64(32)).astype(np.uint32), shape, (d,))
        high, low = (hi, lo) if low is None else add_words(high, low, hi, lo)
    return [high, low]


def add_words(high, low, hi, lo) -> tuple:
    """``(high, low) + (hi, lo)`` as 64-bit numbers in uint32 words: the low words' carry."""
    total = low + lo
    return high + hi + (total < low).astype(np.uint32), total


def physical_rule(eqn, where: str):
    """A function of ``eqn``'s physical operands giving its physical results (a list): see the
    module docstring. ``where`` names the equation's source line for the error a primitive
    on keys without a rule raises."""
    name, params = eqn.primitive.name, eqn.params
    ins = [v.aval for v in eqn.invars]
    out = eqn.outvars[0].aval
    from jax._src.random import prng

    if name in ("random_wrap", "random_unwrap", "copy", "copy_p"):
        return lambda x: [x]
    if name == "random_seed":
        return lambda s: [prng.random_seed_impl_base(s, impl=params["impl"])]
    if name == "random_bits":
        impl, n = ins[0].dtype._impl, len(ins[0].shape)
        return lambda k: [
            prng.random_bits_impl_base(
                impl, k, n, bit_width=params["bit_width"], shape=params["shape"]
            )
        ]
    if name == "random_split":
        impl, n = ins[0].dtype._impl, len(ins[0].shape)
        return lambda k: [prng.random_split_impl_base(impl, k, n, shape=params["shape"])]
    if name == "random_fold_in":
        impl, shape = ins[0].dtype._impl, tuple(ins[0].shape)
        return lambda k, m: [prng.random_fold_in_impl_base(impl, k, m, shape)]
    tail = _trailing(out)
    t = len(tail)
    if name == "slice":
        strides = params.get("strides") or (1,) * len(params["start_indices"])
        return lambda x: [
            lax.slice(
                x,
                tuple(params["start_indices"]) + (0,) * t,
                tuple(params["limit_indices"]) + tail,
                tuple(strides) + (1,) * t,
            )
        ]
    if name == "squeeze":
        return lambda x: [lax.squeeze(x, params["dimensions"])]
    if name == "reshape" and params.get("dimensions") is None:
        return lambda x: [lax.reshape(x, tuple(params["new_sizes"]) + tail)]
    if name == "broadcast_in_dim":
        rank = len(params["shape"])
        return lambda x: [
            lax.broadcast_in_dim(
                x,
                tuple(params["shape"]) + tail,
                tuple(params["broadcast_dimensions"]) + tuple(range(rank, rank + t)),
            )
        ]
    if name == "concatenate":
        return lambda *xs: [lax.concatenate(xs, params["dimension"])]
    if name == "dynamic_slice":
        return lambda x, *idx: [
            lax.dynamic_slice(x, tuple(idx) + (0,) * t, tuple(params["slice_sizes"]) + tail)
        ]
    if name == "select_n" and not is_key(ins[0]):

        def select(which, *cases):
            if which.ndim:  # one choice per key: the same for its data
                which = lax.broadcast_in_dim(which, cases[0].shape, tuple(range(which.ndim)))
            return [lax.select_n(which, *cases)]

        return select
    if name in ("random_gamma", "while"):
        raise RuleError(
            f"'{name}' on PRNG keys{where}: jax.random.gamma, beta and dirichlet "
            "(random_gamma) and poisson (a while loop over keys) draw by rejection "
            "loops autopar does not trace. Draw them outside the step and pass them "
            "in; for draws that must follow the parameters, build them from uniform "
            "or normal draws inside the step (e.g. Kumaraswamy for Beta, a "
            "logistic-normal for Dirichlet)."
        )
    raise RuleError(
        f"'{name}' on PRNG keys{where} has no rule in autopar (it handles "
        "random_bits, split, fold_in, seed, wrap/unwrap and slicing, reshaping, "
        "broadcasting, concatenating and selecting keys); make the random values "
        "outside the step and pass them in, or rewrite that line."
    )
