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
import math

import numpy as np

from .graph import Graph, Node, Value, _param_str

SMALL_CONST = 64  # constants up to this many elements compared by value, larger by identity
REMAT_SCOPE = "rematted_computation"  # JAX's name-stack entry for jax.checkpoint's recomputation


def _operand_key(x):
    if isinstance(x, Value):
        return ("value", x.id)
    data = np.asarray(x.value)
    return (
        "const",
        str(x.dtype),
        tuple(x.shape),
        data.tobytes() if data.size <= SMALL_CONST else id(x.value),
    )


def _merged(graph: Graph, keep_above=None) -> tuple:
    """The graph's operators with every repeat of an earlier one merged into it: (the
    operators left, renumbered; value id -> the value it repeats; whether an operator of
    jax.checkpoint's recomputation was among the repeats). ``keep_above``: a repeat inside
    jax.checkpoint's recomputation whose largest output has more elements than this is kept
    (recomputed), and an operator repeating an earlier one but for such recomputed operands
    is a repeat too (merged, or kept by the same rule)."""
    alias: dict = {}  # value id -> the earlier value it repeats
    twin: dict = {}  # recomputed value id -> the forward value it repeats
    seen: dict = {}
    nodes: list[Node] = []
    recomputed = False
    use = lambda x: alias.get(x.id, x) if isinstance(x, Value) else x
    for n in graph.nodes:
        inputs = tuple(use(x) for x in n.inputs)
        key = (
            n.prim,
            tuple(sorted((k, _param_str(v)) for k, v in n.params.items())),
            tuple(_operand_key(twin.get(x.id, x) if isinstance(x, Value) else x) for x in inputs),
        )
        if key in seen:
            recomputed = recomputed or REMAT_SCOPE in n.scope
            if (
                keep_above is not None
                and REMAT_SCOPE in n.scope
                and max(math.prod(v.shape) for v in n.outputs) > keep_above
            ):
                for mine, theirs in zip(n.outputs, seen[key].outputs):
                    twin[mine.id] = theirs
                nodes.append(dataclasses.replace(n, id=len(nodes), inputs=inputs))
                continue
            for mine, theirs in zip(n.outputs, seen[key].outputs):
                alias[mine.id] = theirs
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
    return _rebuilt(graph, *_merged(graph))


def _rebuilt(graph: Graph, nodes, alias, recomputed) -> Graph:
    """The graph of ``_merged``'s operators, its results read through ``alias``; ``graph``
    itself when nothing recomputed was merged."""
    if not recomputed:
        return graph
    use = lambda x: alias.get(x.id, x) if isinstance(x, Value) else x
    return Graph.build(
        graph.inputs, tuple(use(o) for o in graph.outputs), nodes, graph.in_tree, graph.out_tree
    )


SELECTIVE_RATIO = 4  # selective: recompute values this many times a typical matmul's result


def selective_recompute(graph: Graph) -> Graph:
    """The step recomputing only the large, cheap values of its ``jax.checkpoint`` blocks
    (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models":
    Megatron-LM's selective recomputation): a recomputed operator is kept when its result has
    more than ``SELECTIVE_RATIO`` times the elements of the median matmul result of the
    recomputation (in a transformer block, the attention's scores, softmax, dropout bits and
    mask, b x heads x s^2 against the b x s x h of its projections); every other recomputed
    operator reads the forward pass's value instead, as ``without_recompute``. So the
    backward pass recomputes the attention's s^2 values from the stored queries, keys and
    values (a few percent of the block's FLOPs) and holds every other activation. The graph
    itself when it recomputes nothing."""
    remat = sorted(
        math.prod(n.outputs[0].shape)
        for n in graph.nodes
        if n.prim == "dot_general" and REMAT_SCOPE in n.scope
    )
    if not remat:
        return graph
    return _rebuilt(graph, *_merged(graph, SELECTIVE_RATIO * remat[len(remat) // 2]))


def recomputes(graph: Graph) -> bool:
    """Whether ``graph`` recomputes part of its forward pass: an operator traced inside
    ``jax.checkpoint``'s recomputation (``REMAT_SCOPE`` in its name stack) repeats an earlier
    one."""
    return _merged(graph)[2]
