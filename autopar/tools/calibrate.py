"""Measure this machine, as one backend runs steps on it, into a ``Topology``; keep it per machine.

In: a backend (``"native"``: one worker process per device; ``"jax"``: shard_map over this
process's JAX devices), a device count and ``autopar.compile`` (the caller's: the steps timed
are compiled steps, and this module imports nothing of the compiler). Out:
- ``calibrate(backend, n)``: ``(Topology, measurements)``, checked against what a CPU host
  can measure and against a repeat (``implausible``; refused rather than saved when the repeat
  does not confirm it). Every constant comes from timing small
  compiled steps on that backend with all ``n`` devices busy at once (hybrid_parallel programs,
  the median of back-to-back calls for at least ``TURN_SECONDS``; each also all-reduces one
  number, so that the native runtime runs it on its workers as it runs a plan's step, not in
  the caller), so contention for this machine's cores is in the figures:
  ``step_overhead`` (a call of a step that adds 1 to 8 numbers), ``host_beta`` (the same step on
  a 4 MB argument: per byte sent to the devices and fetched back), ``arg_overhead`` (the same
  step on 16 arguments of 64 KB, 16 results, against one of 1 MB: per array in or out; a GPT's
  step passes dozens of parameters each way, and arrays of 64 KB or more are the ones each
  handled on their own, ``runtime.packing``), ``flops`` and ``small_dot_flops``
  (chained 1024x1024 @ 1024x1024 and 256x512 @ 512x512 matmuls: Topology.matmul_rate
  interpolates between the two), ``mem_bandwidth`` (one elementwise operator on 4 MB jitted in
  this process, read plus write, best of 10, times the share of this machine's cores a device
  gets: XLA fuses chains of such operators inside a step, so a chain measures fusion, not
  bandwidth), and the one level's ``launch`` (what an all-reduce of 1 KB costs beyond the cost
  model's alpha: the call, the segment it splits, the wait for the peers; timed between
  matmuls of ~1 ms, a chain with the all-reduces alternated with the same chain without, as a
  step's collectives sit between operators whose time varies from rank to rank, where each
  waits for the slowest: back to back with nothing between, a whole-step executable's 1 KB
  all-reduce costs less than the step's noise) and ``beta`` (fitted so the cost model's
  all-reduce of 4 MB costs what it measured over one of 1 KB; each timed as a chain of them
  alternated call by call with the same chain without), and the level's ``betas``, one
  per other collective kind (all-gather, reduce-scatter, all-to-all of 4 MB, each timed in a
  chain alternated with the same chain doing local work of the same shapes instead: the
  runtimes move those kinds' bytes at other rates, XLA's CPU all-to-all at a quarter to a
  third of its all-reduce's here). Last, a whole training
  step (``reference_step``: a small language model no benchmark times) planned data parallel on
  those constants and run: the compute rates are divided by how much slower its operators ran
  than priced (``_fit``; ``compute_slowdown`` in the measurements); and that step's compute as
  it ran (``Topology.reference_compute``: its measured call less its priced communication and
  overhead; later profiles, one rank alone on a core, time it beside their plans and scale
  them to it: to the machine's speed at calibration, and to a step's with every device busy).
- ``machine_topology(backend, n, measure)``: the topology a plan without one uses: the
  ``AUTOPAR_TOPOLOGY`` preset or file if that is set (tests set ``local``), else this machine's
  calibration for (backend, n) from the cache (``$AUTOPAR_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``), measured and saved there first if
  ``measure`` (``compile``, which runs on these devices); else ``Topology.local(n)``. More
  devices than this machine has cores are measured on as many devices as cores and
  ``stretch``ed: each device's compute divided among them, the per-call overhead multiplied.
- ``cache_path(backend, n)``: where that calibration lives (one file per host name, backend
  and device count); ``autopar calibrate`` refreshes it.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from autopar.errors import ConfigError
from autopar.topology import KINDS, Level, Topology

SMALL, BIG = 8, 1 << 20  # elements (float32) of the small and the 4 MB arrays
CHAIN = 8  # operators chained in a timed step
ARGS, ARG_ELEMENTS = 16, 16384  # arg_overhead: 16 arguments of 64 KB against one of 1 MB
WAIT_CHAIN, WAIT_ROWS = 16, 64  # the all-reduces amid compute: 16 x (64x512 @ 512x512, ~1 ms)
MATMULS = ((256, 512), (1024, 1024))  # the matmul chains: CHAIN x (rows x dim @ dim x dim),
# topology.SMALL_DOT and LARGE_DOT FLOPs each


def cache_dir() -> Path:
    root = os.environ.get("AUTOPAR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "autopar",
    )
    return Path(root)


def cache_path(backend: str, n: int) -> Path:
    return cache_dir() / f"topology-{socket.gethostname()}-{backend}-{n}.json"


def machine_topology(backend: str, n: int, measure: bool, compile_fn=None) -> Topology:
    backend = "jax" if backend == "xla" else backend  # the same devices and collectives
    preset = os.environ.get("AUTOPAR_TOPOLOGY")
    if preset:
        return Topology.preset(preset, n)
    if n < 2:
        return Topology.local(n)
    m = min(n, max(2, os.cpu_count() or 1))  # more devices than cores: measured at m
    path = cache_path(backend, m)
    topo = None
    if path.is_file():
        try:
            topo = Topology.load(path)
        except (ConfigError, ValueError, OSError):
            topo = None  # damaged: measure again below
    if topo is None:
        if not measure:
            return Topology.local(n)
        if compile_fn is None:
            raise TypeError("machine_topology(measure=True) times compiled steps: pass compile_fn")
        print(
            f"autopar: measuring this machine for the {backend} backend on {m} devices, once "
            f"(cached in {path}; `autopar calibrate --backend {backend} --devices {m}` "
            "measures it again) ...",
            file=sys.stderr,
            flush=True,
        )
        try:
            topo, _ = calibrate(backend, m, compile_fn)
        except ConfigError as e:  # nothing saved: priced on the preset
            print(
                f"autopar: {e} Planning on the local preset meanwhile.", file=sys.stderr, flush=True
            )
            return Topology.local(n)
        save(topo, path)
    return stretch(topo, n)


def stretch(topo: Topology, n: int) -> Topology:
    """``topo`` (one level, measured on m devices) for ``n`` devices of the same machine: with
    n > m each device gets m/n of the compute the m had, and a call serves n/m as many."""
    m = topo.num_devices
    if n == m:
        return topo
    f = m / n
    return replace(
        topo,
        levels=(replace(topo.levels[-1], size=n),),
        flops=topo.flops * f,
        mem_bandwidth=topo.mem_bandwidth * f,
        step_overhead=topo.step_overhead / f,
        small_dot_flops=topo.small_dot_flops * f,
        reference_compute=0.0,
        arg_overhead=topo.arg_overhead / f,
    )


def save(topo: Topology, path) -> None:
    """``topo`` written to ``path`` (a str or Path; its folder made if needed), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    topo.save(tmp)
    os.replace(tmp, path)  # concurrent first calls never see half a file


TURN_SECONDS = 0.2  # a timed step runs back to back for at least this long (``_median_call``)


def _median_call(compiled, args, reps: int) -> float:
    """The median seconds of back-to-back calls after an untimed one: at least ``reps`` of
    them and at least ``TURN_SECONDS`` of calls, as a training loop calls its step (a handful
    of calls could land on one of this machine's slow moments: a 4 MB all-reduce timed at
    4.2 ms, its usual 0.5-1, set a calibration's link at 0.75 GB/s and its compute 1.5x slow)."""
    import jax

    jax.block_until_ready(compiled(*args))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < TURN_SECONDS:
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _exchanging(step):
    """``step`` returning also an all-reduce of one number of its first argument: on the native
    backend a step whose ranks exchange nothing runs in the caller (``Program.ranks_alike``),
    on all of its cores, not on the one-core workers that run a plan's step after a round trip
    from the caller; so every timed step exchanges this much, and differences cancel it."""
    from autopar import comm

    def exchanging(*args):
        return step(*args), comm.all_reduce(args[0].ravel()[:1], "x")

    return exchanging


def _replicated(compile_fn, step, args, backend, n):
    """``step`` (``_exchanging``) compiled as hybrid_parallel on ``n`` devices of ``backend``,
    its arguments replicated: the Compiled (a context manager that stops its workers)."""
    from autopar.config import ParallelConfig, ParallelMode

    cfg = ParallelConfig(
        parallel_mode=ParallelMode.HYBRID_PARALLEL,
        device_num=n,
        backend=backend,
        progress=False,
        topology=Topology.local(n),
    )
    layouts = tuple("[" + ",".join("_" * np.ndim(a)) + "]" for a in args)
    return compile_fn(_exchanging(step), *args, config=cfg, in_strategy=layouts)


def _time_step(compile_fn, step, args, backend, n, reps=7) -> float:
    """Median seconds of a call of ``step`` compiled as ``_replicated`` (as plans are timed:
    the machine's load is part of what a step costs here)."""
    with _replicated(compile_fn, step, args, backend, n) as c:
        return _median_call(c, args, reps)


def _paired_difference(compile_fn, step_a, step_b, args, backend, n, pairs=20) -> float:
    """Median over ``pairs`` back-to-back calls of ``step_a`` then ``step_b`` (both compiled as
    ``_replicated``) of the seconds ``a`` took over ``b``: alternating the two, drift in the
    machine's load falls on both alike."""
    import jax

    with (
        _replicated(compile_fn, step_a, args, backend, n) as a,
        _replicated(compile_fn, step_b, args, backend, n) as b,
    ):

        def call(c):
            t = time.perf_counter()
            jax.block_until_ready(c(*args))
            return time.perf_counter() - t

        for _ in range(2):
            call(a), call(b)
        return float(np.median([call(a) - call(b) for _ in range(pairs)]))


def _elementwise_bandwidth(x) -> float:
    import jax

    scale = jax.jit(lambda v: v * 1.0001)
    x = jax.device_put(x, jax.devices()[0])
    scale(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        scale(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * x.nbytes / best


def _steps():
    import jax.numpy as jnp
    from jax import lax

    from autopar import comm

    def add_one(x):
        return x + 1.0

    def matmuls(x, w):
        for _ in range(CHAIN):
            x = x @ w
        return x

    def all_reduces(x):
        for _ in range(CHAIN):
            x = comm.all_reduce(lax.optimization_barrier(x * 0.5), "x")
        return x

    def no_reduces(x):
        for _ in range(CHAIN):
            x = lax.optimization_barrier(x * 0.5)
        return x

    def kind_chain(kind, on, ranks):
        """CHAIN x (scale, then one ``kind`` over ``ranks`` devices of the 1-D argument, or a
        local stand-in of the same shapes): the difference of ``on`` and not is CHAIN
        collectives of that kind."""

        def step(x):
            n = x.shape[0]
            for _ in range(CHAIN):
                x = lax.optimization_barrier(x * 0.5)
                if kind == "all_gather":
                    y = comm.all_gather(x, "x") if on else jnp.tile(x, ranks)
                    x = lax.optimization_barrier(y)[:n]
                elif kind == "reduce_scatter":
                    y = comm.reduce_scatter(x, "x") if on else x[: n // ranks]
                    x = jnp.tile(lax.optimization_barrier(y), ranks)
                else:
                    x = comm.all_to_all(x, "x", 0, 0) if on else x[::-1]
            return comm.all_reduce(x[:1], "x")  # a result the same on every device

        return step

    def amid_compute(reduce):
        def step(x, w, s):  # WAIT_CHAIN x (a matmul, then a 1 KB all-reduce or not)
            for _ in range(WAIT_CHAIN):
                x = jnp.tanh(x @ w)
                s = lax.optimization_barrier(s + x[0, :256])
                s = comm.all_reduce(s, "x") if reduce else s
            return x, s

        return step

    return add_one, matmuls, all_reduces, no_reduces, kind_chain, amid_compute


# what a CPU host can measure, per figure of the report: (lowest, highest); outside it (or not
# a finite number) a figure is a measurement gone wrong (a burst of load, a clock skip)
BOUNDS = {
    "step_overhead_us": (1.0, 1e6),
    "arg_overhead_us": (0.0, 1e5),
    "host_GBps": (0.05, 1e3),
    "matmul_GFLOPs": (0.5, 1e5),
    "small_matmul_GFLOPs": (0.05, 1e5),
    "elementwise_GBps": (0.1, 5e3),
    "all_reduce_1KB_us": (0.1, 1e6),
    "all_reduce_4MB_us": (1.0, 1e7),
    "all_reduce_1KB_amid_compute_us": (0.0, 1e6),
    "launch_us": (0.0, 1e6),
    "link_GBps": (0.01, 5e3),
    "compute_slowdown": (0.2, 5.0),
}
REPEAT_RATIO = 2.0  # a repeat measurement this far from the first is the machine changing


def implausible(report: dict) -> list:
    """The figures of a calibration ``report`` that no CPU host gives (``BOUNDS``), and a 4 MB
    all-reduce faster than a 1 KB one, each as "name=value (why)"."""
    bad = []
    for name, (low, high) in BOUNDS.items():
        v = report.get(name)
        if v is None:
            continue
        if not math.isfinite(v) or not low <= v <= high:
            bad.append(f"{name}={v:g} (outside {low:g}..{high:g})")
    if report.get("all_reduce_4MB_us", 1.0) < report.get("all_reduce_1KB_us", 0.0):
        bad.append(
            f"all_reduce_4MB_us={report['all_reduce_4MB_us']:g} below "
            f"all_reduce_1KB_us={report['all_reduce_1KB_us']:g}"
        )
    return bad


def calibrate(backend: str, n: int, compile_fn) -> tuple[Topology, dict]:
    """``measure`` checked: a figure no CPU host gives (``implausible``) measures again, and a
    repeat that is implausible too, or that differs from the first run's plausible figures by
    over ``REPEAT_RATIO`` (matmul, link and host rates: the machine changing under the
    measurement), is refused (ConfigError, naming the figures), so nothing impossible is saved
    for every later plan to be priced on. A machine busier than it has cores is warned about
    (the figures are its speed under that load); the report gives ``load_per_core``."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    if load > 1.0:
        print(
            f"autopar calibrate: this machine is busy ({load:.1f} runnable tasks per core): "
            "the figures will be its speed under that load.",
            file=sys.stderr,
            flush=True,
        )
    topo, report = measure(backend, n, compile_fn)
    bad = implausible(report)
    if not bad:
        return topo, {**report, "load_per_core": load}
    topo, again = measure(backend, n, compile_fn)
    worse = implausible(again)
    if worse:
        raise ConfigError(
            "calibration refused: this machine measured impossible figures "
            f"twice ({'; '.join(worse)}); nothing was saved. Measure again when "
            "it is quieter (`autopar calibrate`), or name a preset "
            "(AUTOPAR_TOPOLOGY=local, or --topology)."
        )
    first_bad = {b.split("=")[0] for b in bad}
    moved = [
        k
        for k in ("matmul_GFLOPs", "link_GBps", "host_GBps")
        if k not in first_bad and max(report[k], again[k]) > REPEAT_RATIO * min(report[k], again[k])
    ]
    if moved:
        raise ConfigError(
            f"calibration refused: a first measurement gave {'; '.join(bad)}, and "
            f"its repeat disagrees with it by over {REPEAT_RATIO:g}x on "
            + ", ".join(f"{k} ({report[k]:.3g} then {again[k]:.3g})" for k in moved)
            + ": the machine changed under it; nothing was saved. Measure again "
            "when it is quieter."
        )
    return topo, {
        **again,
        "load_per_core": os.getloadavg()[0] / (os.cpu_count() or 1),
        "remeasured": "; ".join(bad),
    }


def measure(backend: str, n: int, compile_fn) -> tuple[Topology, dict]:
    """One measurement of this machine (the module docstring): ``(Topology, report)``;
    ``compile_fn`` is ``autopar.compile`` (the steps it times are compiled steps)."""
    from autopar.mesh import LogicalMesh
    from autopar.redistribution.planner import Planner

    if n < 2:
        raise ConfigError("calibrate needs at least 2 devices to measure the links.")
    add_one, matmuls, all_reduces, no_reduces, kind_chain, amid_compute = _steps()
    rng = np.random.default_rng(0)
    small = np.ones(SMALL, np.float32)
    big = rng.random(BIG, dtype=np.float32)
    t0 = _time_step(compile_fn, add_one, (small,), backend, n)
    parts = tuple(rng.random(ARG_ELEMENTS, dtype=np.float32) for _ in range(ARGS))
    t_parts = _time_step(compile_fn, lambda *xs: [x + 1.0 for x in xs], parts, backend, n, reps=15)
    t_whole = _time_step(compile_fn, add_one, (np.concatenate(parts),), backend, n, reps=15)
    arg_overhead = max(t_parts - t_whole, 0.0) / (2 * (ARGS - 1))  # per argument or result
    per_call = []  # (flops, seconds) of one matmul per size
    for rows, dim in MATMULS:
        w = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
        x = rng.standard_normal((rows, dim)).astype(np.float32)
        moved = (n + 1) * x.nbytes + n * w.nbytes  # the step's own arguments and result
        per_call.append((2 * rows * dim * dim, (x, w, moved)))
    t_mm = [(f, _time_step(compile_fn, matmuls, xw[:2], backend, n), xw[2]) for f, xw in per_call]
    t_host = _time_step(compile_fn, add_one, (big,), backend, n)
    t_ar = {
        k: _paired_difference(compile_fn, all_reduces, no_reduces, (a,), backend, n)
        for k, a in (("small", rng.random(256, dtype=np.float32)), ("big", big))
    }
    w512 = (rng.standard_normal((512, 512)) / np.sqrt(512)).astype(np.float32)
    amid = (
        rng.standard_normal((WAIT_ROWS, 512)).astype(np.float32),
        w512,
        np.zeros(256, np.float32),
    )
    # a paired difference below zero is the machine's noise (the chain with the all-reduces ran
    # faster than the one without), not a figure: the all-reduce cost nothing measurable
    per_amid = max(
        _paired_difference(compile_fn, amid_compute(True), amid_compute(False), amid, backend, n)
        / WAIT_CHAIN,
        0.0,
    )
    mem_bw = _elementwise_bandwidth(big) * min(1.0, (os.cpu_count() or 1) / n)
    host_beta = max(t_host - t0 - 2 * big.nbytes / mem_bw, 0.0) / ((n + 1) * big.nbytes)
    # the rate of one matmul at each reference size (topology.SMALL_DOT, LARGE_DOT)
    small_rate, flops = (
        f / max((t - t0 - host_beta * moved) / CHAIN, 1e-9) for f, t, moved in t_mm
    )
    level = Level("host", n, alpha=5e-6, beta=1 / 4e9)
    topo = Topology(
        (level,),
        flops=float(flops),
        mem_bandwidth=float(mem_bw),
        step_overhead=float(t0),
        host_beta=float(host_beta),
        small_dot_flops=float(min(small_rate, flops)),
        arg_overhead=float(arg_overhead),
    )

    def model(kind, beta, nbytes):
        lv = replace(level, beta=beta, betas={kind: beta})
        mesh = LogicalMesh.create((n,), None, replace(topo, levels=(lv,)))
        return Planner(mesh).step_time(kind, ("x",), nbytes)[0]

    def fit(kind, measured):
        """beta so that the cost model's ``kind`` of 4 MB costs ``measured`` seconds more than
        one of 1 KB (the model is affine in beta at a fixed size)."""
        d1, d2 = (model(kind, b, big.nbytes) - model(kind, b, 1024) for b in (1e-10, 2e-10))
        slope = (d2 - d1) / 1e-10
        return float(max((measured - (d1 - slope * 1e-10)) / slope, 1e-12))

    per_small, per_big = t_ar["small"] / CHAIN, t_ar["big"] / CHAIN
    beta = fit("all_reduce", per_big - per_small)
    # every other kind of 4 MB against it: what the runtime's call of that kind adds per byte
    # (its fixed part taken as the 1 KB all-reduce's)
    per_kind = {
        k: _paired_difference(
            compile_fn, kind_chain(k, True, n), kind_chain(k, False, n), (big,), backend, n
        )
        / CHAIN
        for k in KINDS[1:]
    }
    betas = {k: fit(k, t - per_small) for k, t in per_kind.items()}
    launch = max(per_amid - model("all_reduce", beta, 1024), 0.0)
    topo = replace(
        topo,
        levels=(
            replace(level, beta=beta, launch=float(launch), betas=tuple(sorted(betas.items()))),
        ),
    )
    run = _reference_run(compile_fn, topo, backend, n)
    k = _fit(run)
    topo = replace(
        topo,
        flops=topo.flops / k,
        small_dot_flops=topo.small_dot_flops / k,
        mem_bandwidth=topo.mem_bandwidth / k,
    )
    # the reference step's compute as it ran in a step, every device busy: what a profile,
    # one rank alone on a core, is brought to (compiler.api._profiled)
    topo = replace(
        topo,
        reference_compute=float(max(run[0] - run[2], run[0] / 2)),
        source=f"calibrated on {socket.gethostname()}, {backend} backend, {n} "
        f"devices, {time.strftime('%Y-%m-%d %H:%M')}",
    )
    return topo, {
        "backend": backend,
        "devices": n,
        "step_overhead_us": t0 * 1e6,
        "arg_overhead_us": arg_overhead * 1e6,
        "host_GBps": 1e-9 / host_beta if host_beta else float("inf"),
        "matmul_GFLOPs": flops * 1e-9,
        "small_matmul_GFLOPs": small_rate * 1e-9,
        "elementwise_GBps": mem_bw * 1e-9,
        "all_reduce_1KB_us": per_small * 1e6,
        "all_reduce_4MB_us": per_big * 1e6,
        "all_reduce_1KB_amid_compute_us": per_amid * 1e6,
        **{f"{k}_4MB_us": t * 1e6 for k, t in per_kind.items()},
        **{f"{k}_link_GBps": 1e-9 / b for k, b in betas.items()},
        "launch_us": launch * 1e6,
        "link_GBps": 1e-9 / beta,
        "reference_step_ms": run[0] * 1e3,
        "reference_estimate_ms": (k * run[1] + run[2]) * 1e3,
        "compute_slowdown": k,
        "reference_compute_ms": topo.reference_compute * 1e3,
    }


# ---------------------------------------------------------------- the reference steps

REFERENCE = {"layers": 2, "d": 192, "heads": 4, "seq": 96, "vocab": 640, "sequences": 8}


def reference_step(n: int):
    """A small language model's SGD step (einsums over a head axis, RMS norms, a squared-ReLU
    MLP, an untied head: written unlike the models the benchmarks time), its parameters and
    token batch as host arrays (``sequences`` sequences, or one per device)."""
    import jax
    import jax.numpy as jnp

    c = REFERENCE
    d, heads, vocab = c["d"], c["heads"], c["vocab"]
    hd, ff = d // heads, 4 * d
    r = np.random.default_rng(2)

    def w(*s: int) -> np.ndarray:
        return (0.02 * r.standard_normal(s)).astype(np.float32)

    ones = lambda: np.ones(d, np.float32)
    blocks = [
        {
            "g1": ones(),
            "wq": w(d, heads, hd),
            "wk": w(d, heads, hd),
            "wv": w(d, heads, hd),
            "wo": w(heads, hd, d),
            "g2": ones(),
            "w1": w(d, ff),
            "w2": w(ff, d),
        }
        for _ in range(c["layers"])
    ]
    params = {"emb": w(vocab, d), "head": w(d, vocab), "blocks": blocks}
    rows = n * -(-c["sequences"] // n)
    tokens = r.integers(0, vocab, (rows, c["seq"] + 1)).astype(np.int32)
    mask = np.tril(np.ones((c["seq"], c["seq"]), bool))

    def rms(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def loss(p, tokens):
        x = p["emb"][tokens[:, :-1]]
        for b in p["blocks"]:
            y = rms(x, b["g1"])
            q, k, v = (jnp.einsum("btd,dhk->bhtk", y, b[w]) for w in ("wq", "wk", "wv"))
            s = jnp.where(mask, jnp.einsum("bhtk,bhsk->bhts", q, k) / np.sqrt(hd), -1e9)
            o = jnp.einsum("bhts,bhsk->bhtk", jax.nn.softmax(s, -1), v)
            x = x + jnp.einsum("bhtk,hkd->btd", o, b["wo"])
            x = x + jnp.square(jax.nn.relu(rms(x, b["g2"]) @ b["w1"])) @ b["w2"]
        logits = x @ p["head"]
        gold = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - gold)

    def step(p, tokens):
        value, grads = jax.value_and_grad(loss)(p, tokens)
        return value, jax.tree.map(lambda a, g: a - 0.05 * g, p, grads)

    return step, params, tokens


def _reference_run(compile_fn, topo: Topology, backend: str, n: int, reps: int = 7) -> tuple:
    """The reference step planned data parallel on ``topo`` and run on ``backend``:
    ``(measured median seconds of a call, as the constants above were timed, estimated
    compute, estimated communication + per-call overhead)``."""
    from autopar.config import Backend, ParallelConfig, ParallelMode

    step, params, tokens = reference_step(n)
    cfg = ParallelConfig(
        parallel_mode=ParallelMode.DATA_PARALLEL,
        device_num=n,
        backend=Backend(backend),
        progress=False,
        topology=topo,
    )
    with compile_fn(step, params, tokens, config=cfg) as c:
        s = c.strategy
        return (
            _median_call(c, (params, tokens), reps),
            s.compute_time,
            s.comm_time + s.overhead_time,
        )


@functools.lru_cache(maxsize=8)
def reference_program(compile_fn, topo: Topology, backend: str, n: int):
    """The reference step planned data parallel on ``topo`` for ``n`` devices: its Program
    (``Topology.reference_compute`` is its compute as it ran at calibration)."""
    from autopar.config import Backend, ParallelConfig, ParallelMode

    step, params, tokens = reference_step(n)
    cfg = ParallelConfig(
        parallel_mode=ParallelMode.DATA_PARALLEL,
        device_num=n,
        backend=Backend(backend),
        progress=False,
        topology=topo,
    )
    return compile_fn(step, params, tokens, config=cfg).program


SLOWDOWN = (0.5, 4.0)  # the range the fitted compute factor is kept in


def _fit(run) -> float:
    """``k`` with ``measured = k * compute + rest`` for the reference run: how much slower the
    operators of a whole step run than the constants measured on their own say (other
    operators than the reference kernels, sizes that leave the caches, the devices' contention
    for the cores), kept in ``SLOWDOWN``."""
    t, compute, rest = run
    return min(max((t - rest) / compute, SLOWDOWN[0]), SLOWDOWN[1])
