"""Activation recomputation as the planner's choice: a step without its recomputation.

In: a traced ``Graph`` (``autopar.trace``: ``jax.checkpoint`` / ``remat`` inlined, so a
checkpointed block's forward operators appear twice, once in the forward pass and once, on
the same operands, inside the backward pass). Out: ``without_recompute(graph)``: the same
step (when it recomputes: ``recomputes``) with every operator that repeats an earlier one
(same primitive, parameters and operands, after the repeats before it are replaced) replaced
by that earlier one, the
backward pass reading the forward pass's values instead of recomputing them, as the step
written without ``jax.checkpoint`` computes (the same number of operators and matmuls); node
ids renumbered in order. Random bits drawn from the same key and counter are the same bits
(threefry is a pure function), so a dropout mask is reused as the forward pass drew it.

What recomputation trades is memory for time: its forward operators run twice (a third more
matmul FLOPs in a transformer block), in exchange for holding only each block's input until
the backward pass. Which one a plan can afford is a question of the memory cap, the stages
and the micro-batches in flight, so ``ParallelConfig(recompute="auto")`` plans both and keeps
the faster plan that fits (``compiler.api``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .graph import Graph, Value, _param_str

SMALL_CONST = 64      # constants up to this many elements compared by value, larger by identity
REMAT_SCOPE = "rematted_computation"   # JAX's name-stack entry for jax.checkpoint's recomputation


def _operand_key(x):
    if isinstance(x, Value):
        return ("value", x.id)
    data = np.asarray(x.value)
    return ("const", str(x.dtype), tuple(x.shape),
            data.tobytes() if data.size <= SMALL_CONST else id(x.value))


def _merged(graph: Graph) -> tuple:
    """The graph's operators with every repeat of an earlier one merged into it: (the
    operators left, renumbered; value id -> the value it repeats; whether an operator of
    jax.checkpoint's recomputation was among the repeats)."""
    alias: dict = {}                       # value id -> the earlier value it repeats
    seen: dict = {}
    nodes, recomputed = [], False
    use = lambda x: alias.get(x.id, x) if isinstance(x, Value) else x
    for n in graph.nodes:
        inputs = tuple(use(x) for x in n.inputs)
        key = (n.prim, tuple(sorted((k, _param_str(v)) for k, v in n.params.items())),
               tuple(_operand_key(x) for x in inputs))
        if key in seen:
            for mine, theirs in zip(n.outputs, seen[key].outputs):
                alias[mine.id] = theirs
            recomputed = recomputed or REMAT_SCOPE in n.scope
            continue
        seen[key] = n
        nodes.append(dataclasses.replace(n, id=len(nodes), inputs=inputs))
    return nodes, alias, recomputed


def without_recompute(graph: Graph) -> Graph:
    """See the module docstring. The graph itself when it recomputes nothing
    (``recomputes``). Repeats the forward pass itself holds (a layer norm's ``x - mean`` written
    twice) are merged too, as XLA's own common-subexpression pass merges them: recomputed
    operators read them, so the forward's and the recomputation's copies only match once
    they are one."""
    nodes, alias, recomputed = _merged(graph)
    if not recomputed:
        return graph
    use = lambda x: alias.get(x.id, x) if isinstance(x, Value) else x
    return Graph.build(graph.inputs, tuple(use(o) for o in graph.outputs), nodes,
                       graph.in_tree, graph.out_tree)


def recomputes(graph: Graph) -> bool:
    """Whether ``graph`` recomputes part of its forward pass: an operator traced inside
    ``jax.checkpoint``'s recomputation (``REMAT_SCOPE`` in its name stack) repeats an earlier
    one."""
    return _merged(graph)[2]
