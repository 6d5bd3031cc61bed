"""Native workers forked from a warm server (runtime/forkserver.py): the workers are the
server's children, a job started after ``keep_warm`` gets the warm workers waiting there (their
JAX backend already up), and exit codes come back as Popen's would."""
import os
import signal
import time

import numpy as np
import pytest

from autopar.runtime import forkserver
from autopar.runtime.launcher import Job

pytestmark = pytest.mark.native


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def backend_up_and_sum(comm, x):
    """Whether JAX's backend was up before this call, and the all-reduced x."""
    from jax._src import xla_bridge
    up = bool(xla_bridge._backends)
    comm.all_reduce(x, list(range(comm.size)), "sum", "ring")
    return up, x


def test_a_job_after_keep_warm_runs_on_the_warm_workers():
    with Job(2, timeout=20.0) as j:
        servers = {parent_of(p.pid) for p in j.procs}
        assert servers <= forkserver.kept_pids() and len(servers) == 1
        before = forkserver.kept_pids()
        j.keep_warm()
        deadline = time.monotonic() + 30
        while len(forkserver.kept_pids() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        warm = forkserver.kept_pids() - before
        assert len(warm) == 2
    with Job(2, timeout=20.0) as j:
        assert {p.pid for p in j.procs} == warm
        got = j.call(backend_up_and_sum, [(np.full(5, r + 1.0, np.float32),) for r in range(2)])
    assert [up for up, _ in got] == [True, True]
    assert all(np.array_equal(x, np.full(5, 3.0, np.float32)) for _, x in got)


def test_exit_codes_come_back_as_popen_gives_them():
    j = Job(2, timeout=20.0)
    os.kill(j.procs[1].pid, signal.SIGKILL)
    assert j.procs[1].wait(10) == -signal.SIGKILL
    j.close()
    assert all(p.poll() is not None for p in j.procs)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # the child runs no JAX itself
def test_a_process_forked_from_the_caller_starts_its_own_server():
    """multiprocessing's fork (or os.fork) after a job: the child cannot use the parent's
    server (its reader thread did not come along); it starts its own, and the parent's goes on."""
    def job_sum():
        with Job(2, timeout=20.0) as j:
            got = j.call(backend_up_and_sum, [(np.ones(3, np.float32),)] * 2)
        return all(np.array_equal(x, np.full(3, 2.0, np.float32)) for _, x in got)
    assert job_sum()
    parents = forkserver.kept_pids()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if job_sum() and not (forkserver.kept_pids() & parents) else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked process hung starting a job (the parent's server was used?)")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert job_sum()
