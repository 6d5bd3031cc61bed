"""All-reduce across two emulated hosts: flat ring against the hierarchical algorithms, and
one TCP connection per pair of ranks against several.

Two Linux network namespaces joined by a veth pair (``autopar.tools.netns``), each a "host"
of ``--per-host`` ranks that share memory inside it and reach the other host only over TCP
through the veth, rate-limited by ``tc tbf`` to ``--rate`` (an emulated NIC; this kernel has
no ``netem``, so no added latency). With ``--flow-rate`` every TCP flow is also capped on its
own (an htb class per connection, matched on its ports once the job is up), as a path or NIC
that holds one flow below the link's rate does. Each ``--streams`` count runs its own job
(``RuntimeOptions.tcp_streams``); within a job every algorithm runs on the same buffers, timed
as ``autopar bench`` times (NCCL-tests rules). Prints a table and, with ``--json``, one object
per row; "/ ring" is each algorithm's time over the flat ring's with the same streams, "/ 1
stream" its time over its own with one connection.

Run (root): ``python benchmarks/netns_hosts.py --rate 1gbit --size 1MB 16MB``;
``python benchmarks/netns_hosts.py --rate 4gbit --flow-rate 1gbit --per-host 1 --streams 1 2 4``.
"""
from __future__ import annotations

import argparse
import json
import sys

from autopar.tools import bench, netns


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (tests/test_readme.py parses the README's command lines)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate per veth end (default 1gbit)")
    ap.add_argument("--per-host", type=int, default=2, help="ranks per host (default 2)")
    ap.add_argument("--size", nargs="+", default=[1 << 20, 16 << 20], type=bench.parse_size)
    ap.add_argument("--algorithm", nargs="+",
                    default=["ring", "halving_doubling", "2d_ring", "2d_torus", "2d_mesh"])
    ap.add_argument("--streams", nargs="+", type=int, default=[1],
                    help="TCP connections per pair of ranks; one job per count (default 1)")
    ap.add_argument("--flow-rate", help="cap every TCP flow at this rate too (htb per flow)")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"netns_hosts: cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    n = 2 * args.per_host
    hosts = [r // args.per_host for r in range(n)]
    rows = []
    for streams in args.streams:
        places, names = netns.make(2, rate=args.rate, per_flow=bool(args.flow_rate))

        def cap(job):
            flows = {}
            for r, got in enumerate(job.call(netns.tcp_flows, [()] * n)):
                flows.setdefault(hosts[r], set()).update(got)
            netns.cap_flows(names, flows, args.flow_rate)
        try:
            got = bench.run(["all_reduce"], n, args.size, args.algorithm, hosts=hosts,
                            inter_host="tcp", namespaces=places, tcp_streams=streams,
                            prepare=cap if args.flow_rate else None)
        finally:
            netns.remove(names)
        rows += [dict(r, streams=streams) for r in got]
    base = {(r["bytes"], r["algorithm"], r["streams"]): r["latency_us"] for r in rows}
    flow = f", each flow capped at {args.flow_rate}" if args.flow_rate else ""
    print(f"all_reduce, 2 hosts x {args.per_host} ranks, veth at {args.rate}{flow}")
    print(f"{'bytes':>8} {'algorithm':>17} {'streams':>7} {'latency us':>11} {'busbw GB/s':>10} "
          f"{'/ ring':>7} {'/ 1 stream':>10}")
    for r in rows:
        ring = base.get((r["bytes"], "ring", r["streams"]))
        one = base.get((r["bytes"], r["algorithm"], 1))
        r.update(rate=args.rate, flow_rate=args.flow_rate,
                 vs_ring=round(r["latency_us"] / ring, 3) if ring else None,
                 vs_one_stream=round(r["latency_us"] / one, 3) if one else None)
        print(f"{bench.size_label(r['bytes']):>8} {r['algorithm']:>17} {r['streams']:>7} "
              f"{r['latency_us']:>11.1f} {r['busbw_gbs']:>10.3f} {r['vs_ring'] or '-':>7} "
              f"{r['vs_one_stream'] or '-':>10}")
        if args.json:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
