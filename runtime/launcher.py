"""Start, drive and stop the worker processes of a native job.

In: the number of ranks, optional host ids per rank (the 2D algorithms' hierarchy; with
``inter_host="tcp"`` ranks of different host ids talk over TCP, emulating several hosts on this
one, and with ``namespaces`` each host's ranks run in a Linux network namespace of their own,
reaching the others through its network: host id -> (namespace, IPv4 address); the caller
makes the namespaces and their links; ``tcp_streams`` TCP connections per pair of ranks on
different hosts, sharing each message in chunks), the collective timeout, whether large shared-memory messages may be read single-copy
from the sender's memory (``direct``, ``RuntimeOptions.direct``; on only where every rank can
reach the others' memory). Out: a ``Job``: ``job.call(fn, per_rank_args)`` runs the
module-level function ``fn(comm, *args)`` on every rank (``comm`` an ``autopar._native.Comm``)
and returns the per-rank results; ``job.close()`` stops the workers.

The workers run ``autopar.runtime.worker`` from the package this process imported, whatever
the working directory (``_worker_path``): forked from a warm server that has imported it
(``forkserver.py``; ``job.keep_warm()`` as a job is closed has warm workers ready for the
next), or started as new processes (``fork=False``, and always where ranks run in network
namespaces). They inherit the job's shared memory segment (a
memfd: nothing is ever named in /dev/shm, so nothing outlives them), reach
the caller over a Unix socket authenticated with the job's random token (passed in the
environment, not the command line), and exit when the caller goes away. A monitor thread
watches them: when a rank dies, the segment's abort flag makes every other rank's collective
raise ``CollectiveError`` at its next wait, and ``call`` raises it too, naming the rank.

Failures in ``call``: a Python exception inside a rank's ``fn`` raises ``WorkerError`` (its
rank, exception type and the worker's traceback); a dead rank or a failed collective raises
``CollectiveError``. Once anything has failed, the ranks still running get a short grace to
answer; then the segment is aborted (so every rank waiting in a collective fails at once), and
ranks that still do not answer (stuck outside any collective, e.g. in Python) are killed and
named in the ``CollectiveError``. A job whose segment was aborted is failed: close it and start
a new one.

Deadlines on the control channel (the caller's side of each rank's socket): a send of a call's
arguments or a read of an answer that moves no byte for ``timeout`` (the collective timeout)
fails, and so does a rank that has not answered ``timeout`` after the first rank did (the ranks
run one program in step; those waiting in a collective for a stopped rank answer once the
segment is aborted), except, in the call that loads a program, a rank that has used a core in
that time (read from /proc): a fresh worker starting JAX and compiling beside a warm one is
slow, not stuck, and gets another ``timeout``. Either way the rank is stopped, swapped out or stuck
outside any collective: it is killed and named in the ``CollectiveError``, and the job is
failed. The start waits at most ``max(60 s, timeout)`` for every rank to report its links up;
``close`` closes the sockets (a worker exits when its socket closes), waits 5 s and kills what
is left.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Listener
from typing import TYPE_CHECKING

from autopar.config import NATIVE_MAX_RANKS
from autopar.errors import CollectiveError, ConfigError, WorkerError

from . import wire
from .liveness import CpuProgress

if TYPE_CHECKING:
    from .forkserver import Forked

START_SECONDS = 60.0  # the least a job's ranks get to connect and report their links up
_GRACE = 1.0  # seconds the other ranks get to answer once a rank has failed, and again once
# the job was aborted (each at most half the collective timeout); a rank in a
# collective answers within milliseconds of an abort, one silent for longer is
# stuck outside them
_ORDER = {"exited": 1, "unresponsive": 1, "CollectiveError": 2}  # error kinds by how little
# they say about the cause; a worker's own
# exception (0) says most


def _deadline(conn, seconds: float) -> None:
    """Make every blocking read and write on ``conn``'s socket fail (``BlockingIOError``) once
    it has moved no byte for ``seconds``: a peer that is stopped, swapped out or stuck cannot
    hold the caller in a send that filled the socket's buffer or a half-read message."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    with socket.socket(fileno=os.dup(conn.fileno())) as s:  # options belong to the socket
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def _free_port() -> int:
    """A port free on this host for the TCP rendezvous, below the kernel's ephemeral range:
    rank 0 binds it later, and the other ranks' TCP listeners (port 0) take ephemeral ports
    meanwhile, in rank 0's network namespace too, where this process cannot look; one of them
    took a port chosen from that range first (``bind ...: Address already in use``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = secrets.randbelow(max(low, 10001) - 10000) + 10000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise CollectiveError(
        f"no free port for the TCP rendezvous in [10000, {low}) after 100 "
        "tries; free some or widen net.ipv4.ip_local_port_range."
    )


_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from autopar.runtime import worker; sys.exit(worker.main(sys.argv[2:]))"
)


def _worker_path() -> tuple[list, str]:
    """The ``sys.path`` a worker imports exactly the ``autopar`` this process imported with
    (the folder holding it first, ``''`` read as the working directory now, as
    multiprocessing's spawn does), and that package's folder. ``python -m`` would put the
    working directory first, so a source checkout there (``./autopar`` without its built
    ``_native``) would shadow an installed package. The worker checks the package it got."""
    init = sys.modules["autopar"].__file__
    assert init is not None  # a regular package (its __init__.py), not a namespace one
    package = os.path.dirname(os.path.abspath(init))
    return [os.path.dirname(package)] + [p or os.getcwd() for p in sys.path], package


def _worker_command() -> list[str]:
    """The command that starts a worker: ``python -c`` with a bootstrap that sets
    ``sys.path`` to ``_worker_path``'s before anything is imported."""
    path, package = _worker_path()
    return [sys.executable, "-c", _BOOT, json.dumps(path), package]


def _places(namespaces, hosts, tcp) -> dict:
    """Host id -> (command prefix, IPv4 address its ranks listen on): ``namespaces`` maps host
    ids to (Linux network namespace, its address), so a host's ranks run inside their namespace
    (``ip netns exec``) and reach other hosts over its network; else every host is this one's
    loopback."""
    out: dict[int, tuple[list[str], str]] = {h: ([], "127.0.0.1") for h in hosts}
    if namespaces is None:
        return out
    if not tcp:
        raise ConfigError(
            "namespaces place hosts in network namespaces, whose ranks can only "
            "talk over TCP: give inter_host='tcp' and ranks on several hosts."
        )
    missing = sorted(set(hosts) - set(namespaces))
    if missing:
        raise ConfigError(f"namespaces names no (namespace, address) for host(s) {missing}.")
    for h in out:
        ns, addr = namespaces[h]
        out[h] = (["ip", "netns", "exec", str(ns)], str(addr))
    return out


class Job:
    @wire.needs_descriptors(
        "starting a native job (a few per rank: its control socket, shared memory, pipes)"
    )
    def __init__(
        self,
        nranks: int,
        hosts=None,
        timeout: float = 10.0,
        inter_host: str = "shm",
        direct: bool = True,
        namespaces=None,
        tcp_streams: int = 1,
        fork: bool = True,
    ):
        from autopar import _native

        if (
            isinstance(nranks, bool)
            or not isinstance(nranks, int)
            or not 1 <= nranks <= NATIVE_MAX_RANKS
        ):
            raise ConfigError(f"a native job has 1 to {NATIVE_MAX_RANKS} ranks, not {nranks!r}.")
        hosts = list(hosts) if hosts is not None else [0] * nranks
        if len(hosts) != nranks:
            raise ConfigError(f"hosts names {len(hosts)} ranks' hosts; the job has {nranks}.")
        if inter_host not in ("shm", "tcp"):
            raise ConfigError(f"inter_host must be 'shm' or 'tcp', not {inter_host!r}.")
        if (
            isinstance(tcp_streams, bool)
            or not isinstance(tcp_streams, int)
            or not 1 <= tcp_streams <= 16
        ):
            raise ConfigError(
                f"tcp_streams (TCP connections per pair of ranks on different "
                f"hosts) must be an int in [1, 16], not {tcp_streams!r}."
            )
        places = _places(namespaces, hosts, inter_host == "tcp" and len(set(hosts)) > 1)
        self.nranks, self.timeout = nranks, timeout
        self.token = secrets.token_hex(16)
        self.segment = _native.Segment.create(nranks)
        self._dir = tempfile.TemporaryDirectory(prefix="autopar-", ignore_cleanup_errors=True)
        address = os.path.join(self._dir.name, "control")
        listener = Listener(address, family="AF_UNIX", authkey=self.token.encode())
        tcp = inter_host == "tcp" and len(set(hosts)) > 1
        rendezvous = f"{places[hosts[0]][1]}:{_free_port()}" if tcp else ""
        env = dict(os.environ, AUTOPAR_JOB_TOKEN=self.token, JAX_PLATFORMS="cpu")
        args = [
            [
                address,
                str(r),
                str(nranks),
                str(self.segment.fd),
                ",".join(map(str, hosts)),
                str(timeout),
                "1" if inter_host == "tcp" else "0",
                rendezvous,
                "1" if direct else "0",
                places[hosts[r]][1],
                str(tcp_streams),
            ]
            for r in range(nranks)
        ]
        self._warm = None  # (path, env) of the fork server, if forked
        self.procs: list[Forked | subprocess.Popen[bytes]] = []
        try:
            if fork and namespaces is None:  # forked from a warm server (forkserver.py)
                from . import forkserver

                path, package = _worker_path()
                for a in args:
                    self.procs.append(forkserver.spawn(path, [package, *a], env, fd_args=(4,)))
                self._warm = (path, env)
            else:
                command = _worker_command()
                for r in range(nranks):
                    self.procs.append(
                        subprocess.Popen(
                            [*places[hosts[r]][0], *command, *args[r]],
                            pass_fds=(self.segment.fd,),
                            env=env,
                            stdin=subprocess.DEVNULL,
                        )
                    )
        except BaseException:  # e.g. Ctrl-C: the ranks started so far go
            listener.close()
            self._dir.cleanup()
            for p in self.procs:
                p.kill()
            raise
        self.failure: str | None = None
        self.closed = False
        self._pid = os.getpid()  # a forked child's copy of the job is not its own
        self._calls = threading.Lock()  # one call at a time: threads share a compiled step
        self._took = 0.0  # seconds the last call took (Job._collect)
        self.conns = [None] * nranks  # filled in by _accept
        self._to = [wire.Box() for _ in range(nranks)]  # to rank r; and its answers', one
        # per answer still lent out, + 1
        self._from: list[dict[int, wire.Box]] = [{} for _ in range(nranks)]
        self._finalizer = weakref.finalize(self, Job._stop, self.procs, self.conns, self._pid)
        try:
            try:
                self._start(listener)
            finally:
                listener.close()  # before the folder holding its socket goes
                self._dir.cleanup()  # (the ranks are connected: nothing is left to a caller
        except BaseException:  # killed later)
            self.close()
            raise
        _JOBS.add(self)
        self._monitor = threading.Thread(target=self._watch, daemon=True)
        self._monitor.start()

    def _start(self, listener):
        """Accept every rank's control connection and wait for each to report its links up."""
        accept = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        accept.start()
        deadline = time.monotonic() + max(START_SECONDS, self.timeout)
        while accept.is_alive() and time.monotonic() < deadline and not self._dead():
            accept.join(0.05)
        if any(c is None for c in self.conns):
            accept.join(0.5)  # a rank that reported and exited may still be being accepted
            late = [f"{r} (pid {self.procs[r].pid})" for r, c in enumerate(self.conns) if c is None]
            raise CollectiveError(
                self._start_failure()
                or self._dead()
                or f"rank(s) {', '.join(late)} did not connect within "
                f"{max(START_SECONDS, self.timeout):.0f} s of the job's start (stopped, or the "
                "machine too busy to start them); nothing is left running, call again"
            )
        for r, c in enumerate(self.conns):  # each rank reports after connecting links
            try:
                if not c.poll(max(0.0, deadline - time.monotonic())):
                    raise CollectiveError(
                        f"rank {r} (pid {self.procs[r].pid}) did not report its links up in time"
                    )
                reply = c.recv()
            except (EOFError, OSError):
                raise CollectiveError(self._gone(r)) from None
            if reply[0] != "ready":
                raise CollectiveError(f"rank {reply[1]} failed to start: {reply[2]}")

    def _start_failure(self) -> str | None:
        """The first failure a connected rank reported before the start gave up (a rank that
        reports it exits, and another rank may fail only because of that), or None."""
        for c in self.conns:
            try:
                reply = c.recv() if c is not None and c.poll(0) else None
            except (EOFError, OSError):
                continue
            if reply and reply[0] == "failed":
                return f"rank {reply[1]} failed to start: {reply[2]}"
        return None

    def _accept(self, listener):
        for _ in range(self.nranks):
            conn = listener.accept()
            rank = conn.recv()
            _deadline(conn, self.timeout)
            self.conns[rank] = conn

    def _dead(self) -> str | None:
        r = self._dead_rank()
        return None if r is None else self._death(r)

    def _dead_rank(self) -> int | None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                return r
        return None

    def _death(self, r: int) -> str:
        p = self.procs[r]
        return f"rank {r} (pid {p.pid}) exited with code {p.returncode}"

    def _gone(self, r: int) -> str:
        """Why rank r's control socket closed (its exit code, once it has one)."""
        try:
            self.procs[r].wait(0.5)
        except subprocess.TimeoutExpired:
            return f"rank {r} (pid {self.procs[r].pid}) closed its control socket"
        return self._death(r)

    def _watch(self):
        while not self.closed:
            r = self._dead_rank()
            if r is not None and not self.closed:
                dead = self._death(r)
                self.failure = self.failure or dead
                self.segment.abort(r, dead)  # a rank >= 0: peers' errors carry the reason
                return
            time.sleep(0.05)

    def call(self, fn, per_rank_args, borrow: bool = False, loading: bool = False):
        """Run ``fn(comm, *per_rank_args[r])`` on every rank r; the list of results. With
        ``borrow``, the results' arrays that came through shared memory are views of it
        (``wire.recv``), valid as long as they are held: a rank answers into shared memory
        none of whose views are held (``lent`` counts those that are). For a function marked
        ``flat`` (``worker``), ``per_rank_args[r]`` is ``(arrays, *args)``, ``arrays`` a list
        of numpy arrays and ``args`` holding none, and each rank's result is ``(head,
        arrays)``. Calls from several threads run one after another. ``loading``: the call
        that loads a program (ranks start JAX and compile, fresh ones far slower than warm
        ones): a late rank that has used a core since another answered is slow, not stuck.

        Raises ``WorkerError`` when ``fn`` raised on a rank, ``CollectiveError`` when a rank died,
        a collective failed or a rank stopped answering after another failed (that rank is
        killed and the job is failed)."""
        with self._calls:
            return self._call(fn, per_rank_args, borrow, loading)

    def _call(self, fn, per_rank_args, borrow, loading=False):
        dead = None if self.closed or self.failure else self._dead()
        if dead:  # before the monitor has seen it
            self.failure = dead
            self.segment.abort(self._dead_rank(), dead)
        if self.closed or self.failure:
            raise CollectiveError(
                f"this native job is {'closed' if self.closed else 'failed: ' + self.failure}; "
                "start a new Job (a compiled step's runner does so on its next call)."
            )
        name = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", ""))
        if not callable(fn) or not name[0] or "<" in name[1]:
            raise ConfigError(
                f"{fn!r}: a job runs module-level functions the workers can "
                "import by name, not lambdas, closures or other objects."
            )
        if not isinstance(per_rank_args, (list, tuple)) or len(per_rank_args) != self.nranks:
            raise ConfigError(
                f"per_rank_args must hold one argument tuple per rank "
                f"({self.nranks}); got {per_rank_args!r:.80}."
            )
        results, errors = [None] * self.nranks, {}  # errors: rank -> (kind, message, tb)
        pending, flat = {}, getattr(fn, "flat", False)
        for r, (c, args) in enumerate(zip(self.conns, per_rank_args)):
            if any(e[0] == "unresponsive" for e in errors.values()):
                break  # the job is failed: the rest get nothing to run
            at, drop = self._answer_box(r)
            try:
                if flat:
                    wire.send(
                        c,
                        ("call", name, tuple(args[1:]), at, drop, args[0]),
                        self._to[r],
                        flat=True,
                    )
                else:
                    wire.send(c, ("call", name, tuple(args), at, drop), self._to[r])
                pending[c] = (r, self._from[r][at])
            except BlockingIOError:
                errors[r] = self._unresponsive(
                    r, "took no byte of the call's arguments in the collective timeout"
                )
            except OSError:
                errors[r] = ("exited", self._gone(r), "")
        try:
            hung = self._collect(pending, results, errors, borrow, loading)
        except BaseException:
            # e.g. KeyboardInterrupt: a reply still owed would answer the next call; the job is done
            self.failure = self.failure or (
                f"a call of {name[0]}.{name[1]} was interrupted before every rank answered"
            )
            self.segment.abort(-1, self.failure)
            raise
        if hung:
            self._give_up(hung, errors)
        if self.segment.aborted and not self.failure:
            self.failure = self.segment.abort_reason()
        gone = [r for r, e in sorted(errors.items()) if e[0] in ("exited", "unresponsive")]
        if gone and not self.failure:  # a rank is gone: the job cannot run another call
            self.failure = errors[gone[0]][1]
        if errors or hung:
            raise self._error(fn, errors, hung)
        return results

    def _answer_box(self, r: int) -> tuple[int, list]:
        """The box rank r answers the next call into: the first none of whose views are held
        (a new one if there is none), and the boxes it drops: the other free ones but the
        first two (a loop that holds its last results uses two by turns)."""
        boxes = self._from[r]
        free = [i for i, b in sorted(boxes.items()) if not b.lent_out]
        at = free[0] if free else min(set(range(len(boxes) + 1)) - set(boxes))
        boxes.setdefault(at, wire.Box())
        drop = [i for i in free[1:] if i >= 2]
        for i in drop:
            boxes.pop(i).close()
        return at, drop

    def lent(self) -> int:
        """The most answers of one rank whose borrowed arrays are still held (``call``)."""
        return max((sum(b.lent_out for b in boxes.values()) for boxes in self._from), default=0)

    def _collect(self, pending, results, errors, borrow=False, loading=False) -> list:
        """Read the replies of ``pending`` (conn -> (rank, the box it answers into)) into
        ``results`` / ``errors``; once something failed, abort the segment after a grace and
        give up on ranks that still do not answer after another. The ranks given up on."""
        grace = self._grace()
        trouble = aborted = None  # when the first failure / the segment's abort was seen
        # poll (wire.readable) from a little before the answers are due, as long as the last
        # call took, until a little after; block before, to leave the cores to the ranks
        start = time.perf_counter()
        spin_from = start + max(0.0, self._took - wire.SPIN_SECONDS)
        spin = max(start, spin_from) + 2 * wire.SPIN_SECONDS
        cpu = None  # loading: the late ranks' CPU time (liveness)
        answered = first = late = None  # when and which rank answered first; whether the
        while pending:  # others were late
            for c in wire.readable(list(pending), 0.05, spin, spin_from):
                r, box = pending.pop(c)
                if answered is None:
                    answered, first = time.monotonic(), r
                    if loading:
                        cpu = CpuProgress(self.procs[q].pid for q, _ in pending.values())
                try:
                    reply = wire.recv(c, box, borrow)
                except BlockingIOError:
                    errors[r] = self._unresponsive(
                        r, "stopped sending its answer for the collective timeout"
                    )
                    continue
                except (EOFError, OSError):
                    errors[r] = ("exited", self._gone(r), "")
                    continue
                if reply[0] == "ok":
                    results[r] = reply[1] if len(reply) == 2 else reply[1:]  # flat: 2 items
                else:
                    errors[r] = tuple(reply[1:])  # (kind, message, traceback)
            now = time.monotonic()
            if trouble is None and (errors or self.failure or self.segment.aborted):
                trouble = now
            if pending and trouble is None and answered and now >= answered + self.timeout:
                # the ranks run one program in step: one that has not answered a collective
                # timeout after another did is stopped or stuck outside any collective (those
                # waiting in a collective for it answer at once when the segment is aborted);
                # while loading, one that has run on a core since is slow (a fresh worker
                # starting JAX and compiling while a warm one answered at once): it gets
                # another timeout
                if cpu is not None and cpu.ran(self.procs[q].pid for q, _ in pending.values()):
                    answered = now
                    continue
                trouble, late = now - grace, True
            if aborted is None and self.segment.aborted:
                aborted = now
            if not pending or trouble is None:
                continue
            if aborted is None and now >= trouble + grace:
                # the others may wait in a collective for a rank that will never join it
                self.segment.abort(*self._culprit(errors))
                aborted = now
            if aborted is not None and now >= aborted + grace:
                if not late:
                    return sorted(r for r, _ in pending.values())
                for r in sorted(r for r, _ in pending.values()):
                    errors[r] = self._unresponsive(
                        r,
                        f"did not answer within the collective timeout of rank {first}'s "
                        "answer" + (", using no core in that time" if loading else ""),
                    )
                return []
        self._took = time.perf_counter() - start
        return []

    def _unresponsive(self, r: int, what: str) -> tuple:
        """Rank r moved no byte on its control socket for the collective timeout: kill it (its
        control stream is out of step now) and fail the job; its error entry."""
        self.procs[r].kill()
        why = (
            f"rank {r} (pid {self.procs[r].pid}) {what} (collective_timeout "
            f"{self.timeout:g} s): stopped, swapped out or stuck; killed "
            "(ParallelConfig.collective_timeout raises the limit)"
        )
        self.failure = self.failure or why
        self.segment.abort(r, why)
        return ("unresponsive", why, "")

    @staticmethod
    def _first(errors):
        """The rank whose error says most about the cause (lowest rank on ties), or None."""
        return min(errors, key=lambda q: (_ORDER.get(errors[q][0], 0), q), default=None)

    def _culprit(self, errors) -> tuple[int, str]:
        """(rank, reason) of the first failure, for the segment's abort."""
        r = self._first(errors)
        if r is None:
            return -1, self.failure or "the caller aborted the job"
        kind, message, _ = errors[r]
        first = message.splitlines()[0] if message else kind
        return r, first if kind in _ORDER else f"rank {r} failed: {kind}: {first}"

    def _give_up(self, hung, errors):
        """Ranks that did not answer after a failure: fail the job and kill them (a rank stuck
        in Python never reads the exit message)."""
        why = f"rank(s) {', '.join(map(str, hung))} did not answer after the job failed"
        self.segment.abort(*(self._culprit(errors) if errors else (hung[0], why)))
        self.failure = self.failure or why
        for r in hung:
            self.procs[r].kill()

    def _error(self, fn, errors, hung):
        """The one exception for a failed call, cause first: a Python exception raised in a
        worker (WorkerError), else a dead rank, else the ranks that did not answer, else the
        first failed collective (CollectiveError); the other ranks' failures follow."""
        where = f"{fn.__module__}.{fn.__qualname__}"
        r = self._first(errors)
        kind = errors[r][0] if r is not None else None
        stuck = (
            (
                f"rank(s) {', '.join(map(str, hung))} did not answer within {self._grace():g} s "
                "after the job was aborted: stuck outside any collective (in Python code or a "
                "compute segment); killed"
            )
            if hung
            else ""
        )
        if kind == "unresponsive":
            head = f"{where}: {errors[r][1]}; the job is failed"
        elif kind == "exited":
            head = (
                f"{where}: {errors[r][1]} during the call; the job is failed. A worker "
                "process ended (killed, out of memory, or an exit in the step's code); its "
                "stderr is above"
            )
        elif kind == "CollectiveError" and hung:
            head, r, stuck = f"{where}: {stuck}", None, ""
        elif kind == "CollectiveError":
            head = f"{where}: {errors[r][1]}"
        elif kind is None:
            head, stuck = f"{where}: {stuck}", ""
        else:
            head = f"rank {r} raised {kind} in {where}: {errors[r][1]}"
        others = [q for q in sorted(errors) if q != r]
        text = (
            head
            + "".join(
                f"\nrank {q} failed too: {(errors[q][1] or errors[q][0]).splitlines()[0]}"
                for q in others
            )
            + (f"\n{stuck}." if stuck else "")
        )
        if hung or any("stopped answering" in e[1] for e in errors.values()):
            text += (
                "\nEvery rank must reach the same collectives; if a rank legitimately "
                f"computes for longer than collective_timeout ({self.timeout:g} s) before "
                "one, raise ParallelConfig.collective_timeout."
            )
        if kind in _ORDER or kind is None:
            return CollectiveError(text)
        tb = errors[r][2]
        if tb:
            text += f"\n\nTraceback in the worker process (rank {r}):\n{tb.rstrip()}"
        return WorkerError(text, rank=r, kind=kind, traceback=tb)

    def _grace(self) -> float:
        return min(self.timeout / 2, _GRACE)

    def keep_warm(self) -> None:
        """Have as many warm workers as this job has ranks ready for the next job of this
        process (forked workers only: runtime/forkserver.py). Call it when the job is done
        (``WorkerRunner.close``), so their warming does not take cores from its steps."""
        if self._warm is not None:
            from . import forkserver

            forkserver.keep_warm(*self._warm, self.nranks)

    def close(self):
        """Stop the workers (they exit on their own when the caller goes away, too)."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()
        self._dir.cleanup()
        for box in self._to + [b for boxes in self._from for b in boxes.values()]:
            box.close()

    def _forked(self) -> None:
        """In a child forked from the caller: the workers are the parent's, so the child
        closes its copies of their sockets and marks the job closed without stopping them (its
        next call starts workers of its own)."""
        self.closed = True
        self._calls = threading.Lock()  # a thread of the parent's may have held it
        self._finalizer.detach()
        for c in self.conns:
            if c is not None:
                c.close()

    @staticmethod
    def _stop(procs, conns, owner):
        if os.getpid() != owner:  # a forked child's copy: the parent's workers are not its own
            return
        for c in conns:  # a worker exits when its control socket closes; sending it
            if c is not None:  # anything could block on a stopped worker's full buffer
                c.close()
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


_JOBS: weakref.WeakSet[Job] = weakref.WeakSet()  # this process's started jobs


def _forget_jobs() -> None:
    """``os.fork``'s child hook: every job it inherited is the parent's (``Job._forked``)."""
    for job in list(_JOBS):
        job._forked()
    _JOBS.clear()


os.register_at_fork(after_in_child=_forget_jobs)
