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
count known only at run time) stays one operator, which every device runs whole
(``strategies/rules/control.py``); one carrying PRNG keys is refused (``trace_keys``).

A cond whose index is known when traced (``platform_index``, resolved here: the default code)
is just the chosen branch. ``custom_linear_solve`` (``jnp.linalg.solve``) is
its ``solve`` function, inlined; ``device_put`` is its operands. ``HANDLERS`` also sends
random bits' counters (``iota_2x32_shape``) to ``trace_keys.counters``.

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

MAX_UNROLL = 128  # scan iterations inlined at most


def emit(builder, fn, ins, src, scope) -> list:
    """``fn`` (a function of arrays shaped as ``ins`` returning a list) traced and inlined on
    ``ins`` (``trace._Builder.emit``): its results as graph values."""
    return builder.emit(fn, ins, src, scope)


def unroll_scan(builder, eqn, ins, src, scope) -> list:
    p = eqn.params
    n, body = p["length"], p["jaxpr"]
    if not 0 < n <= MAX_UNROLL:
        raise RuleError(
            f"a lax.scan of {n} iterations at {src or 'an unknown source line'}: "
            f"autopar unrolls scans of 1 to {MAX_UNROLL} iterations (each one's "
            "operators planned); shorten it, or write the loop in Python over "
            "fewer, larger steps."
        )
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = ins[:nc], list(ins[nc : nc + nk]), ins[nc + nk :]
    ys = {}
    for i in reversed(range(n)) if p["reverse"] else range(n):
        x_i = emit(builder, lambda *a, i=i: [x[i] for x in a], xs, src, scope) if xs else []
        out = builder.inline(body.jaxpr, body.consts, [*consts, *carry, *x_i], src, scope)
        carry, ys[i] = out[:nk], out[nk:]
    stacked = []
    for j in range(len(eqn.outvars) - nk):
        parts = [ys[i][j] for i in range(n)]
        stacked += emit(builder, lambda *a: [jnp.stack(a)], parts, src, scope)
    return carry + stacked


def cond_as_select(builder, eqn, ins, src, scope) -> list:
    index, ops, branches = ins[0], ins[1:], eqn.params["branches"]
    if isinstance(index, Const):  # known when traced (``platform_index``): that
        b = branches[int(np.clip(np.asarray(index.value), 0, len(branches) - 1))]  # branch
        return builder.inline(b.jaxpr, b.consts, list(ops), src, scope)
    outs = [builder.inline(b.jaxpr, b.consts, list(ops), src, scope) for b in branches]
    if len(outs) == 1:
        return outs[0]
    return [
        emit(builder, lambda w, *cases: [lax.select_n(w, *cases)], [index, *cases], src, scope)[0]
        for cases in zip(*outs)
    ]


def empty_scalar(builder, eqn, ins, src, scope) -> list:
    """``empty2``: the uninitialised scalar a differentiated cond keeps for a branch not taken;
    a zero, as XLA lowers it."""
    dtype = np.dtype(eqn.params["dtype"])
    return [Const(np.zeros((), dtype), (), dtype)]


def platform_index(builder, eqn, ins, src, scope) -> list:
    """``platform_index`` (``lax.platform_dependent``, e.g. inside ``jnp.linalg.det``), as a
    constant: the index of the default code, which runs on every platform (a step traced here
    may run on the native runtime's CPU workers or on JAX's devices), else of the code for the
    platform JAX computes on by default (``jax.default_backend()``)."""
    here = {"cpu": {"cpu"}, "gpu": {"cuda", "rocm", "gpu"}, "tpu": {"tpu"}}.get(
        jax.default_backend(), {jax.default_backend()}
    )
    groups = eqn.params["platforms"]
    found = [i for i, ps in enumerate(groups) if ps is not None and here & set(ps)]
    default = [i for i, ps in enumerate(groups) if ps is None]
    if not found and not default:
        raise RuleError(
            f"code at {src or 'an unknown source line'} has versions for "
            f"{[p for ps in groups for p in ps]} only, none for "
            f"{jax.default_backend()}: run the step where JAX computes on one of "
            "those, or give it a default version."
        )
    return [Const(np.int32((default or found)[0]), (), np.dtype(np.int32))]


def linear_solve(builder, eqn, ins, src, scope) -> list:
    """``custom_linear_solve`` (``jnp.linalg.solve``, ``inv``): its ``solve`` function on the
    right-hand side (its consts, then the operands); a differentiated step has already turned
    the solve's transpose into a solve of its own."""
    n, solve = eqn.params["const_lengths"], eqn.params["jaxprs"].solve
    start = n.matvec + n.vecmat
    consts, rhs = ins[start : start + n.solve], ins[sum(n) :]
    return builder.inline(solve.jaxpr, solve.consts, [*consts, *rhs], src, scope)


def placed(builder, eqn, ins, src, scope) -> list:
    """``device_put`` inside a step (``jax.device_put(x)``, ``jnp.array(x, copy=True)``): its
    operands; where values live is the plan's to choose."""
    return list(ins)


HANDLERS = {
    "scan": unroll_scan,
    "cond": cond_as_select,
    "empty2": empty_scalar,
    "iota_2x32_shape": counters,
    "platform_index": platform_index,
    "custom_linear_solve": linear_solve,
    "device_put": placed,
}
