"""The same plans on autopar's three backends, in one run: ``native`` (worker processes, C++
collectives), ``jax`` (autopar's Program as one shard_map) and ``xla`` (jax.jit with the plan's
shardings and constraints: XLA's SPMD partitioner inserts the collectives).

Run: python benchmarks/backends.py [--iters 10] [--devices 2 8]

For each model (an MLP in Megatron-LM's column/row split, the test GPT in data parallelism and
as auto_parallel plans it, each an SGD step) and device count, the plan is made once (the
native backend's, priced for this machine) and compiled on each backend from that Strategy;
with 2 devices all three run, with 8 the two in-process ones (8 fake CPU devices; 8 native
ranks would share this machine's 2 cores). A call goes from host numpy arrays to results
(``jax.Array``s, or the native runtime's numpy), the calls taking turns round after round
(benchmarks/turns.py). Out: one JSON line per (model, devices) with milliseconds per step
(medians of rounds), the ratios ``xla_over_jax`` and ``native_over_jax`` (below 1: faster than
the shard_map Program), and the collectives XLA inserted against the plan's
(``runtime.xla_backend.differences``).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import jax                        # noqa: E402
import numpy as np                # noqa: E402
from jax.sharding import PartitionSpec as P    # noqa: E402

import autopar as ap              # noqa: E402
import models                     # noqa: E402
from autopar.runtime.xla_backend import differences   # noqa: E402
from turns import timed           # noqa: E402

MEGATRON = ({"w1": P(None, "y"), "b1": P("y"), "w2": P("y", None), "b2": P()}, P("x"))


def cases():
    mlp = (models.mlp_params(sizes=(256, 1024, 256)), models.mlp_batch(64, (256, 1024, 256)))
    gpt = (models.gpt_params(vocab=256, seq=32, d=128, heads=4, layers=2),
           models.gpt_batch(batch=16, seq=32, vocab=256))
    return {"mlp megatron": (models.mlp_sgd_step, mlp, "semi_auto_parallel", MEGATRON),
            "gpt data_parallel": (models.gpt_sgd_step, gpt, "data_parallel", None),
            "gpt auto_parallel": (models.gpt_sgd_step, gpt, "auto_parallel", None)}


def config(mode, n, backend):
    shape = (2, n // 2) if n > 2 else (1, 2)
    return ap.ParallelConfig(parallel_mode=mode, mesh_shape=shape, mesh_axis_names=("x", "y"),
                             backend=backend, progress=False)


def run(name, step, args, mode, ins, n, iters):
    base = ap.compile(step, *args, config=config(mode, n, "jax"), in_strategy=ins)
    backends = ("native", "jax", "xla") if n == 2 else ("jax", "xla")
    compiled = {b: base if b == "jax" else ap.compile(step, *args, config=config(mode, n, b),
                                                      in_strategy=ins, strategy=base.strategy)
                for b in backends}
    want = step(*args)
    for b, c in compiled.items():                  # the same numbers on every backend
        jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5),
                     c(*args), want)
    calls = {b: (lambda c=c: jax.block_until_ready(c(*args))) for b, c in compiled.items()}
    ms = {b: float(np.median(t)) * 1e3 for b, t in timed(calls, iters).items()}
    out = {"model": name, "mode": mode, "devices": n, **{f"{b}_ms": round(v, 3)
                                                         for b, v in ms.items()},
           "xla_over_jax": round(ms["xla"] / ms["jax"], 3),
           "plan_collectives": len(base.strategy.collectives),
           "xla_vs_plan": differences(base.strategy.collectives,
                                      compiled["xla"].xla_collectives())}
    if "native" in ms:
        out["native_over_jax"] = round(ms["native"] / ms["jax"], 3)
    for c in compiled.values():
        c.close()
    return out


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--iters", type=int, default=10)
    a.add_argument("--devices", type=int, nargs="+", default=[2, 8])
    args = a.parse_args()
    for n in args.devices:
        for name, (step, xs, mode, ins) in cases().items():
            print(json.dumps(run(name, step, xs, mode, ins, n, args.iters)), flush=True)


if __name__ == "__main__":
    main()
