"""Emulated hosts on this machine: Linux network namespaces joined by veth links.

In: a count of hosts (two joined by a veth pair, more each by a veth to a bridge in a switch
namespace), an optional NIC rate per host (e.g. "10gbit"), and for ``cap_flows`` the
established TCP flows to cap one by one. Out: ``{host id: (namespace, IPv4 address)}``, what
``runtime.launcher.Job``'s ``namespaces`` takes, and the namespace names ``remove`` deletes
(each namespace takes its veth ends with it). Needs root and iproute2; ``unavailable()`` says
why not, or None. Host h's address is 10.231.1.(h+1) on links of their own: traffic stays
between the namespaces made here. This kernel may lack ``netem`` (delay) and ``fq`` (per-flow
pacing): ``tbf``/``htb`` limit rates only, and a flow's cap is an htb class matched on its
ports (``u32``).
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
    """``n`` hosts -> (host id -> (namespace, address), names). Two hosts are joined by a veth
    pair; more by a veth each to a bridge in a "switch" namespace of their own (the last of
    ``names``). ``rate``: each host's NIC rate (``tc tbf`` on its veth end, and on the
    switch's end towards it; with ``per_flow`` an ``htb`` class that ``cap_flows`` later hangs
    a class per TCP flow under)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 200:
        raise ValueError(f"{n!r} hosts: make 2 to 200")
    tag = secrets.token_hex(3)
    names = [f"ap{tag}h{h}" for h in range(n)]
    switch = f"ap{tag}sw" if n > 2 else None
    made = []
    try:
        for ns in names + ([switch] if switch else []):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        ends = [f"ap{tag}v{h}" for h in range(n)]
        if switch:
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for h, dev in enumerate(ends):
                port = f"ap{tag}s{h}"
                _ip("link", "add", dev, "type", "veth", "peer", "name", port)
                _ip("link", "set", port, "netns", switch)
                _ip("-n", switch, "link", "set", port, "master", "br0")
                _ip("-n", switch, "link", "set", port, "up")
                if rate:
                    _shape(switch, port, rate, False)
        else:
            _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        places = {}
        for h, (ns, dev) in enumerate(zip(names, ends)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.231.1.{h + 1}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            if rate or per_flow:
                _shape(ns, dev, rate, per_flow)
            places[h] = (ns, f"10.231.1.{h + 1}")
    except BaseException:
        remove(made)
        raise
    return places, names + ([switch] if switch else [])


def _shape(ns, dev, rate, per_flow):
    """Limit what leaves ``dev`` to ``rate``: a tbf, or with ``per_flow`` an htb whose class
    1:1 is the NIC and 1:2 takes what no flow's class (``cap_flows``) does."""
    tc = ("netns", "exec", ns, "tc")
    if per_flow:
        nic = rate or "100gbit"
        _ip(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2")
        for cls, parent in (("1:1", "1:"), ("1:2", "1:1")):
            _ip(
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                parent,
                "classid",
                cls,
                "htb",
                "rate",
                nic,
                "ceil",
                nic,
            )
    else:
        _ip(
            *tc,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "1mb",
            "latency",
            "10ms",
        )


def tcp_flows(comm=None) -> list:
    """(local port, remote port) of this process's namespace's established TCP connections to
    other addresses than loopback (a job's worker function: ``job.call(tcp_flows, ...)``)."""
    out = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        (lip, lport), (rip, rport) = (a.split(":") for a in f[1:3])
        if f[3] == "01" and rip != "0100007F":  # ESTABLISHED, not 127.0.0.1
            out.append((int(lport, 16), int(rport, 16)))
    return out


def cap_flows(names, flows, flow_rate: str) -> None:
    """Give each TCP flow leaving host h (``flows[h]``: (local port, remote port) pairs, from
    ``tcp_flows`` on h's ranks) its own htb class capped at ``flow_rate`` under the NIC's,
    as a path that holds one flow below the link's rate does. The hosts were made with
    ``make(per_flow=True)``."""
    for h, got in flows.items():
        ns = names[h]
        dev = f"{ns[:-2]}v{h}"
        tc = ("netns", "exec", ns, "tc")
        for i, (lport, rport) in enumerate(sorted(set(got))):
            cls = f"1:{10 + i:x}"
            _ip(
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "classid",
                cls,
                "htb",
                "rate",
                flow_rate,
                "ceil",
                flow_rate,
            )
            _ip(
                *tc,
                "filter",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "sport",
                str(lport),
                "0xffff",
                "match",
                "ip",
                "dport",
                str(rport),
                "0xffff",
                "flowid",
                cls,
            )


def remove(names) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
