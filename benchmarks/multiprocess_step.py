"""A GPT training loop on 4 ranks: autopar's native runtime against JAX's own multi-process CPU
runtime (4 processes of one CPU device each, ``jax.distributed`` with gloo collectives), in
one run on this machine.

Run: python benchmarks/multiprocess_step.py [--config small medium]
     [--mode data_parallel auto_parallel] [--iters 100]

For each GPT configuration (step_time.py's) and parallel mode, autopar plans the step for 4
devices. Then a training loop (``loss, params = step(params, batch)``, the loss read every
step; median ms of ``--iters`` steps after ``WARM`` untimed ones, and on the native side
untimed steps for at least ``WARM_SECONDS``: the previous case's job, closed, readies warm
workers for the next (runtime/forkserver.py, ~0.4 s of CPU each), which shared the cores with
the first steps timed after it: the ranks-alike 0.4 ms step measured 0.63-0.92 ms right after
another case, 0.38-0.39 ms alone) runs
- on autopar's native runtime with its defaults (4 worker processes, each rank's step one
  executable, the parameters kept in the workers): ``native_loop_ms``;
- as JAX SPMD over 4 processes started by ``autopar launch --nprocs 4 --devices-per-process
  1`` (this file with ``--worker``): each process jits the step with the plan's argument
  layouts as NamedShardings over the 4 processes' devices (the new parameters in the same
  layouts), XLA's partitioner choosing the rest, the parameters left on the devices between
  steps and the batch placed from the host each step (``make_array_from_callback``), as the
  native loop takes it: ``jax_multiprocess_loop_ms``
  (process 0's median).
Out: one JSON object per (config, mode) with both and their ratio (above 1: autopar is
faster), and ``ranks_alike``: the plan exchanges nothing and replicates everything, so the
native backend runs one rank's step in the caller (no workers; the caller has one CPU device,
as each JAX process has). With 4 ranks on this machine's 2 cores both runtimes share the cores two ranks to one.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

RANKS = 4
WARM = 10           # untimed steps before the timed ones, on both runtimes
WARM_SECONDS = 2.0  # and on the native one untimed steps for at least this long


def build(name):
    """The step, host parameters and batch of step_time.py's configuration ``name``."""
    import jax
    import numpy as np
    import models as m
    from step_time import CONFIGS
    c = CONFIGS[name]
    p = jax.tree.map(np.asarray, m.gpt_params(vocab=c["vocab"], seq=c["seq"], d=c["d"],
                                              heads=c["heads"]))
    b = jax.tree.map(np.asarray, m.gpt_batch(batch=c["batch"], seq=c["seq"], vocab=c["vocab"]))

    def step(params, batch):                               # tests/models.py's gpt_sgd_step
        loss, grads = jax.value_and_grad(m.gpt_loss)(params, batch, c["heads"])
        return loss, m.sgd(params, grads)
    return step, p, b


def config(mode, backend):
    import autopar as ap
    return ap.ParallelConfig(parallel_mode=mode, device_num=RANKS, progress=False,
                             backend=backend, search_mode="recursive_programming"
                             if mode == "auto_parallel" else None)


def worker(name, mode, iters):
    """In each of the launched processes: JAX SPMD's loop over the 4 processes' devices."""
    import autopar as ap
    from step_time import median_ms   # first: it adds a device count, which init_distributed sets
    ap.init_distributed()
    import jax
    import numpy as np
    step, p, b = build(name)
    program = ap.compile(step, p, b, config=config(mode, "jax")).program
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(program.mesh.shape),
                             program.mesh.axis_names)
    flat, tree = jax.tree.flatten((p, b))
    shardings = [jax.sharding.NamedSharding(mesh, lay.to_partition_spec())
                 for lay in program.in_layouts]
    n_params = len(jax.tree.leaves(p))        # the new parameters keep their layouts
    out = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
           jax.tree.unflatten(jax.tree.structure(p), shardings[:n_params]))
    spmd = jax.jit(lambda *xs: step(*jax.tree.unflatten(tree, xs)), in_shardings=shardings,
                   out_shardings=out)
    def placed(xs, shs):     # each process's blocks of host arrays, as a JAX user places them
        return [jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx])
                for x, sh in zip(xs, shs)]
    state = [jax.tree.unflatten(jax.tree.structure(p), placed(flat[:n_params], shardings))]

    def call():             # the batch from the host each step, as the native loop's
        batch = placed(flat[n_params:], shardings[n_params:])
        loss, state[0] = spmd(*jax.tree.leaves(state[0]), *batch)
        float(np.asarray(loss.addressable_data(0)))
    ms = median_ms(call, iters, WARM)
    print("RESULT " + json.dumps({"process": jax.process_index(), "ms": ms}), flush=True)


def jax_multiprocess_ms(name, mode, iters) -> float:
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                              env.get("XLA_FLAGS", "")).strip()
    got = subprocess.run([sys.executable, "-m", "autopar.cli", "launch", "--nprocs", str(RANKS),
                          "--devices-per-process", "1", os.path.abspath(__file__), "--worker",
                          name, mode, str(iters)], env=env, capture_output=True, text=True,
                         timeout=1200)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in got.stdout.splitlines()
            if "RESULT " in line]
    if got.returncode != 0 or len(rows) != RANKS:
        raise RuntimeError(f"the JAX processes failed ({got.returncode}):\n"
                           f"{got.stdout[-2000:]}\n{got.stderr[-4000:]}")
    return next(r["ms"] for r in rows if r["process"] == 0)


def native_ms(name, mode, iters) -> float:
    import autopar as ap
    from step_time import median_ms
    step, p, b = build(name)
    compiled = ap.compile(step, p, b, config=config(mode, "native"))
    state = [p]

    def call():
        loss, state[0] = compiled(state[0], b)
        float(loss)
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < WARM_SECONDS:
            call()
        return median_ms(call, iters, WARM), compiled.program.ranks_alike()
    finally:
        compiled.close()


def main():
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--config", nargs="+", default=["small", "medium"])
    ap_.add_argument("--mode", nargs="+", default=["data_parallel", "auto_parallel"])
    ap_.add_argument("--iters", type=int, default=100)
    args = ap_.parse_args()
    import step_time  # noqa: F401 - on import it adds a device count to XLA_FLAGS; taken out:
    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                                     os.environ.get("XLA_FLAGS", "")).strip()
    # this process, autopar's caller, has one CPU device as each JAX process has (it runs
    # the step of a plan whose ranks compute alike; a native worker's step ran 1.2-1.4x
    # slower with four fake devices than with one)
    for name in args.config:
        for mode in args.mode:
            out = {"config": name, "mode": mode, "ranks": RANKS}
            ms, out["ranks_alike"] = native_ms(name, mode, args.iters)
            out["native_loop_ms"] = round(ms, 2)
            jax_ms = jax_multiprocess_ms(name, mode, args.iters)
            out["jax_multiprocess_loop_ms"] = round(jax_ms, 2)
            out["jax_over_native"] = round(jax_ms / out["native_loop_ms"], 2)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
