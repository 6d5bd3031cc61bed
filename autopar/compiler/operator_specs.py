"""MindSpore's operator tuples placed on the operator they annotate, and the mesh MindSpore's
device matrices imply.

In: a traced Graph whose ``autopar_shard`` nodes may carry ``device_matrix.OperatorSpec``s
(from ``ap.shard(fn, in_strategy, out_strategy)``) or ``DeviceSpec``s (``ap.Layout(device_matrix,
aliases)(...)``), the ParallelConfig and the user's ``in_strategy``. Out:
- ``with_operator_letters(graph)``: each annotation's OperatorSpecs given the loop letters (the
  rule table's spec) of the one operator reading all its operands; an annotation no single
  operator reads keeps none (each operand on its own device matrix).
- ``tuples_on_device_matrices(config, graph, in_strategy)``: on a one-axis mesh, each plain
  split tuple of an argument or an ``ap.shard``-ed value as MindSpore lays out a tensor's
  tuple by itself (``DeviceSpec.of_tuple``: device matrix ``[repeat] + tuple``).
- ``mesh_for_device_matrices(config, graph, in_strategy)``: on a one-axis mesh (the default
  ``mesh_shape``, which holds no device matrix of two dimensions), the config with the
  coarsest mesh on which every device matrix used is a grouping of whole axes
  (``device_matrix.refining_mesh``), named by the aliases of an ``ap.Layout`` when one device
  matrix alone is used; the config unchanged otherwise.
- ``mindspore_constraints(layouts, config, args, in_strategy)``: a loaded MindSpore strategy
  file (``MindSporeLayouts``) as ``(in_strategy, operator name -> split tuples)``, and
  ``with_tuples``: an operator's candidates held to its tuples.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import jax

from ..annotate import shard_p
from ..arguments import check_counts, leaf_names
from ..config import ParallelMode
from ..device_matrix import DeviceSpec, OperatorSpec, refining_mesh
from ..errors import ConfigError, LayoutError
from ..graph import Graph
from ..layout import Layout
from ..mesh import default_axis_names
from ..strategies.mindspore_ckpt import MindSporeLayouts
from ..strategies.rules import rule_for


def with_operator_letters(graph: Graph) -> Graph:
    groups = defaultdict(list)
    for n in graph.nodes:
        if n.prim == shard_p.name and isinstance(n.params["spec"], OperatorSpec):
            groups[n.params["spec"].group].append(n)
    if not groups:
        return graph
    new = {}
    for nodes in groups.values():
        ins = [n for n in nodes if n.params["spec"].operand >= 0]
        readers = [_readers(graph, n.outputs[0]) for n in ins]
        common = set.intersection(*(set(r) for r in readers)) if readers else set()
        first = nodes[0].params["spec"]
        if len(common) != 1:
            new.update(_gather_table(graph, nodes, ins, first))
            continue
        op = readers[0][next(iter(common))][0]
        spec = rule_for(op).spec(op)
        letters: list[tuple[str, ...]] = [()] * len(first.counts)
        for n, r in zip(ins, readers):
            _, i, dims = r[op.id]
            letters[n.params["spec"].operand] = tuple(
                (spec.inputs[i][d] or "") if d is not None else "" for d in dims
            )
        out_letters = tuple(l or "" for l in spec.outputs[0]) if spec.outputs else ()
        left = _gather_repeat_left(
            op, first, {r[op.id][1]: n.params["spec"].operand for n, r in zip(ins, readers)}
        )
        left = left and all(
            r[op.id][2] == tuple(range(len(n.outputs[0].shape))) for n, r in zip(ins, readers)
        )
        for n in nodes:
            s = n.params["spec"]
            if s.operand < 0 and graph.producer.get(n.inputs[0].id) is not op:
                continue  # the result of something else: its own
            new[n.id] = dataclasses.replace(
                n, params={**n.params, "spec": s.with_letters(letters, out_letters, left)}
            )
    return _replaced(graph, new)


_PASS = {"broadcast_in_dim", "convert_element_type"}  # a value's layout goes through them


def _readers(graph: Graph, v) -> dict:
    """The operators reading annotated value ``v``, through broadcasts and casts (jnp's
    ``x + b`` broadcasts ``b`` first): node id -> (node, input index, per dimension of ``v``
    the reader's input dimension holding it)."""
    out, todo = {}, [(v, tuple(range(len(v.shape))))]
    while todo:
        x, dims = todo.pop()
        for u, i in graph.users[x.id]:
            if u.prim in _PASS and len(u.inputs) == 1:
                bd = u.params.get("broadcast_dimensions", tuple(range(len(x.shape))))
                todo.append((u.outputs[0], tuple(bd[d] for d in dims)))
            else:
                out[u.id] = (u, i, dims)
    return out


def _gather_table(graph: Graph, nodes, ins, first: OperatorSpec) -> dict:
    """A Gather annotated by its table and indices (``jnp.take(table, idx, axis)``: the
    indices pass through jnp's bounds handling first, so the two have no common reader): the
    table's layout on MindSpore's GatherInfo device matrix, node id -> the shard node with it
    (the index counts before the table's own, the repeat rightmost; leftmost where the table
    is split along the gathered axis, ``_gather_repeat_left``). Nothing for anything else."""
    for n in ins:
        s = n.params["spec"]
        gathers = [(u, i) for u, i in graph.users[n.outputs[0].id] if u.prim == "gather"]
        if len(gathers) != 1 or gathers[0][1] != 0 or len(first.counts) != 2:
            continue
        op = gathers[0][0]
        idx = first.counts[1 - s.operand]
        if _gather_repeat_left(op, first, {0: s.operand}):
            return {
                n.id: dataclasses.replace(
                    n, params={**n.params, "spec": dataclasses.replace(s, repeat_left=True)}
                )
            }
        return {
            n.id: dataclasses.replace(
                n, params={**n.params, "spec": dataclasses.replace(s, lead=tuple(idx or ()))}
            )
        }
    return {}


def _gather_repeat_left(op, spec: OperatorSpec, operand_of: dict) -> bool:
    """Whether MindSpore puts the repeat leftmost in this operator's device matrix: a Gather
    whose table (operand 0) is split along a gathered axis (MindSpore 2.10's GatherInfo; its
    files show it: ((2, 1), (1,)) on 8 devices is device matrix (4, 2); a table split over
    every device leaves no repeat to place). Every other operator puts it rightmost."""
    if op.prim != "gather" or 0 not in operand_of:
        return False
    table = spec.counts[operand_of[0]]
    if table is None:
        return False
    return any(table[d] > 1 for d in op.params["dimension_numbers"].start_index_map)


def _replaced(graph: Graph, new: dict) -> Graph:
    """``graph`` with the nodes of ``new`` (node id -> Node) in their places."""
    if not new:
        return graph
    return Graph.build(
        graph.inputs,
        graph.outputs,
        [new.get(n.id, n) for n in graph.nodes],
        graph.in_tree,
        graph.out_tree,
    )


def tuples_on_device_matrices(config, graph: Graph, args, in_strategy):
    """``(graph, in_strategy)`` with each plain split tuple (of an argument, or of a value in
    ``ap.shard``) checked against its value and made MindSpore's layout of that tensor by
    itself (``DeviceSpec.of_tuple``) where the mesh has one axis (``mesh_shape`` left out),
    which holds no split that leaves devices over; unchanged on a mesh of several axes, where
    tuples map onto its axes."""
    if not _one_axis(config):
        return graph, in_strategy
    n = config.devices.device_num
    plain = lambda s: isinstance(s, tuple) and all(isinstance(c, int) for c in s)
    own = lambda s, shape, what: DeviceSpec.of_tuple(check_counts(s, shape, n, what), n, what)
    if in_strategy is not None and len(in_strategy) == len(args):
        is_leaf = lambda s: s is None or plain(s) or isinstance(s, (str, DeviceSpec, Layout))
        try:  # a tuple covering a subtree: one layout per leaf under it
            in_strategy = tuple(
                jax.tree.map(
                    lambda s, sub: (
                        jax.tree.map(lambda x: own(s, x.shape, f"in_strategy {s}"), sub)
                        if plain(s)
                        else s
                    ),
                    spec,
                    a,
                    is_leaf=is_leaf,
                )
                for spec, a in zip(in_strategy, args)
            )
        except ValueError:
            pass  # not the arguments' structure: arg_layouts says so
    new = {
        v.id: dataclasses.replace(
            v,
            params={
                **v.params,
                "spec": own(
                    v.params["spec"], v.outputs[0].shape, f"ap.shard at {v.source or v.name}"
                ),
            },
        )
        for v in graph.nodes
        if v.prim == shard_p.name and plain(v.params["spec"])
    }
    return _replaced(graph, new), in_strategy


def _one_axis(config) -> bool:
    return (
        len(config.mesh_shape) == 1
        and config.devices.device_num > 1
        and config.parallel_mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL)
        and config.pipeline_stages == 1
    )


def mesh_for_device_matrices(config, graph: Graph, in_strategy):
    if not _one_axis(config):
        return config
    n = config.devices.device_num
    specs = [v.params["spec"] for v in graph.nodes if v.prim == shard_p.name]
    specs += [
        s
        for s in jax.tree.leaves(in_strategy, is_leaf=lambda x: isinstance(x, DeviceSpec))
        if isinstance(s, DeviceSpec)
    ]
    specs = [
        s.resolve(n, f"ap.shard {s}") if isinstance(s, OperatorSpec) else s
        for s in specs
        if isinstance(s, (OperatorSpec, DeviceSpec))
    ]
    # a dataset_strategy's tuples as MindSpore lays them out: the devices a tuple does not
    # split repeat it, first ((2, 1) on 4 devices: device matrix (2, 2, 1))
    ds = config.dataset_strategy if isinstance(config.dataset_strategy, tuple) else ()
    data = [
        (n // math.prod(t),) + tuple(t)
        for t in ds
        if isinstance(t, tuple)
        and all(isinstance(c, int) and c >= 1 for c in t)
        and n % math.prod(t) == 0
        and 1 < math.prod(t) < n
    ]
    if not specs and not data:
        return config
    shape = refining_mesh([s.dev_matrix for s in specs] + data, n)
    if len(shape) <= 1:  # every device matrix fits the one axis
        return config
    named = {tuple(a for a, d in zip(s.names, s.dev_matrix) if d > 1) for s in specs if s.names}
    matrices = {tuple(d for d in s.dev_matrix if d > 1) for s in specs}
    names = (
        next(iter(named))
        if len(named) == 1 and matrices == {shape}
        else default_axis_names(len(shape))
    )
    return config.replace(mesh_shape=shape, mesh_axis_names=names or None)


def mindspore_constraints(strategy, config, args, in_strategy):
    """``(in_strategy, operator name -> split tuples, strategy, config)``: for a loaded
    MindSpore strategy file (``MindSporeLayouts``) its parameters' layouts and operators'
    tuples, no Strategy to load, and the config with a pipeline's mesh from its stage files
    (``_stage_files_mesh``); anything else unchanged."""
    if not isinstance(strategy, MindSporeLayouts):
        return in_strategy, {}, strategy, config
    if config.parallel_mode not in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
        raise ConfigError(
            f"{strategy} gives layouts for semi_auto_parallel or auto_parallel to "
            f"plan around; parallel_mode is {config.parallel_mode.value}."
        )
    if in_strategy is not None:
        raise ConfigError(f"{strategy} and in_strategy both give argument layouts; give one.")
    return (
        strategy.in_strategy(args, leaf_names(args)),
        dict(strategy.ops),
        None,
        _stage_files_mesh(strategy, config),
    )


def _stage_files_mesh(layouts: MindSporeLayouts, config):
    """``config`` with a pipeline's mesh taken from its stage files when ``mesh_shape`` is
    left out (the default: the stage axis and one more): the stage axis, then the coarsest mesh on which every stage's
    device matrices are groupings of whole axes ((2, 2) and (4,) on 4 devices a stage: mesh
    (2, 2, 2))."""
    stages = {s for _, s in layouts.param_stages}
    if not stages:
        return config
    if config.pipeline_stages != len(stages):
        raise ConfigError(
            f"{layouts} holds the layouts of {len(stages)} pipeline stages; set "
            f"pipeline_stages={len(stages)} (it is {config.pipeline_stages!r})."
        )
    per = config.devices.device_num // len(stages)
    if tuple(config.mesh_shape) not in ((per * len(stages),), (len(stages), per)):
        return config  # a mesh of the user's
    shape = layouts.stage_mesh(per)
    return (
        config
        if shape is None
        else config.replace(mesh_shape=(len(stages),) + shape, mesh_axis_names=None)
    )


def with_tuples(graph, cands: dict, tuples: dict, mesh) -> dict:
    """``cands`` with each operator ``tuples`` names held to the candidates whose operands
    have its MindSpore split tuples on ``mesh``."""
    out = dict(cands)
    for n in graph.nodes if tuples else ():
        if n.name not in tuples:
            continue
        out[n.id] = [
            c
            for c in cands[n.id]
            if tuple(l.to_strategy(mesh) for l in c.in_layouts) == tuples[n.name]
        ]
        if not out[n.id]:
            shapes = [tuple(x.shape) for x in n.inputs]
            raise LayoutError(
                f"operator {n.name} ({n.source or 'an unknown line'}, operands "
                f"{shapes}): the loaded MindSpore file gives it {tuples[n.name]}, "
                f"which no layout of its operands on {mesh} has. Operators are "
                "named by their place in the traced step, so a file saved from "
                "another version of the step (an annotation added or removed "
                "moves the numbering) names other operators: save the strategy "
                "from this step, or plan on the mesh the file was written for."
            )
    return out
