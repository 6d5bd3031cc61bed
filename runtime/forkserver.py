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

``keep_warm(path, env, n)`` (``Job.keep_warm``, when a compiled step is closed) has the server
fork n warm workers that start their JAX backend and compile once, then wait; the next job's
ranks are handed to them, so its load skips that (about 0.4 s of CPU per rank: the quick
start's 8 ranks on 2 cores load in 1.1-1.2 s instead of 3.3). Messages travel pickled over a
socketpair only the caller and the server hold, descriptors beside them (SCM_RIGHTS).
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
_POOL = 8  # warm children a server keeps at most
_HEADER = struct.Struct("<I")
_MAX_FDS = 8
_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from autopar.runtime import forkserver; forkserver._serve(int(sys.argv[2]))"
)


def _send(sock, msg, fds=()) -> None:
    data = pickle.dumps(msg)
    socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))


def _recv(sock):
    """One message and the descriptors that came with it; (None, []) at the end (the other
    side closed, or went away with messages of ours unread: a reset)."""
    try:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    except ConnectionResetError:
        return None, []
    if not head:
        return None, []
    try:
        head += _exactly(sock, _HEADER.size - len(head))
        (n,) = _HEADER.unpack(head)
        data = _exactly(sock, n)
    except (ConnectionResetError, EOFError):
        return None, fds
    return pickle.loads(data), fds


def _exactly(sock, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


class Forked:
    """A worker the server forked: Popen's view of it (the server reports its exit)."""

    def __init__(self, server: _Server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.exits.get(self.pid)
        if (
            self.returncode is None
            and not self.server.alive
            and not os.path.exists(f"/proc/{self.pid}")
        ):
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
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps(path), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock, self.alive = mine, True
        self.exits: dict[int, int] = {}  # pid -> exit code, of the workers that exited
        self.idle: set[int] = set()  # the pids of the warm workers waiting
        self.pids: list[int] = []  # forked workers not yet handed to a request
        self.lock, self.changed = threading.Lock(), threading.Condition()
        self.stale = 0  # answers owed to requests whose caller stopped waiting (Ctrl-C)
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
                    self.idle.discard(msg[1])
                elif msg[0] == "idle":
                    self.idle.add(msg[1])
                else:
                    self.pids.append(msg[1])
                    self.idle.discard(msg[1])
                self.changed.notify_all()
            if msg is None:
                return

    def spawn(self, args, fd_args, cwd, token) -> Forked:
        """The worker forked for this request. The server answers requests in order; an answer
        whose caller was interrupted while waiting for it (``stale``) is the next to come, and
        its worker, which no job will ever accept, is killed rather than taken for this one."""
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            with self.lock:  # one request answered at a time
                _send(
                    self.sock,
                    ("spawn", list(args), list(fd_args), cwd, token),
                    [null, 1, 2] + [int(args[i]) for i in fd_args],
                )
                try:
                    with self.changed:
                        while len(self.pids) <= self.stale and self.alive:
                            self.changed.wait(0.05)
                        for _ in range(min(self.stale, len(self.pids))):
                            Forked(self, self.pids.pop(0)).kill()
                            self.stale -= 1
                        if not self.pids:
                            raise OSError("the fork server exited before forking a worker")
                        return Forked(self, self.pids.pop(0))
                except BaseException:
                    self.stale += 1  # this request's answer is still to come
                    raise
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


_servers: dict = {}  # environment key -> _Server, least recently used first
_servers_lock = threading.Lock()


def _forget_servers() -> None:
    """In a child forked from the caller (``multiprocessing``'s fork, ``os.fork``): the
    servers, their sockets and reader threads are the parent's, so the child starts its own
    (the copies of the sockets close with the dropped objects; the parent's stay open)."""
    global _servers, _servers_lock
    _servers, _servers_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_servers)


def kept_pids() -> set:
    """The pids of the processes kept between jobs: this process's live fork servers and the
    warm workers waiting in them."""
    with _servers_lock:
        return set().union(*({s.proc.pid} | s.idle for s in _servers.values() if s.alive))


def _key(path, env) -> tuple:
    return (
        json.dumps(path),
        tuple(sorted((k, v) for k, v in env.items() if k != "AUTOPAR_JOB_TOKEN")),
    )


def keep_warm(path: list, env: dict, n: int) -> None:
    """Ask the server of ``(path, env)``, if there is one, to keep ``n`` warm workers ready
    (each has started its JAX backend and compiled once: a job's first load then skips that,
    about 0.4 s of CPU per rank). Call it when a job is done, so their warming does not take
    cores from its steps."""
    with _servers_lock:
        server = _servers.get(_key(path, env))
        if server is not None and server.alive:
            with server.lock:
                _send(server.sock, ("warm", int(n)))


def spawn(path: list, args, env: dict, fd_args=()) -> Forked:
    """Fork a worker running ``worker.main(args)`` under ``env`` (see the module docstring);
    ``path`` is the ``sys.path`` the server imports the package with."""
    key = _key(path, env)
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
    child's exit code; exit when the caller's socket closes. Asked to keep n workers warm, it
    forks warm children (``_idle``) until n (at most ``_POOL``) wait, and hands the next
    requests to them; a request stops the warming until it is asked again (after the job's
    start), so warming children never compete with a job's start."""
    import select

    sock = socket.socket(fileno=fd)
    import jax  # noqa: F401 -- what the workers would import themselves
    import numpy  # noqa: F401

    from autopar import _native  # noqa: F401
    from autopar.runtime import native_backend, native_step, worker  # noqa: F401

    children: set[int] = set()
    idle: list[tuple[int, socket.socket]] = []  # warm children: (pid, socket)
    target = 0
    while True:
        ready, _, _ = select.select([sock] + [s for _, s in idle], [], [], 0.05)
        for pid, s in [w for w in idle if w[1] in ready]:  # an idle child went away
            idle.remove((pid, s))
            s.close()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if sock in ready:
            msg, fds = _recv(sock)
            if msg is None:
                os._exit(0)
            if msg[0] == "warm":
                target = min(msg[1], _POOL)
                continue
            job, target = msg[1:], 0  # no warming while a job starts
            if idle:
                pid, s = idle.pop(0)
                _send(s, job, fds)
                s.close()
            else:
                pid = _fork(lambda: _child(job, fds), [sock] + [s for _, s in idle])
            for f in fds:
                os.close(f)
            children.add(pid)
            _send(sock, ("pid", pid))
        elif len(idle) < target:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = _fork(lambda: _idle(theirs), [sock, mine] + [s for _, s in idle])
            theirs.close()
            idle.append((pid, mine))
            children.add(pid)
            _send(sock, ("idle", pid))


def _fork(run, close) -> int:
    """Fork; the child closes the server's sockets ``close`` and runs ``run`` (which exits)."""
    pid = os.fork()
    if pid == 0:
        try:
            for s in close:
                s.close()
            run()
        finally:
            os._exit(1)
    return pid


def _idle(conn) -> None:
    """A warm child: initialise the JAX CPU backend and compile through an exported call, as a
    worker's first load would (about 0.4 s of CPU), then wait for a job (``_child``); exit
    when the server goes. XLA is set for one single-threaded device first, as ``worker._pin``
    sets it for a pinned rank: flags are read once, at the backend's start."""
    from .worker import xla_flags

    xla_flags(single_threaded=True)
    import jax
    import jax.numpy as jnp
    from jax import export

    like = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    e = export.deserialize(export.export(jax.jit(lambda x: x @ x + 1.0))(like).serialize())
    jax.jit(e.call).lower(*e.in_avals).compile()
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # the job sets its own cache (compile_shared)
    msg, fds = _recv(conn)
    if msg is None:
        os._exit(0)
    conn.close()
    _child(msg, fds)


def _child(job: tuple, fds: list[int]) -> None:
    """Become the worker of ``job`` (a spawn request's args, fd_args, cwd and token): the
    caller's stdin/stdout/stderr and segment descriptor, its working directory and job token,
    then ``worker.main``; exit with its code."""
    code = 1
    try:
        args, fd_args, cwd, token = job
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
    except BaseException:  # noqa: BLE001 -- reported as the exit code
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
