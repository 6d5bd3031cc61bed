"""End-to-end step time of a GPT block training step on 2 ranks: autopar's native runtime
against JAX's own SPMD execution of the same layouts, in one run on this machine.

Run: python benchmarks/step_time.py [--config small medium] [--mode data_parallel auto_parallel]
     [--iters 20] [--bucket-bytes 26214400]

For each GPT configuration and parallel mode, autopar plans the step for 2 devices; then the
same step is timed as
- autopar native, interpreted (``native_ms``): ``compiled(params, batch)`` on 2 worker
  processes with AUTOPAR_WHOLE_STEP=0 (a Python interpreter in each worker walks the program,
  collectives overlapped with compute), and again with AUTOPAR_OVERLAP=0 (each all-reduce
  bucket awaited as it is issued) to show what the overlap gains;
- autopar native, whole step (``native_whole_step_ms``, the runtime's default): each rank's
  step one compiled executable, its collectives XLA custom calls (runtime.native_step), with
  and without the overlap of full buckets inside it (``--bucket-bytes`` sets the bucket size,
  ``allreduce_fusion_bytes``: with the default 25 MiB the GPTs' gradients make one bucket,
  awaited at once); these per-call columns run with AUTOPAR_RESIDENT=0 (the same arguments
  sent every call);
- autopar jax: the same Program through shard_map on 2 CPU devices of this process;
- JAX SPMD: ``jax.jit(step, in_shardings=<the plan's argument layouts as NamedSharding>)`` on
  the same 2 CPU devices, XLA's own partitioner choosing everything else.
Every call goes from host numpy arrays to host numpy results (inputs placed, outputs fetched),
median of --iters calls after 2 warm-ups. Then as a training loop runs (``loss, params =
step(params, batch)``, the loss read each step): ``native_resident_loop_ms`` with the runtime's
defaults, whole step and results kept in the workers (runtime.resident: only the batch goes
in), against
``jax_spmd_loop_ms`` (the parameters stay on JAX's devices; the batch comes from the host each
step, as the native loop's does and a data loader's would). The whole step per call, JAX SPMD
per call and the two loops are timed together, their calls taking turns round after round (the
other columns one after another). Out: one JSON object per (config, mode) with milliseconds per
step (medians) and the ratios JAX SPMD / autopar native (above 1: autopar is faster):
``spmd_over_whole_step`` and ``spmd_loop_over_resident_loop`` are medians over rounds of the
ratio of the two calls in the same round, so the machine's drift between rounds cancels;
``ranks_alike``: the plan exchanges nothing and replicates everything, so every native column
ran one rank's step in the caller (no workers).
"""
import argparse
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar as ap  # noqa: E402
import models as m  # noqa: E402
from turns import timed  # noqa: E402

CONFIGS = {  # the compiler-core test block, and one where compute outweighs overheads
    "small": dict(vocab=64, seq=8, d=32, heads=4, batch=4),
    "medium": dict(vocab=512, seq=64, d=256, heads=8, batch=16),
}


def median_ms(call, iters, warm=2):
    """The median ms of ``iters`` calls after ``warm`` untimed ones."""
    for _ in range(warm):
        call()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def loop(step, params, batch):
    """A training loop's step: its parameters come from the step before."""
    state = [params]

    def call():
        loss, state[0] = step(state[0], batch)
        float(loss)
    return call


def host(tree):
    return jax.tree.map(np.asarray, jax.block_until_ready(tree))


def measure(name, mode, iters, bucket_bytes=25 << 20):
    c = CONFIGS[name]
    p = jax.tree.map(np.asarray, m.gpt_params(vocab=c["vocab"], seq=c["seq"], d=c["d"], heads=c["heads"]))
    b = jax.tree.map(np.asarray, m.gpt_batch(batch=c["batch"], seq=c["seq"], vocab=c["vocab"]))

    def step(params, batch):                               # tests/models.py's gpt_sgd_step
        loss, grads = jax.value_and_grad(m.gpt_loss)(params, batch, c["heads"])
        return loss, m.sgd(params, grads)

    out = {"config": name, "mode": mode, **c}
    out["bucket_bytes"] = bucket_bytes
    cfg = dict(parallel_mode=mode, device_num=2, progress=False,
               allreduce_fusion_bytes=bucket_bytes)
    for label, backend, overlap, whole in (
            ("native_ms", "native", "1", "0"), ("native_no_overlap_ms", "native", "0", "0"),
            ("native_whole_step_no_overlap_ms", "native", "0", "1"),
            ("autopar_jax_ms", "jax", "1", "0")):
        os.environ["AUTOPAR_OVERLAP"] = overlap   # RuntimeOptions.from_env, as the runner starts
        os.environ["AUTOPAR_WHOLE_STEP"] = whole
        os.environ["AUTOPAR_RESIDENT"] = "0"
        compiled = ap.compile(step, p, b, config=ap.ParallelConfig(backend=backend, **cfg))
        out[label] = median_ms(lambda: host(compiled(p, b)), iters)
        compiled.close()
    # the runtime's defaults, per call (the same arguments sent every call) and in a loop,
    # each alternated with JAX SPMD's below
    os.environ.update(AUTOPAR_OVERLAP="1", AUTOPAR_WHOLE_STEP="1", AUTOPAR_RESIDENT="0")
    per_call = ap.compile(step, p, b, config=ap.ParallelConfig(backend="native", **cfg))
    host(per_call(p, b))                          # its workers start with these options
    os.environ["AUTOPAR_RESIDENT"] = "1"
    compiled = ap.compile(step, p, b, config=ap.ParallelConfig(backend="native", **cfg))
    host(compiled(p, b))
    for k in ("AUTOPAR_OVERLAP", "AUTOPAR_WHOLE_STEP", "AUTOPAR_RESIDENT"):
        os.environ.pop(k)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(compiled.program.mesh.shape),
                             compiled.program.mesh.axis_names)
    flat, tree = jax.tree.flatten((p, b))
    shardings = [jax.sharding.NamedSharding(mesh, lay.to_partition_spec())
                 for lay in compiled.program.in_layouts]
    n_params = len(jax.tree.leaves(p))        # the new parameters keep their layouts (a loop
    kept = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),  # feeds them back)
            jax.tree.unflatten(jax.tree.structure(p), shardings[:n_params]))
    spmd = jax.jit(lambda *xs: step(*jax.tree.unflatten(tree, xs)), in_shardings=shardings,
                   out_shardings=kept)
    placed = jax.tree.unflatten(jax.tree.structure(p), [
        jax.device_put(x, sh) for x, sh in zip(flat[:n_params], shardings)])
    t = timed({"whole": lambda: host(per_call(p, b)), "spmd": lambda: host(spmd(*flat)),
               "loop": loop(compiled, p, b),
               "spmd_loop": loop(lambda *a: spmd(*jax.tree.leaves(a)), placed, b)}, iters)
    per_call.close(), compiled.close()
    for label, name in (("native_whole_step_ms", "whole"), ("jax_spmd_ms", "spmd"),
                        ("native_resident_loop_ms", "loop"), ("jax_spmd_loop_ms", "spmd_loop")):
        out[label] = float(np.median(t[name])) * 1e3
    out["spmd_over_native"] = round(out["jax_spmd_ms"] / out["native_ms"], 2)
    # the headline ratios: the median over rounds of SPMD's call over native's in that round
    out["spmd_over_whole_step"] = round(float(np.median(t["spmd"] / t["whole"])), 2)
    out["spmd_loop_over_resident_loop"] = round(float(np.median(t["spmd_loop"] / t["loop"])), 2)
    out["overlap_gain"] = round(out["native_no_overlap_ms"] / out["native_ms"], 2)
    out["whole_step_overlap_gain"] = round(out["native_whole_step_no_overlap_ms"] /
                                           out["native_whole_step_ms"], 2)
    out["collectives"] = len(compiled.collectives())
    out["ranks_alike"] = compiled.program.ranks_alike()   # native: one rank's step, in the caller
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", default=["small", "medium"], choices=sorted(CONFIGS))
    p.add_argument("--mode", nargs="+", default=["data_parallel", "auto_parallel"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--bucket-bytes", type=int, default=25 << 20,
                   help="all-reduce bucket size (allreduce_fusion_bytes), default 25 MiB")
    args = p.parse_args()
    for name in args.config:
        for mode in args.mode:
            print(json.dumps(measure(name, mode, args.iters, args.bucket_bytes)), flush=True)


if __name__ == "__main__":
    main()
