"""All-reduce across two emulated hosts: flat ring against the hierarchical algorithms.

Two Linux network namespaces joined by a veth pair (``autopar.tools.netns``), each a "host"
of ``--per-host`` ranks that share memory inside it and reach the other host only over TCP
through the veth, rate-limited by ``tc tbf`` to ``--rate`` (an emulated NIC; this kernel has
no ``netem``, so no added latency). Every algorithm runs in one job, the same buffers, the
same machine, timed as ``autopar bench`` times (NCCL-tests rules). Prints a table and, with
``--json``, one object per row; the ratio is each algorithm's time over the flat ring's.

Run (root): ``python benchmarks/netns_hosts.py --rate 1gbit --size 1MB 16MB``.
"""
from __future__ import annotations

import argparse
import json
import sys

from autopar.tools import bench, netns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate per veth end (default 1gbit)")
    ap.add_argument("--per-host", type=int, default=2, help="ranks per host (default 2)")
    ap.add_argument("--size", nargs="+", default=["1MB", "16MB"], type=bench.parse_size)
    ap.add_argument("--algorithm", nargs="+",
                    default=["ring", "halving_doubling", "2d_ring", "2d_torus", "2d_mesh"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"netns_hosts: cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    places, names = netns.make(2, rate=args.rate)
    try:
        n = 2 * args.per_host
        hosts = [r // args.per_host for r in range(n)]
        rows = bench.run(["all_reduce"], n, args.size, args.algorithm, hosts=hosts,
                         inter_host="tcp", namespaces=places)
    finally:
        netns.remove(names)
    ring = {r["bytes"]: r["latency_us"] for r in rows if r["algorithm"] == "ring"}
    print(f"all_reduce, 2 hosts x {args.per_host} ranks, veth at {args.rate} (tbf)")
    print(f"{'bytes':>8} {'algorithm':>17} {'latency us':>11} {'busbw GB/s':>10} {'/ ring':>7}")
    for r in rows:
        r["rate"] = args.rate
        r["vs_ring"] = round(r["latency_us"] / ring[r["bytes"]], 3) if r["bytes"] in ring else None
        print(f"{bench.size_label(r['bytes']):>8} {r['algorithm']:>17} {r['latency_us']:>11.1f} "
              f"{r['busbw_gbs']:>10.3f} {r['vs_ring'] if r['vs_ring'] is not None else '-':>7}")
        if args.json:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
