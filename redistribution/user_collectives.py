"""Lowering a hybrid_parallel step: the collectives it calls, as written.

In: the per-device Graph of the step (``autopar.trace.trace_per_device``: local shapes, JAX's
collective primitives as nodes), the LogicalMesh, the layout of every argument leaf and of
every result (never partial: the step's own collectives made them whole) and a
``Planner`` (to pick and price each collective's algorithm). Out: ``(Program, comm)``: the
Program both runtimes run and, per collective node id, its estimated seconds. No
layout is chosen: every operator computes on its local shapes, and each collective primitive
becomes one ``Collective`` over the mesh axes it names:

| JAX primitive                          | Program                                              |
|----------------------------------------|------------------------------------------------------|
| ``psum``, ``psum_invariant``, ``pmax``, ``pmin`` | ``all_reduce`` (op sum, max, min), one per operand |
| ``all_gather``, ``all_gather_invariant`` | ``all_gather`` along ``all_gather_dimension`` (untiled: a size-1 dimension is inserted first) |
| ``reduce_scatter``                     | ``reduce_scatter`` along ``scatter_dimension`` (untiled: that dimension is dropped after) |
| ``all_to_all``                         | ``all_to_all`` (``dim`` = concat_axis, ``dst_dim`` = split_axis) |
| ``axis_index``                         | ``Slice`` of the constant ``arange(n)`` over the axes, then a reshape to a scalar |
| ``pvary``                              | nothing: it only retypes a value as varying          |
"""

from __future__ import annotations

import math

import jax
import numpy as np

from autopar.errors import RuleError
from autopar.graph import Const, Node, Value
from autopar.program import Collective, Compute, Program, Slice, StepKind, segment

_REDUCE = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min"}
_GATHER = ("all_gather", "all_gather_invariant")
_RETYPE = ("pvary",)
COLLECTIVE_PRIMS = (
    frozenset(_REDUCE)
    | set(_GATHER)
    | set(_RETYPE)
    | {"reduce_scatter", "all_to_all", "axis_index"}
)


def collectives_inside(node) -> set:
    """The ``ap.comm`` functions whose collective primitives lie inside ``node``'s own jaxprs
    (a while loop's body and condition), at any depth: the native runtime cannot run them there
    (only a Program's collectives are its own), JAX's shard_map can."""
    found, todo = set(), list(node.params.values())
    while todo:
        p = todo.pop()
        if isinstance(p, (tuple, list)):
            todo.extend(p)
            continue
        jaxpr = getattr(p, "jaxpr", p)
        for eqn in getattr(jaxpr, "eqns", ()):
            name = eqn.primitive.name
            if name in COLLECTIVE_PRIMS - set(_RETYPE):
                found.add(
                    "ap.comm."
                    + (
                        "all_reduce"
                        if name in _REDUCE
                        else "all_gather"
                        if name in _GATHER
                        else name
                    )
                )
            todo.extend(eqn.params.values())
    return found


def _axes(node) -> tuple:
    names = node.params.get("axes", node.params.get("axis_name"))
    names = (names,) if isinstance(names, str) else tuple(names)
    if not all(isinstance(a, str) for a in names) or node.params.get("axis_index_groups"):
        raise RuleError(
            f"{node.prim} at {node.source or node.name} names axes {names!r} with "
            f"groups {node.params.get('axis_index_groups')}; hybrid_parallel runs "
            "collectives over whole named mesh axes only."
        )
    return names


def lower_hybrid(graph, mesh, in_layouts, out_layouts, planner) -> tuple:
    """``(Program, comm)`` of the module docstring."""
    low = _HybridLowering(graph, mesh, planner)
    for node in graph.nodes:
        low.node(node)
    outputs = [low.reg(x) for x in graph.outputs]
    inputs = tuple(v.id for v in graph.inputs)
    final = [r for r in outputs if isinstance(r, int)]
    return Program(
        mesh,
        inputs,
        tuple(in_layouts),
        tuple(outputs),
        tuple(out_layouts),
        segment(low.out, low.avals, final),
        graph.in_tree,
        graph.out_tree,
        low.avals,
    ), low.comm


class _HybridLowering:
    """The instructions so far (``out``), every register's local shape and dtype
    (``avals``; a graph value's register is its id), the values ``pvary`` renamed
    (``alias``) and each collective node's seconds (``comm``)."""

    def __init__(self, graph, mesh, planner):
        self.mesh, self.planner = mesh, planner
        self.avals = {v.id: (tuple(v.shape), np.dtype(v.dtype)) for v in graph.inputs}
        for n in graph.nodes:
            self.avals.update((o.id, (tuple(o.shape), np.dtype(o.dtype))) for o in n.outputs)
        self.alias = {}
        self.next_reg = max(self.avals, default=-1) + 1
        self.out, self.comm = [], {}

    def reg(self, x):
        return x if isinstance(x, Const) else self.alias.get(x.id, x.id)

    def new(self, shape, dtype):
        self.next_reg += 1
        self.avals[self.next_reg - 1] = (tuple(shape), np.dtype(dtype))
        return self.next_reg - 1

    def reshape(self, node, src, shape, dst=None):
        dst = self.new(shape, self.avals[src][1]) if dst is None else dst
        v = Value(-1, tuple(shape), self.avals[src][1])
        rn = Node(
            -1,
            jax.lax.reshape_p,
            (Value(-1, *self.avals[src]),),
            (v,),
            {"new_sizes": tuple(shape), "dimensions": None, "sharding": None},
            node.source,
            node.scope,
            node.backward,
        )
        self.out.append(Compute(rn, rn.params, (src,), (dst,), (tuple(shape),)))
        return dst

    def collective(self, kind, node, axes, src, dst, **kw):
        shape, dtype = self.avals[src]
        nbytes = max(int(math.prod(shape)), int(math.prod(self.avals[dst][0]))) * dtype.itemsize
        seconds, algorithm = self.planner.step_time(kind, axes, nbytes)
        self.comm[node.id] = self.comm.get(node.id, 0.0) + seconds
        self.out.append(
            Collective(
                kind,
                axes,
                shape,
                dtype,
                nbytes,
                algorithm,
                src=src,
                out=dst,
                reason=f"{node.name} at {node.source or 'an unknown line'}",
                node_id=node.id,
                prices=self.planner.all_reduce_prices(axes) if kind == StepKind.ALL_REDUCE else (),
                **kw,
            )
        )

    def node(self, node):
        """One graph node: an operator as it is (the trace's manual-mesh shardings dropped),
        a collective primitive per the module table."""
        p, ins = node.params, [self.reg(x) for x in node.inputs]
        if node.prim not in COLLECTIVE_PRIMS:
            local = {k: None if k in ("sharding", "out_sharding") else v for k, v in p.items()}
            self.out.append(
                Compute(
                    node,
                    local,
                    tuple(ins),
                    tuple(o.id for o in node.outputs),
                    tuple(tuple(o.shape) for o in node.outputs),
                )
            )
            return
        axes = _axes(node)
        if node.prim in _RETYPE:
            self.alias.update((o.id, r) for o, r in zip(node.outputs, ins))
            return
        if any(isinstance(r, Const) for r in ins):  # a literal: give it a register
            ins = [
                _const_reg(r, self.new, self.out, node) if isinstance(r, Const) else r for r in ins
            ]
        o = node.outputs[0].id
        if node.prim in _REDUCE:
            for r, v in zip(ins, node.outputs):
                self.collective(StepKind.ALL_REDUCE, node, axes, r, v.id, op=_REDUCE[node.prim])
        elif node.prim in _GATHER:
            d, src = p["all_gather_dimension"], ins[0]
            if not p["tiled"]:
                shape = list(self.avals[src][0])
                src = self.reshape(node, src, shape[:d] + [1] + shape[d:])
            self.collective(StepKind.ALL_GATHER, node, axes, src, o, dim=d)
        elif node.prim == "reduce_scatter":
            d = p["scatter_dimension"]
            if p["tiled"]:
                self.collective(StepKind.REDUCE_SCATTER, node, axes, ins[0], o, dim=d)
            else:
                shape = list(self.avals[ins[0]][0])
                mid = self.new(shape[:d] + [1] + shape[d + 1 :], self.avals[ins[0]][1])
                self.collective(StepKind.REDUCE_SCATTER, node, axes, ins[0], mid, dim=d)
                self.reshape(node, mid, self.avals[o][0], o)
        elif node.prim == "all_to_all":
            if not p.get("tiled", False):
                raise RuleError(
                    f"all_to_all at {node.source or node.name} is untiled; call "
                    "ap.comm.all_to_all (or jax.lax.all_to_all with tiled=True)."
                )
            self.collective(
                StepKind.ALL_TO_ALL,
                node,
                axes,
                ins[0],
                o,
                dim=p["concat_axis"],
                dst_dim=p["split_axis"],
            )
        else:  # axis_index
            n = math.prod(self.mesh.axis_size(a) for a in axes)
            iota = Const(np.arange(n, dtype=np.int32), (n,), np.dtype(np.int32))
            mid = self.new((1,), np.int32)
            self.out.append(Slice(axes, 0, (n,), iota, mid))
            self.reshape(node, mid, (), o)


def _const_reg(c, new, out, node):
    """A register holding literal ``c`` (a collective reads registers only)."""
    r = new(c.shape, c.dtype)
    v = Value(-1, tuple(c.shape), np.dtype(c.dtype))
    cn = Node(
        -1,
        jax.lax.convert_element_type_p,
        (c,),
        (v,),
        {"new_dtype": np.dtype(c.dtype), "weak_type": False, "sharding": None},
        node.source,
        node.scope,
        node.backward,
    )
    out.append(Compute(cn, cn.params, (c,), (r,), (tuple(c.shape),)))
    return r
