"""One rank of a native job (started by ``runtime.launcher.Job``; not for direct use).

In (argv): the caller's control socket, rank, size, the inherited segment descriptor, host ids,
timeout, whether ranks of different hosts use TCP, the TCP rendezvous address; the job token
in ``AUTOPAR_JOB_TOKEN``. Out: replies on the control socket: ("ready",) once the links are
up, then per ("call", (module, name), args) an ("ok", result) or ("error", kind, message,
traceback text); kind is "CollectiveError" for any autopar CollectiveError, else the
exception's type name.
Exits on ("exit",) or when the caller goes away.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from multiprocessing.connection import Client

from autopar.errors import CollectiveError


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv):
    address, rank, size, fd, hosts, timeout, tcp, rendezvous = argv
    rank, size, fd = int(rank), int(size), int(fd)
    token = os.environ.pop("AUTOPAR_JOB_TOKEN")
    conn = Client(address, family="AF_UNIX", authkey=token.encode())
    conn.send(rank)
    try:
        from autopar import _native
        comm = _native.Comm(rank, size, fd, [int(h) for h in hosts.split(",")], float(timeout),
                            tcp == "1")
        os.close(fd)
        if rendezvous:
            comm.connect_tcp(rendezvous, token)
    except Exception as e:            # noqa: BLE001 - reported to the caller
        conn.send(("failed", rank, f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0                  # the caller is gone
        if msg[0] == "exit":
            return 0
        _, (module, name), args = msg
        try:
            conn.send(("ok", _resolve(module, name)(comm, *args)))
        except Exception as e:        # noqa: BLE001 - reported to the caller
            kind = "CollectiveError" if isinstance(e, CollectiveError) else type(e).__name__
            conn.send(("error", kind, str(e), traceback.format_exc()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
