"""Start, drive and stop the worker processes of a native job.

In: the number of ranks, optional host ids per rank (the 2D algorithms' hierarchy; with
``inter_host="tcp"`` ranks of different host ids talk over TCP, emulating several hosts on this
one), the collective timeout. Out: a ``Job``: ``job.call(fn, per_rank_args)`` runs the
module-level function ``fn(comm, *args)`` on every rank (``comm`` an ``autopar._native.Comm``)
and returns the per-rank results; ``job.close()`` stops the workers.

The workers are ``python -m autopar.runtime.worker`` processes: they inherit the job's shared
memory segment (a memfd: nothing is ever named in /dev/shm, so nothing outlives them), reach
the caller over a Unix socket authenticated with the job's random token (passed in the
environment, not the command line), and exit when the caller goes away. A monitor thread
watches them: when a rank dies, the segment's abort flag makes every other rank's collective
raise ``CollectiveError`` at its next wait, and ``call`` raises it too, naming the rank.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Listener

from autopar.errors import CollectiveError, ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, nranks: int, hosts=None, timeout: float = 10.0, inter_host: str = "shm"):
        from autopar import _native
        if nranks < 1:
            raise ConfigError(f"a native job needs at least one rank, not {nranks}.")
        hosts = list(hosts) if hosts is not None else [0] * nranks
        if len(hosts) != nranks:
            raise ConfigError(f"hosts names {len(hosts)} ranks' hosts; the job has {nranks}.")
        if inter_host not in ("shm", "tcp"):
            raise ConfigError(f"inter_host must be 'shm' or 'tcp', not {inter_host!r}.")
        self.nranks, self.timeout = nranks, timeout
        self.token = secrets.token_hex(16)
        self.segment = _native.Segment.create(nranks)
        self._dir = tempfile.TemporaryDirectory(prefix="autopar-")
        address = os.path.join(self._dir.name, "control")
        listener = Listener(address, family="AF_UNIX", authkey=self.token.encode())
        tcp = inter_host == "tcp" and len(set(hosts)) > 1
        rendezvous = f"127.0.0.1:{_free_port()}" if tcp else ""
        env = dict(os.environ, AUTOPAR_JOB_TOKEN=self.token, JAX_PLATFORMS="cpu")
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)  # as spawn does
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "autopar.runtime.worker", address, str(r), str(nranks),
             str(self.segment.fd), ",".join(map(str, hosts)), str(timeout),
             "1" if inter_host == "tcp" else "0", rendezvous],
            pass_fds=(self.segment.fd,), env=env, stdin=subprocess.DEVNULL) for r in range(nranks)]
        self.failure: str | None = None
        self.closed = False
        self.conns = [None] * nranks                 # filled in by _accept
        self._finalizer = weakref.finalize(self, Job._stop, self.procs, self.conns)
        try:
            accept = threading.Thread(target=self._accept, args=(listener,), daemon=True)
            accept.start()
            deadline = time.monotonic() + max(60.0, timeout)
            while accept.is_alive() and time.monotonic() < deadline and not self._dead():
                accept.join(0.05)
            if any(c is None for c in self.conns):
                raise CollectiveError(self._dead() or "the workers did not start in time")
            for c in self.conns:                     # each rank reports after connecting links
                reply = c.recv()
                if reply[0] != "ready":
                    raise CollectiveError(f"rank {reply[1]} failed to start: {reply[2]}")
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self._monitor = threading.Thread(target=self._watch, daemon=True)
        self._monitor.start()

    def _accept(self, listener):
        for _ in range(self.nranks):
            conn = listener.accept()
            rank = conn.recv()
            self.conns[rank] = conn

    def _dead(self) -> str | None:
        for r, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                return f"rank {r} (pid {p.pid}) exited with code {code}"
        return None

    def _watch(self):
        while not self.closed:
            dead = self._dead()
            if dead and not self.closed:
                self.failure = dead
                self.segment.abort(-1, dead)
                return
            time.sleep(0.05)

    def call(self, fn, per_rank_args):
        """Run ``fn(comm, *per_rank_args[r])`` on every rank r; the list of results."""
        if self.closed or self.failure:
            raise CollectiveError(f"this job is {'closed' if self.closed else 'failed: ' + self.failure}")
        name = (fn.__module__, fn.__qualname__)
        for c, args in zip(self.conns, per_rank_args):
            c.send(("call", name, tuple(args)))
        results, errors = [None] * self.nranks, []
        for r, c in enumerate(self.conns):
            while not c.poll(0.05):
                if self.failure:
                    break
            if self.failure and not c.poll(0.2):
                errors.append((r, "CollectiveError", self.failure))
                continue
            try:
                reply = c.recv()
            except (EOFError, OSError):
                errors.append((r, "CollectiveError", self.failure or f"rank {r} went away"))
                continue
            if reply[0] == "ok":
                results[r] = reply[1]
            else:
                errors.append((r, reply[1], reply[2]))
        if errors:
            r, kind, msg = min(errors, key=lambda e: e[1] != "CollectiveError")
            if kind == "CollectiveError":
                raise CollectiveError(msg)
            raise RuntimeError(f"rank {r}: {kind}: {msg}")
        return results

    def close(self):
        """Stop the workers (they exit on their own when the caller goes away, too)."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()
        self._dir.cleanup()

    @staticmethod
    def _stop(procs, conns):
        for c in conns:
            try:
                if c is not None:
                    c.send(("exit",))
                    c.close()
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
