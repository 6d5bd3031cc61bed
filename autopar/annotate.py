"""Annotations that survive tracing: ``ap.shard`` (a value's layout) and ``ap.pipeline_stage``
(the pipeline stage of a block of operators).

``ap.shard``: in: a JAX value and a strategy (a tuple of split counts, MindSpore style, a
``jax.sharding.PartitionSpec``, an ``ap.Layout`` or its text ``"[_,y]"``, or MindSpore's
``ap.Layout(device_matrix, aliases)(...)``). Out: the same
value, tagged by the identity primitive ``autopar_shard``. Or in: a function and MindSpore's
``in_strategy``/``out_strategy``; out: the function with its operands and result tagged
(``device_matrix.OperatorSpec``, resolved against the operator at planning). Run
normally (without autopar) the tag is a no-op; traced by ``ap.compile`` it fixes the layout of
that value. Tangents are not tagged, so a tag constrains the forward value only.

``ap.pipeline_stage(i)``: a context manager (a ``jax.named_scope`` named ``autopar_stage<i>``):
the operators traced inside it run in stage ``i``; their derivatives inherit the stage through
JAX's name stack (``transpose(jvp(autopar_stage<i>))``). Outside autopar it only names a scope.
"""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

from .device_matrix import DeviceSpec, MeshTemplate, OperatorSpec
from .errors import ConfigError, LayoutError
from .layout import Layout

shard_p = Primitive("autopar_shard")
shard_p.def_impl(lambda x, *, spec: x)
shard_p.def_abstract_eval(lambda x, *, spec: x)
mlir.register_lowering(shard_p, mlir.lower_fun(lambda x, *, spec: x, multiple_results=False))
ad.primitive_jvps[shard_p] = lambda primals, tangents, *, spec: (
    shard_p.bind(primals[0], spec=spec),
    tangents[0],
)
batching.primitive_batchers[shard_p] = lambda args, dims, *, spec: (args[0], dims[0])


def shard(x, strategy=None, out_strategy=None, *, in_strategy=None):
    """Annotate a value with a layout: ``ap.shard(w, (1, 4))``, ``ap.shard(w, P(None, "y"))``
    (a ``jax.sharding.PartitionSpec``), ``ap.shard(w, "[_,y]")`` (a layout's text) or ``ap.shard(w, ap.Layout((2, 4), ("dp", "mp"))("None",
    "mp"))``; or an operator-like function with MindSpore's tuples (``ms.shard``):
    ``ap.shard(fn, in_strategy=((2, 1), (1, 4)), out_strategy=None)`` returns ``fn`` whose
    operands (and result) carry them, on the device matrix MindSpore derives for the operator
    it calls (``device_matrix.OperatorSpec``)."""
    if callable(x) and not hasattr(x, "shape"):
        return _shard_fn(x, in_strategy if in_strategy is not None else strategy, out_strategy)
    if strategy is None or out_strategy is not None or in_strategy is not None:
        raise LayoutError(
            "ap.shard(value, strategy) takes one strategy for a value; "
            "in_strategy/out_strategy are for ap.shard(function, ...)."
        )
    return shard_p.bind(x, spec=_value_spec(strategy, np.ndim(x)))


def _value_spec(strategy, rank: int):
    if isinstance(strategy, str):
        strategy = Layout.parse(strategy)
    if isinstance(strategy, PartitionSpec):
        strategy = Layout.from_partition_spec(strategy, rank)
    if isinstance(strategy, (Layout, DeviceSpec)):
        return strategy
    if isinstance(strategy, MeshTemplate):
        raise LayoutError(
            f"{strategy} is a device matrix, not a layout: call it with one alias "
            "per tensor dimension, e.g. ap.Layout((2, 4), ('dp', 'mp'))('dp', "
            "'None')."
        )
    try:
        return tuple(strategy)  # validated (integers >= 1, fits) by ap.compile
    except TypeError:
        raise LayoutError(
            f"ap.shard strategy {strategy!r} must be a tuple of split counts "
            "like (1, 4), a jax.sharding.PartitionSpec like P(None, 'y'), or an "
            "ap.Layout or its text like '[_,y]'."
        ) from None


_groups = itertools.count()


def _shard_fn(fn, in_strategy, out_strategy):
    if not isinstance(in_strategy, (tuple, list)):
        raise LayoutError(
            f"ap.shard({getattr(fn, '__name__', fn)}, in_strategy="
            f"{in_strategy!r}): give one entry per argument: a split tuple, an "
            "ap.Layout(...)(...) or None, e.g. ((2, 1), (1, 4))."
        )
    plain = lambda s: s is not None and not isinstance(s, (Layout, DeviceSpec, str, PartitionSpec))
    name = getattr(fn, "__name__", "fn")
    counts = tuple(tuple(s) if plain(s) else None for s in in_strategy)
    for c in counts:
        if c is not None and not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in c
        ):
            raise LayoutError(
                f"ap.shard({name}, in_strategy={in_strategy!r}): {c} is not a "
                "tuple of split counts (whole numbers >= 1, one per dimension of "
                "its argument); for mesh axis names give a "
                "jax.sharding.PartitionSpec, e.g. P('x', None), or a layout's "
                "text, e.g. '[x,_]'."
            )

    @functools.wraps(fn)
    def wrapped(*args):
        if len(args) != len(in_strategy):
            raise LayoutError(
                f"{name} was given {len(args)} "
                f"arguments but in_strategy has {len(in_strategy)} entries."
            )
        for i, (a, c) in enumerate(zip(args, counts)):
            if c is not None and len(c) != np.ndim(a):
                raise LayoutError(
                    f"ap.shard({name}, in_strategy={in_strategy!r}): argument {i} "
                    f"has {np.ndim(a)} dimension(s) but its strategy {c} gives "
                    f"{len(c)} split counts; give one per dimension."
                )
        _softmax_axis_unsplit(fn, counts, name, in_strategy, args)
        group = next(_groups)
        args = [
            a
            if s is None
            else shard_p.bind(
                a,
                spec=OperatorSpec(counts, i, group)
                if counts[i] is not None
                else _value_spec(s, np.ndim(a)),
            )
            for i, (a, s) in enumerate(zip(args, in_strategy))
        ]
        out = fn(*args)
        if out_strategy is None:
            return out
        if not isinstance(out_strategy, (tuple, list)) or len(out_strategy) != 1:
            raise LayoutError(
                f"out_strategy={out_strategy!r}: give one entry for the "
                "operator's one result, e.g. ((8, 1),)."
            )
        o = out_strategy[0]
        return shard_p.bind(
            out,
            spec=OperatorSpec(counts, -1, group, tuple(o))
            if plain(o)
            else _value_spec(o, np.ndim(out)),
        )

    return wrapped


def _softmax_axis_unsplit(fn, counts, name, in_strategy, args) -> None:
    """MindSpore's Softmax (and LogSoftmax) refuse a strategy splitting the axis they
    normalise over; so does ``ap.shard(jax.nn.softmax, ...)``, which stands for it."""
    base, kw = (fn.func, fn.keywords) if isinstance(fn, functools.partial) else (fn, {})
    if base not in (jax.nn.softmax, jax.nn.log_softmax) or not counts or counts[0] is None:
        return
    axes = kw.get("axis", -1)
    for axis in axes if isinstance(axes, (tuple, list)) else (axes,):
        if counts[0][axis % np.ndim(args[0])] > 1:
            raise LayoutError(
                f"ap.shard({name}, in_strategy={in_strategy!r}): the strategy splits the axis "
                f"the softmax normalises over ({axis}) {counts[0][axis]} ways, which "
                "MindSpore's Softmax refuses (\"the strategy corresponding to axis dimension is "
                "not 1\"); give 1 there and split the other dimensions, or annotate the values "
                "(ap.shard(x, ...)) and let autopar plan the softmax with its collectives."
            )


STAGE_SCOPE = "autopar_stage"


def pipeline_stage(i: int):
    """``with ap.pipeline_stage(0): h = block(params, x)``: the operators inside run in stage 0."""
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ConfigError(
            f"ap.pipeline_stage({i!r}): the stage must be an integer >= 0 "
            "(stages count from 0 up to pipeline_stages - 1)."
        )
    return jax.named_scope(f"{STAGE_SCOPE}{i}")
