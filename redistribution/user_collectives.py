"""Lowering a hybrid_parallel step: the collectives it calls, as written.

In: the per-device Graph of the step (``autopar.trace.trace_per_device``: local shapes, JAX's
collective primitives as nodes), the LogicalMesh, the layout of every argument leaf and of
every result (never partial: the step's own collectives made them whole) and a ``Planner`` (to pick and price each collective's algorithm). Out: ``(Program, comm)``: the
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
COLLECTIVE_PRIMS = frozenset(_REDUCE) | set(_GATHER) | set(_RETYPE) | {
    "reduce_scatter", "all_to_all", "axis_index"}


def _axes(node) -> tuple:
    names = node.params.get("axes", node.params.get("axis_name"))
    names = (names,) if isinstance(names, str) else tuple(names)
    if not all(isinstance(a, str) for a in names) or node.params.get("axis_index_groups"):
        raise RuleError(f"{node.prim} at {node.source or node.name} names axes {names!r} with "
                        f"groups {node.params.get('axis_index_groups')}; hybrid_parallel runs "
                        "collectives over whole named mesh axes only.")
    return names


def lower_hybrid(graph, mesh, in_layouts, out_layouts, planner) -> tuple:
    avals = {v.id: (tuple(v.shape), np.dtype(v.dtype)) for v in graph.inputs}
    for n in graph.nodes:
        avals.update((o.id, (tuple(o.shape), np.dtype(o.dtype))) for o in n.outputs)
    alias = {}                                   # value id -> register (pvary)
    nxt = [max(avals, default=-1) + 1]
    out = []

    def reg(x):
        return x if isinstance(x, Const) else alias.get(x.id, x.id)

    def new(shape, dtype):
        nxt[0] += 1
        avals[nxt[0] - 1] = (tuple(shape), np.dtype(dtype))
        return nxt[0] - 1

    def reshape(node, src, shape, dst=None):
        dst = new(shape, avals[src][1]) if dst is None else dst
        v = Value(-1, tuple(shape), avals[src][1])
        rn = Node(-1, jax.lax.reshape_p, (Value(-1, avals[src][0], avals[src][1]),), (v,),
                  {"new_sizes": tuple(shape), "dimensions": None, "sharding": None},
                  node.source, node.scope, node.backward)
        out.append(Compute(rn, rn.params, (src,), (dst,), (tuple(shape),)))
        return dst

    comm = {}

    def collective(kind, node, src, dst, **kw):
        shape, dtype = avals[src]
        nbytes = max(int(math.prod(shape)), int(math.prod(avals[dst][0]))) * dtype.itemsize
        seconds, algorithm = planner.step_time(kind, axes, nbytes)
        comm[node.id] = comm.get(node.id, 0.0) + seconds
        out.append(Collective(kind, axes, shape, dtype, nbytes, algorithm, src=src, out=dst,
                              reason=f"{node.name} at {node.source or 'an unknown line'}",
                              node_id=node.id,
                              prices=planner.all_reduce_prices(axes) if kind == StepKind.ALL_REDUCE
                              else (), **kw))

    for node in graph.nodes:
        p, ins = node.params, [reg(x) for x in node.inputs]
        if node.prim not in COLLECTIVE_PRIMS:      # drop the trace's (manual-mesh) shardings
            local = {k: None if k in ("sharding", "out_sharding") else v for k, v in p.items()}
            out.append(Compute(node, local, tuple(ins), tuple(o.id for o in node.outputs),
                               tuple(tuple(o.shape) for o in node.outputs)))
            continue
        axes = _axes(node)
        if node.prim in _RETYPE:
            alias.update((o.id, r) for o, r in zip(node.outputs, ins))
            continue
        if any(isinstance(r, Const) for r in ins):      # a literal: give it a register
            ins = [_const_reg(r, new, out, node) if isinstance(r, Const) else r for r in ins]
        o = node.outputs[0].id
        if node.prim in _REDUCE:
            for r, v in zip(ins, node.outputs):
                collective(StepKind.ALL_REDUCE, node, r, v.id, op=_REDUCE[node.prim])
        elif node.prim in _GATHER:
            d, src = p["all_gather_dimension"], ins[0]
            if not p["tiled"]:
                shape = list(avals[src][0])
                src = reshape(node, src, shape[:d] + [1] + shape[d:])
            collective(StepKind.ALL_GATHER, node, src, o, dim=d)
        elif node.prim == "reduce_scatter":
            d = p["scatter_dimension"]
            if p["tiled"]:
                collective(StepKind.REDUCE_SCATTER, node, ins[0], o, dim=d)
            else:
                shape = list(avals[ins[0]][0])
                mid = new(shape[:d] + [1] + shape[d + 1:], avals[ins[0]][1])
                collective(StepKind.REDUCE_SCATTER, node, ins[0], mid, dim=d)
                reshape(node, mid, avals[o][0], o)
        elif node.prim == "all_to_all":
            if not p.get("tiled", False):
                raise RuleError(f"all_to_all at {node.source or node.name} is untiled; call "
                                "ap.comm.all_to_all (or jax.lax.all_to_all with tiled=True).")
            collective(StepKind.ALL_TO_ALL, node, ins[0], o, dim=p["concat_axis"],
                       dst_dim=p["split_axis"])
        else:                                            # axis_index
            n = math.prod(mesh.axis_size(a) for a in axes)
            iota = Const(np.arange(n, dtype=np.int32), (n,), np.dtype(np.int32))
            mid = new((1,), np.int32)
            out.append(Slice(axes, 0, (n,), iota, mid))
            reshape(node, mid, (), o)
    outputs = [reg(x) for x in graph.outputs]
    inputs = tuple(v.id for v in graph.inputs)
    final = [r for r in outputs if isinstance(r, int)]
    return Program(mesh, inputs, tuple(in_layouts), tuple(outputs), tuple(out_layouts),
                   segment(out, avals, final), graph.in_tree, graph.out_tree, avals), comm


def _const_reg(c, new, out, node):
    """A register holding literal ``c`` (a collective reads registers only)."""
    r = new(c.shape, c.dtype)
    v = Value(-1, tuple(c.shape), np.dtype(c.dtype))
    cn = Node(-1, jax.lax.convert_element_type_p, (c,), (v,),
              {"new_dtype": np.dtype(c.dtype), "weak_type": False, "sharding": None},
              node.source, node.scope, node.backward)
    out.append(Compute(cn, cn.params, (c,), (r,), (tuple(c.shape),)))
    return r
