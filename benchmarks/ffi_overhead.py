"""What one collective costs as an XLA custom call inside a rank's compiled step, and the 4 KB
all-reduce's latency, for the autopar this Python imports (so two builds compare in one run:
``PYTHONPATH=/path/to/other/checkout python benchmarks/ffi_overhead.py`` beside a plain run).

Run: python benchmarks/ffi_overhead.py [--calls 64] [--elements 1024] [--rounds 15]
Plans a 2-rank hybrid_parallel step that chains ``--calls`` + 1 all-reduces of ``--elements``
float32 (4 KB by default) over ``x`` and one with a single all-reduce (so both run on the
workers), runs both on the native backend's whole-step runtime (each rank's step one
executable, the all-reduces custom calls), and takes turns between them, ``--rounds`` rounds of
back-to-back calls (~0.2 s each). Prints one JSON object: which autopar, the median step of
each, ``per_call_us`` = (with - without) / calls (a custom call's whole cost, binding and the
exchange of its 4 KB, on the step's thread), and
``bench_4KB_us``: ``autopar bench --op all_reduce --ranks 2 --size 4KB`` (the binding's
all-reduce called from Python, recursive doubling).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("AUTOPAR_TOPOLOGY", "local")     # the plan does not depend on the cache

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.tools import bench  # noqa: E402


def chain(calls: int):
    def step(x):
        for _ in range(calls):
            x = ap.comm.all_reduce(x, "x") * 0.5
        return x * 0.5

    return step


def turn(c, x, seconds=0.2) -> float:
    """Median seconds of back-to-back calls for ``seconds`` (after one untimed call)."""
    jax.block_until_ready(c(x))
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        jax.block_until_ready(c(x))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--elements", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    cfg = ap.ParallelConfig(parallel_mode="hybrid_parallel", device_num=2, mesh_shape=(2,),
                            progress=False)
    x = np.ones(args.elements, np.float32)
    with ap.compile(chain(args.calls + 1), x, config=cfg, in_strategy=("[_]",)) as with_calls, \
            ap.compile(chain(1), x, config=cfg, in_strategy=("[_]",)) as without:
        # each all-reduce of the 2 ranks' equal copies doubles x and the 0.5 halves it back
        np.testing.assert_allclose(np.asarray(with_calls(x)), x * 0.5, rtol=1e-6)
        rounds = [(turn(with_calls, x), turn(without, x)) for _ in range(args.rounds)]
    t_with = statistics.median(a for a, _ in rounds)
    t_without = statistics.median(b for _, b in rounds)
    per_call = statistics.median((a - b) / args.calls for a, b in rounds)
    (row,) = bench.run(["all_reduce"], 2, [4096], algorithms=("recursive_doubling",))
    print(json.dumps({
        "autopar": os.path.dirname(os.path.dirname(ap.__file__)),
        "calls": args.calls, "bytes": 4 * args.elements,
        "step_with_us": round(t_with * 1e6, 1), "step_without_us": round(t_without * 1e6, 1),
        "per_call_us": round(per_call * 1e6, 2), "bench_4KB_us": row["latency_us"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
