"""auto_parallel's search of one mesh: the SearchProblem of the step solved by the configured
solver (or recursive programming's cuts), data parallelism's plan kept when the solver's answer
prices higher, and the lower bound the search proves on every plan's cost.

In: a ``CompileRequest`` (api.py), the config, a LogicalMesh, its Planner, the candidates per
node and the MicroFit its layouts must pass (or None). Out: an ``Assignment`` (propagation.py)
with its cost in the search's model and its ``bound``/``prove``.
"""

from __future__ import annotations

import dataclasses
import math
import time

from ..arguments import fixed_layouts
from ..config import ParallelMode, SearchMode
from ..errors import AutoparError
from ..layout import Layout
from ..progress import Progress
from ..redistribution.lower import plan_steps
from ..strategies import recursive, solvers
from ..strategies.build import build_problem, default_arg_options
from ..strategies.candidates import candidates_of, identity_candidate
from ..strategies.propagation import Assignment, propagate
from ..strategies.solvers import trws
from .pipeline_plan import batch_inputs, reshard_cost

PROGRESS_AFTER = 1.0  # seconds a search runs before its progress bar appears


def default_search_mode(mesh) -> SearchMode:
    """auto_parallel's solver when ``search_mode`` is None: ``dynamic_programming`` on meshes
    of at most two axes of size > 1 (exact on series-parallel graphs; the best plan of every
    solver on every GPT in BENCHMARKS.md, up to 96 layers on 1024 devices), else
    ``recursive_programming``: with a third axis a node's candidates and edge matrices grow
    5x, and dynamic programming took 25x the time for no better plan (BENCHMARKS.md)."""
    if sum(1 for size in mesh.shape if size > 1) <= 2:
        return SearchMode.DYNAMIC_PROGRAMMING
    return SearchMode.RECURSIVE_PROGRAMMING


def _progress(name, solver, config):
    """The progress display of a search (autopar.progress): the ``autopar`` logger always, a
    bar on a terminal's stderr once it has run PROGRESS_AFTER seconds and config.progress."""
    return Progress(
        f"autopar [{name}, {solver}]", config.search_time, config.progress, PROGRESS_AFTER
    )


BOUND_TOLERANCE = 1e-3  # the bound search stops within this share of the plan's cost
BOUND_SHARE = 2.0  # ... or after this many times the search's own time (>= 1 s)
BOUND_MAX = 10.0  # ... and never for longer than this many seconds


def built_problem(req, mesh, planner, cands, fit):
    """The step's ``Built`` problem on ``mesh`` with no memory limit (``search`` gives it each
    limit it searches within; nothing else in it depends on the limit)."""
    seconds = lambda s, d, shape, dtype: plan_steps(planner, s, d, shape, dtype)[1]
    fixed = req.arg_layouts(mesh)
    options = (
        None
        if fit is None
        else tuple(
            fit.argument(v, opts)
            for v, opts in zip(req.graph.inputs, default_arg_options(req.graph, mesh, fixed))
        )
    )
    return build_problem(
        req.graph,
        mesh,
        cands,
        fixed,
        seconds,
        None,
        req.name,
        [n for n, _ in req.names],
        arg_options=options,
        state_pairs=req.pairs,
        state_pricing=req.state_pricing(),
        repeat=req.micro if req.pipelined else 1,
        batch_inputs=frozenset(batch_inputs(req.graph, req.args, req.batch_argnums, req.pairs)),
    )


def search(req, config, mesh, planner, cands, fit, built=None):
    """auto_parallel: the SearchProblem of the graph, solved by ``config.search_mode``
    (``fit``: the MicroFit its layouts must pass, or None). Out: the plans for the caller to
    lower and compare by their estimated step, cheapest in the search's model first: the
    solver's answer (dynamic programming's polished by local search, ``_polished``, and its
    own), data parallelism's plan and every operator replicated (each of the last two
    where the problem can express it and it fits), then data parallelism's plan as
    data_parallel itself lowers it (where the problem can express it): the search prices every
    collective on its own, where the runtime fuses gradient all-reduces into buckets, and its
    solvers are exact only on trees. Each Assignment's ``bound``: the
    solver's proven lower bound; while the gap exceeds ``BOUND_TOLERANCE``, its ``prove``
    tries TRW-S's (``trws.bound``, the engine ``autopar solve`` bounds with) for
    ``BOUND_SHARE`` times as long as the search took (at least a second, at most ``BOUND_MAX``
    and what ``search_time`` leaves; less once its sweeps stall), run only for the plan a
    Strategy reports. ``built``: the step's problem on ``mesh`` (``built_problem``) when the
    caller searches it again within another limit."""
    t0 = time.monotonic()
    if built is None:
        built = built_problem(req, mesh, planner, cands, fit)
    built = dataclasses.replace(built, problem=built.problem.with_limit(config.max_device_memory))
    progress = _progress(req.name, config.search_mode.value, config)
    try:
        solution = solvers.get(config.search_mode.value)(
            built.problem, time_limit=config.search_time, progress=progress
        )
        raw = solution
        if config.search_mode is SearchMode.DYNAMIC_PROGRAMMING:
            solution = _polished(built.problem, solution, time.monotonic() - t0, config, progress)
    finally:
        progress.close()
    bound = solution.lower_bound
    offered = {}  # distinct choices; the solver's kept even if it overflows
    dp = data_parallel_assignment(req, config, mesh, planner, cands)
    dp_choice = None if dp is None else built.choice_of(dp.choice, dp.inputs, dp.held)
    # dynamic programming's own answer too: local search packs memory up to the limit in the
    # problem's model, which the lowered program can overrun where the plan it polished fits
    searched = config.search_mode.value
    for c, label in (
        (list(solution.choice), f"{searched}'s plan"),
        (list(raw.choice), f"{searched}'s plan before local search"),
        (dp_choice, "data parallelism's plan, in the search's terms"),
        (_replicated_choice(req, mesh, cands, built), "every operator replicated"),
    ):
        if c is not None and (not offered or built.problem.feasible(c)):
            offered.setdefault(tuple(c), (c, label))
    offered = sorted(offered.values(), key=lambda cl: built.problem.cost(cl[0]))  # stable
    cost = built.problem.cost(offered[0][0])
    took = time.monotonic() - t0

    proved = []  # the answer, once asked (a MeshPlan is reused)

    def prove():
        if not proved:
            budget = min(BOUND_MAX, max(1.0, BOUND_SHARE * took))
            if config.search_time is not None:
                budget = min(budget, config.search_time - took)
            got = trws.bound(built.problem, budget, cost, BOUND_TOLERANCE) if budget > 0 else None
            better = max(b for b in (bound, got, -math.inf) if b is not None)
            proved.append(None if better == -math.inf else min(better, cost))
        return proved[0]

    loose = bound is None or cost - bound > BOUND_TOLERANCE * abs(cost)
    bound = None if bound is None else min(bound, cost)

    def assignment(picked, label):
        choice, inputs = built.assignment(picked)
        return Assignment(
            choice,
            inputs,
            built.problem.cost(picked),
            built.held(picked, choice),
            bound,
            prove if loose else None,
            built.problem.peak(picked),
            label,
        )

    # and data parallelism's plan itself, as data_parallel lowers it: its choice in the problem's
    # terms converts some values elsewhere (gpt-large: 32 collectives, all-gathers and
    # reduce-scatters among them, against data_parallel's 30 all-reduces, and 7% slower run)
    return tuple(assignment(c, label) for c, label in offered) + (
        (dp,) if dp_choice is not None else ()
    )


POLISH_SHARE = 0.5  # local search after dynamic programming: this share of its time,
POLISH_MIN = 1.0  # ... at least this many seconds
POLISH_MAX = 30.0  # ... and at most this many
POLISH_NODES = 2000  # ... on problems of at least this many nodes


def _polished(problem, solution, took, config, progress):
    """Dynamic programming's ``solution`` improved by local search (``solvers.local_search``,
    the IOPDDL contest solver) seeded with it, for ``POLISH_SHARE`` times the ``took`` seconds
    the search has run (within ``POLISH_MIN``..``POLISH_MAX`` and what ``search_time``
    leaves); the answer as it was when it is proven optimal. Elimination is exact only on
    series-parallel graphs, and a training step is not one (a weight is read by the forward
    pass, its recomputation and the backward pass): on 4 blocks of GPT 39B on a 2-stage mesh of
    (32, 8) A100s, dynamic programming's plan costs 3.19 s, Megatron-LM's 2.30 s, and local
    search from dynamic programming's finds 1.89 s in 3 s (its proven lower bound: 1.78).
    Problems of fewer than ``POLISH_NODES`` nodes keep dynamic programming's answer: local
    search stops on the clock, so its answer depends on the machine's speed and load, and a
    small step (whose plan gains little) plans the same way every time. Nor does an answer
    found on the problem with its repeated layers folded (``solution.folded``: dp.solve folds
    large problems): on 32 searches of GPT 1.7B, 18B and 39B (8-24 layers, 6-21k nodes, every
    stage mesh auto_parallel tried) local search improved none of them, in 4-7 s each (its
    exact reduction of the whole problem alone outruns the budget), where the unfolded answers
    it improved by up to 29%."""
    if solution.optimal or solution.folded or problem.num_nodes < POLISH_NODES:
        return solution
    budget = min(POLISH_MAX, max(POLISH_MIN, POLISH_SHARE * took))
    if config.search_time is not None:
        budget = min(budget, config.search_time - took)
    if budget < POLISH_MIN:
        return solution
    got = solvers.get("local_search")(
        problem, time_limit=budget, initial=solution, progress=progress
    )
    bounds = [b for b in (solution.lower_bound, got.lower_bound) if b is not None]
    best = got if got.cost < solution.cost else solution
    return dataclasses.replace(
        best,
        bound=min(max(bounds), best.cost) if bounds else None,
        optimal=best.optimal or got.optimal,
    )


BASELINE_OPERATORS = 4000


def _replicated_choice(req, mesh, cands, built):
    """Every operator replicated (each device runs the whole step: no communication at all;
    on a model too small to pay for a collective the fastest plan, and one the solvers, exact
    only on trees, can miss) as a choice of ``built``'s problem; annotated values keep their
    layouts. None where the problem cannot express it."""
    if mesh.size < 2 or len(req.graph.nodes) > BASELINE_OPERATORS:
        return None
    pinned = req.arg_layouts(mesh)
    inputs = tuple(
        pinned.get(j) or Layout.replicated(len(v.shape)) for j, v in enumerate(req.graph.inputs)
    )
    return built.choice_of({n.id: cands[n.id][0] for n in req.graph.nodes}, inputs, {})


def data_parallel_assignment(req, config, mesh, planner, cands):
    """data_parallel's plan of the step on ``mesh`` as an Assignment (its cost: the resharding
    seconds propagation counts), or None: no data-parallel plan here (e.g. a batch the mesh
    does not divide), a mesh of one device, or a graph over ``BASELINE_OPERATORS`` operators
    (data_parallel's propagation costs about a millisecond per operator, as much as the search
    itself on the large graphs)."""
    if mesh.size < 2 or len(req.graph.nodes) > BASELINE_OPERATORS:
        return None
    dp = config.replace(parallel_mode=ParallelMode.DATA_PARALLEL, enable_parallel_optimizer=False)
    dp_req = dataclasses.replace(req, config=dp)
    try:
        fixed = fixed_layouts(dp, mesh, req.graph)
        args = dp_req.arg_layouts(mesh)
    except AutoparError:  # no data-parallel plan here (a batch the mesh does not divide)
        return None
    return dataclasses.replace(
        propagate(req.graph, mesh, fixed, args, reshard_cost(planner), cands, req.pairs),
        label="data parallelism's plan, as data_parallel lowers it",
    )


def recursive_search(req, config, mesh, planner, fixed, fit):
    """auto_parallel with search_mode='recursive_programming': one cut per mesh axis, each
    solved by dynamic programming (strategies/recursive.py). Out: as ``search``'s, the cuts'
    plan, then data parallelism's (``data_parallel_assignment``) and, with nothing annotated,
    every operator replicated; those two only on a mesh of one axis, as they need every
    operator's candidates on the whole mesh, the product of the axes this search never
    enumerates, and not with a MicroFit, which they do not see."""
    seconds = lambda s, d, shape, dtype: plan_steps(planner, s, d, shape, dtype)[1]
    progress = _progress(req.name, "recursive_programming", config)
    try:
        found = recursive.search(
            req.graph,
            mesh,
            {nid: identity_candidate(l) for nid, l in fixed.items()},
            req.arg_layouts(mesh),
            seconds,
            config.max_device_memory,
            solvers.get("dynamic_programming"),
            time_limit=config.search_time,
            progress=progress,
            name=req.name,
            arg_names=[n for n, _ in req.names],
            state_pairs=req.pairs,
            state_pricing=req.state_pricing(),
            fit=fit,
        )
    finally:
        progress.close()
    if fit is not None or len(mesh.shape) > 1 or len(req.graph.nodes) > BASELINE_OPERATORS:
        return (found,)
    cands = with_fixed(candidates_of(req.graph, mesh), fixed)
    offered = [found, data_parallel_assignment(req, config, mesh, planner, cands)]
    if not fixed and not req.arg_layouts(mesh):  # nothing pinned: nothing to convert
        offered.append(
            Assignment(
                {n.id: cands[n.id][0] for n in req.graph.nodes},
                tuple(Layout.replicated(len(v.shape)) for v in req.graph.inputs),
                0.0,
            )
        )
    unique = []
    for a in offered:
        if a is not None and all(a.choice != u.choice for u in unique):
            unique.append(a)
    return tuple(unique)


def with_fixed(cands, fixed):
    """``cands`` with each annotated value's layout its only candidate."""
    for nid, layout in fixed.items():
        cands[nid] = [identity_candidate(layout)]
    return cands
