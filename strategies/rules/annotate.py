"""The ``autopar_shard`` annotation primitive (``ap.shard``, see ``autopar/annotate.py``).

In: an ``autopar_shard`` node. Out: the identity spec ``"d0 d1 .. -> d0 d1 .."``, linear in its
operand. The rule says only what is computable; the annotated layout itself (the ``spec``
param) is a constraint that the search applies to the node, not a restriction of this rule.
"""

from __future__ import annotations

from autopar.annotate import shard_p

from .spec import OpSpec, Rule


def shard_spec(node):
    dims = tuple(f"d{i}" for i in range(len(node.inputs[0].shape)))
    return OpSpec((dims,), (dims,), frozenset(), ((0,),))


RULES = {shard_p.name: Rule(shard_spec)}
