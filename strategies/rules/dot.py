"""Contractions: ``dot_general``.

In: a dot_general node. Out: the einsum-like spec, e.g. a matmul is ``"m k+, k+ n -> m n"``
and a batched matmul ``"b m k+, b k+ n -> b m n"``: batch and free dimensions split the
result, contracting dimensions leave partial sums. Linear in each operand separately.
"""

from __future__ import annotations

from .spec import OpSpec, Rule


def dot_general_spec(node):
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.inputs[0].shape, node.inputs[1].shape
    L = [None] * len(lhs)
    R = [None] * len(rhs)
    for i, (a, b) in enumerate(zip(lb, rb)):
        L[a] = R[b] = f"b{i}"
    for i, (a, b) in enumerate(zip(lc, rc)):
        L[a] = R[b] = f"k{i}"
    out = [L[a] for a in lb]
    for i in range(len(lhs)):
        if L[i] is None:
            L[i] = f"m{i}"
            out.append(L[i])
    for i in range(len(rhs)):
        if R[i] is None:
            R[i] = f"n{i}"
            out.append(R[i])
    reduce = frozenset(f"k{i}" for i in range(len(lc)))
    return OpSpec((tuple(L), tuple(R)), (tuple(out),), reduce, ((0,), (1,)))


RULES = {"dot_general": Rule(dot_general_spec)}
