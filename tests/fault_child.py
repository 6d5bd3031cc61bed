"""A user's process under a resource limit, for tests/test_native_limits.py: compiles a 2-device
data_parallel step on the native runtime and calls it 3 times, then prints one line, ``OK
<loss>`` or ``ERR <module> <type> <message>``, and the job's worker pids as ``PIDS ...``.

``python fault_child.py nofile N``: the open-files limit set to N first (the workers inherit
it). ``python fault_child.py oom``: after the first call each worker's address space is capped
(``RLIMIT_AS``) just above what it holds, so the next call's large intermediate cannot be
allocated there. ``python fault_child.py plain``: no limit.
"""
import os
import resource
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
kind = sys.argv[1]
if kind == "nofile":
    n = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

import jax                                   # noqa: E402 - after the limit and the flags
import jax.numpy as jnp                      # noqa: E402
import numpy as np                           # noqa: E402

import autopar as ap                         # noqa: E402

ROWS = 2048 if kind == "oom" else 64         # oom: a (2048, 2048) x (2048, 2048) product


def step(w, x):
    def loss(w):
        h = jnp.tanh(x @ w)
        return jnp.mean(jnp.tanh(h @ w.T) ** 2)
    value, g = jax.value_and_grad(loss)(w)
    return value, w - 0.1 * g


def vm_bytes(pid) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(pid)


w = np.full((ROWS, ROWS), 1.0 / ROWS, np.float32)
x = np.ones((ROWS if kind == "oom" else 8, ROWS), np.float32)
pids = []
try:
    c = ap.compile(step, w, x, config=ap.ParallelConfig(parallel_mode="data_parallel",
                                                        device_num=2, progress=False))
    value, w2 = c(w, x)
    pids = [p.pid for p in c._runner.job.procs]
    if kind == "oom":
        for pid in pids:
            cap = vm_bytes(pid) + (16 << 20)
            resource.prlimit(pid, resource.RLIMIT_AS, (cap, cap))
    for _ in range(2):
        value, w2 = c(w2, x)
    print("OK", float(value))
    c.close()
except BaseException as e:                   # noqa: BLE001 - printed for the test to judge
    print("ERR", type(e).__module__, type(e).__name__, " ".join(str(e).split())[:2000])
print("PIDS", *pids, flush=True)
