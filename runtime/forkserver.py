"""Native workers forked from a warm parent instead of started from nothing.

A worker spends most of its start importing jax, numpy and autopar (about 1.3 s of CPU each;
a job of 8 ranks on 2 cores took 9.5 s to start). A fork server is a process of this
package's, started once, that imports them and then forks each worker on request: the child
has the modules already and runs ``worker.main`` at once. Nothing in the server initialises a
JAX backend or starts a thread of its own, so forking it is safe (jax warns only after a backend
exists).

In: ``spawn(args, env, fd_args)``: the worker's arguments (``worker.main``'s argv), its whole
environment, and the indices of the arguments that are file descriptors to hand over (the
job's segment). Out: a ``Forked``, with ``subprocess.Popen``'s ``pid``, ``returncode``,
``poll``, ``wait`` and ``kill``. The child gets the caller's current stdin, stdout and stderr,
its working directory and exactly ``env``. A server serves one environment: the modules it
imported read theirs as they were imported, so a caller whose environment has changed since
(a benchmark setting ``AUTOPAR_*``, a test's ``XLA_FLAGS``) gets a server of its own; at most
``_KEEP`` servers are kept, the least recently used closed first. A server exits when its
caller goes away; it reaps its children and reports their exit codes.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time

_KEEP = 2
_HEADER = struct.Struct("<I")
_MAX_FDS = 8
_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
         "from autopar.runtime import forkserver; forkserver._serve(int(sys.argv[2]))")


def _send(sock, msg, fds=()) -> None:
    data = pickle.dumps(msg)
    socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))


def _recv(sock):
    """One message and the descriptors that came with it; (None, []) at the end."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not head:
        return None, []
    while len(head) < _HEADER.size:
        head += sock.recv(_HEADER.size - len(head))
    (n,) = _HEADER.unpack(head)
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return pickle.loads(bytes(data)), fds


class Forked:
    """A worker the server forked: Popen's view of it (the server reports its exit)."""

    def __init__(self, server: "_Server", pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.exits.get(self.pid)
        if self.returncode is None and not self.server.alive and \
                not os.path.exists(f"/proc/{self.pid}"):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        with self.server.changed:
            while self.poll() is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
                self.server.changed.wait(0.05 if left is None else min(left, 0.05))
        return self.returncode

    def kill(self):
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


class _Server:
    """The caller's end of one fork server."""

    def __init__(self, path: list, env: dict):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(path),
                                      str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                     env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.exits, self.alive = mine, {}, True
        self.lock, self.changed, self.pids = threading.Lock(), threading.Condition(), []
        self.reader = threading.Thread(target=self._read, daemon=True, name="autopar-forkserver")
        self.reader.start()

    def _read(self):
        while True:
            try:
                msg, _ = _recv(self.sock)
            except OSError:
                msg = None
            with self.changed:
                if msg is None:
                    self.alive = False
                elif msg[0] == "exit":
                    self.exits[msg[1]] = msg[2]
                else:
                    self.pids.append(msg[1])
                self.changed.notify_all()
            if msg is None:
                return

    def spawn(self, args, fd_args, cwd, token) -> Forked:
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            with self.lock:                       # one request answered at a time
                _send(self.sock, ("spawn", list(args), list(fd_args), cwd, token),
                      [null, 1, 2] + [int(args[i]) for i in fd_args])
                with self.changed:
                    while not self.pids and self.alive:
                        self.changed.wait(0.05)
                    if not self.pids:
                        raise OSError("the fork server exited before forking a worker")
                    return Forked(self, self.pids.pop(0))
        finally:
            os.close(null)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_servers: dict = {}          # environment key -> _Server, least recently used first
_servers_lock = threading.Lock()


def server_pids() -> set:
    """The pids of this process's live fork servers."""
    with _servers_lock:
        return {s.proc.pid for s in _servers.values() if s.alive}


def spawn(path: list, args, env: dict, fd_args=()) -> Forked:
    """Fork a worker running ``worker.main(args)`` under ``env`` (see the module docstring);
    ``path`` is the ``sys.path`` the server imports the package with."""
    key = (json.dumps(path), tuple(sorted((k, v) for k, v in env.items()
                                          if k != "AUTOPAR_JOB_TOKEN")))
    with _servers_lock:
        server = _servers.pop(key, None)
        if server is None or not server.alive:
            server = _Server(path, {k: v for k, v in env.items() if k != "AUTOPAR_JOB_TOKEN"})
        _servers[key] = server
        while len(_servers) > _KEEP:
            _servers.pop(next(iter(_servers))).close()
    return server.spawn(args, fd_args, os.getcwd(), env.get("AUTOPAR_JOB_TOKEN"))


# ---------------------------------------------------------------------- the server's side
def _serve(fd: int) -> None:
    """The server process: import what a worker needs, then fork one per request; report each
    child's exit code; exit when the caller's socket closes."""
    import select
    sock = socket.socket(fileno=fd)
    import jax  # noqa: F401 -- what the workers would import themselves
    import numpy  # noqa: F401
    from autopar import _native  # noqa: F401
    from autopar.runtime import native_backend, native_step, worker  # noqa: F401
    children = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if not ready:
            continue
        msg, fds = _recv(sock)
        if msg is None:
            os._exit(0)
        _, args, fd_args, cwd, token = msg
        pid = os.fork()
        if pid == 0:
            _child(sock, args, fd_args, cwd, fds, token)
        for f in fds:
            os.close(f)
        children.add(pid)
        _send(sock, ("pid", pid))


def _child(sock, args, fd_args, cwd, fds, token) -> None:
    code = 1
    try:
        sock.close()
        if token is not None:
            os.environ["AUTOPAR_JOB_TOKEN"] = token
        for target, f in zip((0, 1, 2), fds[:3]):
            os.dup2(f, target)
        for i, f in zip(fd_args, fds[3:]):
            os.set_inheritable(f, True)
            args[i] = str(f)
        for f in fds[:3]:
            os.close(f)
        os.chdir(cwd)
        from autopar.runtime import worker
        code = worker.main(args)
    except BaseException:             # noqa: BLE001 -- reported as the exit code
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
