"""Emulated hosts on this machine: Linux network namespaces joined by a veth pair.

In: a count of hosts (2), an optional NIC rate for ``tc tbf`` on each veth end (e.g.
"10gbit"). Out: ``{host id: (namespace, IPv4 address)}``, what ``runtime.launcher.Job``'s
``namespaces`` takes, and the namespace names ``remove`` deletes (each namespace takes its veth
end with it). Needs root and iproute2; ``unavailable()`` says why not, or None. The addresses
are 10.231.1.1 and 10.231.1.2 on a link of their own: traffic stays between the namespaces made
here. This kernel may lack ``netem`` (delay): ``tbf`` limits the rate only.
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


def make(n: int = 2, rate: str | None = None) -> tuple[dict, list]:
    """``n`` (2) hosts joined by a veth pair -> (host id -> (namespace, address), names)."""
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
            if rate:
                _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                    rate, "burst", "1mb", "latency", "10ms")
            places[h] = (ns, f"10.231.1.{h + 1}")
    except BaseException:
        remove(made)
        raise
    return places, names


def remove(names) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
