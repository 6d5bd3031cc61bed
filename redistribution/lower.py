"""Lowering: Graph + chosen candidates -> per-rank SPMD Program.

In: a Graph, the chosen ``Candidate`` of every node (its input/output layouts), the layout of
every graph input, a LogicalMesh and a redistribution ``Planner``. Out: ``(Program, comm)``:
the Program holds one ``Compute`` per node (local shape params from the node's rule), grouped
into ``Segment``s, and between producer and consumer the ``Slice``/``Collective`` steps of the cheapest
redistribution from the produced layout to the layout the consumer reads. A value redistributed
to the same layout for several consumers is redistributed once. Graph outputs are made
replicated unless ``out_layouts`` names a (non-partial) layout for them; ``reduced_to`` maps a
value to a layout it is redistributed to before any other read (optimizer level1: a gradient is
reduced in full, then sliced). ``comm`` maps node id -> estimated seconds of the
redistributions feeding it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.graph import Const, Value
from autopar.layout import Layout
from autopar.program import (
    Collective,
    Compute,
    Program,
    Slice,
    StepKind,
    all_reduce_buckets,
    defer_all_reduce_readers,
    segment,
)
from autopar.strategies.rules import rule_for

from .planner import after


def step_layout(layout: Layout, step) -> Layout:
    """The layout after one step: a planner step, or a ``ZeroStep`` adding a partial axis."""
    if step.kind == StepKind.PARTIAL_ZERO:
        return Layout(layout.dims, layout.partial | set(step.axes))
    return after(layout, step)


@dataclass(frozen=True)
class ZeroStep:
    """Local step making a replicated value a partial sum over ``axes``: the value stays on the
    first rank of the axis group, every other rank holds zeros (exact; no communication)."""

    axes: tuple
    kind: StepKind = StepKind.PARTIAL_ZERO
    dim: int | None = None
    dst_dim: int | None = None


def plan_steps(planner, src: Layout, dst: Layout, shape, dtype):
    """``(steps, seconds)`` from ``src`` to ``dst``. Partial axes the destination has and the
    source lacks are created last, locally (``ZeroStep``); the rest is the planner's path.
    Answers are kept in ``planner.steps_memo`` (searches ask the same pairs millions of times)."""
    key = (src, dst, tuple(shape), dtype)
    hit = planner.steps_memo.get(key)
    if hit is None:
        extra = dst.partial - src.partial
        plan = planner.plan(src, Layout(dst.dims, dst.partial - extra), shape, dtype)
        zeros = tuple(ZeroStep((a,)) for a in sorted(extra, key=planner.mesh.axis_names.index))
        hit = planner.steps_memo[key] = (tuple(plan.steps) + zeros, plan.cost)
    return hit


def _nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def emit_steps(
    steps, src, layout, shape, dtype, planner, new_reg, avals, reason="", last=None, node_id=None
):
    """The instructions of ``steps`` (planner steps or ``ZeroStep``s) taking register ``src`` of
    a value of global ``shape`` from ``layout``: ``[(instruction, layout after it)]``, each
    writing a new register (``new_reg()``; ``last`` for the final one when given) whose local
    shape and dtype go into ``avals``; ``reason`` and ``node_id`` say which node's input it is."""
    out, cur, mesh = [], layout, planner.mesh
    for k, step in enumerate(steps):
        here = cur.local_shape(shape, mesh)
        nxt = step_layout(cur, step)
        reg = last if last is not None and k == len(steps) - 1 else new_reg()
        if step.kind in (StepKind.SLICE, StepKind.PARTIAL_ZERO):
            ins = Slice(step.axes, step.dim, here, src, reg, step.kind, node_id=node_id)
        else:
            there = nxt.local_shape(shape, mesh)
            nbytes = max(_nbytes(here, dtype), _nbytes(there, dtype))
            _, algo = planner.step_time(step.kind, step.axes, _nbytes(here, dtype))
            ins = Collective(
                step.kind,
                tuple(step.axes),
                here,
                np.dtype(dtype),
                nbytes,
                algo,
                step.dim,
                step.dst_dim,
                src,
                reg,
                reason,
                prices=planner.all_reduce_prices(tuple(step.axes))
                if step.kind == StepKind.ALL_REDUCE
                else (),
                node_id=node_id,
            )
        avals[reg] = (nxt.local_shape(shape, mesh), np.dtype(dtype))
        out.append((ins, nxt))
        src, cur = reg, nxt
    return out


class _Lowerer:
    def __init__(self, graph, choice, in_layouts, mesh, planner, out_layouts=None, reduced_to=None):
        self.graph, self.choice, self.mesh, self.planner = graph, choice, mesh, planner
        self.out_layouts = out_layouts or (None,) * len(graph.outputs)
        self.reduced_to = reduced_to or {}
        self.instructions = []
        self.owners = []  # per instruction: index of the node it feeds or computes,
        # None for a result's redistribution
        self.current = None
        self.where = {}  # value id -> {Layout: register}
        self.layout = {}  # value id -> produced layout
        self.next_reg = 0
        self.inputs = []
        self.avals = {}  # register -> (local shape, dtype)
        self.local = {}  # (node signature, candidate) -> (out shapes, params)
        for v, l in zip(graph.inputs, in_layouts):
            r = self.new_reg()
            self.avals[r] = (l.local_shape(v.shape, mesh), np.dtype(v.dtype))
            self.inputs.append(r)
            self.where[v.id] = {l: r}
            self.layout[v.id] = l

    def new_reg(self) -> int:
        self.next_reg += 1
        return self.next_reg - 1

    def read(self, x, want: Layout, reason: str):
        """Register holding ``x`` in layout ``want`` (emitting redistribution); and its cost."""
        if isinstance(x, Const):
            have, src = Layout.replicated(len(x.shape)), x
            if want == have:
                return x, 0.0
        else:
            held = self.where[x.id]
            if want in held:
                return held[want], 0.0
            stage = self.reduced_to.get(x.id)
            if stage is not None and stage != want and stage not in held:
                _, c = self.read(x, stage, reason)
                r, c2 = self.read(x, want, reason)
                return r, c + c2
            # read from the cheapest layout the value already exists in
            have = min(
                held,
                key=lambda l: (
                    plan_steps(self.planner, l, want, x.shape, x.dtype)[1],
                    l != self.layout[x.id],
                ),
            )
            src = held[have]
        steps, cost = plan_steps(self.planner, have, want, x.shape, x.dtype)
        made = emit_steps(
            steps,
            src,
            have,
            x.shape,
            x.dtype,
            self.planner,
            self.new_reg,
            self.avals,
            reason,
            node_id=None if self.current is None else self.graph.nodes[self.current].id,
        )
        for ins, lay in made:
            self.instructions.append(ins)
            self.owners.append(self.current)
            src = ins.out
            if not isinstance(x, Const):
                self.where[x.id][lay] = src
        return src, cost

    def run(self):
        comm = {}
        for index, node in enumerate(self.graph.nodes):
            self.current = index
            cand = self.choice[node.id]
            ins, cost = [], 0.0
            for k, (x, want) in enumerate(zip(node.inputs, cand.in_layouts)):
                r, c = self.read(x, want, f"{node.name} input {k}")
                ins.append(r)
                cost += c
            comm[node.id] = cost
            key = (node.signature, cand)  # a repeated layer's node: the same shapes
            if key not in self.local:
                in_shapes = [
                    l.local_shape(x.shape, self.mesh) for x, l in zip(node.inputs, cand.in_layouts)
                ]
                out_shapes = [
                    l.local_shape(v.shape, self.mesh)
                    for v, l in zip(node.outputs, cand.out_layouts)
                ]
                self.local[key] = (
                    out_shapes,
                    rule_for(node).params_for(node, in_shapes, out_shapes),
                )
            out_shapes, params = self.local[key]
            outs = []
            for v, l, shp in zip(node.outputs, cand.out_layouts, out_shapes):
                r = self.new_reg()
                self.avals[r] = (tuple(shp), np.dtype(v.dtype))
                self.where[v.id] = {l: r}
                self.layout[v.id] = l
                outs.append(r)
            self.instructions.append(
                Compute(node, params, tuple(ins), tuple(outs), tuple(out_shapes))
            )
            self.owners.append(self.current)
        self.current = None
        outputs, out_layouts, out_cost = [], [], 0.0
        for i, (o, want) in enumerate(zip(self.graph.outputs, self.out_layouts)):
            want = want or Layout.replicated(len(o.shape))
            r, c = self.read(o, want, f"output {i}") if isinstance(o, Value) else (o, 0.0)
            outputs.append(r)
            out_layouts.append(want)
            out_cost += c
        return outputs, out_layouts, comm, out_cost


@dataclass(frozen=True)
class LoweredSteps:
    """``lower_steps``' result. ``lowering``: ``instructions`` (the steps in graph order),
    ``owners`` (per step, the node index it computes or feeds; None: a result's), ``avals``
    (register -> local shape, dtype), ``inputs`` (argument registers), ``where`` (value id ->
    {layout: register}) and ``new_reg()`` for registers added later. Then the result registers
    and layouts, per node id the seconds of the redistributions feeding it, and the seconds of
    laying the results out."""

    lowering: _Lowerer
    outputs: list
    out_layouts: list
    comm: dict
    out_cost: float


def lower_steps(graph, choice, in_layouts, mesh, planner, out_layouts=None, reduced_to=None):
    """The lowering before segmentation; the pipeline cuts it into stages."""
    lowerer = _Lowerer(graph, choice, in_layouts, mesh, planner, out_layouts, reduced_to)
    return LoweredSteps(lowerer, *lowerer.run())


def lower(
    graph, choice, in_layouts, mesh, planner, out_layouts=None, reduced_to=None, bucket_bytes=0
):
    """``(Program, comm per node id, results' seconds)``: ``lower_steps`` segmented, its
    all-reduces bucketed by ``bucket_bytes`` (``program.all_reduce_buckets``; 0: one each)."""
    low = lower_steps(graph, choice, in_layouts, mesh, planner, out_layouts, reduced_to)
    lowerer = low.lowering
    body = segment(
        defer_all_reduce_readers(lowerer.instructions),
        lowerer.avals,
        [o for o in low.outputs if isinstance(o, int)],
    )
    prog = Program(
        mesh,
        tuple(lowerer.inputs),
        tuple(in_layouts),
        tuple(low.outputs),
        tuple(low.out_layouts),
        body,
        graph.in_tree,
        graph.out_tree,
        dict(lowerer.avals),
        all_reduce_buckets(body, mesh, bucket_bytes),
        bucket_bytes,
    )
    return prog, low.comm, low.out_cost
