"""autopar's graph IR: a small SSA graph made from a jaxpr.

In: built by ``autopar.trace``. Out: ``Graph`` with ``Value`` (shape, dtype), ``Const``
(a literal or captured array) and ``Node`` (one JAX primitive application) in topological
order, use lists, and ``str(graph)``: a stable printed form for golden tests, e.g.
``%3:f32[8,32] = dot_general(%0, %1) {dimension_numbers=...}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jax.extend.core import Primitive
    from jax.tree_util import PyTreeDef
    from jax.typing import ArrayLike

_SHORT = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int32": "i32",
    "int64": "i64",
    "int8": "i8",
    "uint8": "u8",
    "uint32": "u32",
    "bool": "bool",
}


def type_str(shape, dtype) -> str:
    return f"{_SHORT.get(str(dtype), str(dtype))}[{','.join(map(str, shape))}]"


@dataclass(frozen=True)
class Value:
    """An SSA value: produced by one node (or a graph input), read by any number of nodes."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"%{self.id}"


@dataclass(frozen=True, eq=False)
class Const:
    """A literal or an array captured by the traced function; always available everywhere."""

    value: ArrayLike
    shape: tuple[int, ...]
    dtype: np.dtype

    def __str__(self) -> str:
        if self.shape == ():
            return repr(np.asarray(self.value).item())
        return f"const:{type_str(self.shape, self.dtype)}"


@dataclass(frozen=True, eq=False)
class Node:
    """One primitive application. ``params`` are the JAX primitive's own parameters."""

    id: int
    primitive: Primitive
    inputs: tuple
    outputs: tuple[Value, ...]
    params: dict
    source: str = ""
    scope: str = ""  # JAX's name stack: jax.named_scope / ap.pipeline_stage names, with
    # jvp(...) / transpose(jvp(...)) around them for derivatives
    backward: bool = False  # part of a derivative (traced under JAX's transpose(...)): set
    # once by the trace, read by stage assignment and pipelining

    @property
    def prim(self) -> str:
        return self.primitive.name

    @property
    def name(self) -> str:
        return f"{self.prim}.{self.id}"

    @cached_property
    def signature(self) -> str:
        """What the operator computes, without value ids: primitive, parameters and operand and
        result types (constants marked). Nodes with equal signatures have the same candidates,
        costs and memory, which lets planning reuse work across repeated layers."""
        ins = ",".join(
            _const_sig(x) if isinstance(x, Const) else type_str(x.shape, x.dtype)
            for x in self.inputs
        )
        outs = ",".join(type_str(v.shape, v.dtype) for v in self.outputs)
        ps = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()) if v is not None)
        return f"{self.prim}({ins})->{outs}{{{ps}}}"

    def __str__(self) -> str:
        outs = ", ".join(f"{v}:{type_str(v.shape, v.dtype)}" for v in self.outputs)
        ins = ", ".join(str(i) for i in self.inputs)
        ps = ", ".join(
            f"{k}={_param_str(v)}"
            for k, v in sorted(self.params.items())
            if k not in _HIDDEN_PARAMS and v is not None
        )
        return f"{outs} = {self.prim}({ins})" + (f" {{{ps}}}" if ps else "")


def _const_sig(c: Const) -> str:
    """A constant's part of a signature: scalars by value, arrays by type (and whether all zero,
    which some rules check)."""
    if c.shape == ():
        return f"{c}:{c.dtype}"
    return f"const:{type_str(c.shape, c.dtype)}" + (":0" if not np.any(np.asarray(c.value)) else "")


_HIDDEN_PARAMS = {
    "sharding",
    "out_sharding",
    "precision",
    "preferred_element_type",
    "accumulation_type",
    "mode",
    "unique_indices",
    "indices_are_sorted",
    "update_jaxpr",
    "update_consts",
}


def _param_str(v) -> str:
    s = str(v).replace("\n", " ")
    return s if len(s) <= 80 else s[:77] + "..."


@dataclass(frozen=True, eq=False)
class Graph:
    inputs: tuple[Value, ...]
    outputs: tuple  # Value or Const
    nodes: tuple[Node, ...]
    in_tree: PyTreeDef | None = None
    out_tree: PyTreeDef | None = None
    producer: dict[int, Node] = field(default_factory=dict, repr=False)  # value id -> Node
    # value id -> [(Node, input index)]
    users: dict[int, list[tuple[Node, int]]] = field(default_factory=dict, repr=False)

    @staticmethod
    def build(inputs, outputs, nodes, in_tree=None, out_tree=None) -> Graph:
        producer: dict[int, Node] = {}
        users: dict[int, list[tuple[Node, int]]] = {v.id: [] for v in inputs}
        for n in nodes:
            for i, x in enumerate(n.inputs):
                if isinstance(x, Value):
                    users[x.id].append((n, i))
            for v in n.outputs:
                producer[v.id] = n
                users[v.id] = []
        return Graph(
            tuple(inputs), tuple(outputs), tuple(nodes), in_tree, out_tree, producer, users
        )

    def dependents(self, positions) -> frozenset:
        """The ids of the graph inputs at ``positions`` and of every node output computed from
        one of them (the values that vary with those inputs: with the batch, the batch's)."""
        out = {self.inputs[i].id for i in positions}
        for n in self.nodes:
            if any(isinstance(x, Value) and x.id in out for x in n.inputs):
                out.update(v.id for v in n.outputs)
        return frozenset(out)

    def values(self):
        yield from self.inputs
        for n in self.nodes:
            yield from n.outputs

    def __str__(self) -> str:
        lines = [
            "graph(" + ", ".join(f"{v}:{type_str(v.shape, v.dtype)}" for v in self.inputs) + ") {"
        ]
        lines += [f"  {n}" for n in self.nodes]
        lines.append("  return " + ", ".join(str(o) for o in self.outputs))
        lines.append("}")
        return "\n".join(lines)
