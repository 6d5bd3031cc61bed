"""Collectives on this host: autopar's native runtime against torch.distributed (gloo) and MPI
(mpi4py), side by side in one run, with the memory-copy bandwidth as the physical limit.

Run: python benchmarks/collectives.py [--ranks 2 4 8] [--ops all_reduce all_gather ...]
     [--sizes 4KB 64KB 1MB 16MB 256MB] [--peers gloo mpi] [--repeat 3] [--markdown]

Every implementation is timed by the same rules (``autopar.tools.bench.timing``: back-to-back
calls after a barrier, several rounds, per round the slowest rank, the median round) and sized
by NCCL-tests' conventions (``bench.buffers``), float32, sum; autopar's all-reduce is the
algorithm a compiled program runs for the size (the cost table's, ``--algorithm auto``), as
MPI and gloo pick theirs. This machine's figures drift by
up to 1.5x within minutes, so the implementations take turns (autopar, gloo, MPI, autopar, ...)
--repeat times and each cell is the median over the turns. Out: one JSON object per
measurement (impl, op, ranks, bytes, autopar's algorithm, latency_us, busbw_gbs); with
--markdown also one table per
(op, ranks) with the ratios autopar busbw / peer busbw (above 1: autopar is faster). A peer that
is not installed (torch, mpi4py with an ``mpiexec``) or does not implement an operation (gloo
has no reduce_scatter) is left out of its cells. all_reduce runs in place for every
implementation (MPI_IN_PLACE).
"""
import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from autopar.tools import bench  # noqa: E402

MB = 1 << 20


def row(impl, op, n, nbytes, sec):
    return {"impl": impl, "op": op, "ranks": n, "bytes": nbytes, "latency_us": round(sec * 1e6, 2),
            "busbw_gbs": round(nbytes / sec * bench.BUS_FACTOR[op](n) / 1e9, 3)}


# --- torch.distributed, gloo ----------------------------------------------------------------

def gloo_rank(rank, n, port, ops, sizes, queue):
    import warnings
    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore", category=FutureWarning)   # all_gather_into_tensor's notice
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    calls = {"all_reduce": lambda x, y: dist.all_reduce(x),
             "all_gather": lambda x, y: dist.all_gather_into_tensor(y, x),
             "all_to_all": lambda x, y: dist.all_to_all_single(y, x),
             "broadcast": lambda x, y: dist.broadcast(x, 0)}
    out = {}
    for op in ops:
        if op not in calls:
            continue
        for nbytes in sizes:
            x, y = (torch.from_numpy(a) for a in bench.buffers(op, nbytes, n, np.float32))
            out[(op, nbytes)] = bench.timing(lambda: calls[op](x, y), dist.barrier, nbytes)
    dist.destroy_process_group()
    queue.put(out)


def gloo(n, ops, sizes):
    try:
        import torch  # noqa: F401
    except ImportError:
        return []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=gloo_rank, args=(r, n, port, ops, sizes, queue)) for r in range(n)]
    for p in procs:
        p.start()
    got = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return [row("gloo", op, n, nbytes, bench.combine([g[(op, nbytes)] for g in got], nbytes))
            for (op, nbytes) in got[0]]


# --- MPI (mpi4py), run under mpiexec by this script itself ------------------------------------

def mpi_worker(ops, sizes):
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    n = c.Get_size()
    calls = {"all_reduce": lambda x, y: c.Allreduce(MPI.IN_PLACE, x),
             "all_gather": lambda x, y: c.Allgather(x, y),
             "reduce_scatter": lambda x, y: c.Reduce_scatter_block(x, y),
             "all_to_all": lambda x, y: c.Alltoall(x, y),
             "broadcast": lambda x, y: c.Bcast(x, 0)}
    rows = []
    for op in ops:
        for nbytes in sizes:
            x, y = bench.buffers(op, nbytes, n, np.float32)
            times = c.gather(bench.timing(lambda: calls[op](x, y), c.Barrier, nbytes), root=0)
            if c.Get_rank() == 0:
                rows.append(row("mpi", op, n, nbytes, bench.combine(times, nbytes)))
    if c.Get_rank() == 0:
        print(json.dumps(rows))


def mpi(n, ops, sizes):
    mpiexec = shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return []
    if not mpiexec:
        return []
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    out = subprocess.run([mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__),
                          "--mpi-worker", "--ops", *ops, "--sizes", *map(str, sizes)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the physical limit ----------------------------------------------------------------------

def memcpy(sizes):
    """GB/s of one np.copyto of each size (one core)."""
    out = {}
    for nbytes in sizes:
        src, dst = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
        sec = bench.combine([bench.timing(lambda: np.copyto(dst, src), lambda: None, nbytes)], nbytes)
        out[nbytes] = round(nbytes / sec / 1e9, 2)
    return out


def median(rows):
    """The row of median latency among one cell's turns (the upper one of an even count)."""
    return sorted(rows, key=lambda r: r["latency_us"])[len(rows) // 2]


def markdown(rows, copy):
    cells = {(r["impl"], r["op"], r["ranks"], r["bytes"]): r for r in rows}
    impls = [i for i in ("gloo", "mpi") if any(r["impl"] == i for r in rows)]
    for op, n in sorted({(r["op"], r["ranks"]) for r in rows}, key=lambda k: (bench.OPS.index(k[0]), k[1])):
        print(f"\n{op}, {n} ranks (latency us / busbw GB/s; ratio = autopar busbw / peer busbw)\n")
        head = ["size", "autopar"] + impls + [f"vs {i}" for i in impls] + ["memcpy GB/s"]
        print("| " + " | ".join(head) + " |\n|" + "---:|" * len(head))
        for nbytes in sorted({r["bytes"] for r in rows if r["op"] == op and r["ranks"] == n}):
            ours = cells.get(("autopar", op, n, nbytes))
            line = [bench.size_label(nbytes)]
            for impl in ["autopar"] + impls:
                c = cells.get((impl, op, n, nbytes))
                line.append(f"{c['latency_us']:.1f} / {c['busbw_gbs']:.2f}" if c else "-")
            for impl in impls:
                c = cells.get((impl, op, n, nbytes))
                # same bytes and bus factor: the busbw ratio is the inverse latency ratio
                line.append(f"{c['latency_us'] / ours['latency_us']:.2f}" if c and ours else "-")
            line.append(str(copy.get(nbytes, "-")))
            print("| " + " | ".join(line) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--ops", nargs="+", default=list(bench.OPS), choices=bench.OPS)
    p.add_argument("--sizes", nargs="+", default=["4KB", "64KB", "1MB", "16MB", "256MB"])
    p.add_argument("--peers", nargs="*", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    p.add_argument("--repeat", type=int, default=3, help="turns per implementation (median taken)")
    p.add_argument("--markdown", action="store_true", help="also print the tables of ratios")
    p.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tables-from", metavar="LOG", help="only print the tables of a saved run's JSON lines")
    args = p.parse_args()
    sizes = [bench.parse_size(s) for s in args.sizes]
    if args.tables_from:
        with open(args.tables_from) as f:
            rows = [json.loads(line) for line in f if line.startswith("{")]
        return markdown(rows, {})
    if args.mpi_worker:
        return mpi_worker(args.ops, sizes)
    rows = []
    copy = memcpy(sizes)
    impls = {"autopar": lambda n: [dict(r, impl="autopar") for r in bench.run(args.ops, n, sizes,
                                                                                ("auto",))],
             "gloo": lambda n: gloo(n, args.ops, sizes), "mpi": lambda n: mpi(n, args.ops, sizes)}
    for n in args.ranks:
        turns = {}
        for _ in range(args.repeat):
            for impl in ["autopar"] + args.peers:
                for r in impls[impl](n):
                    turns.setdefault((impl, r["op"], r["bytes"]), []).append(r)
        got = [median(rs) for rs in turns.values()]
        for r in got:
            print(json.dumps({k: r[k] for k in ("impl", "op", "ranks", "bytes", "algorithm",
                                                "latency_us", "busbw_gbs") if k in r}), flush=True)
        rows += got
    if args.markdown:
        markdown(rows, copy)


if __name__ == "__main__":
    main()
