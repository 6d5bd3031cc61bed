"""Where a plan's step spends its time: XLA's own per-operation timings of each plan of a
plan_truth model, beside the plan's estimate.

Run: python benchmarks/plan_profile.py [--model gpt-small] [--devices 2]
     [--plans data_parallel semi_auto_parallel] [--steps 5] [--top 12]

Each plan (data_parallel, semi_auto_parallel with Megatron's splits, auto_parallel, as
``plan_truth.py`` builds them) is compiled on the jax backend (every device a thread of this
process, so one trace holds them all) and priced on this machine's calibrated topology; after 3
warm-up calls, ``--steps`` calls run under ``jax.profiler.trace`` with a Perfetto trace, which
is read back here. Out: per plan, the estimate (compute, communication, per call) and the
measured median, then the ``--top`` XLA operations (fusions, collectives, and ``Rendezvous``:
a device waiting for the others at a collective) by milliseconds per step summed over the
devices, with how many ran per step. XLA names its fusions by what they do first
(``copy_bitcast_fusion``: a copy into another layout, a transpose).
"""
import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plan_truth as pt  # noqa: E402  (sets the fake device count before jax is imported)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar as ap  # noqa: E402


def profile(call, steps: int) -> collections.Counter:
    """{operation name: (microseconds per step, calls per step)} of ``steps`` calls."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                call()
        path, = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(("$", "ThunkExecutor", "Pjit")):
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    return {k: (v / steps, count[k] / steps) for k, v in total.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small", choices=list(pt.MODELS))
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--plans", nargs="+", default=list(pt.PLANS[:2]), choices=list(pt.PLANS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    step, params, batch, megatron = pt.model(args.model)
    for mode in args.plans:
        cfg = ap.ParallelConfig(parallel_mode=mode, device_num=args.devices, backend="jax",
                                progress=False)
        kw = ({"in_strategy": megatron(cfg.logical_mesh().axis_names[-1])}
              if mode == "semi_auto_parallel" else {})
        with ap.compile(step, params, batch, config=cfg, **kw) as c:
            call = lambda: jax.tree.map(np.asarray, jax.block_until_ready(c(params, batch)))
            for _ in range(3):
                call()
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            ops = profile(call, args.steps)
            s = c.strategy
            print(f"{args.model} {mode} on {args.devices} devices: estimated "
                  f"{s.step_time * 1e3:.2f} ms (compute {s.compute_time * 1e3:.2f}, communication "
                  f"{s.comm_time * 1e3:.2f}, per call {s.overhead_time * 1e3:.2f}), measured "
                  f"{np.median(times) * 1e3:.2f} ms, {len(c.collectives())} collectives")
            for name, (us, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:args.top]:
                print(f"  {us / 1e3:8.2f} ms  x{n:5.1f}  {name}")


if __name__ == "__main__":
    main()
