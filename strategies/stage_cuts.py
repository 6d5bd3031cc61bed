"""Pipeline stages and their device counts, by dynamic programming.

In: a Graph, the stage count S, micro-batches M and scheduler, one ``StageOption`` per stage
mesh size k a stage may have (the candidate of every node the layout search chose on that
mesh, per-node communication seconds there, and its ``MicroPlan`` from strategies.microbatch:
which values are per micro-batch, and their sizes), the batch input positions, the link
between stages, the per-device memory cap, fixed ``Stages`` (from ``ap.pipeline_stage``) or
none (cut the forward pass), and fixed device counts or none (choose them, using every
device). Out: ``StagePlan``: the ``Stages`` (strategies.stage_assign), each stage's device count,
seconds per micro-batch and peak bytes per device, the estimated step time and the cuts.

1. Forward operators are those that depend on the batch and neither are nor read a
   derivative. A *cut* after forward operator i is a layer boundary when exactly one forward
   value crosses it (the residual stream between blocks) and no batch value of the backward
   pass would cross it forward (point 2's anchors: inside a block recomputed under
   ``jax.checkpoint``); layers are the runs between cuts.
   Fixed stages are one layer each.
2. A value is *used* at its last forward reader (through operators on arguments only, such as
   a broadcast bias; an argument read by the LM head too, a tied embedding, counts there; the
   activation crossing a cut is used after it). A derivative operator (JAX's
   ``transpose(...)`` scope) is anchored where the latest forward value it reads is used: the
   transpose of a layer's operator reads that layer's residuals. An operator reading only
   derivatives (a cotangent sum), or one outside the derivative (an update), is anchored at the
   earliest of its inputs. Operators on arguments only go where they are read. A layer's time
   on a k-device mesh is its forward operators plus everything anchored in it, in the layouts
   chosen on that mesh (compute roofline plus redistribution), for the whole batch, divided by
   M per micro-batch; an operator split over micro-batches is priced on one micro-batch's
   shapes, times M, as are the redistributions feeding it (each micro-batch's: a parameter
   gathered for a matmul is gathered again for every micro-batch), and each sum over
   micro-batches (a gradient) costs an add per micro-batch (its bytes read twice and written
   once).
3. A stage's memory: its parameters and optimizer state (arguments first read in it), their
   new values and its sums over micro-batches (the accumulated gradients), plus the
   activations its backward reads (split over micro-batches) for each micro-batch it holds at
   once (``pipeline.in_flight``: all M for GPipe, ``S - s`` for 1F1B), plus its largest value
   (one micro-batch's where it is split).
4. The DP (Alpa's): for a bound t on the slowest stage, ``best[s][i][d]`` is the least sum of
   stage times covering the first i layers with s stages on d devices, each stage within t and
   the cap on one of its allowed sizes. A cut stage's time includes receiving its input
   activation and sending back its cotangent over the link, priced at the block of it its own
   mesh holds (next to a stage of another size the value moves whole, which is not priced).
   The step estimate is ``sum + (M - 1) * t``; bounds are tried from the least feasible one up
   while a larger bound can still lower the estimate. Beyond ``BOUNDS`` candidate bounds only
   the top of each 0.5% band is tried, so the estimate is within 0.5% x (M - 1) x t of the DP's
   optimum.
5. Interleaved (``interleave`` v > 1, Megatron-LM's virtual pipeline): the layers are cut
   into S v parts on stages of one size, part j on the devices of stage j mod S
   (``_plan_interleaved``); the estimate is ``pipeline_program.pipeline_seconds``.
Stage s holds the next ``k_s`` devices in order.
"""

from __future__ import annotations

import bisect
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from autopar.config import PipelineScheduler
from autopar.errors import InfeasibleError, PipelineError
from autopar.graph import Graph, Value
from autopar.mesh import LogicalMesh
from autopar.pipeline_program import device_schedule, in_flight, pipeline_seconds
from autopar.topology import Level

from .candidates import Candidate
from .cost_model import compute_time, fused, local_bytes, output_bytes
from .microbatch import MB, MicroPlan
from .stage_assign import Stages

BOUNDS = 400  # candidate bounds beyond which they are thinned to 0.5% bands


@dataclass(frozen=True)
class StageOption:
    """What a stage on one mesh runs: the layouts the search chose there."""

    mesh: LogicalMesh  # the stage's mesh
    choice: dict[int, Candidate]  # node id -> Candidate on ``mesh``
    in_layouts: tuple  # per graph input, on ``mesh``
    comm: dict[int, float]  # node id -> seconds of the redistributions feeding it on ``mesh``
    plan: MicroPlan  # on micro_mesh(mesh)
    micro_comm: dict[int, float] = field(default_factory=dict)  # node id -> seconds of the
    # redistributions feeding it for one micro-batch, on the micro-batch
    # mesh (a parameter gathered in the forward is gathered per micro-batch)


@dataclass(frozen=True)
class StagePlan:
    stages: Stages
    sizes: tuple  # devices per stage
    seconds: tuple  # per stage: one micro-batch, forward and backward (no transfers)
    memory: tuple  # per stage: peak bytes per device
    step_time: float  # pipeline_seconds(seconds, M, interleave), the objective
    cuts: tuple  # forward positions after which a stage ends (empty: fixed stages)
    interleave: int = 1  # stages per device group (stage j on group j mod groups)


class _Forward(NamedTuple):
    """What ``_layers`` finds: the forward node indices in program order (``fwd``), the valid
    cut positions among them (``cuts``: i = a cut before forward node i), each node's anchor
    (the forward position its cost goes to) and which nodes are derivatives or read one
    (``back``)."""

    fwd: tuple
    cuts: tuple
    anchor: tuple
    back: tuple


# graph -> {batch input positions: its _Forward}: the stage planner asks for a graph's layers
# once per (stages, micro-batches, interleave) tried, and a graph never changes once built
_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layers(graph, batch_inputs) -> _Forward:
    """A graph and its batch input positions -> the forward nodes, the cut positions among them,
    each node's anchor and which nodes are derivatives (module docstring, points 1 and 2), as
    tuples (kept per graph and shared)."""
    known = _FORWARD.setdefault(graph, {})
    key = frozenset(batch_inputs)
    if key not in known:
        known[key] = _Forward(*map(tuple, _find_layers(graph, key)))
    return known[key]


def _find_layers(graph, batch_inputs) -> tuple:
    index = {n.id: k for k, n in enumerate(graph.nodes)}
    back = _derivatives(graph, index)
    varies = graph.dependents(batch_inputs)
    fwd = [
        k
        for k, n in enumerate(graph.nodes)
        if not back[k] and any(o.id in varies for o in n.outputs)
    ]
    pos = {k: i for i, k in enumerate(fwd)}
    last_use = _last_use(graph, fwd, pos, back)
    anchor = _anchors(graph, index, pos, back, last_use)
    split = _backward_splits(graph, index, back, varies, anchor, len(fwd))
    cuts = [i for i in _cuts(graph, index, fwd, pos) if not split[i]]
    return fwd, cuts, anchor, back


def _derivatives(graph, index) -> list:
    """A graph and its node index by id -> per node, whether it is a derivative (JAX's
    ``transpose(...)`` scope) or reads the result of one."""
    back = [False] * len(graph.nodes)
    for k, n in enumerate(graph.nodes):
        back[k] = n.backward or any(
            isinstance(x, Value) and x.id in graph.producer and back[index[graph.producer[x.id].id]]
            for x in n.inputs
        )
    return back


def _cuts(graph, index, fwd, pos) -> list:
    """The forward node indices ``fwd`` (``pos``: index -> forward position) -> the positions i
    such that exactly one batch value crosses a cut before forward node i."""
    crossing = np.zeros(len(fwd) + 1, np.int64)  # batch values alive across each cut
    for i, k in enumerate(fwd):
        for o in graph.nodes[k].outputs:
            last = max(
                [pos[index[u.id]] for u, _ in graph.users.get(o.id, ()) if index[u.id] in pos],
                default=i,
            )
            if last > i:
                crossing[i + 1] += 1
                crossing[last + 1] -= 1
    crossing = np.cumsum(crossing)
    return [i for i in range(1, len(fwd)) if crossing[i] == 1]


def _backward_splits(graph, index, back, varies, anchor, n_fwd) -> np.ndarray:
    """Per cut position, whether it would split the backward pass against the pipeline's
    order: a batch value made by a derivative anchored before the cut and read by one anchored
    after it (a block recomputed under ``jax.checkpoint``: its recomputation is anchored where
    the block's input is used, so a cut inside the block would send recomputed values forward
    in the backward pass, while later stages run their backward first)."""
    split = np.zeros(n_fwd + 2, np.int64)
    for k, n in enumerate(graph.nodes):
        if not back[k]:
            continue
        for x in n.inputs:
            if isinstance(x, Value) and x.id in varies and x.id in graph.producer:
                u = index[graph.producer[x.id].id]
                if back[u] and anchor[u] < anchor[k]:
                    split[anchor[u] + 1] += 1
                    split[anchor[k] + 1] -= 1
    return np.cumsum(split) > 0


def _last_use(graph, fwd, pos, back) -> dict:
    """The forward nodes -> value id -> the forward position where it is used: its last forward
    reader (a tied embedding: the LM head; the activation crossing a cut: the layer after it),
    else its producer; through invariant operators (a broadcast bias), where their results
    are used."""
    last_use = {
        x.id: i for i, k in enumerate(fwd) for x in graph.nodes[k].inputs if isinstance(x, Value)
    }
    for k in fwd:
        for o in graph.nodes[k].outputs:
            last_use.setdefault(o.id, pos[k])
    for k in reversed(range(len(graph.nodes))):
        n = graph.nodes[k]
        if k in pos or back[k]:
            continue
        at = [last_use[o.id] for o in n.outputs if o.id in last_use]
        for x in n.inputs if at else ():
            if isinstance(x, Value):
                last_use[x.id] = max(last_use.get(x.id, -1), max(at))
    return last_use


def _anchors(graph, index, pos, back, last_use) -> list:
    """Forward positions ``pos``, derivative flags and where values are used -> per node the
    forward position its cost goes to (module docstring, point 2)."""
    anchor: list[int | None] = [None] * len(graph.nodes)
    for k, n in enumerate(graph.nodes):
        if k in pos:
            anchor[k] = pos[k]
        elif back[k]:
            # a derivative goes where the forward values it reads are used (the transpose of a
            # layer's operator reads that layer's residuals); one reading only derivatives (a
            # cotangent sum), or an update, goes to the earliest place among its inputs
            res = [last_use[x.id] for x in n.inputs if isinstance(x, Value) and x.id in last_use]
            got = [
                anchor[index[graph.producer[x.id].id]]
                for x in n.inputs
                if isinstance(x, Value)
                and x.id in graph.producer
                and back[index[graph.producer[x.id].id]]
            ]
            got = [a for a in got if a is not None]
            if res and n.backward:
                anchor[k] = max(res)
            elif res or got:
                anchor[k] = min(res + got)
    for k in reversed(range(len(graph.nodes))):  # invariant or unplaced: where it is read
        if anchor[k] is None:
            users = [
                anchor[index[u.id]]
                for v in graph.nodes[k].outputs
                for u, _ in graph.users.get(v.id, ())
                if anchor[index[u.id]] is not None
            ]
            anchor[k] = min(users) if users else 0
    return anchor


@dataclass(frozen=True, kw_only=True)
class StageRequest:
    """What the stage DP plans (see the module docstring)."""

    graph: Graph
    count: int  # pipeline stages S
    micro: int  # micro-batches M
    scheduler: PipelineScheduler
    options: dict[int, StageOption]  # stage size k -> StageOption
    batch_inputs: frozenset  # graph input positions split over micro-batches
    link: Level  # the topology Level between stages
    devices: int  # how many devices the stages share
    cap: int | None = None  # bytes per device (None: no cap)
    sizes: tuple | None = None  # fixed devices per stage (None: choose among ``options``)
    stages: Stages | None = None  # fixed Stages (None: cut the forward pass)
    interleave: int = 1  # model parts per stage's devices (point 5)


def plan_stages(req: StageRequest) -> StagePlan:
    """See the module docstring. The passes: the layers (``_layer_groups``), the device counts
    each stage may take, the per-size cost tables of every run of layers (``_tables``), the
    fitting runs, the DP under the least feasible bound on the slowest stage (``_StageDP``,
    ``_best_split``), and the chosen stages tallied as they are (``_stage_plan``)."""
    if req.interleave > 1:
        return _plan_interleaved(req)
    graph, count, micro, scheduler = req.graph, req.count, req.micro, req.scheduler
    options, batch_inputs, link, devices = req.options, req.batch_inputs, req.link, req.devices
    cap, sizes, stages = req.cap, req.sizes, req.stages
    fwd, cuts, anchor, back = _layers(graph, batch_inputs)
    layers = _layer_groups(graph, count, stages, fwd, cuts, anchor)
    allowed = [tuple(options) if sizes is None else (sizes[s],) for s in range(count)]
    total = devices if sizes is None else sum(sizes)
    reach = {0}
    for s in range(count):
        reach = {r + k for r in reach for k in allowed[s] if r + k <= total}
    if total not in reach:
        raise PipelineError(
            f"{count} pipeline stages of {sorted(options)} devices each cannot "
            f"use exactly {total} devices; change pipeline_stages, device_num or "
            "the batch size (a stage size whose layouts cannot split the batch "
            "into micro-batches is left out)."
        )
    tables = {
        k: _tables(graph, layers, o, micro, batch_inputs, link, back, fwd, stages is None)
        for k, o in options.items()
    }
    fits = {}  # (stage, size) -> stage [j, i) fits the cap
    for s in range(count):
        for k in allowed[s]:
            t = tables[k]
            fits[s, k] = (
                np.isfinite(t.sec)
                if cap is None
                else np.isfinite(t.sec)
                & (t.fixed + in_flight(scheduler, count, micro, s) * t.act <= cap)
            )
    dp = _StageDP(count, layers.count, total, micro, allowed, tables, fits)
    bounds = sorted(
        {float(x) for s in range(count) for k in allowed[s] for x in tables[k].sec[fits[s, k]]}
    )
    if not bounds or dp.solve(bounds[-1]) is None:
        what = (
            f"no split of the step into {count} pipeline stages"
            if stages is None
            else f"the {count} stages given by ap.pipeline_stage"
        )
        on = "" if sizes is None else f" on {list(sizes)} devices"
        raise InfeasibleError(
            f"{what}{on} fits max_device_memory={cap} bytes per device; raise the cap, use more "
            "stages, devices or micro-batches, the 1f1b scheduler, or enable_parallel_optimizer."
        )
    floor = np.min([np.diff(tables[k].per_layer) for k in options], axis=0).sum()
    value, picked = _best_split(dp, bounds, floor, micro)
    return _stage_plan(req, back, layers, value, picked)


def _plan_interleaved(req: StageRequest) -> StagePlan:
    """Point 5: S stages' devices, each holding v parts. The layers are cut into S v parts of
    the one stage size k = devices / S by the DP above (as S v stages on virtual devices,
    balancing them), part j on group j mod S; each group's memory is its parts' state, its
    largest value and the parts' activations its schedule holds at once
    (``pipeline_program.in_flight``), against the cap; the estimate is
    ``pipeline_seconds`` of the parts."""
    S, v, micro = req.count, req.interleave, req.micro
    V = S * v
    k = req.devices // S
    if (
        req.stages is not None
        or (req.sizes is not None and set(req.sizes) != {k})
        or k not in req.options
        or k * S != req.devices
    ):
        raise PipelineError(
            f"pipeline_interleave={v} cuts the layers into {V} parts of equal devices itself: "
            "give pipeline_stage_devices 'equal' (or leave it unset) and no ap.pipeline_stage "
            "annotations."
        )
    if micro % S:
        raise PipelineError(
            f"pipeline_interleave={v} needs micro_batches divisible by "
            f"pipeline_stages={S} (Megatron-LM's interleaved schedule); "
            f"micro_batches={micro}."
        )
    graph = req.graph
    fwd, cuts, anchor, back = _layers(graph, req.batch_inputs)
    layers = _layer_groups(graph, V, None, fwd, cuts, anchor)
    tables = {
        k: _tables(
            graph, layers, req.options[k], micro, req.batch_inputs, req.link, back, fwd, True
        )
    }
    fits = {(s, k): np.isfinite(tables[k].sec) for s in range(V)}
    dp = _StageDP(V, layers.count, V * k, micro, [(k,)] * V, tables, fits)
    bounds = sorted({float(x) for x in tables[k].sec[fits[0, k]]})
    floor = np.diff(tables[k].per_layer).sum()
    _, picked = _best_split(dp, bounds, floor, micro)
    virtual = dataclasses.replace(req, count=V)
    plan = _stage_plan(virtual, back, layers, 0.0, picked, interleave=v)
    if req.cap is not None and max(plan.memory) > req.cap:
        top = int(np.argmax(plan.memory))
        raise InfeasibleError(
            f"interleaving {V} parts over {S} stages' devices needs {plan.memory[top]} bytes "
            f"per device on stage {top % S}'s, more than max_device_memory={req.cap}; raise "
            "the cap, lower pipeline_interleave, or use more stages or micro-batches."
        )
    return plan


@dataclass(frozen=True)
class _Layers:
    """The units stages are made of: ``count`` layers (runs of forward positions between cut
    points, ``bounds[l]`` to ``bounds[l + 1]``; or, for fixed stages, the stages themselves),
    the layer of every node (``group``) and the layers reading every graph input
    (``in_groups``)."""

    count: int
    group: list
    in_groups: list
    bounds: list


def _layer_groups(graph, count, stages, fwd, cuts, anchor) -> _Layers:
    if stages is not None:
        return _Layers(
            count,
            list(stages.of_node),
            [[s for s in range(count) if i in stages.inputs[s]] for i in range(len(graph.inputs))],
            [],
        )
    bounds = [0, *cuts, len(fwd)]  # layer l = forward positions [b[l], b[l+1])
    n_layers = len(bounds) - 1
    if n_layers < count:
        raise PipelineError(
            f"pipeline_stages={count} but the step has only {n_layers} layer(s) (forward cut "
            "points where one activation crosses); use fewer stages or wrap blocks in "
            "ap.pipeline_stage(i) to choose the stages."
        )
    layer_of = lambda a: bisect.bisect_right(bounds, a) - 1
    first_read = {}
    for k, n in enumerate(graph.nodes):
        for x in n.inputs:
            if isinstance(x, Value) and x.id not in first_read:
                first_read[x.id] = anchor[k]
    return _Layers(
        n_layers,
        [layer_of(a) for a in anchor],
        [[layer_of(first_read[v.id])] if v.id in first_read else [] for v in graph.inputs],
        bounds,
    )


@dataclass(frozen=True)
class _Tables:
    """One stage size's costs of a stage made of layers [j, i): ``sec`` (one micro-batch's
    seconds with the activations sent across its two cuts; inf where j >= i), ``fixed``
    (bytes held through the step, plus the largest value), ``act`` (one micro-batch's
    activations kept for the backward) and ``per_layer`` (cumulative seconds per micro-batch)."""

    sec: np.ndarray
    fixed: np.ndarray
    act: np.ndarray
    per_layer: np.ndarray


def _tables(graph, layers, option, micro, batch_inputs, link, back, fwd, cut) -> _Tables:
    o, n = option, layers.count
    t, act, big, state = _tally(
        graph,
        layers.group,
        layers.in_groups,
        n,
        o.choice,
        o.in_layouts,
        o.comm,
        batch_inputs,
        o.mesh,
        o.plan,
        back,
        o.micro_comm,
    )
    send = np.zeros(n + 1)
    for c in range(1, n) if cut else ():  # the activation crossing each cut
        node = graph.nodes[fwd[layers.bounds[c] - 1]]
        send[c] = 2 * (
            link.alpha
            + link.beta_for("send") * output_bytes(node, o.plan.choice[node.id], o.plan.mesh)
        )
    T, A, W = (np.concatenate([[0], np.cumsum(x)]) for x in (t, act, state))
    sec = np.full((n + 1, n + 1), np.inf)
    fixed = np.zeros((n + 1, n + 1))
    for j in range(n):
        sec[j, j + 1 :] = (T[j + 1 :] - T[j]) / micro + send[j] + send[j + 1 :]
        fixed[j, j + 1 :] = W[j + 1 :] - W[j] + np.maximum.accumulate(big[j:])
    return _Tables(sec, fixed, A[None, :] - A[:, None], T / micro)


class _StageDP:
    """``solve(bound)``: the cheapest split of the layers into the stages, each stage a run of
    layers on one of its allowed sizes that fits and takes at most ``bound`` seconds, using
    exactly every device: ``(sum + (micro - 1) x slowest, [(j, i, size) per stage])``, or None.
    Only device counts from which the remaining stages can still use every device are kept
    (one per stage with fixed sizes), so a step is a few (layers x layers) minimisations."""

    def __init__(self, count, n_layers, devices, micro, allowed, tables, fits):
        self.count, self.n_layers, self.devices, self.micro = count, n_layers, devices, micro
        self.allowed, self.tables, self.fits = allowed, tables, fits
        ahead = [{0}]  # device counts the first s stages can use
        for s in range(count):
            ahead.append({d + k for d in ahead[-1] for k in allowed[s] if d + k <= devices})
        behind = {devices}  # ... from which the rest can use every device
        self.ends = [None] * count
        for s in reversed(range(count)):
            self.ends[s] = ahead[s + 1] & behind
            behind = {d - k for d in behind for k in allowed[s] if d - k >= 0}

    def solve(self, bound):
        L, N, inf = self.n_layers, self.devices, np.inf
        start = np.full(L + 1, inf)
        start[0] = 0.0
        best, back = {0: start}, []
        for s in range(self.count):
            new, arg = {}, {}
            for d, row in best.items():
                for k in self.allowed[s]:
                    if d + k not in self.ends[s]:
                        continue
                    sec = self.tables[k].sec
                    got = row[:, None] + np.where(self.fits[s, k] & (sec <= bound), sec, inf)
                    m, a = got.min(axis=0), got.argmin(axis=0)
                    if d + k not in new:
                        new[d + k], arg[d + k] = m, (a, np.full(L + 1, k))
                        continue
                    better = m < new[d + k]
                    new[d + k] = np.where(better, m, new[d + k])
                    aj, ak = arg[d + k]
                    arg[d + k] = (np.where(better, a, aj), np.where(better, k, ak))
            best = new
            back.append(arg)
        if N not in best or best[N][L] == inf:
            return None
        out, i, d = [], L, N
        for s in reversed(range(self.count)):
            aj, ak = back[s][d]
            j, k = int(aj[i]), int(ak[i])
            out.append((j, i, k))
            i, d = j, d - k
        out.reverse()
        slowest = max(self.tables[k].sec[j, i] for j, i, k in out)
        return float(best[N][L]) + (self.micro - 1) * slowest, out


def _best_split(dp: _StageDP, bounds, floor, micro):
    """The best ``dp.solve(bound)`` over the candidate bounds on the slowest stage: from the
    least feasible one (binary search; past BOUNDS candidates, the top of each 0.5% band) up,
    until ``floor`` (every layer at its cheapest) plus (micro - 1) x bound cannot win."""
    if len(bounds) > BOUNDS:
        bands = [bounds[0]]
        for c in bounds[1:]:
            if c > bands[-1] * 1.005:
                bands.append(c)
            else:
                bands[-1] = c
        bounds = bands
    lo, hi = 0, len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if dp.solve(bounds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    best = None
    for bound in bounds[lo:]:
        if best is not None and floor + (micro - 1) * bound >= best[0]:
            break
        got = dp.solve(bound)
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    return best


def _stage_plan(req: StageRequest, back, layers, value, picked, interleave=1) -> StagePlan:
    """The chosen split as Stages, each stage's seconds and memory tallied as it is (an
    argument read in two stages is held in both); interleaved, a stage's memory is its device
    group's (every part it holds)."""
    graph, count, micro, stages = req.graph, req.count, req.micro, req.stages
    cut_at = ()
    if stages is None:
        layer_stage = [s for s, (j, i, _) in enumerate(picked) for _ in range(j, i)]
        stages = Stages.of(graph, count, [layer_stage[g] for g in layers.group])
        cut_at = tuple(layers.bounds[i] for _, i, _ in picked[:-1])
    readers = [[s for s in range(count) if i in stages.inputs[s]] for i in range(len(graph.inputs))]
    secs, mems, memo = [], [], {}
    for s, (_, _, k) in enumerate(picked):
        o = req.options[k]
        if k not in memo:
            memo[k] = _tally(
                graph,
                stages.of_node,
                readers,
                count,
                o.choice,
                o.in_layouts,
                o.comm,
                req.batch_inputs,
                o.mesh,
                o.plan,
                back,
                o.micro_comm,
            )
        t, act, big, state = memo[k]
        secs.append(float(t[s] / micro))
        mems.append(int(state[s] + in_flight(req.scheduler, count, micro, s) * act[s] + big[s]))
    if interleave > 1:
        groups = count // interleave
        t, act, big, state = memo[picked[0][2]]
        per_group = [
            int(
                sum(state[j] for j in range(d, count, groups))
                + max(big[j] for j in range(d, count, groups))
                + _held_activations(groups, interleave, micro, d, act)
            )
            for d in range(groups)
        ]
        mems = [per_group[j % groups] for j in range(count)]
        value = pipeline_seconds(secs, micro, interleave)
    return StagePlan(
        stages,
        tuple(k for _, _, k in picked),
        tuple(secs),
        tuple(mems),
        float(value),
        cut_at,
        interleave,
    )


def _held_activations(groups, interleave, micro, d, act) -> float:
    """The most bytes of activations device group ``d`` holds at once in the interleaved
    schedule (``pipeline_program.device_schedule``): each forward of part j adds its one
    micro-batch's activations ``act[j]``, its backward frees them."""
    held = peak = 0.0
    for j, phase, _ in device_schedule(groups, interleave, micro, d):
        held += act[j] if phase == "forward" else -act[j]
        peak = max(peak, held)
    return peak


def _tally(
    graph,
    group_of_node,
    groups_of_input,
    count,
    choice,
    in_layouts,
    comm,
    batch_inputs,
    stage_mesh,
    plan,
    back,
    micro_comm=None,
):
    """Per group (a layer or a stage): seconds of its operators for the whole batch, bytes of
    one micro-batch's activations its backward reads, its largest value (sizes of one
    micro-batch, from the ``MicroPlan``), and what it holds through the step: parameters and
    optimizer state (old and new values) and its sums over micro-batches."""
    index = {n.id: k for k, n in enumerate(graph.nodes)}
    t, act, big, state = np.zeros(count), np.zeros(count), np.zeros(count), np.zeros(count)
    touch = fused(graph, stage_mesh)
    micro = plan.mesh.axis_size(MB)
    topo = stage_mesh.topology
    stream = topo.chip.stream_rate if topo.chip is not None else topo.mem_bandwidth
    memo = {}  # (signature, candidates) -> what the node costs and makes
    for k, (n, g) in enumerate(zip(graph.nodes, group_of_node)):
        cand = plan.choice[n.id]
        key = (n.signature, choice[n.id], cand, touch.get(n.id))
        if key not in memo:
            # an operator run per micro-batch is priced on one micro-batch's shapes (a GEMM of
            # a micro-batch's rows fills the device less than one of the whole batch's), times M
            per_micro = any(MB in axes for _, axes in cand.assign)
            memo[key] = (
                compute_time(n, cand, plan.mesh, touch.get(n.id)) * micro
                if per_micro
                else compute_time(n, choice[n.id], stage_mesh, touch.get(n.id)),
                output_bytes(n, cand, plan.mesh),
                any(MB in d for lay in cand.out_layouts for d in lay.dims),
                any(MB in lay.partial for lay in cand.out_layouts),
            )
        seconds, b, split, summed = memo[key]
        per_micro = micro_comm is not None and n.id in micro_comm
        t[g] += seconds + (micro * micro_comm[n.id] if per_micro else comm.get(n.id, 0.0))
        big[g] = max(big[g], b)
        # an activation the backward reads, one per micro-batch in flight (what is the same
        # for every micro-batch, a transposed weight, is recomputed where it is read)
        if (
            not back[k]
            and split
            and any(back[index[u.id]] for v in n.outputs for u, _ in graph.users.get(v.id, ()))
        ):
            act[g] += b
        if summed:
            state[g] += b  # a sum over micro-batches (a gradient), held until the last
            t[g] += micro * 3 * b / stream  # added into the sum after each: read both, write
    for i, (v, lay, gs) in enumerate(zip(graph.inputs, in_layouts, groups_of_input)):
        if i not in batch_inputs:
            for g in gs:
                state[g] += 2 * local_bytes(lay, v, stage_mesh)
    return t, act, big, state
