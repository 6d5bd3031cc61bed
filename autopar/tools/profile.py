"""One rank's compute in a lowered Program, measured on this machine (``profile_plans``).

In: a ``Program`` (per-rank instructions; ``avals`` gives every register's local shape and
dtype). Out: ``compute_seconds(program)``, the median seconds of one rank's step run alone on
one core, every collective replaced by a local stand-in of the same shapes (table below): what
the rank computes, as XLA compiles it, without communicating or waiting.

Why: the cost model prices each operator by its flops or bytes at rates fitted on a reference
step, but XLA's CPU code does not cost the same per flop in every program: a dot whose operands
it reads transposed runs on another kernel at a third of the rate, a transposing fusion costs
many times its bytes (BENCHMARKS.md, issue 19: Megatron's GPT plan computed 1.6x data
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

Arguments are ones (valid indices for a gather, no denormals). The collectives' own time is the
cost model's (``Strategy.comm_time``), not measured here.
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


_STANDIN = checked_table({
    StepKind.ALL_REDUCE: lambda x, s, n: x,
    StepKind.ALL_GATHER: lambda x, s, n: _copies(x, s.dim, n),
    StepKind.REDUCE_SCATTER: lambda x, s, n: _first(x, s.dim, n),
    StepKind.ALL_TO_ALL: lambda x, s, n: _copies(_first(x, s.dst_dim, n), s.dim, n),
    StepKind.SLICE: lambda x, s, n: _first(x, s.dim, n),
    StepKind.PARTIAL_ZERO: lambda x, s, n: x,
}, StepKind, "profile stand-ins")


def local_function(program):
    """One rank's step with every collective and slice replaced by its stand-in: local
    argument blocks -> local results."""
    from autopar.runtime.jax_backend import program_function
    return program_function(program, lambda x, ins, mesh: _STANDIN[ins.kind](
        x, ins, math.prod(mesh.axis_size(a) for a in ins.axes)))


def exported(program) -> bytes:
    """``local_function(program)`` as serialized ``jax.export`` bytes (StableHLO)."""
    import jax
    specs = [jax.ShapeDtypeStruct(*program.avals[r]) for r in program.inputs]
    return jax.export.export(jax.jit(local_function(program)))(*specs).serialize()


def compute_seconds(program, seconds: float = 1.0, timeout: float = 300.0) -> float:
    """The median seconds of one rank's step of ``program`` (see the module docstring), timed
    for about ``seconds`` after two warm-up calls (3 calls at least), in a child process
    pinned to one core. Raises ConfigError when the child fails or runs past ``timeout``."""
    blob = exported(program)
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f) \
        + " --xla_cpu_multi_thread_eigen=false"
    env["JAX_PLATFORMS"] = "cpu"
    try:
        done = subprocess.run([sys.executable, "-m", "autopar.tools.profile", str(seconds)],
                              input=blob, capture_output=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"profile_plans: one rank's step did not finish {timeout:g} s; turn "
                          "profile_plans off for a step this long.") from None
    if done.returncode != 0:
        raise ConfigError("profile_plans: timing one rank's step failed:\n"
                          + done.stderr.decode(errors="replace")[-2000:])
    return float(json.loads(done.stdout.decode().strip().splitlines()[-1])["median"])


def _child(seconds: float) -> dict:
    """In the child: read the exported step on stdin, pin to one core, time it."""
    import time
    cores = sorted(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cores[0]})
    from autopar.runtime.worker import tune_malloc
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        tune_malloc()
    import jax
    exp = jax.export.deserialize(bytearray(sys.stdin.buffer.read()))
    args = [jax.device_put(np.ones(a.shape, a.dtype)) for a in exp.in_avals]
    f = jax.jit(exp.call)
    for _ in range(2):
        jax.block_until_ready(f(*args))
    times = []
    end = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < end:
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return {"median": float(np.median(times)), "calls": len(times)}


if __name__ == "__main__":
    print(json.dumps(_child(float(sys.argv[1]))))
