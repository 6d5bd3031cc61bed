"""Annotations that survive tracing: ``ap.shard`` (a value's layout) and ``ap.pipeline_stage``
(the pipeline stage of a block of operators).

``ap.shard``: in: a JAX value and a strategy (a tuple of split counts, MindSpore style, or an
``ap.Layout``). Out: the same value, tagged by the identity primitive ``autopar_shard``. Run
normally (without autopar) the tag is a no-op; traced by ``ap.compile`` it fixes the layout of
that value. Tangents are not tagged, so a tag constrains the forward value only.

``ap.pipeline_stage(i)``: a context manager (a ``jax.named_scope`` named ``autopar_stage<i>``):
the operators traced inside it run in stage ``i``; their derivatives inherit the stage through
JAX's name stack (``transpose(jvp(autopar_stage<i>))``). Outside autopar it only names a scope.
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .errors import ConfigError, LayoutError
from .layout import Layout

shard_p = Primitive("autopar_shard")
shard_p.def_impl(lambda x, *, spec: x)
shard_p.def_abstract_eval(lambda x, *, spec: x)
mlir.register_lowering(shard_p, mlir.lower_fun(lambda x, *, spec: x, multiple_results=False))
ad.primitive_jvps[shard_p] = lambda primals, tangents, *, spec: (shard_p.bind(primals[0], spec=spec),
                                                                 tangents[0])
batching.primitive_batchers[shard_p] = lambda args, dims, *, spec: (args[0], dims[0])


def shard(x, strategy):
    """Annotate ``x`` with a layout: ``ap.shard(w, (1, 4))`` or ``ap.shard(w, ap.Layout.parse("[_,y]"))``."""
    if isinstance(strategy, str):
        strategy = Layout.parse(strategy)
    if isinstance(strategy, Layout):
        spec = strategy
    else:
        try:
            spec = tuple(strategy)          # validated (integers >= 1, fits) by ap.compile
        except TypeError:
            raise LayoutError(f"ap.shard strategy {strategy!r} must be a tuple of split counts "
                              "like (1, 4) or an ap.Layout.") from None
    return shard_p.bind(x, spec=spec)


STAGE_SCOPE = "autopar_stage"


def pipeline_stage(i: int):
    """``with ap.pipeline_stage(0): h = block(params, x)``: the operators inside run in stage 0."""
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ConfigError(f"ap.pipeline_stage({i!r}): the stage must be an integer >= 0 "
                          "(stages count from 0 up to pipeline_stages - 1).")
    return jax.named_scope(f"{STAGE_SCOPE}{i}")
