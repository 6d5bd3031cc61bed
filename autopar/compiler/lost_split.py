"""Where data_parallel's (or semi_auto_parallel's) plan stops splitting the batch, when most of
the batch's work then runs whole on every device (a warning, not an error: the plan is correct,
only not parallel).

data_parallel splits the batch's rows (semi_auto_parallel: as ``dataset_strategy`` or
``unannotated="batch"`` says) and lets every operator follow its inputs' layouts. An
operator whose rule has no layout for the rows as they arrive (``x.reshape(K, -1, D)`` on a
one-axis mesh of more than K devices: every chunk's rows lie on some devices only) takes its
input whole (an all-gather), and everything computed from it follows whole. In: the graph, the
propagated Assignment, the batch's graph input positions and the operators' candidates. Out:
None, or the text of the warning naming that operator and the share of the batch's work after
it.
"""

from __future__ import annotations

import math

from ..graph import Value

SHARE = 0.5  # warn when at least this share of the batch's work runs unsplit
CHUNKING = frozenset({"reshape", "squeeze"})  # chunks of rows as a dimension
SLICING = frozenset({"slice", "dynamic_slice"})  # chunks of rows sliced out


def lost_split(
    graph, assignment, batch: set, cands: dict, mode: str = "data_parallel"
) -> str | None:
    """The warning's text, or None: no operator takes a batch-derived value that arrives split
    whole for want of a layout taking it split (``cands``: each operator's candidates; one that
    has such a layout gathered by choice, fewer bytes than a partial sum's reduction), or what
    follows whole from such values is under ``SHARE`` of the batch's work (the sizes of the
    batch-derived operators' operands and results, a proxy of their work)."""
    pos = {v.id: j for j, v in enumerate(graph.inputs)}
    derived = {graph.inputs[j].id for j in batch}
    whole_from: set[int] = set()  # values computed, whole, from a gathered batch-derived value
    work = whole = 0
    first = None
    for n in graph.nodes:
        cand = assignment.choice.get(n.id)
        ins = [x for x in n.inputs if isinstance(x, Value)]
        if cand is None or not any(x.id in derived for x in ins):
            continue
        derived.update(v.id for v in n.outputs)
        size = sum(math.prod(v.shape) for v in ins + list(n.outputs))
        work += size
        gathers = any(
            isinstance(x, Value)
            and x.id in derived
            and lay.is_replicated()
            and _arrives_split(graph, assignment, pos, x)
            and not any(
                c.in_layouts[i] == _arriving(graph, assignment, pos, x) for c in cands.get(n.id, ())
            )
            for i, (x, lay) in enumerate(zip(n.inputs, cand.in_layouts))
        )
        if not (gathers or any(x.id in whole_from for x in ins)) or not all(
            lay.is_replicated() for lay in cand.out_layouts
        ):
            continue
        first = first or n
        whole += size
        whole_from.update(v.id for v in n.outputs)
    if first is None or whole < SHARE * work:
        return None
    if first.prim in SLICING:  # gradient accumulation by slicing the batch
        advice = (
            "; to accumulate gradients over K parts of the batch, write the step on the "
            "whole batch and set ParallelConfig(micro_batches=K): autopar splits every "
            "device's rows into K micro-batches and sums their gradients; or slice "
            "strided rows, x.reshape(-1, K, ...)[:, k] for part k, which every device "
            "holds a share of"
        )
    elif first.prim in CHUNKING:
        advice = (
            "; or keep the rows a dimension of their own: x.reshape(-1, K, "
            "...).swapaxes(0, 1) instead of x.reshape(K, -1, ...) makes chunk k the rows "
            "k, K + k, ... of every device"
        )
    else:
        advice = ""
    return (
        f"{mode}: the batch's row split ends at {first.name} at "
        f"{first.source or 'an unknown line'}, which takes its input whole (an all-gather); "
        f"{whole / work:.0%} of the batch's work after it runs whole on every device. "
        f"auto_parallel can plan it split (redistributing, e.g. with an all-to-all){advice}."
    )


def _arriving(graph, assignment, pos, x):
    """The layout value ``x`` leaves its producer in (or is given in)."""
    if x.id in pos:
        return assignment.inputs[pos[x.id]]
    p = graph.producer[x.id]
    return assignment.choice[p.id].out_layouts[[v.id for v in p.outputs].index(x.id)]


def _arrives_split(graph, assignment, pos, x) -> bool:
    """Whether value ``x`` arrives split, not as a partial sum."""
    lay = _arriving(graph, assignment, pos, x)
    return bool(lay.axes) and not lay.partial
