"""All-reduce between two emulated hosts: autopar's native TCP transport against
torch.distributed's gloo and Open MPI's TCP BTL, over the same emulated link, in one run.

Two Linux network namespaces joined by a veth pair (``autopar.tools.netns``), one rank in each,
so every byte of every implementation crosses the veth over TCP. Each veth end is limited to
``--rate`` (tc tbf; with ``--flow-rate`` an htb tree instead, where every TCP connection
between the hosts gets its own class capped at ``--flow-rate`` once the connections are up, as
a path that holds one flow below the link's rate does; this kernel has no netem, so no added
latency). Each implementation runs on a fresh pair of namespaces, in this order: autopar's ring
with one TCP connection per pair of ranks, autopar's ring with ``--streams`` connections
(``RuntimeOptions.tcp_streams``), gloo (``dist.all_reduce``, one rank per namespace, its
sockets bound to the veth with GLOO_SOCKET_IFNAME), Open MPI (``MPI_Allreduce`` in place via
mpi4py, ``--mca pml ob1 --mca btl tcp,self`` on 10.231.1.0/24; mpirun runs inside the first
namespace and starts its daemon in the second through an rsh agent that is ``ip netns exec``,
because a rank in a namespace cannot reach a daemon's PMIx server in the root namespace). The
peers' connections are capped like autopar's: each rank does one all-reduce (which also checks
the sum), waits while this script caps the connections it finds between the hosts (``ss``
inside each namespace), then is timed.

Timing is ``autopar tools bench``'s (``bench.timing``/``bench.combine``, NCCL-tests rules:
back-to-back float32 sums after a barrier, several rounds, per round the slowest rank, the
median round divided by its calls; busbw = bytes / time x 2(n-1)/n). Out: a table per size of
latency, bus bandwidth, the peer's time over autopar's with ``--streams`` connections (above 1:
autopar is faster), the TCP connections the implementation had open between the hosts (data;
and control: gloo's TCPStore, Open MPI's daemon links); then per implementation the bytes that
crossed the veth against the 2 x bytes per call a ring moves (a check that the traffic did cross
it) and the TCP segments retransmitted in the two namespaces (tbf and htb drop what overflows
their queues). ``--json`` adds one object per row. Machines with few cores drift between runs:
compare within a run. Open MPI's ranks busy-poll by default (1 slot per host: not
oversubscribed), which on a machine with as few cores as ranks starves the other processes;
``--mpi-mca mpi_yield_when_idle=1`` makes them yield, as ranks on hosts of their own need not.

Needs root, iproute2, and for the peers a Python with torch, numpy and mpi4py (``--peer-python``,
default /work/peers-venv/bin/python) and Open MPI's mpirun; a peer that is missing is skipped
with a note. Run (root): ``python benchmarks/netns_peers.py`` (4gbit link, 1gbit per flow,
64KB 1MB 16MB); ``python benchmarks/netns_peers.py --rate 10gbit`` (no per-flow cap).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_PYTHON = "/work/peers-venv/bin/python"
STORE_PORT = 29511                     # gloo's TCPStore, on host 0 (fresh namespaces each run)
WAIT_S = 120.0                         # a peer's start-up, and its ranks' wait for the caps


def _bench():
    """autopar.tools.bench loaded from its file: the peers' Python lacks autopar's
    dependencies, and bench needs only numpy."""
    spec = importlib.util.spec_from_file_location("autopar_bench",
                                                  os.path.join(ROOT, "autopar/tools/bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- the peers' ranks (run by --peer-python inside a namespace) -------------------------------

def worker(args) -> None:
    """One rank of gloo or Open MPI: check one all-reduce, say ready, wait for the caps, time
    every size, write the round times for the caller."""
    import numpy as np
    bench = _bench()
    if args.worker == "gloo":
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        rank = args.rank
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{STORE_PORT}",
                                rank=rank, world_size=2)
        bufs = {n: torch.from_numpy(bench.buffers("all_reduce", n, 2, np.float32)[0])
                for n in args.size}
        call = lambda n: (lambda: dist.all_reduce(bufs[n]))     # noqa: E731
        barrier = dist.barrier
    else:
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        rank = c.Get_rank()
        bufs = {n: bench.buffers("all_reduce", n, 2, np.float32)[0] for n in args.size}
        call = lambda n: (lambda: c.Allreduce(MPI.IN_PLACE, bufs[n]))   # noqa: E731
        barrier = c.Barrier
    first = args.size[0]
    arr = bufs[first].numpy() if hasattr(bufs[first], "numpy") else bufs[first]
    arr[:] = 1
    call(first)()                                      # connections up, and a correct sum
    if not (arr == 2).all():
        raise SystemExit(f"{args.worker} rank {rank}: all-reduce of ones gave {arr[:4]}...")
    arr[:] = 0
    barrier()
    open(os.path.join(args.dir, f"ready{rank}"), "w").close()
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(os.path.join(args.dir, "go")):
        if time.monotonic() > deadline:
            raise SystemExit(f"{args.worker} rank {rank}: no go from the caller")
        time.sleep(0.02)
    barrier()
    out = {n: bench.timing(call(n), barrier, n) for n in args.size}
    with open(os.path.join(args.dir, f"result{rank}.json"), "w") as f:
        json.dump({str(n): t for n, t in out.items()}, f)
    barrier()
    if args.worker == "gloo":
        dist.destroy_process_group()


# --- the caller: namespaces, connections, caps ------------------------------------------------

def between(names, places) -> dict:
    """{host: [(local port, remote port, process name)]}: the established TCP connections of
    host h's namespace to the other host's address (``ss``, IPv4 and v4-mapped IPv6)."""
    out = {}
    for h, ns in enumerate(names):
        other = places[1 - h][1]
        got = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htnp", "state", "established"],
                             capture_output=True, text=True, check=True).stdout
        for line in got.splitlines():
            f = line.split()
            (lip, lport), (rip, rport) = (a.replace("[::ffff:", "").replace("]", "").rsplit(":", 1)
                                          for a in f[2:4])
            if rip == other:
                proc = re.search(r'\(\("([^"]+)"', line)
                out.setdefault(h, []).append((int(lport), int(rport),
                                              proc.group(1) if proc else "?"))
    return out


def connections(names, places, flow_rate, store_port=None) -> tuple[int, int]:
    """Cap every connection between the hosts at ``flow_rate`` (if set) and count them from
    host 0's side: (data connections, control connections: TCPStore, MPI daemons)."""
    flows = between(names, places)
    if flow_rate:
        from autopar.tools import netns
        netns.cap_flows(names, {h: [(lp, rp) for lp, rp, _ in fl] for h, fl in flows.items()},
                        flow_rate)
    control = sum(1 for lp, rp, proc in flows.get(0, ())
                  if not proc.startswith("python") or store_port in (lp, rp))
    return len(flows.get(0, ())) - control, control


def counters(names) -> tuple[int, int]:
    """(bytes sent by both veth ends, TCP segments both namespaces retransmitted) so far."""
    sent = resent = 0
    for h, ns in enumerate(names):
        got = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", f"{ns[:-2]}v{h}"],
                             capture_output=True, text=True, check=True).stdout
        sent += json.loads(got)[0]["stats64"]["tx"]["bytes"]
        snmp = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                              capture_output=True, text=True, check=True).stdout
        head, vals = [ln.split() for ln in snmp.splitlines() if ln.startswith("Tcp:")]
        resent += int(vals[head.index("RetransSegs")])
    return sent, resent


def wait_ready(d, procs, logs):
    deadline = time.monotonic() + WAIT_S
    while not all(os.path.exists(os.path.join(d, f"ready{r}")) for r in range(2)):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            why = "a process exited" if dead else "timed out"
            raise RuntimeError(f"peer did not start ({why}):\n" + tail(logs))
        time.sleep(0.05)


def tail(logs) -> str:
    return "\n".join(open(f).read()[-3000:] for f in logs if os.path.exists(f))


def finish(d, procs, logs, bench, sizes):
    open(os.path.join(d, "go"), "w").close()
    for p in procs:
        try:
            rc = p.wait(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        if rc != 0:
            raise RuntimeError(f"peer exited with {rc}:\n" + tail(logs))
    per_rank = [json.load(open(os.path.join(d, f"result{r}.json"))) for r in range(2)]
    return {n: bench.combine([t[str(n)] for t in per_rank], n) for n in sizes}


def peer_command(args, d, kind, extra=()):
    return [args.peer_python, os.path.abspath(__file__), "--worker", kind, "--dir", d,
            "--size", *map(str, args.size), *extra]


def run_gloo(args, places, names, bench, d):
    logs = [os.path.join(d, f"gloo{r}.log") for r in range(2)]
    procs = []
    for r, (ns, _) in sorted(places.items()):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=f"{ns[:-2]}v{r}", OMP_NUM_THREADS="1")
        cmd = peer_command(args, d, "gloo", ["--rank", str(r), "--master", places[0][1]])
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd], env=env, stdout=open(logs[r], "w"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL))
    wait_ready(d, procs, logs)
    conns = connections(names, places, args.flow_rate, STORE_PORT)
    return finish(d, procs, logs, bench, args.size), conns


def run_mpi(args, places, names, bench, d):
    """mpirun inside host 0's namespace; the daemon on host 1 started by an 'rsh agent' that
    enters host 1's namespace (the hosts are named by their addresses)."""
    agent = os.path.join(d, "agent.sh")
    with open(agent, "w") as f:
        f.write("#!/bin/sh\nhost=$1; shift\ncase $host in\n")
        for ns, addr in places.values():
            f.write(f"  {addr}) ns={ns} ;;\n")
        f.write("  *) echo \"agent: unknown host $host\" >&2; exit 1 ;;\nesac\n"
                "exec ip netns exec $ns sh -c \"$*\"\n")
    os.chmod(agent, 0o755)
    log = os.path.join(d, "mpi.log")
    hosts = ",".join(f"{addr}:1" for _, addr in (places[0], places[1]))
    cmd = ["ip", "netns", "exec", places[0][0], "mpirun", "--allow-run-as-root", "-np", "2",
           "--host", hosts, "--mca", "plm_rsh_agent", agent,
           "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
           "--mca", "btl_tcp_if_include", "10.231.1.0/24",
           "--mca", "oob_tcp_if_include", "10.231.1.0/24",
           *[a for kv in args.mpi_mca for a in ("--mca", *kv.split("=", 1))],
           "-x", "OMP_NUM_THREADS=1", *peer_command(args, d, "mpi")]
    procs = [subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)]
    wait_ready(d, procs, [log])
    conns = connections(names, places, args.flow_rate)
    return finish(d, procs, [log], bench, args.size), conns


def run_autopar(args, places, names, bench, streams):
    conns = []

    def prepare(job):
        conns.append(connections(names, places, args.flow_rate))
    rows = bench.run(["all_reduce"], 2, args.size, ["ring"], hosts=[0, 1], inter_host="tcp",
                     namespaces=places, tcp_streams=streams, prepare=prepare)
    return {r["bytes"]: r["latency_us"] / 1e6 for r in rows}, conns[0]


def expected_bytes(bench, sizes, peer):
    """What a ring moves across the link in all (warm-up, check and timed calls): 2 x bytes
    per call for two ranks."""
    total = 0
    for n in sizes:
        calls, rounds = bench.schedule(n)
        total += 2 * n * (min(calls, 3) + calls * rounds + (1 if peer and n == sizes[0] else 0))
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="4gbit", help="veth rate each way (default 4gbit)")
    ap.add_argument("--flow-rate", default=None,
                    help="cap each TCP connection at this rate (default 1gbit when --rate is "
                         "left at 4gbit, else none; 'none' turns it off)")
    ap.add_argument("--size", nargs="+", default=["64KB", "1MB", "16MB"])
    ap.add_argument("--streams", type=int, default=4, help="autopar's TCP connections per pair "
                    "of ranks in its second run (default 4)")
    ap.add_argument("--impl", nargs="+", default=["autopar1", "autopar", "gloo", "mpi"],
                    choices=["autopar1", "autopar", "gloo", "mpi"],
                    help="autopar1: one stream; autopar: --streams streams")
    ap.add_argument("--peer-python", default=PEER_PYTHON,
                    help=f"Python with torch, numpy, mpi4py (default {PEER_PYTHON})")
    ap.add_argument("--mpi-mca", nargs="+", default=[], metavar="KEY=VALUE",
                    help="more Open MPI MCA settings, e.g. mpi_yield_when_idle=1")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=["gloo", "mpi"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.size = [int(s) for s in args.size]
        worker(args)
        return 0
    sys.path.insert(0, ROOT)
    from autopar.tools import bench, netns
    args.size = [bench.parse_size(s) for s in args.size]
    if args.flow_rate is None:
        args.flow_rate = "1gbit" if args.rate == "4gbit" else None
    elif args.flow_rate.lower() == "none":
        args.flow_rate = None
    why = netns.unavailable()
    if why:
        print(f"netns_peers: cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    skipped = {}
    if not os.access(args.peer_python, os.X_OK):
        skipped.update(gloo=f"no {args.peer_python}", mpi=f"no {args.peer_python}")
    if shutil.which("mpirun") is None:
        skipped["mpi"] = "no mpirun"
    label = {"autopar1": "autopar 1 stream", "autopar": f"autopar {args.streams} streams",
             "gloo": "gloo", "mpi": "open mpi"}
    results = {}     # impl -> ({bytes: seconds}, (data, control conns), veth bytes, retransmits)
    for impl in args.impl:
        if impl in skipped:
            continue
        places, names = netns.make(2, rate=args.rate, per_flow=bool(args.flow_rate))
        d = tempfile.mkdtemp(prefix="netns-peers-")
        try:
            before = counters(names)
            if impl.startswith("autopar"):
                got = run_autopar(args, places, names, bench, 1 if impl == "autopar1"
                                  else args.streams)
            else:
                got = (run_gloo if impl == "gloo" else run_mpi)(args, places, names, bench, d)
            after = counters(names)
            results[impl] = (*got, after[0] - before[0], after[1] - before[1])
        except Exception as e:          # a peer that fails is reported, the others still run
            skipped[impl] = f"{type(e).__name__}: {e}"
        finally:
            netns.remove(names)
            shutil.rmtree(d, ignore_errors=True)
    flow = f", each TCP connection capped at {args.flow_rate}" if args.flow_rate else ""
    print(f"all_reduce float32, 2 hosts x 1 rank (network namespaces), veth at {args.rate}{flow}")
    print(f"{'size':>6} {'library':>17} {'latency us':>11} {'busbw GB/s':>10} "
          f"{'/ autopar':>9} {'conns':>5} {'ctl':>3}")
    rows = []
    for n in args.size:
        ref = results.get("autopar", ({},))[0].get(n)
        for impl in args.impl:
            if impl not in results:
                continue
            sec = results[impl][0][n]
            data, ctl = results[impl][1]
            r = {"bytes": n, "library": label[impl], "rate": args.rate, "flow_rate": args.flow_rate,
                 "latency_us": round(sec * 1e6, 2),
                 "busbw_gbs": float(f"{n / sec * bench.BUS_FACTOR['all_reduce'](2) / 1e9:.4g}"),
                 "vs_autopar": round(sec / ref, 3) if ref else None,
                 "connections": data, "control_connections": ctl,
                 "veth_bytes_all_sizes": results[impl][2],
                 "retransmits_all_sizes": results[impl][3]}
            rows.append(r)
            print(f"{bench.size_label(n):>6} {r['library']:>17} {r['latency_us']:>11.1f} "
                  f"{r['busbw_gbs']:>10.3f} {r['vs_autopar'] or '-':>9} {data:>5} {ctl:>3}")
    print("conns: TCP connections between the hosts carrying data; ctl: control ones (gloo's "
          "TCPStore, Open MPI's daemons).\nBytes across the veth (all sizes, against a ring's) "
          "and TCP segments retransmitted:")
    for impl, (_, _, crossed, resent) in results.items():
        want = expected_bytes(bench, args.size, not impl.startswith("autopar"))
        print(f"  {label[impl]:>17}: {crossed / 1e6:9.1f} MB ({crossed / want:.2f} x a ring's "
              f"{want / 1e6:.1f} MB), {resent} retransmitted")
    for impl, why in skipped.items():
        print(f"  {label[impl]} skipped: {why}")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return 1 if any(i in skipped for i in args.impl) else 0


if __name__ == "__main__":
    sys.exit(main())
