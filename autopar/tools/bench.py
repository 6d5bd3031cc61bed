"""Latency and bus bandwidth of autopar's native collectives on this host.

Run: ``python -m autopar.tools.bench --op all_reduce --ranks 2 --size 16MB [--algorithm ring]
[--dtype float32] --json``. ``--op`` and ``--size`` take several values (``--op all`` is every
collective); ``--algorithm`` applies to all_reduce only and may also take several values
(``auto``: per size, the one the cost table picks on this host, as a compiled program does).

Out: one measurement per (op, size, algorithm): with ``--json`` one JSON object per line with
the keys op, ranks, bytes, algorithm, dtype, latency_us and busbw_gbs, else a table.

Conventions are NCCL-tests': ``bytes`` is each rank's buffer (all_reduce, broadcast,
all_to_all), its whole output (all_gather) or its whole input (reduce_scatter); bus bandwidth is
bytes / time x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and
all_to_all, x 1 for broadcast. A measurement runs ``calls`` back-to-back collectives per
round after a barrier, several rounds; a round's time is its slowest rank's, and the figure is
the median round divided by its calls. ``timing`` below is shared with
``benchmarks/collectives.py``, which runs the peers (gloo, MPI) under the same rules.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import numpy as np

from autopar.errors import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
}


def parse_size(text: str) -> int:
    """'16MB', '4K', '1048576' -> bytes; ConfigError for anything else."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([KMG]?B?)", text.strip().upper())
    if not m or int(float(m.group(1)) * UNITS[m.group(2)]) < 1:
        raise ConfigError(
            f"bench: cannot read the size {text!r}; write e.g. 4KB, 16MB or "
            "1048576 (bytes, at least 1)."
        )
    return int(float(m.group(1)) * UNITS[m.group(2)])


def size_label(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def schedule(nbytes: int) -> tuple[int, int]:
    """(calls per round, rounds): about 32 MB moved per round, at most 100 calls."""
    calls = max(1, min(100, (32 << 20) // max(nbytes, 1)))
    return calls, (5 if nbytes >= (64 << 20) else 9)


def timing(run, barrier, nbytes: int) -> list[float]:
    """Seconds of each round of back-to-back calls of run() (after warm-up)."""
    calls, rounds = schedule(nbytes)
    for _ in range(min(calls, 3)):
        run()
    out = []
    for _ in range(rounds):
        barrier()
        t = time.perf_counter()
        for _ in range(calls):
            run()
        out.append(time.perf_counter() - t)
    return out


def combine(per_rank: list[list[float]], nbytes: int) -> float:
    """Seconds per call: per round the slowest rank, then the median round."""
    calls, _ = schedule(nbytes)
    return float(np.median(np.max(np.array(per_rank), axis=0))) / calls


def buffers(op: str, nbytes: int, n: int, dtype):
    """(input, output) numpy buffers for one rank, sized by the NCCL-tests convention, each
    starting on a page (``zeros``)."""
    es = np.dtype(dtype).itemsize
    count = nbytes // es
    if op in ("all_gather", "all_to_all", "reduce_scatter"):
        count -= count % n
    if op == "all_gather":
        return zeros(count // n, dtype), zeros(count, dtype)
    if op == "reduce_scatter":
        return zeros(count, dtype), zeros(count // n, dtype)
    return zeros(count, dtype), zeros(count, dtype)


def zeros(count: int, dtype, page: int = 4096) -> np.ndarray:
    """A zeroed array starting on a page boundary, as OSU's benchmarks place theirs. Where a
    buffer starts within its page decides how fast a copy between two runs: a destination 4
    to 16 bytes past its source modulo 4 KiB (32 or more is not) meets the CPU's 4K aliasing
    (a 1 MB all-gather's single-copy reads 4x slower here). Ranks forked from one server
    share one heap history, so malloc put every rank's output 16 bytes past its input; here
    every implementation gets its buffers placed alike."""
    nbytes = count * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + page, np.uint8)
    start = -raw.ctypes.data % page
    return raw[start : start + nbytes].view(dtype)


def one_call(comm, op, x, y, ranks, algorithm, reducers=()):
    """The zero-argument function that runs one collective `op` on the buffers."""
    servers = list(reducers) if algorithm == "reduction_server" else []
    return {
        "all_reduce": lambda: comm.all_reduce(x, ranks, "sum", algorithm, servers),
        "all_gather": lambda: comm.all_gather(x, y, ranks),
        "reduce_scatter": lambda: comm.reduce_scatter(x, y, ranks),
        "all_to_all": lambda: comm.all_to_all(x, y, ranks),
        "broadcast": lambda: comm.broadcast(x, ranks, 0),
    }[op]


def auto_algorithm(nbytes: int, ranks: int) -> str:
    """The all-reduce a compiled program runs for ``nbytes`` over ``ranks`` ranks of this host:
    the cost table's cheapest on ``Topology.local(ranks)``."""
    from autopar.mesh import LogicalMesh
    from autopar.redistribution.planner import Planner
    from autopar.topology import Topology

    mesh = LogicalMesh.create((ranks,), topology=Topology.local(ranks))
    return Planner(mesh).step_time("all_reduce", mesh.axis_names, nbytes)[1]


def algorithms_of(op, algorithms, nbytes, ranks):
    """all_reduce's algorithms are chosen ('auto': the cost table's for the size); the other
    collectives have one each."""
    if op != "all_reduce":
        return [
            {
                "all_gather": "ring",
                "reduce_scatter": "ring",
                "all_to_all": "pairwise",
                "broadcast": "chain",
            }[op]
        ]
    return list(
        dict.fromkeys(auto_algorithm(nbytes, ranks) if a == "auto" else a for a in algorithms)
    )


def measure(comm, cases, dtype, workers=None, reducers=()):
    """In each rank: {(op, bytes, algorithm): (round seconds, network bytes this rank sent
    per call)} for a worker, the number of all-reduces served for a reducer. ``workers``
    (default every rank) run the collectives; ``reducers`` serve the "reduction_server"
    all-reduces (``comm.serve_reductions``) and nothing else."""
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    ranks = list(range(comm.size)) if workers is None else list(workers)
    reducers = list(reducers)
    if comm.rank in reducers:
        return sum(
            comm.serve_reductions(ranks, reducers)
            for op, _, algo in cases
            if algo == "reduction_server"
        )
    tcp = [p for p in range(comm.size) if comm.link_kind(p).startswith("tcp")]
    out = {}
    for op, nbytes, algo in cases:
        x, y = buffers(op, nbytes, len(ranks), dtype)
        run = one_call(comm, op, x, y, ranks, algo, reducers)
        before = comm.bytes_sent()
        seconds = timing(run, lambda: comm.barrier(ranks), nbytes)
        after = comm.bytes_sent()
        calls, rounds = schedule(nbytes)
        sent = sum(after[p] - before[p] for p in tcp) / (min(calls, 3) + calls * rounds)
        if algo == "reduction_server":
            comm.release_reducers(reducers, ranks)
        out[(op, nbytes, algo)] = (seconds, sent)
    return out


def run(
    ops,
    ranks: int,
    sizes,
    algorithms=("ring",),
    dtype="float32",
    hosts=None,
    direct=True,
    inter_host="shm",
    namespaces=None,
    tcp_streams=1,
    prepare=None,
    reducers: int = 0,
):
    """Measure on a fresh job of `ranks` processes; the list of result rows (dicts).
    ``direct=False`` turns single-copy reads off (``RuntimeOptions.direct``); ``hosts``,
    ``inter_host``, ``namespaces`` and ``tcp_streams`` place and join the ranks on (emulated)
    hosts as ``Job`` does; ``prepare(job)`` runs once the job is up, before the measurement.
    ``reducers``: that many more ranks (the last ones; ``hosts`` names theirs too) serve the
    "reduction_server" all-reduces. A row's ``net_bytes_per_call`` is the most bytes a rank
    sent over TCP per call (0 without TCP links)."""
    from autopar.runtime.launcher import Job
    from autopar.tools import bench as me  # the workers resolve this module by name

    cases = [
        (op, nbytes, algo)
        for op in ops
        for nbytes in sizes
        for algo in algorithms_of(op, algorithms, nbytes, ranks)
    ]
    if any(a == "reduction_server" for _, _, a in cases) and not reducers:
        raise ValueError("the reduction_server all-reduce needs reducers=1 or more")
    workers, servers = list(range(ranks)), list(range(ranks, ranks + reducers))
    with Job(
        ranks + reducers,
        hosts=hosts,
        timeout=60.0,
        direct=direct,
        inter_host=inter_host,
        namespaces=namespaces,
        tcp_streams=tcp_streams,
    ) as job:
        if prepare is not None:
            prepare(job)
        per_rank = job.call(me.measure, [(cases, dtype, workers, servers)] * (ranks + reducers))
    rows = []
    for op, nbytes, algo in cases:
        sec = combine([r[(op, nbytes, algo)][0] for r in per_rank[:ranks]], nbytes)
        busbw = nbytes / sec * BUS_FACTOR[op](ranks) / 1e9 if sec > 0 else 0.0
        sent = max(r[(op, nbytes, algo)][1] for r in per_rank[:ranks])
        rows.append(
            {
                "op": op,
                "ranks": ranks,
                "bytes": nbytes,
                "algorithm": algo,
                "dtype": dtype,
                "latency_us": round(sec * 1e6, 2),
                "busbw_gbs": float(f"{busbw:.4g}"),
                "net_bytes_per_call": round(sent),
            }
        )
    return rows


def main(argv=None, prog="python -m autopar.tools.bench"):
    from autopar import _native
    from autopar.argtypes import at_least

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--op",
        nargs="+",
        default=["all_reduce"],
        choices=OPS + ("all",),
        help="collectives to measure ('all': every one)",
    )
    p.add_argument(
        "--ranks",
        type=at_least(2, "worker processes"),
        default=2,
        help="worker processes (default 2)",
    )
    p.add_argument(
        "--size",
        nargs="+",
        default=["16MB"],
        help="per-rank buffer sizes, e.g. 4KB 1MB 16MB (NCCL-tests convention)",
    )
    p.add_argument(
        "--algorithm",
        nargs="+",
        default=None,
        choices=sorted(_native.ALLREDUCE_ALGORITHMS) + ["auto"],
        help="all_reduce algorithms (default ring; auto: the one a compiled program "
        "runs for the size, the cost table's cheapest on this host)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "float16", "bfloat16", "int32", "int64"],
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="no single-copy reads from peers' memory: every message through the "
        "shared-memory slots (what single-copy gains)",
    )
    args = p.parse_args(argv)
    ops = OPS if "all" in args.op else tuple(dict.fromkeys(args.op))
    rows = run(
        ops,
        args.ranks,
        [parse_size(s) for s in args.size],
        args.algorithm or ["ring"],
        args.dtype,
        direct=args.direct,
    )
    if args.json:
        for r in rows:
            print(json.dumps(r), flush=True)
        return 0
    print(
        f"{'op':<15}{'ranks':>6}{'size':>9}  {'algorithm':<17}{'latency us':>12}{'busbw GB/s':>12}"
    )
    for r in rows:
        print(
            f"{r['op']:<15}{r['ranks']:>6}{size_label(r['bytes']):>9}  {r['algorithm']:<17}"
            f"{r['latency_us']:>12.1f}{r['busbw_gbs']:>12.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
