"""Reduction Server all-reduce against the ring, halving-doubling and 2D-ring, across emulated
hosts with rate-limited NICs.

``--hosts`` worker hosts of ``--per-host`` ranks each and ``--reducers`` reducer hosts of one
reducer rank each, every host a Linux network namespace on a bridge (``autopar.tools.netns``)
whose veth is limited to ``--rate`` both ways (``tc tbf``: an emulated NIC; this kernel has no
``netem``, so no added latency). Ranks of one host share memory; hosts talk over TCP. Every
algorithm runs in one job on the same buffers, timed as ``autopar bench`` times (NCCL-tests
rules: busbw = bytes / time x 2(n-1)/n over the n workers). "net bytes / buffer" is the most
any worker sent over TCP per call, measured by the runtime's per-link byte counters
(``Comm.bytes_sent``), over the buffer: a ring sends 2(n-1)/n of it (less where ranks of a host
share memory), a Reduction Server worker 1 whatever n. "/ ring" is each time over the ring's.

Run (root): ``python benchmarks/reduction_server.py --hosts 4 --reducers 4 --rate 1gbit``.
"""
from __future__ import annotations

import argparse
import json
import sys

from autopar.tools import bench, netns


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (tests/test_readme.py parses the README's command lines)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4, help="worker hosts (default 4)")
    ap.add_argument("--per-host", type=int, default=1, help="worker ranks per host (default 1)")
    ap.add_argument("--reducers", type=int, default=4,
                    help="reducer hosts, one reducer each (default 4)")
    ap.add_argument("--rate", default="1gbit", help="each host's NIC rate (default 1gbit)")
    ap.add_argument("--size", nargs="+", default=[1 << 20, 16 << 20], type=bench.parse_size)
    ap.add_argument("--algorithm", nargs="+",
                    default=["ring", "halving_doubling", "2d_ring", "reduction_server"])
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"reduction_server: cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    n = args.hosts * args.per_host
    hosts = [r // args.per_host for r in range(n)]
    hosts += [args.hosts + j for j in range(args.reducers)]
    places, names = netns.make(args.hosts + args.reducers, rate=args.rate)
    try:
        rows = bench.run(["all_reduce"], n, args.size, args.algorithm, hosts=hosts,
                         inter_host="tcp", namespaces=places, reducers=args.reducers)
    finally:
        netns.remove(names)
    ring = {r["bytes"]: r["latency_us"] for r in rows if r["algorithm"] == "ring"}
    print(f"all_reduce, {args.hosts} hosts x {args.per_host} worker ranks, "
          f"{args.reducers} reducer hosts, NICs at {args.rate} (tbf)")
    print(f"{'bytes':>8} {'algorithm':>17} {'latency us':>11} {'busbw GB/s':>10} "
          f"{'net bytes / buffer':>18} {'/ ring':>7}")
    for r in rows:
        r.update(rate=args.rate, worker_hosts=args.hosts, per_host=args.per_host,
                 reducer_hosts=args.reducers,
                 net_per_buffer=round(r["net_bytes_per_call"] / r["bytes"], 3),
                 vs_ring=round(r["latency_us"] / ring[r["bytes"]], 3) if r["bytes"] in ring
                 else None)
        print(f"{bench.size_label(r['bytes']):>8} {r['algorithm']:>17} {r['latency_us']:>11.1f} "
              f"{r['busbw_gbs']:>10.3f} {r['net_per_buffer']:>18} {r['vs_ring'] or '-':>7}")
        if args.json:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
