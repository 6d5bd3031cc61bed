"""Control flow inside a traced step, inlined as straight-line operators the planner can lay out.

``lax.scan`` (and ``fori_loop`` with static bounds, which JAX traces as a scan; a layer stack
written with ``nn.scan``; gradient accumulation over micro-batches) is unrolled: its body is
inlined once per iteration, each iteration reading its slice of the scanned inputs and the
previous iteration's carry, and the per-iteration outputs stacked, so every iteration's
operators get layouts of their own. At most ``MAX_UNROLL`` iterations: a longer scan (an RNN
over a long sequence) would make a graph too large to plan, and is refused. ``lax.cond`` /
``lax.switch`` with a traced index computes every branch and selects each result by the index
(``select_n``), as XLA does for cheap branches: the values are the chosen branch's; a branch's
cost is paid even when it is not taken (the uninitialised scalars, ``empty2``, a differentiated
cond keeps for the branches not taken become zeros, as XLA lowers them). ``while_loop`` (a trip
count known only at run time) is not handled: its eqn reaches the rule table, which refuses it
with the user's line.

``HANDLERS`` also sends random bits' counters (``iota_2x32_shape``) to ``trace_keys.counters``.

In: the tracer's builder (``autopar.trace._Builder``), a ``scan`` or ``cond`` equation, its
operands as graph values, its source line and scope. Out: the equation's results as graph
values, the operators that compute them added to the builder.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .errors import RuleError
from .graph import Const
from .trace_keys import counters

MAX_UNROLL = 128        # scan iterations inlined at most


def emit(builder, fn, ins, src, scope) -> list:
    """``fn`` (a function of arrays shaped as ``ins`` returning a list) traced and inlined on
    ``ins``: its results as graph values."""
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ins]
    sub = jax.make_jaxpr(fn)(*specs)
    return builder.inline(sub.jaxpr, sub.consts, list(ins), src, scope)


def unroll_scan(builder, eqn, ins, src, scope) -> list:
    p = eqn.params
    n, body = p["length"], p["jaxpr"]
    if not 0 < n <= MAX_UNROLL:
        raise RuleError(f"a lax.scan of {n} iterations at {src or 'an unknown source line'}: "
                        f"autopar unrolls scans of 1 to {MAX_UNROLL} iterations (each one's "
                        "operators planned); shorten it, or write the loop in Python over "
                        "fewer, larger steps.")
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
    ys = {}
    for i in (reversed(range(n)) if p["reverse"] else range(n)):
        x_i = emit(builder, lambda *a, i=i: [x[i] for x in a], xs, src, scope) if xs else []
        out = builder.inline(body.jaxpr, body.consts, [*consts, *carry, *x_i], src, scope)
        carry, ys[i] = out[:nk], out[nk:]
    stacked = []
    for j in range(len(eqn.outvars) - nk):
        parts = [ys[i][j] for i in range(n)]
        stacked += emit(builder, lambda *a: [jnp.stack(a)], parts, src, scope)
    return carry + stacked


def cond_as_select(builder, eqn, ins, src, scope) -> list:
    index, ops = ins[0], ins[1:]
    outs = [builder.inline(b.jaxpr, b.consts, list(ops), src, scope)
            for b in eqn.params["branches"]]
    if len(outs) == 1:
        return outs[0]
    return [emit(builder, lambda w, *cases: [lax.select_n(w, *cases)], [index, *cases],
                 src, scope)[0] for cases in zip(*outs)]


def empty_scalar(builder, eqn, ins, src, scope) -> list:
    """``empty2``: the uninitialised scalar a differentiated cond keeps for a branch not taken;
    a zero, as XLA lowers it."""
    dtype = np.dtype(eqn.params["dtype"])
    return [Const(np.zeros((), dtype), (), dtype)]


HANDLERS = {"scan": unroll_scan, "cond": cond_as_select, "empty2": empty_scalar,
            "iota_2x32_shape": counters}
