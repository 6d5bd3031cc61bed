"""All-reduce latency and bus bandwidth: autopar's native collectives against
torch.distributed's gloo backend, in one run on this machine.

Run: python benchmarks/collectives.py [--ranks 2] [--sizes 4K 256K 1M 16M 256M] [--iters 20]
Prints one JSON object per (size, implementation): median seconds per all-reduce of float32
sum (the slowest rank's, over --iters back-to-back calls after 3 warm-ups), busbw in GB/s
(NCCL-tests convention: bytes x 2(n-1)/n / seconds), and for autopar the ratio gloo time /
autopar time (above 1: autopar is faster). gloo is measured only when torch is installed.
"""
import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def timed(call, iters):
    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def autopar_rank(comm, sizes, algorithm, iters):
    """In each worker: seconds per all-reduce for each size."""
    ranks = list(range(comm.size))
    out = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        comm.barrier(ranks)
        out.append(timed(lambda: comm.all_reduce(x, ranks, "sum", algorithm), iters))
    return out


def gloo_rank(rank, n, port, sizes, iters, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        dist.barrier()
        out.append(timed(lambda: dist.all_reduce(x), iters))
    dist.destroy_process_group()
    queue.put((rank, out))


def gloo(n, sizes, iters):
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=gloo_rank, args=(r, n, port, sizes, iters, queue)) for r in range(n)]
    for p in procs:
        p.start()
    got = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return [max(t[i] for _, t in got) for i in range(len(sizes))]


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--ranks", type=int, default=2)
    ap_.add_argument("--sizes", nargs="+", default=["4K", "256K", "1M", "16M", "256M"])
    ap_.add_argument("--iters", type=int, default=20)
    ap_.add_argument("--algorithms", nargs="+", default=["ring", "halving_doubling", "tree"])
    args = ap_.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    n = args.ranks
    import collectives as me                    # the workers import this module by name
    from autopar.runtime.launcher import Job
    ours = {}
    with Job(n) as job:
        for algo in args.algorithms:
            per_rank = job.call(me.autopar_rank, [(sizes, algo, args.iters)] * n)
            ours[algo] = [max(t[i] for t in per_rank) for i in range(len(sizes))]
    peer = gloo(n, sizes, args.iters)
    busbw = lambda b, t: b * 2 * (n - 1) / n / t / 1e9
    for i, (label, b) in enumerate(zip(args.sizes, sizes)):
        if peer:
            print(json.dumps({"size": label, "ranks": n, "impl": "gloo", "us": round(peer[i] * 1e6, 1),
                              "busbw_GBps": round(busbw(b, peer[i]), 3)}))
        for algo, t in ours.items():
            row = {"size": label, "ranks": n, "impl": f"autopar {algo}", "us": round(t[i] * 1e6, 1),
                   "busbw_GBps": round(busbw(b, t[i]), 3)}
            if peer:
                row["gloo_over_autopar"] = round(peer[i] / t[i], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
