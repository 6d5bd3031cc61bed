"""The rule table: JAX primitive -> ``Rule``, assembled from one module per op family.

In: a graph node. Out: ``rule_for(node)`` returns the Rule of its primitive (``node.primitive``)
or raises ``RuleError`` naming the primitive, its operand shapes and the user's source line.
Adding an operator is one entry in its family's ``RULES`` dict, keyed by the name jaxprs print;
a name that is no JAX primitive fails here, at import (``primitives.primitive``).
"""

from __future__ import annotations

from autopar.errors import RuleError
from autopar.graph import type_str

from . import annotate, control, dot, elementwise, indexing, linalg, reduce, shape, window
from .primitives import primitive
from .spec import OpSpec, Rule, parse

RULES: dict = {
    primitive(name): rule
    for family in (elementwise, dot, shape, reduce, indexing, annotate, window, linalg, control)
    for name, rule in family.RULES.items()
}


def rule_for(node) -> Rule:
    rule = RULES.get(node.primitive)
    if rule is None:
        shapes = ", ".join(type_str(x.shape, x.dtype) for x in node.inputs)
        raise RuleError(
            f"no sharding rule for primitive '{node.prim}' ({shapes}) at "
            f"{node.source or 'an unknown source line'}; rewrite that line with supported jax.numpy "
            "operations, or add a Rule for it to a family module in autopar/strategies/rules/."
        )
    return rule


__all__ = ["RULES", "OpSpec", "Rule", "parse", "rule_for"]
