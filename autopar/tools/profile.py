"""A lowered Program's compute, measured on this machine (``profile_plans``).

In: ``Program``s (per-rank instructions; ``avals`` gives every register's local shape and
dtype) and the backend. Out: ``compute_seconds(programs, backend)``, per program the typical
seconds of its step with every collective replaced by a local stand-in of the same shapes
(table below): what a rank computes, as XLA compiles it, without communicating or waiting.
For ``native`` one rank's step alone on one core, as a worker runs it; for ``jax`` every
device's at once, as that backend runs them. The programs are timed in turn in one process,
so plans compared with each other are measured on the machine as it ran at the same moments.

Why: the cost model prices each operator by its flops or bytes at rates fitted on a reference
step, but XLA's CPU code does not cost the same per flop in every program: a dot whose operands
it reads transposed runs on another kernel at a third of the rate, a transposing fusion costs
many times its bytes (BENCHMARKS.md: Megatron's GPT plan computed 1.6x data
parallelism's per rank where the model said 1.15-1.2x). Measuring the compiled program is what
Alpa does for its stages; here it is one rank's whole step, compiled as the native runtime
compiles it (one executable) and run as its workers run it (one core, XLA single-threaded,
glibc's malloc tuned), in a child process so that neither the pinning nor the flags touch the
caller.

| kind           | stand-in (rank 0's shapes)                                  |
|----------------|-------------------------------------------------------------|
| all_reduce     | the value itself                                            |
| all_gather     | ``n`` copies concatenated along ``dim``                     |
| reduce_scatter | the first ``1/n`` of ``dim``                                |
| all_to_all     | the first ``1/n`` of ``dst_dim``, ``n`` copies along ``dim``|
| slice          | the first ``1/n`` of ``dim``                                |
| partial_zero   | the value itself (rank 0 keeps it)                          |

Each stand-in sits between optimization barriers, as opaque to XLA as the custom call it
replaces (``_standin``; for ``jax``, in place of the shard_map's collectives). For ``native`` a
collective is lowered as the worker's executable lowers it (``runtime.native_step``: the
same reshapes, transposes and copies around it) with the stand-in in the custom call's place
(``_StandinCalls``): with the table's stand-ins alone the profile put auto_parallel's
mlp-large plan (a reduce-scatter along the features, then transposed back) at Megatron's
compute, 53.1 against 52.3 ms, where the workers took 7 ms more. Arguments are ones (valid
indices for a gather, no denormals). The collectives' own time is the cost model's
(``Strategy.comm_time``), not measured here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np

from autopar.errors import ConfigError
from autopar.program import StepKind, checked_table


def _first(x, dim, n):
    from jax import lax

    return lax.slice_in_dim(x, 0, x.shape[dim] // n, axis=dim)


def _copies(x, dim, n):
    import jax.numpy as jnp

    return jnp.concatenate([x] * n, axis=dim)


ROUNDS = 8  # turns of every step at least
TURN_SECONDS = 0.05  # a turn: one untimed call, then back-to-back calls for about this long

_STANDIN = checked_table(
    {
        StepKind.ALL_REDUCE: lambda x, s, n: x,
        StepKind.ALL_GATHER: lambda x, s, n: _copies(x, s.dim, n),
        StepKind.REDUCE_SCATTER: lambda x, s, n: _first(x, s.dim, n),
        StepKind.ALL_TO_ALL: lambda x, s, n: _copies(_first(x, s.dst_dim, n), s.dim, n),
        StepKind.SLICE: lambda x, s, n: _first(x, s.dim, n),
        StepKind.PARTIAL_ZERO: lambda x, s, n: x,
    },
    StepKind,
    "profile stand-ins",
)


def _standin(x, ins, mesh):
    """A collective's stand-in, opaque to XLA as the custom call it replaces: its input is
    computed whole and its output read as a value (``optimization_barrier`` both sides).
    Without them XLA pushed a stand-in's slice into the producer (computing half of a partial
    sum a reduce-scatter would have read whole) and fused around the rest: auto_parallel's
    gpt-large plan profiled 3-5% below data parallelism's and ran 6-25% above it; with them
    3-6% above."""
    from jax import lax

    n = math.prod(mesh.axis_size(a) for a in ins.axes)
    return lax.optimization_barrier(_STANDIN[ins.kind](lax.optimization_barrier(x), ins, n))


_CORE = {  # a custom call's stand-in, on what native_step hands it: (operand, result shape)
    "all_reduce": lambda x, shape: x,
    "all_gather": lambda x, shape: x[None].repeat(shape[0], axis=0),  # n copies
    "reduce_scatter": lambda x, shape: x[: shape[0]],
    "all_to_all": lambda x, shape: x,
}


class _StandinCalls:
    """What ``runtime.native_step``'s lowering calls for a custom call (``call``), answered by
    a stand-in between optimization barriers, so the profile's executable has the same
    reshapes, transposes and copies around each collective as the worker's."""

    def call(self, name, results, x, order, aliases=None, **attrs):
        from jax import lax

        return lax.optimization_barrier(
            _CORE[name](lax.optimization_barrier(x), results[0].shape)
        ), order


def _native_standin(x, ins, mesh):
    import jax.numpy as jnp

    from autopar.runtime.native_step import _LOWER, _Groups

    n = math.prod(mesh.axis_size(a) for a in ins.axes)
    out, _ = _LOWER[ins.kind](_StandinCalls(), ins, x, _Groups((), n), 0, jnp.int32(0))
    return out


def local_function(program):
    """One rank's step with every collective and slice replaced by its stand-in: local
    argument blocks -> local results."""
    from autopar.runtime.jax_backend import program_function

    return program_function(program, _native_standin)


def exported(program, backend: str = "native") -> bytearray:
    """The step as serialized ``jax.export`` bytes (StableHLO): for ``native``, one rank's
    (``local_function``); for ``jax``, every device's at once, the ``shard_map`` the jax
    backend runs with the stand-ins in place of its collectives (global arguments in the
    plan's layouts)."""
    import jax

    if backend == "native":
        specs = [jax.ShapeDtypeStruct(*program.avals[r]) for r in program.inputs]
        return jax.export.export(jax.jit(local_function(program)))(*specs).serialize()
    from jax.sharding import NamedSharding

    from autopar.runtime.jax_backend import sharded_function

    f, jm, in_specs = sharded_function(program, _standin)
    specs = [
        jax.ShapeDtypeStruct(
            tuple(n * k for n, k in zip(program.avals[r][0], layout.splits(program.mesh))),
            program.avals[r][1],
            sharding=NamedSharding(jm, spec),
        )
        for r, layout, spec in zip(program.inputs, program.in_layouts, in_specs)
    ]
    return jax.export.export(f)(*specs).serialize()


def compute_seconds(
    programs, backend: str = "native", seconds: float = 1.0, timeout: float = 300.0
) -> list:
    """The seconds of the step of each of ``programs`` (see the module docstring), in one
    child process: every step warmed up twice, then timed in turns, round after round, for
    about ``seconds`` per step (``ROUNDS`` rounds at least; each round starts one step later),
    so the machine's drift (up to 1.3x within a minute here) reaches every step alike. A turn
    is an untimed call, then back-to-back calls for about ``TURN_SECONDS`` (at least one),
    their median: a step runs warm in a training loop, and called one by one in turn with
    another a small step ran cold (the calibration's reference step, 15.7 ms alone, 22.4 ms
    alternated call by call with a 125 ms GPT step). Each step's figure is the first's median
    times the median over rounds of its ratio to the first in the same round (ratios of turns
    a moment apart: on gpt-large's three candidate plans on the jax backend, five profiles of
    8-11 rounds put the third at 1.015-1.06 of the first this way and at 0.98-1.09 by plain
    medians; five of 3 rounds at 0.91-1.05 and 0.62-1.06).
    ``native``: one rank's step, the child pinned to one core with one single-threaded XLA
    device, as a native worker runs it; times the mesh's ranks per core of this process's
    where the mesh has more ranks than cores (its workers then take turns on them). ``jax``:
    every device's step at once in a child with this process's XLA flags (its fake CPU
    devices), as the jax backend runs it here. Steps whose exported programs are the same are
    timed once. Raises ConfigError when the child fails or runs past ``timeout`` per step."""
    blobs = [bytes(exported(p, backend)) for p in programs]
    distinct = list(dict.fromkeys(blobs))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    meshes = {
        b: None if backend == "native" else [list(p.mesh.shape), list(p.mesh.axis_names)]
        for b, p in zip(blobs, programs)
    }
    head = {
        "backend": backend,
        "sizes": [len(b) for b in distinct],
        "meshes": [meshes[b] for b in distinct],
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "autopar.tools.profile", str(seconds)],
            input=json.dumps(head).encode() + b"\n" + b"".join(distinct),
            capture_output=True,
            env=env,
            timeout=timeout * len(distinct),
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"profile_plans: {len(distinct)} step(s) did not finish in "
            f"{timeout:g} s each; turn profile_plans off for steps this long."
        ) from None
    if done.returncode != 0:
        raise ConfigError(
            "profile_plans: timing a plan's step failed:\n"
            + done.stderr.decode(errors="replace")[-2000:]
        )
    measured = json.loads(done.stdout.decode().strip().splitlines()[-1])["seconds"]
    cores = len(os.sched_getaffinity(0))
    share = lambda p: max(1.0, p.mesh.size / cores) if backend == "native" else 1.0
    return [measured[distinct.index(b)] * share(p) for b, p in zip(blobs, programs)]


def _child(seconds: float) -> dict:
    """In the child: read the job on stdin (``compute_seconds``: a JSON line naming the
    backend, the exported steps' sizes and, for the jax backend, each one's mesh, then the
    steps' bytes; no pickle), set up as that backend runs a step, time them in turn."""
    import time

    job = json.loads(sys.stdin.buffer.readline())
    blobs, data, at = [], sys.stdin.buffer.read(), 0
    for n in job["sizes"]:
        blobs.append(data[at : at + n])
        at += n
    if job["backend"] == "native":
        cores = sorted(os.sched_getaffinity(0))
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), {cores[0]})
        from autopar.runtime.worker import tune_malloc, xla_flags

        xla_flags(single_threaded=True)  # before JAX starts its backend, as a worker
        if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            tune_malloc()
    import jax

    steps = []
    for blob, mesh in zip(blobs, job["meshes"]):
        if mesh is not None:
            shape, names = mesh
            mesh = jax.sharding.Mesh(
                np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names
            )
        exp = jax.export.deserialize(bytearray(blob))
        where = exp.in_shardings_jax(mesh) if mesh is not None else [None] * len(exp.in_avals)
        steps.append(
            (
                jax.jit(exp.call),
                [jax.device_put(np.ones(a.shape, a.dtype), w) for a, w in zip(exp.in_avals, where)],
            )
        )

    def call(f, args) -> float:
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        return time.perf_counter() - t

    once = [min(call(*st) for _ in range(2)) for st in steps]  # warm-up
    times: list[list[float]] = [[] for _ in steps]  # per step, its turns' medians
    end = time.perf_counter() + seconds * len(steps)
    while len(times[0]) < ROUNDS or time.perf_counter() < end:
        k = len(times[0]) % len(steps)  # each round starts one step later
        for i in list(range(k, len(steps))) + list(range(k)):
            call(*steps[i])  # untimed: the caches after another step
            times[i].append(
                float(
                    np.median(
                        [call(*steps[i]) for _ in range(max(1, round(TURN_SECONDS / once[i])))]
                    )
                )
            )
    t = np.array(times)
    return {
        "seconds": [float(x) for x in np.median(t[0]) * np.median(t / t[0], axis=1)],
        "rounds": len(times[0]),
    }


if __name__ == "__main__":
    print(json.dumps(_child(float(sys.argv[1]))))
