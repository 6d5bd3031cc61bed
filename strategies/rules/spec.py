"""The sharding-rule notation and the Rule record.

In: a rule author's description of one primitive application. Out: an ``OpSpec``: every
operand and result dimension is labelled with a loop letter; splitting a letter over mesh axes
splits every dimension that carries it. Einsum-like text builds one:

    dot_general  "b m k+, b k+ n -> b m n"

- a letter in an output may be split (the op then computes the matching slice locally);
- ``+`` marks a letter whose split leaves a pending partial sum on every output
  (contractions, ``reduce_sum``); a letter found only in inputs without ``+`` may not be split
  (e.g. the reduced dimension of ``reduce_max``);
- ``_`` marks a dimension that may never be split (a concatenation axis, an iota dimension);
- ``linear`` lists groups of inputs in which the op is jointly linear: a candidate may feed
  every input of one group with partial sums over some free mesh axes, and the outputs are then
  partial over the same axes (``add``: ``((0, 1),)``; ``mul``: ``((0,), (1,))``).

``reduce_partial`` lists inputs that carry no ``+`` letter yet are added into the result
(``scatter-add``'s operand): when a ``+`` letter is split they must arrive as partial sums over
the same axes, or every device would add them once.

A ``Rule`` pairs the spec builder with ``local_params``, which rewrites the primitive's shape
parameters for local (per-device) shapes; the default handles ``shape``/``new_sizes``/``sizes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jax import lax

Dims = tuple  # tuple[str | None, ...]


@dataclass(frozen=True)
class OpSpec:
    inputs: tuple[Dims, ...]
    outputs: tuple[Dims, ...]
    reduce: frozenset = frozenset()
    linear: tuple[tuple[int, ...], ...] = ()
    reduce_partial: tuple[int, ...] = ()  # inputs that must be partial over split ``+`` letters

    @property
    def letters(self) -> tuple[str, ...]:
        """Letters that may be split, in order of first appearance."""
        seen, out_letters = [], {l for d in self.outputs for l in d if l}
        for dims in self.inputs + self.outputs:
            for l in dims:
                if l and l not in seen and (l in out_letters or l in self.reduce):
                    seen.append(l)
        return tuple(seen)

    def __str__(self) -> str:
        def side(ops):
            return ", ".join(
                " ".join((l or "_") + ("+" if l in self.reduce else "") for l in d) for d in ops
            )

        return f"{side(self.inputs)} -> {side(self.outputs)}"


def parse(text: str, linear=()) -> OpSpec:
    """``parse("b m k+, b k+ n -> b m n")``; an empty operand (a scalar) is written ``""``."""
    lhs, rhs = text.split("->")
    reduce = set()

    def operands(side):
        ops = []
        for op in side.split(","):
            dims = []
            for tok in op.split():
                if tok.endswith("+"):
                    tok = tok[:-1]
                    reduce.add(tok)
                dims.append(None if tok == "_" else tok)
            ops.append(tuple(dims))
        return tuple(ops)

    return OpSpec(operands(lhs), operands(rhs), frozenset(reduce), tuple(tuple(g) for g in linear))


def default_local_params(node, in_shapes, out_shapes) -> dict:
    """Replace a primitive's global shape parameters by the local ones."""
    p = dict(node.params)
    if "shape" in p:
        p["shape"] = tuple(out_shapes[0])
    if "new_sizes" in p:
        p["new_sizes"] = tuple(out_shapes[0])
    if node.prim == lax.split_p.name:
        p["sizes"] = tuple(s[p["axis"]] for s in out_shapes)
    return p


@dataclass(frozen=True)
class Rule:
    """How one primitive may be split. ``spec(node)`` -> OpSpec; ``local_params(node, local input
    shapes, local output shapes)`` -> the params to bind the primitive with on one device."""

    spec: Callable
    local_params: Callable | None = None

    def params_for(self, node, in_shapes, out_shapes) -> dict:
        return (self.local_params or default_local_params)(node, in_shapes, out_shapes)
