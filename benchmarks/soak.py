"""A training loop of 300 calls on the native runtime, its memory measured as it runs: the
resident set (RSS) of the caller and of each worker after call 10 (warm) and after the last,
and what is left once the job is closed (its processes, /dev/shm entries). A leak shows as RSS
that keeps growing with the calls.

Run: python benchmarks/soak.py [--calls 300] [--devices 2] [--mode data_parallel]
Out: one JSON line: per process the RSS in MiB at call 10 and at the end, the growth per 100
calls, and the loss at the end against the plain jax.jit loop's.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ap_ = argparse.ArgumentParser()
ap_.add_argument("--calls", type=int, default=300)
ap_.add_argument("--devices", type=int, default=2)
ap_.add_argument("--mode", default="data_parallel")
opts = ap_.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={opts.devices}"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax                                   # noqa: E402
import jax.numpy as jnp                      # noqa: E402
import numpy as np                           # noqa: E402
import optax                                 # noqa: E402

import autopar as ap                         # noqa: E402


def rss_mib(pid) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


opt = optax.adam(1e-3)


def step(params, opt_state, batch):
    x, y = batch

    def loss(p):
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)
    value, g = jax.value_and_grad(loss)(params)
    updates, opt_state = opt.update(g, opt_state, params)
    return value, optax.apply_updates(params, updates), opt_state


r = np.random.default_rng(0)
params = {"w1": jnp.asarray(r.normal(0, .05, (256, 1024)), jnp.float32),
          "b1": jnp.zeros(1024, jnp.float32),
          "w2": jnp.asarray(r.normal(0, .05, (1024, 256)), jnp.float32)}
state = opt.init(params)
batches = [(jnp.asarray(r.normal(size=(64, 256)), jnp.float32),
            jnp.asarray(r.normal(size=(64, 256)), jnp.float32)) for _ in range(4)]

shm = set(os.listdir("/dev/shm"))
c = ap.compile(step, params, state, batches[0], config=ap.ParallelConfig(
    parallel_mode=opts.mode, device_num=opts.devices, progress=False))
ref = jax.jit(step)
p, s, rp, rs = params, state, params, state
pids = None
marks = {}
for k in range(1, opts.calls + 1):
    value, p, s = c(p, s, batches[k % 4])
    float(value)
    if pids is None:
        pids = {"caller": os.getpid(), **{f"rank{i}": q.pid
                                          for i, q in enumerate(c._runner.job.procs)}}
    if k in (10, opts.calls):
        marks[k] = {n: rss_mib(q) for n, q in pids.items()}
ref_value = None
for k in range(1, opts.calls + 1):
    ref_value, rp, rs = ref(rp, rs, batches[k % 4])
c.close()
left = [q for n, q in pids.items() if n != "caller" and os.path.exists(f"/proc/{q}")]
span = (opts.calls - 10) / 100
print(json.dumps({
    "calls": opts.calls, "devices": opts.devices, "mode": opts.mode,
    "rss_mib_at_10": {n: round(v, 1) for n, v in marks[10].items()},
    "rss_mib_at_end": {n: round(v, 1) for n, v in marks[opts.calls].items()},
    "growth_mib_per_100_calls": {n: round((marks[opts.calls][n] - marks[10][n]) / span, 2)
                                 for n in pids},
    "loss": float(value), "jit_loss": float(ref_value),
    "loss_rel_diff": abs(float(value) - float(ref_value)) / abs(float(ref_value)),
    "workers_left": left, "dev_shm_left": sorted(set(os.listdir("/dev/shm")) - shm)}))
