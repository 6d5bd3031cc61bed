"""Emulated hosts on this machine: Linux network namespaces joined by a veth pair.

In: a count of hosts (2), an optional NIC rate for each veth end (e.g. "10gbit"), and for
``cap_flows`` the established TCP flows to cap one by one. Out: ``{host id: (namespace, IPv4 address)}``, what ``runtime.launcher.Job``'s
``namespaces`` takes, and the namespace names ``remove`` deletes (each namespace takes its veth
end with it). Needs root and iproute2; ``unavailable()`` says why not, or None. The addresses
are 10.231.1.1 and 10.231.1.2 on a link of their own: traffic stays between the namespaces made
here. This kernel may lack ``netem`` (delay) and ``fq`` (per-flow pacing): ``tbf``/``htb`` limit
rates only, and a flow's cap is an htb class matched on its ports (``u32``).
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess


def _ip(*args):
    got = subprocess.run(["ip", *args], capture_output=True, text=True)
    if got.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {got.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"approbe{secrets.token_hex(3)}"
    got = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if got.returncode != 0:
        return f"ip netns add failed: {got.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def make(n: int = 2, rate: str | None = None, per_flow: bool = False) -> tuple[dict, list]:
    """``n`` (2) hosts joined by a veth pair -> (host id -> (namespace, address), names).
    ``rate``: each veth end's rate (``tc tbf``, or with ``per_flow`` an ``htb`` class that
    ``cap_flows`` later hangs a class per TCP flow under)."""
    if n != 2:
        raise ValueError(f"{n} hosts: one veth pair joins exactly 2")
    tag = secrets.token_hex(3)
    names = [f"ap{tag}h{h}" for h in range(n)]
    made = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        ends = [f"ap{tag}v{h}" for h in range(n)]
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        places = {}
        for h, (ns, dev) in enumerate(zip(names, ends)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.231.1.{h + 1}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            tc = ("netns", "exec", ns, "tc")
            if per_flow:                   # 1:1 the NIC; 1:2 what no flow's class takes
                nic = rate or "100gbit"
                _ip(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2")
                for cls in ("1:1", "1:2"):
                    _ip(*tc, "class", "add", "dev", dev, "parent", "1:" if cls == "1:1" else "1:1",
                        "classid", cls, "htb", "rate", nic, "ceil", nic)
            elif rate:
                _ip(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb",
                    "latency", "10ms")
            places[h] = (ns, f"10.231.1.{h + 1}")
    except BaseException:
        remove(made)
        raise
    return places, names


def tcp_flows(comm=None) -> list:
    """(local port, remote port) of this process's namespace's established TCP connections to
    other addresses than loopback (a job's worker function: ``job.call(tcp_flows, ...)``)."""
    out = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        (lip, lport), (rip, rport) = (a.split(":") for a in f[1:3])
        if f[3] == "01" and rip != "0100007F":                  # ESTABLISHED, not 127.0.0.1
            out.append((int(lport, 16), int(rport, 16)))
    return out


def cap_flows(names, flows, flow_rate: str) -> None:
    """Give each TCP flow leaving host h (``flows[h]``: (local port, remote port) pairs, from
    ``tcp_flows`` on h's ranks) its own htb class capped at ``flow_rate`` under the NIC's,
    as a path that holds one flow below the link's rate does. The hosts were made with
    ``make(per_flow=True)``."""
    for h, ns in enumerate(names):
        dev = f"{ns[:-2]}v{h}"
        tc = ("netns", "exec", ns, "tc")
        for i, (lport, rport) in enumerate(sorted(set(flows.get(h, ())))):
            cls = f"1:{10 + i:x}"
            _ip(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb", "rate",
                flow_rate, "ceil", flow_rate)
            _ip(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "sport", str(lport), "0xffff", "match", "ip", "dport",
                str(rport), "0xffff", "flowid", cls)


def remove(names) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
