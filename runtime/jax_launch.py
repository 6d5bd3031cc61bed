"""``autopar launch``: start this host's processes of a multi-process JAX job (like torchrun).

In: ``nprocs`` processes for this host, ``devices_per_process``, the job's ``nnodes`` hosts,
this host's ``node_rank``, the coordinator ``HOST:PORT`` (default: a free port on this host,
for a one-host job) and the command (a script and its arguments, or ``-m module ...``).
Out: the processes' output, each line prefixed with ``[rank]`` (stdout to stdout, stderr to
stderr), and an exit status: 0 when every process exits 0; else the first failure's status
(128 + signal for a process killed by a signal), after stopping the others (SIGTERM, then
SIGKILL after ``GRACE`` seconds). A SIGINT or SIGTERM to the launcher is passed on to the
processes.
Each process finds its place in the environment ``ap.init_distributed`` reads:
``AUTOPAR_COORDINATOR``, ``AUTOPAR_NUM_PROCESSES``, ``AUTOPAR_PROCESS_ID`` (node_rank *
nprocs + local rank), ``AUTOPAR_LOCAL_RANK`` and ``AUTOPAR_DEVICES_PER_PROCESS``; the script
calls ``ap.init_distributed()`` before any JAX computation.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.errors import ConfigError

GRACE = 5.0  # seconds the other processes get to stop after a failure, before SIGKILL


@dataclass(frozen=True)
class LaunchOptions:
    command: tuple  # [script.py, args...] or ["-m", module, args...]
    nprocs: int = 1  # processes on this host
    devices_per_process: int | None = None  # CPU: host devices per process; GPU: per process
    nnodes: int = 1  # hosts in the job
    node_rank: int = 0  # this host's index, 0 .. nnodes - 1
    coordinator: str | None = None  # HOST:PORT of process 0's coordinator

    def check(self) -> None:
        if not self.command:
            raise ConfigError(
                "autopar launch: give the script to run, e.g. autopar launch --nprocs 2 train.py."
            )
        if self.nprocs < 1 or self.nnodes < 1:
            raise ConfigError(f"--nprocs {self.nprocs} and --nnodes {self.nnodes} must be >= 1.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in 0 .. {self.nnodes - 1}.")
        if self.devices_per_process is not None and self.devices_per_process < 1:
            raise ConfigError(f"--devices-per-process {self.devices_per_process} must be >= 1.")
        if self.nnodes > 1 and not self.coordinator:
            raise ConfigError(
                "--nnodes > 1 needs --coordinator HOST:PORT, the address of node "
                "0 (where process 0 runs), the same on every node."
            )
        if self.coordinator and not self.coordinator.rpartition(":")[2].isdigit():
            raise ConfigError(
                f"--coordinator {self.coordinator!r}: write HOST:PORT, e.g. 10.0.0.1:12345."
            )
        script = self.command[0]
        if script != "-m" and not os.path.isfile(script):
            raise ConfigError(f"autopar launch: {script}: no such file.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGTERM when the launcher exits (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _forward(stream, out, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line.decode(errors="replace"))
            out.flush()
    stream.close()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def launch(opts: LaunchOptions) -> int:
    """Run the job's processes of this host (see the module docstring) -> the exit status."""
    opts.check()
    coordinator = opts.coordinator or f"127.0.0.1:{_free_port()}"
    total = opts.nnodes * opts.nprocs
    lock, procs, threads = threading.Lock(), [], []
    for local in range(opts.nprocs):
        rank = opts.node_rank * opts.nprocs + local
        env = dict(
            os.environ,
            AUTOPAR_COORDINATOR=coordinator,
            AUTOPAR_NUM_PROCESSES=str(total),
            AUTOPAR_PROCESS_ID=str(rank),
            AUTOPAR_LOCAL_RANK=str(local),
            PYTHONUNBUFFERED="1",
        )
        if opts.devices_per_process is not None:
            env["AUTOPAR_DEVICES_PER_PROCESS"] = str(opts.devices_per_process)
        # its own session: a Ctrl-C reaches the launcher alone, which passes it on once; and
        # it gets SIGTERM if the launcher dies (preexec_fn runs before any thread is started)
        procs.append(
            subprocess.Popen(
                [sys.executable, *opts.command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        )
    width = len(str(total - 1))
    for local, p in enumerate(procs):
        rank = opts.node_rank * opts.nprocs + local
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(
                target=_forward, args=(stream, out, f"[{rank:>{width}}] ", lock), daemon=True
            )
            t.start()
            threads.append(t)
    stopping = []

    def passed_on(signum, _frame):
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, passed_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _wait(procs, opts, stopping)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in threads:
            t.join(timeout=2.0)


def _wait(procs, opts: LaunchOptions, stopping) -> int:
    """Wait for the processes; at the first failure stop the others -> the exit status."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad or stopping:
            i, c = bad[0] if bad else (None, 0)
            if i is not None and not stopping:
                rank = opts.node_rank * opts.nprocs + i
                print(
                    f"autopar launch: process {rank} exited with status {_status(c)}; "
                    "stopping the others.",
                    file=sys.stderr,
                    flush=True,
                )
            _stop(procs)
            if stopping and not bad:
                return 128 + stopping[0]
            return _status(c)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
