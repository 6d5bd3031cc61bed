"""Automatic pipeline stages: where to cut the forward pass, by dynamic programming.

In: a Graph, the stage count S, micro-batches M and scheduler, the chosen candidate of every
node on the stage mesh (each stage runs its operators in the layouts the layout search chose),
per-node communication seconds, the batch input positions, the stage mesh, the full mesh (its
first axis prices the transfers), the ``MicroPlan`` (strategies.microbatch: which values are
per micro-batch, and their sizes) and the per-device memory cap. Out: ``StagePlan``: the
``Stages`` (strategies.stages), the estimated step time and the cut points;
``stage_estimates`` gives any Stages' seconds per micro-batch and peak bytes per device.

1. Forward operators are those that depend on the batch and neither are nor read a
   derivative. A *cut* after forward operator i is a layer boundary when exactly one forward
   value crosses it (the residual stream between blocks); layers are the runs between cuts.
2. A value is *used* at its last forward reader (through operators on arguments only, such as
   a broadcast bias; an argument read by the LM head too, a tied embedding, counts there; the
   activation crossing a cut is used after it). A derivative operator (JAX's
   ``transpose(...)`` scope) is anchored where the latest forward value it reads is used: the
   transpose of a layer's operator reads that layer's residuals. An operator reading only
   derivatives (a cotangent sum), or one outside the derivative (an update), is anchored at the
   earliest of its inputs. Operators on arguments only go where they are read. A layer's time
   is its forward operators plus everything anchored in it. Times are for the whole batch on
   the stage mesh (compute roofline plus redistribution), divided by M per micro-batch.
3. A stage's memory: its parameters and optimizer state (arguments first read in it), their
   new values and its sums over micro-batches (the accumulated gradients), plus the
   activations its backward reads (split over micro-batches) for each micro-batch it holds at
   once (``pipeline.in_flight``: all M for GPipe, ``S - s`` for 1F1B), plus its largest value
   (one micro-batch's where it is split).
4. The DP (Alpa's): for a bound t on the slowest stage, ``best[s][i]`` is the least sum of stage
   times covering the first i layers with s stages, each within t and the cap; a stage's time
   includes receiving its input activation and sending back its cotangent over the stage axis.
   The step estimate is ``sum + (M - 1) * t``; bounds are tried from the least feasible one up
   while a larger bound can still lower the estimate.
Each stage then holds a contiguous block of devices along the first mesh axis (every stage the
same stage mesh).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from autopar.errors import InfeasibleError, PipelineError
from autopar.graph import Value
from autopar.pipeline import in_flight

from .cost_model import compute_time, local_bytes, output_bytes
from .microbatch import MB
from .stages import Stages, _backward


@dataclass(frozen=True)
class StagePlan:
    stages: Stages
    step_time: float          # sum + (M - 1) * max, the objective
    cuts: tuple               # forward positions after which a stage ends


def _layers(graph, batch_inputs):
    """Forward node indices, the valid cut positions among them, each node's anchor and which
    nodes are derivatives (or read one)."""
    index = {n.id: k for k, n in enumerate(graph.nodes)}
    back = [False] * len(graph.nodes)
    for k, n in enumerate(graph.nodes):
        back[k] = _backward(n) or any(
            isinstance(x, Value) and x.id in graph.producer and back[index[graph.producer[x.id].id]]
            for x in n.inputs)
    batch_ids = {graph.inputs[i].id for i in batch_inputs}
    varies = {}                                   # value id -> depends on the batch
    for n in graph.nodes:
        v = any(isinstance(x, Value) and (x.id in batch_ids or varies.get(x.id, False))
                for x in n.inputs)
        for o in n.outputs:
            varies[o.id] = v
    fwd = [k for k, n in enumerate(graph.nodes)
           if not back[k] and any(varies[o.id] for o in n.outputs)]
    pos = {k: i for i, k in enumerate(fwd)}
    crossing = np.zeros(len(fwd) + 1, np.int64)   # batch values alive across each cut
    for i, k in enumerate(fwd):
        for o in graph.nodes[k].outputs:
            last = max([pos[index[u.id]] for u, _ in graph.users.get(o.id, ())
                        if index[u.id] in pos], default=i)
            if last > i:
                crossing[i + 1] += 1
                crossing[last + 1] -= 1
    crossing = np.cumsum(crossing)
    cuts = [i for i in range(1, len(fwd)) if crossing[i] == 1]   # cut before forward node i
    # where a value is used: its last forward reader (a tied embedding: the LM head; the
    # activation crossing a cut: the layer after it), else its producer
    last_use = {x.id: i for i, k in enumerate(fwd) for x in graph.nodes[k].inputs
                if isinstance(x, Value)}
    for k in fwd:
        for o in graph.nodes[k].outputs:
            last_use.setdefault(o.id, pos[k])
    for k in reversed(range(len(graph.nodes))):   # through invariant operators (a broadcast
        n = graph.nodes[k]                         # bias): where their results are used
        if k in pos or back[k]:
            continue
        at = [last_use[o.id] for o in n.outputs if o.id in last_use]
        for x in n.inputs if at else ():
            if isinstance(x, Value):
                last_use[x.id] = max(last_use.get(x.id, -1), max(at))
    anchor = [None] * len(graph.nodes)           # forward position each node's cost goes to
    for k, n in enumerate(graph.nodes):
        if k in pos:
            anchor[k] = pos[k]
        elif back[k]:
            # a derivative goes where the forward values it reads are used (the transpose of a
            # layer's operator reads that layer's residuals); one reading only derivatives (a
            # cotangent sum), or an update, goes to the earliest place among its inputs
            res = [last_use[x.id] for x in n.inputs if isinstance(x, Value) and x.id in last_use]
            got = [anchor[index[graph.producer[x.id].id]] for x in n.inputs
                   if isinstance(x, Value) and x.id in graph.producer
                   and back[index[graph.producer[x.id].id]]]
            got = [a for a in got if a is not None]
            if res and _backward(n):
                anchor[k] = max(res)
            elif res or got:
                anchor[k] = min(res + got)
    for k in reversed(range(len(graph.nodes))):   # invariant or unplaced: where it is read
        if anchor[k] is None:
            users = [anchor[index[u.id]] for v in graph.nodes[k].outputs
                     for u, _ in graph.users.get(v.id, ()) if anchor[index[u.id]] is not None]
            anchor[k] = min(users) if users else 0
    return fwd, cuts, anchor, back


def plan_stages(graph, count, micro, scheduler, choice, in_layouts, comm, batch_inputs,
                stage_mesh, full_mesh, plan, cap=None) -> StagePlan:
    fwd, cuts, anchor, back = _layers(graph, batch_inputs)
    bounds = [0] + cuts + [len(fwd)]              # layer l = forward positions [b[l], b[l+1])
    L = len(bounds) - 1
    if L < count:
        raise PipelineError(f"pipeline_stages={count} but the step has only {L} layer(s) "
                            "(forward cut points where one activation crosses); use fewer stages "
                            "or wrap blocks in ap.pipeline_stage(i) to choose the stages.")
    layer_of = lambda a: bisect.bisect_right(bounds, a) - 1
    first_read = {}
    for k, n in enumerate(graph.nodes):
        for x in n.inputs:
            if isinstance(x, Value) and x.id not in first_read:
                first_read[x.id] = anchor[k]
    t, act, big, state = _tally(graph, [layer_of(a) for a in anchor],
                                [[layer_of(first_read[v.id])] if v.id in first_read else []
                                 for v in graph.inputs], L, choice, in_layouts, comm,
                                batch_inputs, stage_mesh, plan, back)
    # the activation crossing each cut, priced over the stage axis both ways
    level = full_mesh.level(full_mesh.axis_names[0])
    send = np.zeros(L + 1)
    for c in range(1, L):
        k = fwd[bounds[c] - 1]
        nbytes = output_bytes(graph.nodes[k], plan.choice[graph.nodes[k].id], plan.mesh)
        send[c] = 2 * (level.alpha + level.beta * nbytes)
    T, A, W = (np.concatenate([[0], np.cumsum(x)]) for x in (t, act, state))

    def seg(j, i):                                # stage = layers [j, i): (seconds, fixed bytes)
        return (T[i] - T[j]) / micro + send[j] + send[i], W[i] - W[j], A[i] - A[j], \
            max(big[j:i]) if i > j else 0

    times = {}
    for j in range(L):
        for i in range(j + 1, L + 1):
            times[(j, i)] = seg(j, i)

    def mem(s, j, i):
        _, w, a, b = times[(j, i)]
        return w + in_flight(scheduler, count, micro, s) * a + b

    def solve(bound):
        best = np.full((count + 1, L + 1), np.inf)
        arg = np.zeros((count + 1, L + 1), np.int64)
        best[0][0] = 0.0
        for s in range(1, count + 1):
            for i in range(s, L - (count - s) + 1):
                for j in range(s - 1, i):
                    if best[s - 1][j] == np.inf:
                        continue
                    sec = times[(j, i)][0]
                    if sec > bound or (cap is not None and mem(s - 1, j, i) > cap):
                        continue
                    if best[s - 1][j] + sec < best[s][i]:
                        best[s][i], arg[s][i] = best[s - 1][j] + sec, j
        if best[count][L] == np.inf:
            return None
        ends, i = [], L
        for s in range(count, 0, -1):
            ends.append(i)
            i = arg[s][i]
        return best[count][L], tuple(reversed(ends))

    candidates = sorted({v[0] for v in times.values()})
    lo, hi = 0, len(candidates) - 1
    if solve(candidates[hi]) is None:
        raise InfeasibleError(
            f"no split of the step into {count} pipeline stages fits max_device_memory={cap} "
            "bytes per device; raise the cap, use more stages or micro-batches, or "
            "enable_parallel_optimizer.")
    while lo < hi:                                 # the least feasible bound on the slowest stage
        mid = (lo + hi) // 2
        if solve(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    best = None
    floor = T[L] / micro                           # no split sums to less
    for bound in candidates[lo:]:
        if best is not None and floor + (micro - 1) * bound >= best[0]:
            break
        got = solve(bound)
        if got is not None:
            total, ends = got
            value = total + (micro - 1) * max(times[(j, i)][0] for j, i in
                                              zip((0,) + ends[:-1], ends))
            if best is None or value < best[0]:
                best = (value, ends)
    value, ends = best
    starts = (0,) + ends[:-1]
    layer_stage = [s for s, (j, i) in enumerate(zip(starts, ends)) for _ in range(j, i)]
    stages = Stages.of(graph, count, [layer_stage[layer_of(a)] for a in anchor])
    return StagePlan(stages, float(value), tuple(bounds[e] for e in ends[:-1]))


def _tally(graph, group_of_node, groups_of_input, count, choice, in_layouts, comm, batch_inputs,
           stage_mesh, plan, back):
    """Per group (a layer or a stage): seconds of its operators for the whole batch, bytes of
    one micro-batch's activations its backward reads, its largest value (sizes of one
    micro-batch, from the ``MicroPlan``), and what it holds through the step: parameters and
    optimizer state (old and new values) and its sums over micro-batches."""
    index = {n.id: k for k, n in enumerate(graph.nodes)}
    t, act, big, state = np.zeros(count), np.zeros(count), np.zeros(count), np.zeros(count)
    for k, (n, g) in enumerate(zip(graph.nodes, group_of_node)):
        t[g] += compute_time(n, choice[n.id], stage_mesh) + comm.get(n.id, 0.0)
        cand = plan.choice[n.id]
        b = output_bytes(n, cand, plan.mesh)
        big[g] = max(big[g], b)
        # an activation the backward reads, one per micro-batch in flight (what is the same
        # for every micro-batch, a transposed weight, is recomputed where it is read)
        if not back[k] and any(MB in d for lay in cand.out_layouts for d in lay.dims) and any(
                back[index[u.id]] for v in n.outputs for u, _ in graph.users.get(v.id, ())):
            act[g] += b
        if any(MB in lay.partial for lay in cand.out_layouts):
            state[g] += b         # a sum over micro-batches (a gradient), held until the last
    for i, (v, lay, gs) in enumerate(zip(graph.inputs, in_layouts, groups_of_input)):
        if i not in batch_inputs:
            for g in gs:
                state[g] += 2 * local_bytes(lay, v, stage_mesh)
    return t, act, big, state


def stage_estimates(graph, stages, micro, scheduler, choice, in_layouts, comm, batch_inputs,
                    stage_mesh, plan) -> tuple[tuple, tuple]:
    """(seconds per micro-batch, peak bytes per device) of each stage of given ``Stages``, by
    the accounting of ``plan_stages`` (transfers not included)."""
    back = _layers(graph, batch_inputs)[3]
    S = stages.count
    readers = [[s for s in range(S) if i in stages.inputs[s]] for i in range(len(graph.inputs))]
    t, act, big, state = _tally(graph, stages.of_node, readers, S, choice, in_layouts, comm,
                                batch_inputs, stage_mesh, plan, back)
    mems = tuple(int(state[s] + in_flight(scheduler, S, micro, s) * act[s] + big[s])
                 for s in range(S))
    return tuple(float(x / micro) for x in t), mems
