"""The public entry: ``compile``, ``parallel`` and ``plan``.

In: a single-device step function, example arguments (pytrees; the first holds the
parameters), a ``ParallelConfig`` and optional ``batch_argnums``/``in_strategy``/``strategy``.
Out: a ``Compiled`` object (compiled.py): calling it runs the sharded Program on
``config.backend`` (the native multi-process runtime by default; ``backend="jax"`` for
shard_map over JAX devices) and returns the same pytree (and values) as the plain function;
``.strategy`` is the chosen Strategy, ``.program`` the per-rank Program, ``.collectives()``
its inserted collectives.
The entry layer (autopar.compiler, with search, hybrid_plan, pipeline_plan and dump) imports
every layer.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
import warnings
from collections.abc import Sequence

import jax

from ..arguments import (
    arg_layouts,
    check_call,
    default_batch,
    fixed_layouts,
    leaf_names,
    leaf_type,
    state_pairs,
)
from ..config import Backend, OptimizerLevel, ParallelConfig, ParallelMode, SearchMode
from ..errors import ConfigError, InfeasibleError, LayoutError, PipelineError
from ..graph import Graph
from ..progress import logger
from ..recompute import recomputes, selective_recompute, without_recompute
from ..redistribution.lower import lower, lower_steps
from ..redistribution.planner import Planner
from ..runtime.jax_distributed import multi_process
from ..strategies.build import StatePricing
from ..strategies.candidates import batch_defaults, candidates_of
from ..strategies.cost_model import memory_timeline, program_memory
from ..strategies.microbatch import MicroFit
from ..strategies.optimizer import optimizer_updates
from ..strategies.problem import least_need
from ..strategies.propagation import Assignment, propagate
from ..strategies.slices import slice_early
from ..strategies.strategy import Alternative, Strategy
from ..strategies.strategy_file import check_fits
from ..tools.calibrate import machine_topology, reference_program
from ..tools.profile import compute_seconds
from ..trace import trace
from .call_args import split_static
from .checks import check_backend, check_request, config_of, pipelined
from .compiled import Compiled
from .dump import (
    assemble_strategy,
    bucket_bytes,
    estimate_terms,
    host_arrays,
    host_bytes,
    input_strategies,
    peak_of,
    plan_op_strategies,
)
from .hybrid_plan import plan_hybrid
from .key_args import split_keys
from .lost_split import lost_split
from .mesh_plan import MeshPlan
from .multiprocess import plan_for_processes
from .operator_specs import (
    mesh_for_device_matrices,
    mindspore_constraints,
    tuples_on_device_matrices,
    with_operator_letters,
    with_tuples,
)
from .pipeline_plan import (
    Staged,
    auto_pipeline,
    batch_inputs,
    pipeline_program,
    plan_pipeline,
    reshard_cost,
)
from .search import built_problem, default_search_mode, recursive_search, search, with_fixed


def _search_name(config) -> str:
    mode = config.parallel_mode
    if mode is ParallelMode.AUTO_PARALLEL:
        return config.search_mode.value
    return "sharding_propagation" if mode is ParallelMode.SEMI_AUTO_PARALLEL else "none"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileRequest:
    """What one compile plans, fixed before any mesh is chosen: the traced step and how the
    user called it."""

    config: ParallelConfig
    graph: Graph  # the traced step
    args: tuple  # the example arguments (arrays or ShapeDtypeStructs)
    batch_argnums: tuple
    in_strategy: Sequence[object] | None  # the user's in_strategy: one entry per argument
    strategy: Strategy | None  # a Strategy to load instead of searching
    names: tuple  # (leaf name, is a parameter) per argument leaf
    name: str  # the step function's name, for progress and messages
    pairs: tuple  # (argument, result) positions of the carried state
    pipelined: bool
    micro: int = 1  # micro-batches every layout must leave the batch rows for
    op_tuples: dict = dataclasses.field(default_factory=dict)  # operator name -> the split
    # tuples a loaded MindSpore file gives it

    def micro_fit(self, mesh):
        """The MicroFit of ``micro`` on ``mesh`` (strategies.microbatch), or None without
        micro-batches."""
        if self.micro == 1:
            return None
        batch = batch_inputs(self.graph, self.args, self.batch_argnums, self.pairs)
        return MicroFit(self.graph, batch, self.micro, mesh)

    def arg_layouts(self, mesh) -> dict:
        return arg_layouts(
            self.config,
            mesh,
            self.graph,
            self.args,
            self.batch_argnums,
            self.in_strategy,
            self.names,
        )

    def state_pricing(self) -> StatePricing:
        """ZeRO inside auto_parallel's search: with the parallel optimizer on, state leaves of
        at least ``parallel_optimizer_threshold`` KB are priced at their real cost when their
        new value is made in another layout (levels 1-3), optimizer state also when it is read
        through a collective, and parameters too at level 3 (gathered where read)."""
        config = self.config
        if not config.enable_parallel_optimizer:
            return StatePricing()
        big = frozenset(
            i
            for i, _ in self.pairs
            if self.graph.inputs[i].nbytes >= config.parallel_optimizer_threshold * 1024
        )
        if config.optimizer_level is OptimizerLevel.LEVEL3:
            return StatePricing(returned=big, read=big)
        return StatePricing(returned=big, read=frozenset(i for i in big if not self.names[i][1]))


def _from_strategy(strategy, graph, mesh, cands, names) -> Assignment:
    if not strategy.mesh_matches(mesh):
        raise LayoutError(
            f"the strategy was made for mesh {strategy.mesh_shape} "
            f"{strategy.axis_names}, not {mesh}; use the same mesh_shape."
        )
    check_fits(strategy, graph, mesh, [n for n, _ in names])
    choice = {}
    for node, op in zip(graph.nodes, strategy.ops):
        match = [
            c
            for c in cands[node.id]
            if c.in_layouts == op.in_layouts and c.out_layouts == op.out_layouts
        ]
        if op.prim != node.prim:
            raise LayoutError(
                f"strategy entry {op.name} ({op.prim}) does not fit {node.name} "
                f"({node.prim}) of this function; it was saved for a different "
                "function or shapes."
            )
        if not match:
            for j, (l, x) in enumerate(zip(op.in_layouts, node.inputs)):
                l.check(x.shape, mesh, f"strategy entry {op.name} input {j}")
            for j, (l, v) in enumerate(zip(op.out_layouts, node.outputs)):
                l.check(v.shape, mesh, f"strategy entry {op.name} output {j}")
            layouts = (
                f"{', '.join(map(str, op.in_layouts))} -> {', '.join(map(str, op.out_layouts))}"
            )
            raise LayoutError(
                f"strategy entry {op.name}: {node.prim} cannot run as {layouts} on "
                f"{mesh} (autopar has no rule for those layouts); write the file "
                "again with autopar, or give that operator layouts it can run."
            )
        choice[node.id] = match[0]
    held = {
        v.id: l
        for node, op in zip(graph.nodes, strategy.ops)
        for v, l in zip(node.outputs, op.converted)
        if l is not None
    }
    return Assignment(choice, tuple(i.layout for i in strategy.inputs), 0.0, held)


def compile(
    fn,
    *args,
    config: ParallelConfig | None = None,
    batch_argnums=None,
    in_strategy=None,
    strategy: Strategy | None = None,
    batch_is_process_local: bool = False,
    static_argnums=None,
    static_argnames=None,
    donate_argnums=None,
) -> Compiled:
    """Trace ``fn(*args)``, choose layouts per ``config`` and build a runnable ``Compiled``.

    ``batch_argnums``: arguments holding the batch (default: every argument after the first
    whose new version the step does not return: ``step(params, opt_state, batch)`` splits the
    batch, not the optimizer state; hybrid_parallel: every argument after the first).
    ``in_strategy``: semi_auto_parallel / auto_parallel; one entry per argument: None, a
    split-count tuple, an ``ap.Layout`` (or its text), or a pytree of those matching the argument.
    ``strategy``: a saved ``Strategy`` to reuse instead of searching.
    In a multi-process JAX runtime (``ap.init_distributed``, ``autopar launch``) every process
    calls ``compile`` and then the step with the same arguments, or with
    ``batch_is_process_local=True`` each with its own rows of the batch arguments; the plan is
    made once and checked the same on every process (``compiler.multiprocess``), and every
    process gets the whole results, as numpy arrays.
    ``static_argnums`` / ``static_argnames`` / ``donate_argnums``: as ``jax.jit``'s (the static
    arguments are part of the plan: calling with other values raises; ``@ap.parallel``
    compiles once per value). Donated arguments' buffers are reused on the jax backend; the
    native runtime keeps a step's state in its workers anyway and ignores the hint.
    ``batch_argnums`` and ``in_strategy`` count every argument, static ones included (their
    in_strategy entries None).
    """
    config = config_of(config)
    user_fn = fn
    fn, args, call = split_static(fn, args, static_argnums, static_argnames, donate_argnums)
    batch_argnums, in_strategy = call.over_dynamic(batch_argnums, in_strategy)
    keys = None
    keyed = split_keys(fn, args)  # typed PRNG keys go in and out as their data
    if keyed is not None:
        fn, args, keys = keyed
    if strategy is None and config.strategy_ckpt_load_file:
        strategy = Strategy.load(config.strategy_ckpt_load_file)
    check_backend(config)
    local = ()
    if config.backend is Backend.JAX and multi_process():
        (graph, strat, program), local = plan_for_processes(
            _plan, fn, args, config, batch_argnums, in_strategy, strategy, batch_is_process_local
        )
    else:
        graph, strat, program = _plan(
            fn, args, config, batch_argnums, in_strategy, strategy, measure=True
        )
    logger.info(
        "compiled %s (%s, %s): %d operators, %d collectives; %s",
        getattr(fn, "__name__", "step"),
        strat.mode,
        strat.search,
        len(graph.nodes),
        len(program.collectives()),
        ", ".join(f"{k} {v:.2f} s" for k, v in strat.phase_seconds),
    )
    if config.strategy_ckpt_save_file and (not multi_process() or jax.process_index() == 0):
        strat.save(config.strategy_ckpt_save_file)  # one writer: the plan is everyone's
    leaf_types = [leaf_type(x) for x in jax.tree.leaves(args)]
    return Compiled(
        user_fn,
        graph,
        config,
        strat,
        program,
        graph.in_tree,
        leaf_types,
        local,
        keys,
        call,
        call.donated_leaves(args),
    )


def plan(
    fn,
    *args,
    config: ParallelConfig | None = None,
    batch_argnums=None,
    in_strategy=None,
    static_argnums=None,
    static_argnames=None,
) -> Strategy:
    """The Strategy ``compile`` would choose (with its estimated step time and per-device
    memory), without building anything runnable. Arguments may be ``jax.ShapeDtypeStruct``s,
    so a model far larger than this machine's memory is planned without allocating it;
    static arguments as ``compile``'s."""
    fn, args, call = split_static(fn, args, static_argnums, static_argnames)
    batch_argnums, in_strategy = call.over_dynamic(batch_argnums, in_strategy)
    keyed = split_keys(fn, args)
    if keyed is not None:
        fn, args, _ = keyed
    return _plan(fn, args, config, batch_argnums, in_strategy, None)[1]


def _on_mesh(req: CompileRequest, mesh) -> MeshPlan:
    """Layouts for every operator of the step on ``mesh`` by the config's mode, then the
    parallel optimizer, then lowering (the Program itself only without a pipeline): ``_finish``
    (auto_parallel's: ``_cheapest`` of the plans its search offers)."""
    config, graph, pipelined, pairs = req.config, req.graph, req.pipelined, req.pairs
    mode = config.parallel_mode
    planner = Planner(mesh)
    fixed = fixed_layouts(config, mesh, graph)
    # a pipeline's stages hold parts of the step: the stage planner applies the memory cap
    search_config = config.replace(max_device_memory=None) if pipelined else config
    fit = req.micro_fit(mesh) if req.strategy is None else None
    if (
        req.strategy is None
        and mode is ParallelMode.AUTO_PARALLEL
        and config.search_mode is SearchMode.RECURSIVE_PROGRAMMING
    ):  # never the full product
        return _cheapest(
            req, mesh, planner, recursive_search(req, search_config, mesh, planner, fixed, fit)
        )
    cands = with_fixed(candidates_of(graph, mesh), fixed)  # annotated values keep theirs
    cands = with_tuples(graph, cands, req.op_tuples, mesh)
    if config.unannotated == "batch" and req.strategy is None:
        cands = batch_defaults(
            graph, cands, mesh, fixed, batch_inputs(graph, req.args, req.batch_argnums, pairs)
        )
    if fit is not None:
        cands = fit.nodes(graph, cands)
    if req.strategy is not None:
        assignment = _from_strategy(req.strategy, graph, mesh, cands, req.names)
    elif mode is ParallelMode.AUTO_PARALLEL:
        return _searched(req, config if pipelined else search_config, mesh, planner, cands, fit)
    else:
        assignment = propagate(
            graph, mesh, fixed, req.arg_layouts(mesh), reshard_cost(planner), cands, pairs
        )
        if (
            mode in (ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL)
            and mesh.size > 1
            and not pipelined
        ):
            lost = lost_split(
                graph,
                assignment,
                batch_inputs(graph, req.args, req.batch_argnums, pairs),
                cands,
                mode.value,
            )
            if lost:
                warnings.warn(lost, stacklevel=3)
    return _profiled(req, [_finish(req, mesh, planner, assignment)])[0]


_ZERO_HINT = ", or set enable_parallel_optimizer=True to shard the optimizer state and update."
SEARCH_RETRIES = 3  # searches under a tighter cap when the lowered plan overruns the real one
RETRY_STEP = 0.1  # ... each at least this share tighter than the last


def _searched(req: CompileRequest, config, mesh, planner, cands, fit) -> MeshPlan:
    """auto_parallel's plan on ``mesh``: the search (``search``) and ``_cheapest`` of what it
    offers. The search's memory model is the problem's (live intervals of operator outputs);
    the lowered program's (``memory_timeline``) is the truth the cap is checked against, so
    when no offered plan fits the cap there, the search runs again within what it thought its
    plan holds scaled down by the overrun (and at least ``RETRY_STEP`` below its last limit,
    but not below the least any plan holds in its model, where it stops), up to
    ``SEARCH_RETRIES`` times (the last plan is returned either way: the caller names its peak
    when it does not fit). The problem is built once for every limit.

    On a pipeline's stage mesh the whole step is searched within the memory of all
    ``pipeline_stages`` stages' devices (``max_device_memory`` times the stage count): its
    parameters and optimizer state are spread over the stages, and it holds the whole batch's
    activations, what GPipe's stages hold together (1F1B's hold fewer); so a layout whose state
    could fit no split into stages is not offered, though the stage planner, which checks each
    stage against the cap, remains the judge. Where no layout fits that, the search runs
    without it (the stage planner names what does not fit)."""
    cap = config.max_device_memory
    built = built_problem(req, mesh, planner, cands, fit)  # searched within each limit
    if not req.pipelined or cap is None:
        return _searched_within(req, config, mesh, planner, cands, fit, built)
    try:
        return _searched_within(
            req,
            config.replace(max_device_memory=cap * config.pipeline_stages),
            mesh,
            planner,
            cands,
            fit,
            built,
        )
    except InfeasibleError:
        return _searched_within(
            req, config.replace(max_device_memory=None), mesh, planner, cands, fit, built
        )


def _searched_within(req: CompileRequest, config, mesh, planner, cands, fit, built) -> MeshPlan:
    """``_searched`` within ``config.max_device_memory`` (for a pipeline's stage mesh, the
    scaled cap ``_searched`` gives it), searching ``built`` (``search.built_problem``)."""
    cap = config.max_device_memory
    limit = cap
    best = peak = least = None
    problem = built.problem
    for _ in range(SEARCH_RETRIES + 1):
        try:
            found = search(
                req, config.replace(max_device_memory=limit), mesh, planner, cands, fit, built
            )
        except InfeasibleError as e:
            if best is None:
                raise
            raise InfeasibleError(
                f"no plan fits max_device_memory={cap}: the search's plan within it lowers to "
                f"{peak} bytes per device, and searched again within {limit} bytes: {e}"
            ) from None
        best = _cheapest(req, mesh, planner, found)
        if cap is None or req.pipelined:
            return best
        peak = program_memory(best.program, memory_timeline(best.program))[0]
        if peak <= cap:
            return best
        # the next search within what the search thought this plan holds, scaled by its
        # overrun (a plan the search thought smaller than the limit would be found again), and
        # no less than the least any plan holds in the search's model (within less, none fits)
        searched = found[0].peak if found[0].peak else limit
        if least is None:  # no plan holds less in the search's model
            least = problem.peak(problem.smallest())
        nxt = max(least, int(min(limit * (1 - RETRY_STEP), searched * cap / peak)))
        if nxt >= limit:  # no tighter search is possible
            raise InfeasibleError(
                f"no plan fits max_device_memory={cap}: the search's plan within {limit} bytes "
                f"lowers to {peak} bytes per device, and no plan holds less in the search's "
                f"model: {least_need(problem)}. Raise max_device_memory, use more devices or "
                "a smaller batch" + ("." if config.enable_parallel_optimizer else _ZERO_HINT)
            )
        limit = nxt
    assert best is not None  # the loop ran at least once
    return best


def _cheapest(req: CompileRequest, mesh, planner, found) -> MeshPlan:
    """Of auto_parallel's plans ``found`` (the search's first, then data parallelism's: see
    ``search``), the one whose lowered program is estimated fastest, as its Strategy will say
    (``dump.estimate_terms``); the first on a tie, and only those within max_device_memory
    (the first when none is; only those are profiled); every one priced goes into the
    MeshPlan's ``alternatives``. A pipeline's stage is planned further by the stage planner:
    its first plan."""
    plans = [_finish(req, mesh, planner, a) for a in (found[:1] if req.pipelined else found)]
    if len(plans) == 1:
        return _profiled(req, plans)[0]
    cap = req.config.max_device_memory
    peaks = [program_memory(p.program, memory_timeline(p.program))[0] for p in plans]
    within = [k for k, peak in enumerate(peaks) if cap is None or peak <= cap] or [0]
    priced = list(plans)  # measured (profile_plans): the ones it may keep
    for k, p in zip(within, _profiled(req, [plans[k] for k in within])):
        priced[k] = p
    terms = [estimate_terms(req.graph, req.names, p, req.config, req.pairs) for p in priced]
    best = min(within, key=lambda k: sum(terms[k]))  # the first on a tie
    alternatives = tuple(
        Alternative(
            label=p.assignment.label or f"plan {k + 1}",
            seconds=sum(t),
            compute=t[0],
            comm=t[1],
            overhead=t[2],
            peak_memory=peaks[k],
            chosen=k == best,
            fits=cap is None or peaks[k] <= cap,
        )
        for k, (p, t) in enumerate(zip(priced, terms))
    )
    return dataclasses.replace(priced[best], alternatives=alternatives)


def _profiled(req: CompileRequest, plans: list) -> list:
    """``plans`` with their lowered programs' compute measured, all in one child process
    timing them in turn (``tools.profile.compute_seconds``), when the config has
    ``profile_plans``; else as they are. When the topology knows the calibration's reference
    step's compute (``Topology.reference_compute``, as it ran in a step at calibration), that
    step is timed among them and their figures scaled by its calibrated over its measured time:
    the machine's speed drifts here by up to 1.5x within minutes, and the estimate's priced
    parts (communication, per-call overhead) are at its speed at calibration, so the measured
    compute is brought there too; and a step's compute with every device busy runs slower than
    one rank's alone on a core (the reference step's by 1.1-1.2x here), which the scale holds."""
    if not req.config.profile_plans:
        return plans
    backend, mesh = req.config.backend.value, plans[0].program.mesh
    topo = mesh.topology
    programs = [p.program for p in plans]
    if topo.reference_compute:
        programs.append(reference_program(compile, topo, backend, mesh.size))
    seconds = compute_seconds(programs, backend)
    scale = topo.reference_compute / seconds.pop() if topo.reference_compute else 1.0
    return [dataclasses.replace(p, measured=t * scale) for p, t in zip(plans, seconds)]


def _finish(req: CompileRequest, mesh, planner, assignment) -> MeshPlan:
    """The MeshPlan of ``assignment``: the parallel optimizer's updates, the state's result
    layouts, and the lowered Program (without a pipeline) or only its communication."""
    config, graph, pipelined, pairs = req.config, req.graph, req.pipelined, req.pairs
    mode = config.parallel_mode
    updates = {}
    is_param = [p for _, p in req.names]
    if config.enable_parallel_optimizer and mesh.size > 1:
        su = optimizer_updates(
            graph,
            assignment.choice,
            assignment.inputs,
            pairs,
            is_param,
            mesh,
            config,
            searched=mode is ParallelMode.AUTO_PARALLEL,
        )
        assignment = Assignment(su.choice, su.in_layouts, assignment.cost, assignment.held)
        updates = su.updates
    # state (new parameters, optimizer state) stays in its argument's layout from step to step,
    # as the searches assume; the backends put the blocks together for the caller
    out_layouts = [None] * len(graph.outputs)
    for i, j in pairs:
        out_layouts[j] = assignment.inputs[i]
    assignment = dataclasses.replace(
        assignment,
        choice=slice_early(
            graph, assignment.choice, assignment.inputs, mesh, reshard_cost(planner)
        ),
    )
    if pipelined:
        comm = lower_steps(
            graph, assignment.choice, assignment.inputs, mesh, planner, out_layouts
        ).comm
        return MeshPlan(mesh, planner, assignment, updates, tuple(out_layouts), comm)
    program, comm, out_comm = lower(
        graph,
        assignment.choice,
        assignment.inputs,
        mesh,
        planner,
        out_layouts,
        assignment.held,
        bucket_bytes(config),
    )
    return MeshPlan(mesh, planner, assignment, updates, tuple(out_layouts), comm, program, out_comm)


def _gc_paused(f):
    """``f`` run with Python's cyclic garbage collector paused (restored after, and left alone
    when the caller had paused it). Planning a deep model allocates millions of short-lived
    objects while its caches keep millions alive, and each collection rescans them: on the
    175B plan collection took a quarter of the time (68.8 -> 50.2 s) and freed almost nothing
    (the same peak resident memory with and without)."""

    @functools.wraps(f)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return f(*args, **kwargs)
        gc.disable()
        try:
            return f(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_gc_paused
def _plan(fn, args, config, batch_argnums, in_strategy, strategy, measure=False):
    """``(graph, Strategy, Program or PipelineProgram)``: trace, plan on the mesh (or the
    pipeline's stage meshes; with stages or micro-batches "auto", every pipeline
    ``auto_pipeline`` considers), check the memory cap, assemble the Strategy. Without a
    topology in the config, this machine's (``tools.calibrate.machine_topology``: cached, or
    measured first when ``measure``, as ``compile`` does before running here)."""
    config = config_of(config)
    given = (batch_argnums, in_strategy)  # as the caller gave them (recompute="auto")
    named = batch_argnums is not None
    batch_argnums = check_call(fn, args, batch_argnums)
    in_strategy, ops, strategy, config = mindspore_constraints(strategy, config, args, in_strategy)
    if strategy is not None and not isinstance(strategy, Strategy):
        raise ConfigError(
            f"strategy={strategy!r} must be an ap.Strategy (ap.Strategy.load(path) "
            "reads a file; or set strategy_ckpt_load_file in the config)."
        )
    if config.topology is None:
        config = config.replace(
            topology=machine_topology(
                config.backend.value, config.devices.device_num, measure, compile
            )
        )
    mode = config.parallel_mode
    if strategy is not None and config.pipeline.auto:  # the loaded plan's pipeline
        config = config.replace(
            pipeline_stages=max(len(strategy.stages), 1), micro_batches=strategy.micro_batches
        )
    check_request(config, strategy, pipelined(config))
    if mode is ParallelMode.HYBRID_PARALLEL:
        return plan_hybrid(fn, args, config, batch_argnums, in_strategy)
    t0 = time.monotonic()
    traced = with_operator_letters(trace(fn, *args))
    if (
        config.recompute == "auto"
        and mode is ParallelMode.AUTO_PARALLEL
        and strategy is None
        and recomputes(traced)
    ):
        return _recompute_or_not(fn, args, config, *given, measure)
    how = strategy.recompute if strategy is not None else config.recompute
    if how in RECOMPUTE_OF:
        traced = RECOMPUTE_OF[how](traced)
    graph, in_strategy = tuples_on_device_matrices(config, traced, args, in_strategy)
    t_trace = time.monotonic()
    if not named:
        batch_argnums = default_batch(graph)
    config = mesh_for_device_matrices(config, graph, in_strategy)
    full = config.logical_mesh()
    if mode is ParallelMode.AUTO_PARALLEL and config.search_mode is None:
        config = config.replace(search_mode=default_search_mode(full))
    names = leaf_names(args)
    req = CompileRequest(
        config=config,
        graph=graph,
        args=args,
        batch_argnums=batch_argnums,
        in_strategy=in_strategy,
        strategy=strategy,
        names=tuple(names),
        name=getattr(fn, "__name__", "step"),
        pairs=tuple(state_pairs(graph)),
        pipelined=pipelined(config),
        op_tuples=ops,
        micro=config.micro_batches if isinstance(config.micro_batches, int) else 1,
    )
    if config.pipeline.auto:
        graph, strat, program = auto_pipeline(
            req,
            full,
            lambda r, cache: _plan_traced(r, full, t0, t_trace, cache),
            lambda r, cache: _staged(r, full, cache),
        )
    else:
        graph, strat, program = _plan_traced(req, full, t0, t_trace)
    return (
        graph,
        dataclasses.replace(strat, recompute=how) if how in RECOMPUTE_OF else strat,
        program,
    )


RECOMPUTE_OF = {"none": without_recompute, "selective": selective_recompute}  # the rewrites


def _recompute_or_not(fn, args, config, batch_argnums, in_strategy, measure):
    """``recompute="auto"``: the step planned as written (its ``jax.checkpoint`` blocks
    recomputed) and without recomputation (``autopar.recompute``), each over every pipeline
    the config leaves open, then with selective recomputation on the pipeline (stages,
    micro-batches, interleave) of the faster of the two, or on the config's when neither could
    be planned; the fastest plan within the cap kept (on a tie, the first planned); the error
    of the first when none can be planned. Selective recomputation over every pipeline again
    took the 18B row of benchmarks/published_runs.py from 290 to 649 s for the same plan."""
    plans, errors = [], []

    def one(cfg):
        try:
            graph, strat, program = _plan(fn, args, cfg, batch_argnums, in_strategy, None, measure)
        except (ConfigError, LayoutError, PipelineError, InfeasibleError) as e:
            errors.append(e)
            return
        seconds = strat.pipeline_time if strat.stages else strat.step_time
        plans.append((seconds, len(plans), (graph, strat, program)))

    for how in ("as_written", "none"):
        one(config.replace(recompute=how))
    selective = config.replace(recompute="selective")
    if plans and config.pipeline.auto:
        strat = min(plans)[2][1]
        stages = len(strat.stages) // strat.pipeline_interleave if strat.stages else 1
        selective = selective.replace(
            pipeline_stages=stages,
            micro_batches=strat.micro_batches,
            pipeline_interleave=strat.pipeline_interleave,
            pipeline_stage_devices=None
            if stages == 1
            else (config.devices.device_num // stages,) * stages,
        )
    one(selective)
    if not plans:
        raise errors[0]
    return min(plans)[2]


def _plan_traced(req: CompileRequest, full, t0, t_trace, cache=None):
    """``_plan`` after tracing: the layouts (``cache``: (mesh, pipelined, micro) -> MeshPlan,
    shared by the pipelines ``auto_pipeline`` tries), the cap, the Strategy."""
    config, graph, names, pipelined = req.config, req.graph, req.names, req.pipelined
    cache = {} if cache is None else cache
    if pipelined:
        program, per_stage = pipeline_program(config, graph, full, _staged(req, full, cache))
        t_search = time.monotonic()
        node_plan = [per_stage[s] for s in program.node_stages]
        out_comm = 0.0
    else:
        mesh_plan = _mesh_plans(req, cache)(full)
        t_search = time.monotonic()
        program, out_comm, per_stage = mesh_plan.program, mesh_plan.out_comm, (mesh_plan,)
        node_plan = [mesh_plan] * len(graph.nodes)
    first = per_stage[0]
    inputs = input_strategies(graph, names, program, per_stage, pipelined)
    ops = plan_op_strategies(
        graph,
        names,
        node_plan,
        program.node_stages if pipelined else (0,) * len(graph.nodes),
        converts=not pipelined,
    )
    timeline = () if pipelined else memory_timeline(program)
    peak, peak_op, peak_where = peak_of(program, graph, pipelined, timeline)
    cap = config.max_device_memory
    # no search has checked this plan (data_parallel, semi_auto_parallel), or it changed after
    # the search (the parallel optimizer, results gathered for return)
    if cap is not None and peak > cap:
        hint = "" if config.enable_parallel_optimizer else _ZERO_HINT[:-1]
        raise InfeasibleError(
            f"{config.parallel_mode.value} needs {peak} bytes per device at {peak_op} "
            f"({peak_where}), more than max_device_memory={cap}. Raise max_device_memory, use "
            f"more devices{', pipeline stages or micro-batches' if pipelined else ''} or a "
            f"smaller batch{hint}."
        )
    t_lower = time.monotonic()
    certified = _search_result(config, req, per_stage, pipelined)  # part of the search
    t_bound = time.monotonic() - t_lower
    strat = assemble_strategy(
        mode=config.parallel_mode.value,
        search="loaded" if req.strategy is not None else _search_name(config),
        mesh=first.mesh,
        inputs=inputs,
        ops=ops,
        program=program,
        planner=first.planner,
        peak=peak,
        peak_op=peak_op,
        cap=cap,
        timeline=timeline,
        output_comm=out_comm,
        host_bytes=host_bytes(graph, program, req.pairs),
        host_arrays=host_arrays(graph),
        measured_compute=None if pipelined else first.measured,
        alternatives=() if pipelined else first.alternatives,
        micro_batches=config.micro_batches,
        scheduler=config.pipeline_scheduler.value,
        phase_seconds=(
            ("trace", t_trace - t0),
            ("search", t_search - t_trace + t_bound),
            ("lower", time.monotonic() - t_search - t_bound),
        ),
        **certified,
    )
    return graph, strat, program


def _search_result(config, req, per_stage, pipelined) -> dict:
    """``search_cost`` and ``search_bound`` for the Strategy: auto_parallel's searched plan
    without a pipeline (a pipeline's stage searches each have their own model); else none."""
    if (
        pipelined
        or req.strategy is not None
        or config.parallel_mode is not ParallelMode.AUTO_PARALLEL
    ):
        return {}
    a = per_stage[0].assignment
    return {"search_cost": a.cost, "search_bound": a.bound if a.prove is None else a.prove()}


def _mesh_plans(req: CompileRequest, cache):
    """``mesh -> MeshPlan`` of ``req`` (``_on_mesh``), kept in ``cache`` by (mesh, pipelined,
    micro)."""

    def on_mesh(mesh):
        key = (mesh, req.pipelined, req.micro)
        if key not in cache:
            cache[key] = _on_mesh(req, mesh)
        return cache[key]

    return on_mesh


def _staged(req: CompileRequest, full, cache) -> Staged:
    """The pipeline of ``req`` planned up to its stages (``plan_pipeline``), kept in ``cache``
    by its stages and micro-batches, so ``auto_pipeline`` can rank pipelines by their stages
    before cutting any into a program."""
    config = req.config
    key = ("staged", config.pipeline_stages, config.micro_batches, config.pipeline_interleave)
    if key not in cache:
        cache[key] = plan_pipeline(
            config,
            req.graph,
            full,
            _mesh_plans(req, cache),
            req.args,
            req.batch_argnums,
            req.names,
            req.pairs,
            cache,
        )
    return cache[key]
