"""Measure this machine's constants into a ``Topology``: what ``autopar calibrate`` runs.

In: the number of ranks to measure the links with (worker processes of the native runtime) and
the message sizes. Out: a one-level ``Topology`` ("host") with
- ``flops``: float32 FLOP/s of one jitted JAX matmul (1024 x 1024) on the CPU, best of 5;
- ``mem_bandwidth``: bytes/s of a 64 MB array copy (read plus write), best of 5;
- ``alpha``/``beta``: the line through the native ring all-gather's time at the smallest and
  the largest size (``tools.bench``'s conventions), read through its model ``(n-1) alpha + (n-1)/n
  bytes beta`` (strategies/comm_cost.py; the all-gather adds no reduction term).
Also the measurements themselves, for the caller to print.
"""
from __future__ import annotations

import time

import numpy as np

from autopar.topology import Level, Topology

SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def _best(fn, reps=5) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def compute_rates() -> tuple[float, float]:
    """(FLOP/s, memory bytes/s) of this process."""
    import jax
    import jax.numpy as jnp
    n = 1024
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    flops = 2 * n ** 3 / _best(lambda: mm(a).block_until_ready())
    src = np.ones(16 << 20, np.float32)
    dst = np.empty_like(src)
    bandwidth = 2 * src.nbytes / _best(lambda: np.copyto(dst, src))
    return flops, bandwidth


def link_constants(ranks: int = 2, sizes=SIZES) -> tuple[float, float, list]:
    """(alpha seconds, beta seconds per byte, bench rows) of the native ring all-gather."""
    from . import bench
    rows = bench.run(("all_gather",), ranks, list(sizes))
    x = np.array([r["bytes"] for r in rows], float) * (ranks - 1) / ranks
    y = np.array([r["latency_us"] for r in rows]) * 1e-6
    slope = (y[-1] - y[0]) / (x[-1] - x[0])         # the line through the smallest and the
    intercept = y[0] - slope * x[0]                  # largest size: a least-squares line would
    return max(intercept / (ranks - 1), 0.0), max(slope, 1e-15), rows   # fit the large ones only


def calibrate(ranks: int = 2, sizes=SIZES) -> tuple[Topology, dict]:
    if ranks < 2:
        raise ValueError("calibrate needs at least 2 ranks to measure the links.")
    flops, bandwidth = compute_rates()
    alpha, beta, rows = link_constants(ranks, sizes)
    topo = Topology((Level("host", ranks, alpha=float(alpha), beta=float(beta)),),
                    flops=float(flops), mem_bandwidth=float(bandwidth))
    return topo, {"flops": flops, "mem_bandwidth": bandwidth, "alpha": alpha, "beta": beta,
                  "all_gather": rows}
