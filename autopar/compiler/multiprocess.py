"""One plan for every process of a multi-process JAX runtime.

In: ``compile``'s request (step, arguments, config, ...) on every process of a
``jax.distributed`` runtime, and ``plan``: ``compile``'s planner for one process. Out: the same
``(graph, Strategy, Program)`` on every process, or the same error on every process.

Process 0 plans (the search runs once, with process 0's topology: its cached calibration or
the default, never a measurement, which would run on the other processes' devices); the others
receive its topology and strategy and lower that strategy (``compile(strategy=...)``), so a
search with a time limit cannot give two processes two plans. hybrid_parallel has no search
and every process plans it. Then a SHA-256 of each process's plan (the strategy without the
search's own provenance, and the Program's text) is compared across processes: a mismatch (a
process that traced another step or other shapes, or runs another autopar or JAX) is a
ConfigError on every process instead of a hang in the first collective.
With ``batch_is_process_local`` each process passes its slice of the batch arguments (dimension
0, processes in order), so the step is planned for ``process_count`` times that batch.
"""

from __future__ import annotations

import hashlib
import json

import jax

from ..arguments import check_call, default_batch
from ..config import ParallelMode
from ..errors import AutoparError, ConfigError
from ..runtime.jax_distributed import broadcast_text, check_same
from ..strategies.strategy import Strategy
from ..tools.calibrate import machine_topology
from ..topology import Topology
from ..trace import trace

PROVENANCE = ("search", "search_cost", "search_bound")  # how process 0 found the plan


def process_local_positions(args, batch_argnums) -> tuple:
    """The flat leaf positions of the arguments ``batch_argnums`` names."""
    out: list[int] = []
    k = 0
    for i, a in enumerate(args):
        n = len(jax.tree.leaves(a))
        if i in batch_argnums:
            out.extend(range(k, k + n))
        k += n
    return tuple(out)


def global_arguments(args, batch_argnums) -> tuple:
    """``args`` with every batch leaf as a ``jax.ShapeDtypeStruct`` of ``process_count`` times
    its rows (what the step sees once the processes' slices are put together)."""
    p = jax.process_count()

    def whole(x):
        shape = tuple(getattr(x, "shape", ()))
        if not shape:
            raise ConfigError(
                "batch_is_process_local=True: a batch argument is a scalar; each "
                "process passes its rows of every batch array."
            )
        return jax.ShapeDtypeStruct((shape[0] * p,) + shape[1:], x.dtype)

    return tuple(jax.tree.map(whole, a) if i in batch_argnums else a for i, a in enumerate(args))


def digest(strategy: Strategy, program) -> bytes:
    d = {k: v for k, v in strategy.to_dict().items() if k not in PROVENANCE}
    text = json.dumps(d, sort_keys=True) + "\n" + str(program)
    return hashlib.sha256(text.encode()).digest()


def plan_everywhere(plan, fn, args, config, batch_argnums, in_strategy, strategy):
    """``plan(fn, args, config, batch_argnums, in_strategy, strategy)`` once on process 0 and
    shared (see the module docstring) -> ``(graph, Strategy, Program)`` on every process."""
    first = jax.process_index() == 0
    topo = config.topology
    if topo is None and first:
        topo = machine_topology("jax", config.devices.device_num, False)
    topo = Topology.from_dict(
        json.loads(broadcast_text(json.dumps(topo.to_dict()) if first else "")),
        "process 0's topology",
    )
    config = config.replace(topology=topo)
    everyone = config.parallel_mode is ParallelMode.HYBRID_PARALLEL
    made, error = None, None
    if first or everyone:
        try:
            made = plan(fn, args, config, batch_argnums, in_strategy, strategy)
        except Exception as e:  # noqa: BLE001 -- raised below, after the others are told
            error = e
    if not everyone:
        text = broadcast_text(made[1].to_json() if made is not None else "")
        if not text:  # every process knows: none waits for another
            raise error or ConfigError("process 0 could not plan the step (see its error).")
        if not first:
            try:
                made = plan(fn, args, config, batch_argnums, in_strategy, Strategy.from_json(text))
            except AutoparError as e:
                error = ConfigError(
                    f"process {jax.process_index()} cannot run process 0's plan: {e}"
                )
            except Exception as e:  # noqa: BLE001 -- raised below, after the others are told
                error = e
    check_same(None if made is None else digest(made[1], made[2]), "the plan")
    if error is not None:
        raise error
    return made


def plan_for_processes(
    plan, fn, args, config, batch_argnums, in_strategy, strategy, batch_is_process_local
):
    """``compile``'s planning under a multi-process runtime -> ``((graph, Strategy, Program),
    positions)``: the plan every process shares (``plan_everywhere``), for the global batch
    when ``batch_is_process_local``, and the flat leaf positions of the process-local batch
    leaves (empty when the batch is global)."""
    batch = check_call(fn, args, batch_argnums)
    if (
        batch_argnums is None
        and batch_is_process_local
        and config.parallel_mode is not ParallelMode.HYBRID_PARALLEL
    ):
        batch = default_batch(trace(fn, *args))  # the state the step returns is no batch
    local = process_local_positions(args, batch) if batch_is_process_local else ()
    made = plan_everywhere(
        plan,
        fn,
        global_arguments(args, batch) if local else args,
        config,
        batch if local else batch_argnums,
        in_strategy,
        strategy,
    )
    return made, local
