"""Reductions, scans and sorts along axes.

In: a node of ``reduce_sum``, ``reduce_max``/``min``/``prod``/``and``/``or``/``xor``, ``reduce``,
``argmax``/``argmin``, ``cumsum``/``cumprod``/``cummax``/``cummin``/``cumlogsumexp``, ``sort`` or
``top_k``. Out: its ``OpSpec``:

- ``reduce_sum``: kept dimensions carry letters, reduced ones carry ``+`` letters (a split
  reduced dimension leaves a partial sum), e.g. ``"a b+ c -> a c"``; linear in its operand.
- every other reduction: reduced dimensions are ``_`` (a local max of a block is not the max, and
  the notation's only pending reduction is a sum); kept dimensions carry letters. So also
  ``reduce`` (``lax.reduce`` with a function of the user's own, over one or more operands with
  their initial values: scalars, no letters).
- scans, ``sort`` and ``top_k``: the scanned/sorted axis is ``_``, the others carry letters;
  ``cumsum`` is linear.
No local params change: ``axes``/``axis``/``dimension``/``k`` name dimensions, not sizes.
"""

from __future__ import annotations

from .spec import OpSpec, Rule


def _reduction(summed: bool):
    def spec(node):
        rank = len(node.inputs[0].shape)
        axes = {a % rank for a in node.params["axes"]}
        ins = tuple(
            (None if not summed else f"r{d}") if d in axes else f"d{d}" for d in range(rank)
        )
        out = tuple(l for d, l in enumerate(ins) if d not in axes)
        reduce = frozenset(f"r{d}" for d in axes) if summed else frozenset()
        return OpSpec((ins,), (out,), reduce, ((0,),) if summed else ())

    return Rule(spec)


def _user_reduction(node):
    """``reduce``: its operands, then as many scalar initial values; one result per operand."""
    n = len(node.outputs)
    rank = len(node.inputs[0].shape)
    axes = set(node.params["dimensions"])
    dims = tuple(None if d in axes else f"d{d}" for d in range(rank))
    out = tuple(l for d, l in enumerate(dims) if d not in axes)
    return OpSpec((dims,) * n + ((),) * n, (out,) * n, frozenset(), ())


def _along_axis(param: str, linear: bool):
    """Ops whose outputs keep the operands' rank, except that the ``param`` axis is whole
    (``top_k`` changes its size, which is why it may never be split)."""

    def spec(node):
        rank = len(node.inputs[0].shape)
        axis = node.params[param] % rank
        dims = tuple(None if d == axis else f"d{d}" for d in range(rank))
        return OpSpec(
            tuple(dims for _ in node.inputs),
            tuple(dims for _ in node.outputs),
            frozenset(),
            ((0,),) if linear else (),
        )

    return Rule(spec)


RULES = {
    "reduce_sum": _reduction(summed=True),
    **{
        name: _reduction(summed=False)
        for name in (
            "reduce_max",
            "reduce_min",
            "reduce_prod",
            "reduce_and",
            "reduce_or",
            "reduce_xor",
            "argmax",
            "argmin",
        )
    },
    "cumsum": _along_axis("axis", linear=True),
    **{
        name: _along_axis("axis", linear=False)
        for name in ("cumprod", "cummax", "cummin", "cumlogsumexp", "top_k")
    },
    "sort": _along_axis("dimension", linear=False),
    "reduce": Rule(_user_reduction),
}
