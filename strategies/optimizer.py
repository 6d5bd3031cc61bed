"""Optimizer parallel (ZeRO, MindSpore's ``enable_parallel_optimizer``): shard the parameter
update over the mesh axes that hold a parameter replicated.

In: a Graph, the chosen candidate of every node and layout of every input (from any mode or
search), the state pairs (graph input leaf, graph output leaf) the step threads through (new
parameters, new optimizer state), which input leaves are parameters, the mesh, the level and
the size threshold. Out: a ``ShardedUpdate``: the new choice and input layouts, and the layout
of each sharded parameter's update. The caller returns each state output in its
input's layout, so the state keeps its layout from step to step. Applying it to its own result
(a reloaded strategy) changes nothing.

The update region: walking back from each state output through elementwise nodes whose
outputs have the state's shape (``p - lr * g``, momentum, Adam's moments and their bias-
corrected ratio), stopping at anything else (the gradient's matmul, scalar schedules) and
dropping nodes read outside the region. Each connected group of region nodes belongs to one
parameter shape; its layout ``T`` splits dimension 0 of the parameter's
tensor-parallel slice over the parameter's free axes (mesh axes of size > 1 it is not split
over, in mesh order, inside its own axes of that dimension): MindSpore's rule, so its strategy
files say exactly how (``mindspore_fields``). Where they do not divide dimension 0, autopar
takes the first other dimension they divide, unless MindSpore output is asked for
(``dim0_only``). Then, per group:

| level        | update, optimizer state | gradient into the update | parameter in / out      |
|--------------|-------------------------|--------------------------|-------------------------|
| level1, 2    | ``T``                   | reduce-scatter           | as chosen / all-gather  |
| level3       | ``T``                   | reduce-scatter           | ``T`` / ``T``; gathered where read |

So the parallel optimizer moves what data parallelism moves: a reduce-scatter and an
all-gather of a tensor cost the ring what its all-reduce costs (MindSpore and ZeRO do the
same). The gradient's reduce-scatter is the redistribution planner's cheapest path from the
partial sum to ``T``: for a gradient small enough that an all-reduce's fewer messages win
(recursive doubling, below ~16 KB on 4 devices of this host), it all-reduces and slices.
Levels 1 and 2 differ in MindSpore only under gradient accumulation (level2 keeps the
accumulated gradient sharded); autopar accumulates micro-batch gradients whole at both.
Groups whose parameter is below ``threshold`` bytes, or with no dimension the free axes
divide, keep their replicated update (MindSpore does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autopar.graph import Value
from autopar.layout import Layout

from .candidates import candidate_for, enumerate_candidates
from .rules import rule_for
from .rules.elementwise import RULES as ELEMENTWISE
from .rules.primitives import primitives


@dataclass(frozen=True)
class ShardedUpdate:
    choice: dict  # node id -> Candidate
    in_layouts: tuple  # per graph input
    # parameter input position -> Layout of its sharded update
    updates: dict[int, Layout] = field(default_factory=dict)


def update_region(graph, state_pairs) -> list[set]:
    """Connected groups of update nodes (node ids), see the module docstring."""
    region = {}  # node id -> the state shape it updates
    for _, j in state_pairs:
        out = graph.outputs[j]
        if not isinstance(out, Value) or not out.shape:
            continue
        stack = [out]
        while stack:
            v = stack.pop()
            n = graph.producer.get(v.id)
            if (
                n is None
                or n.id in region
                or n.prim not in ELEMENTWISE
                or any(o.shape != out.shape for o in n.outputs)
            ):
                continue
            region[n.id] = out.shape
            stack += [x for x in n.inputs if isinstance(x, Value)]
    outputs = {o.id for o in graph.outputs if isinstance(o, Value)}
    changed = True
    while changed:  # drop nodes read outside the region
        changed = False
        for n in graph.nodes:
            if n.id in region and any(
                u.id not in region
                for v in n.outputs
                if v.id not in outputs
                for u, _ in graph.users.get(v.id, ())
            ):
                del region[n.id]
                changed = True
    groups, seen = [], set()
    by_id = {n.id: n for n in graph.nodes}
    for nid in region:  # connected components through region edges
        if nid in seen:
            continue
        group, stack = set(), [nid]
        while stack:
            k = stack.pop()
            if k in group:
                continue
            group.add(k)
            n = by_id[k]
            near = [graph.producer.get(x.id) for x in n.inputs if isinstance(x, Value)]
            near += [u for v in n.outputs for u, _ in graph.users.get(v.id, ())]
            stack += [m.id for m in near if m is not None and m.id in region]
        seen |= group
        groups.append(group)
    return groups


def _shard_layout(base: Layout, shape, mesh, dim0_only: bool = False) -> Layout | None:
    """MindSpore's rule: the free axes (mesh order) split dimension 0 of the tensor-parallel
    slice further, inside its own axes. Where they do not divide dimension 0, autopar (not
    MindSpore, nor ``dim0_only``) takes the first other dimension they divide."""
    free = tuple(
        a
        for a, s in zip(mesh.axis_names, mesh.shape)
        if s > 1 and a not in base.axes and a not in base.partial
    )
    k = math.prod(mesh.axis_size(a) for a in free)
    if k == 1 or not shape:
        return None
    splits = base.splits(mesh)
    for d in [0] if dim0_only else range(len(shape)):
        if (shape[d] // splits[d]) % k == 0:
            dims = list(base.dims)
            dims[d] = dims[d] + free
            return Layout(tuple(dims))
    return None


def mindspore_fields(layout: Layout, update: Layout | None, mesh) -> dict | None:
    """MindSpore's ``opt_weight_shard_step``/``_size`` of a parameter stored in ``layout``
    whose update runs in ``update`` on ``mesh`` (one stage's): 0, 0 when the update is not
    sharded further; None when MindSpore cannot say how it is (its optimizer shard splits
    only dimension 0 of the tensor-parallel slice, inside its axes, over the innermost of the
    axes the layout leaves free). The ranks holding one slice, ascending (row-major over the
    mesh), are R; ``size`` consecutive ones share an update; ``step`` is
    (R[-1] - R[0]) / (|R| - 1), as MindSpore's C++ writes it."""
    if update is None or update == layout:
        return {"opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
    free = [a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1 and a not in layout.axes]
    head = layout.dims[0] if layout.dims else ()
    extra = update.dims[0][len(head) :] if update.dims else ()
    if (
        update.partial
        or layout.partial
        or update.dims[1:] != layout.dims[1:]
        or update.dims[0][: len(head)] != head
        or not extra
        or list(extra) != free[len(free) - len(extra) :]
    ):
        return None
    stride = {a: math.prod(mesh.shape[mesh.axis_names.index(a) + 1 :]) for a in free}
    span = sum((mesh.axis_size(a) - 1) * stride[a] for a in free)
    n = math.prod(mesh.axis_size(a) for a in free)
    return {
        "opt_weight_shard_step": span // (n - 1),
        "opt_weight_shard_size": math.prod(mesh.axis_size(a) for a in extra),
    }


_PASS = primitives("transpose", "reshape", "convert_element_type", "copy", "squeeze", "neg")


def _push_partial(graph, choice, value, region, mesh):
    """Let a pending partial sum flow through the layout-only linear nodes (transpose,
    reshape, ...) between the gradient's producer and the update, so the update reads it
    partial and reduce-scatters it, instead of an all-reduce before the first of them."""
    chain = []
    n = graph.producer.get(value.id)
    while (
        n is not None
        and n.primitive in _PASS
        and all(u.id in region for u, _ in graph.users.get(n.outputs[0].id, ()))
    ):
        chain.append(n)
        region = {n.id}
        x = n.inputs[0]
        src = graph.producer.get(x.id) if isinstance(x, Value) else None
        if src is None:
            return
        have = choice[src.id].out_layouts[[v.id for v in src.outputs].index(x.id)]
        if have.partial:
            break
        n = src
    else:
        return
    for n in reversed(chain):  # from the partial producer downwards
        want_in = have
        picked = [
            c
            for c in enumerate_candidates(n, rule_for(n).spec(n), mesh)
            if c.in_layouts[0] == want_in and c.out_layouts[0].partial == want_in.partial
        ]
        if not picked:
            return
        choice[n.id] = picked[0]
        have = picked[0].out_layouts[0]


def shard_update(
    graph,
    choice,
    in_layouts,
    state_pairs,
    is_param,
    mesh,
    level: str,
    threshold: int,
    dim0_only: bool = False,
    only=None,
) -> ShardedUpdate:
    """The sharded update (module docstring); ``is_param`` per graph input, ``threshold`` in
    bytes, ``level`` one of "level1", "level2", "level3"; ``dim0_only``: MindSpore's rule
    alone (a parameter whose dimension 0 the free axes do not divide keeps its replicated
    update); ``only``: the parameter input positions to shard (None: all)."""
    choice, in_layouts = dict(choice), list(in_layouts)
    updates = {}
    pair_of = {graph.inputs[i].id: (i, j) for i, j in state_pairs}
    by_id = {n.id: n for n in graph.nodes}
    for group in update_region(graph, state_pairs):
        nodes = [by_id[k] for k in sorted(group)]
        read = {x.id: x for n in nodes for x in n.inputs if isinstance(x, Value)}
        states = [pair_of[v] for v in read if v in pair_of]
        params = [(i, j) for i, j in states if is_param[i]]
        if not params:
            continue
        p_in = params[0][0]
        shape = graph.inputs[p_in].shape
        if graph.inputs[p_in].nbytes < threshold or (only is not None and p_in not in only):
            continue
        t = _shard_layout(in_layouts[p_in], shape, mesh, dim0_only)
        if t is None and only is not None:  # re-planned: MindSpore leaves it replicated
            t = in_layouts[p_in]
        picked = {n.id: candidate_for(n, rule_for(n).spec(n), t, mesh) for n in nodes} if t else {}
        if not t or not all(picked.values()):
            continue
        choice.update(picked)
        if t != in_layouts[p_in]:
            updates[p_in] = t
        made = {v.id for n in nodes for v in n.outputs}
        for vid, x in read.items():
            if vid not in made and vid not in pair_of:
                _push_partial(graph, choice, x, group, mesh)
        for i, _ in states:
            if level == "level3" or not is_param[i]:  # optimizer state always kept sharded
                in_layouts[i] = t
    return ShardedUpdate(choice, tuple(in_layouts), updates)


def sharded_updates(graph, choice, in_layouts, state_pairs, is_param) -> dict:
    """Parameter input position -> the layout its update runs in, for each parameter whose
    update a search sharded (ZeRO chosen inside auto_parallel): the new value is made in a
    layout splitting more than any layout the operators outside the update region read the
    parameter in."""
    region = set().union(*update_region(graph, state_pairs))
    out = {}
    for i, j in state_pairs:
        new = graph.outputs[j]
        if not is_param[i] or not isinstance(new, Value) or new.id not in graph.producer:
            continue
        n = graph.producer[new.id]
        made = choice[n.id].out_layouts[n.outputs.index(new)]
        read = [
            choice[u.id].in_layouts[k]
            for u, k in graph.users[graph.inputs[i].id]
            if u.id not in region
        ]
        if made not in read and all(len(made.axes) > len(l.axes) for l in read):
            out[i] = made
    return out


def optimizer_updates(
    graph, choice, in_layouts, state_pairs, is_param, mesh, config, searched: bool
) -> ShardedUpdate:
    """The parallel optimizer's updates under ``config`` (a ParallelConfig): those a search
    chose (``searched``: auto_parallel) or ``shard_update``'s. When the plan is to be saved as
    a MindSpore strategy file (``strategy_ckpt_save_file`` not ending in .json), every update
    follows MindSpore's rule, re-planned where a search chose another."""
    for_mindspore = not str(config.strategy_ckpt_save_file or ".json").endswith(".json")
    if not searched:
        return shard_update(
            graph,
            choice,
            in_layouts,
            state_pairs,
            is_param,
            mesh,
            config.optimizer_level.value,
            config.parallel_optimizer_threshold * 1024,
            dim0_only=for_mindspore,
        )
    updates = sharded_updates(graph, choice, in_layouts, state_pairs, is_param)
    redo = {
        i
        for i, u in updates.items()
        if for_mindspore and mindspore_fields(in_layouts[i], u, mesh) is None
    }
    if not redo:
        return ShardedUpdate(choice, tuple(in_layouts), updates)
    su = shard_update(
        graph,
        choice,
        in_layouts,
        state_pairs,
        is_param,
        mesh,
        config.optimizer_level.value,
        0,
        dim0_only=True,
        only=redo,
    )
    return ShardedUpdate(
        su.choice, su.in_layouts, {i: u for i, u in updates.items() if i not in redo} | su.updates
    )
