"""hybrid_parallel planning: the step's own collectives (``ap.comm``), run as written.

In: the step function, example arguments, the ParallelConfig, ``batch_argnums`` and
``in_strategy``. Out: ``(graph, Strategy, Program)`` as ``api._plan`` gives for the other
modes. Arguments are split as data_parallel splits them unless ``in_strategy`` /
``dataset_strategy`` say otherwise; results are replicated, except new state (parameters,
optimizer state), which keeps its argument's layout. The step is traced per device under
``jax.shard_map`` (autopar.trace.trace_per_device) and lowered by
redistribution.user_collectives; the Strategy lists every operator on its local shapes (nothing is chosen).
"""

from __future__ import annotations

import dataclasses
import time
import types

import jax
import numpy as np

from ..arguments import arg_layouts, leaf_names, state_pairs
from ..config import Backend
from ..errors import ConfigError, InfeasibleError
from ..graph import Value
from ..layout import Layout
from ..program import all_reduce_buckets
from ..redistribution.planner import Planner
from ..redistribution.user_collectives import COLLECTIVE_PRIMS, collectives_inside, lower_hybrid
from ..strategies.candidates import Candidate
from ..strategies.cost_model import memory_timeline, program_memory
from ..strategies.strategy import InputStrategy
from ..trace import trace_per_device
from .dump import assemble_strategy, bucket_bytes, host_arrays, host_bytes, label, op_strategies


def plan_hybrid(fn, args, config, batch_argnums, in_strategy):
    if config.pipeline_stages != 1 or config.micro_batches != 1 or config.enable_parallel_optimizer:
        raise ConfigError(
            "parallel_mode='hybrid_parallel' runs the step's own collectives as "
            "written; pipeline stages, micro-batches and the parallel optimizer "
            "are planned by the other modes. Unset them or use auto_parallel."
        )
    mesh = config.logical_mesh()
    names = leaf_names(args)
    t0 = time.monotonic()
    leaves = jax.tree.leaves(args)
    graph_inputs = types.SimpleNamespace(
        inputs=[  # global shapes, for arg_layouts
            Value(j, tuple(np.shape(x)), jax.dtypes.canonicalize_dtype(jax.numpy.result_type(x)))
            for j, x in enumerate(leaves)
        ]
    )
    given = arg_layouts(config, mesh, graph_inputs, args, batch_argnums, in_strategy, names)
    in_layouts = [
        given.get(j, Layout.replicated(len(v.shape))) for j, v in enumerate(graph_inputs.inputs)
    ]
    in_specs = [l.to_partition_spec() for l in in_layouts]
    shapes = trace_per_device(fn, args, mesh, in_specs)  # the results' structure and shapes
    out_layouts = [Layout.replicated(len(v.shape)) for v in shapes.outputs]
    for i, j in state_pairs(shapes):
        out_layouts[j] = in_layouts[i]
    graph = trace_per_device(fn, args, mesh, in_specs, [l.to_partition_spec() for l in out_layouts])
    t_trace = time.monotonic()
    if config.backend is Backend.NATIVE:
        for node in graph.nodes:
            inside = collectives_inside(node)
            if inside:
                raise ConfigError(
                    f"hybrid_parallel: {node.prim} at {node.source or node.name} calls "
                    f"{', '.join(sorted(inside))} inside its body; the native runtime runs "
                    "collectives between operators, not inside a loop whose trip count is "
                    "known only at run time. Use lax.fori_loop with static bounds (unrolled), "
                    "move the collective out of the loop, or use backend='jax'."
                )
    planner = Planner(mesh)
    program, comm = lower_hybrid(graph, mesh, in_layouts, out_layouts, planner)
    program = dataclasses.replace(
        program,
        buckets=all_reduce_buckets(program.instructions, mesh, bucket_bytes(config)),
        bucket_bytes=bucket_bytes(config),
    )
    replicated = [
        Candidate(
            (),
            frozenset(),
            -1,
            tuple(Layout.replicated(len(x.shape)) for x in n.inputs),
            tuple(Layout.replicated(len(v.shape)) for v in n.outputs),
        )
        for n in graph.nodes
    ]
    ops = op_strategies(
        graph,
        names,
        replicated,
        [comm.get(n.id, 0.0) for n in graph.nodes],
        [mesh] * len(graph.nodes),
        [0] * len(graph.nodes),
        COLLECTIVE_PRIMS,
    )
    timeline = memory_timeline(program)
    peak, at = program_memory(program, timeline)
    peak_op = "the arguments" if at is None else label(at)
    cap = config.max_device_memory
    if cap is not None and peak > cap:
        raise InfeasibleError(
            f"hybrid_parallel needs {peak} bytes per device at {peak_op}, more "
            f"than max_device_memory={cap}. Raise max_device_memory, split more "
            "of the arguments (in_strategy) or use a smaller batch."
        )
    inputs = tuple(
        InputStrategy(name=nm, shape=v.shape, dtype=str(v.dtype), layout=l, is_param=p)
        for (nm, p), v, l in zip(names, graph_inputs.inputs, in_layouts)
    )
    called = types.SimpleNamespace(
        inputs=graph_inputs.inputs,
        outputs=[
            Value(v.id, tuple(s * k for s, k in zip(v.shape, l.splits(mesh))), v.dtype)
            if isinstance(v, Value)
            else v
            for v, l in zip(graph.outputs, out_layouts)
        ],
    )
    strat = assemble_strategy(
        mode="hybrid_parallel",
        search="manual",
        mesh=mesh,
        inputs=inputs,
        ops=ops,
        program=program,
        planner=planner,
        peak=peak,
        peak_op=peak_op,
        cap=cap,
        timeline=timeline,
        host_bytes=host_bytes(called, program, state_pairs(shapes)),
        host_arrays=host_arrays(called),
        phase_seconds=(
            ("trace", t_trace - t0),
            ("search", 0.0),
            ("lower", time.monotonic() - t_trace),
        ),
    )
    return graph, strat, program
