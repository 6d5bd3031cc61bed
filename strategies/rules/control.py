"""Control flow the tracer leaves as one operator: ``while`` (``lax.while_loop`` with a trip
count known only at run time; ``scan``, static ``fori_loop`` and ``cond`` are inlined by
``autopar.trace_control``).

In: a ``while`` node. Out: its ``OpSpec``: no dimension of any operand or result may be split,
so every device runs the whole loop on whole operands (what it computes is the single-device
loop's values; what the loop reads is gathered first). Priced as one pass of its results
(the cost model cannot know how many times it turns).
"""

from __future__ import annotations

from .spec import OpSpec, Rule


def whole_spec(node):
    return OpSpec(
        tuple((None,) * len(x.shape) for x in node.inputs),
        tuple((None,) * len(y.shape) for y in node.outputs),
        frozenset(),
        (),
    )


RULES = {"while": Rule(whole_spec)}
