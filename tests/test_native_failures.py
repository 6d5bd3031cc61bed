"""Failures on the native runtime: a Python exception in a worker is a WorkerError (rank,
type, the worker's traceback); a rank that stops answering fails the call with CollectiveError
within the bound, leaves no process behind, and the next job (or the next call of a compiled
step, on the default backend) works. Small jobs (2-3 ranks) with a 2 s collective timeout."""
import os
import re
import signal
import threading
import time

import numpy as np
import pytest

import autopar as ap
import models as m
from autopar.errors import AutoparError, CollectiveError, WorkerError
from autopar.runtime.launcher import Job
from test_api import assert_same

pytestmark = pytest.mark.native

TIMEOUT = 2.0
BOUND = TIMEOUT + 20.0         # generous: the failure must arrive, not arrive fast


# --- per-rank functions (run in the workers) -------------------------------------------------

def raise_on(comm, bad):
    if comm.rank in bad:
        raise ValueError(f"bad value on rank {comm.rank}")
    return comm.rank


def raise_or_barrier(comm, bad):
    if comm.rank == bad:
        raise ValueError("no barrier for me")
    comm.barrier(list(range(comm.size)))
    return comm.rank


def sleep_or_barrier(comm, sleeper):
    if comm.rank == sleeper:
        time.sleep(3600)               # stuck in Python, never reaches the barrier
    comm.barrier(list(range(comm.size)))
    return comm.rank


def late_to_barriers(comm, late, first, second):
    """Rank ``late`` reaches a barrier that waits up to 30 s ``first`` seconds after the others
    (as a slow compile does at a load's barrier), then one under the job's own timeout
    ``second`` seconds after them."""
    if comm.rank == late:
        time.sleep(first)
    comm.barrier(list(range(comm.size)), timeout=30.0)
    after = comm.timeout
    if comm.rank == late:
        time.sleep(second)
    comm.barrier(list(range(comm.size)))
    return after


def reduce_through_rank_2(comm, count):
    """Ranks 0 and 1 all-reduce through reducer rank 2; rank 1 passes ``count[1]`` elements."""
    if comm.rank == 2:
        return comm.serve_reductions([0, 1], [2])
    x = np.ones(count[comm.rank], np.float32)
    comm.all_reduce(x, [0, 1], "sum", "reduction_server", [2])
    comm.release_reducers([2], [0, 1])
    return float(x.sum())


def ranks(comm):
    return comm.rank


# --- helpers ------------------------------------------------------------------------------------

def gone(procs):
    """Every worker has exited and been reaped: no /proc entry left for its pid."""
    return all(p.poll() is not None and not os.path.exists(f"/proc/{p.pid}") for p in procs)


def worker_pid(comm):
    return os.getpid()


def pids_gone(pids):
    """No /proc entry is left for any of the pids: every process exited and was reaped."""
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def stop_rank_and_call(c, rank, *args):
    """Stop worker ``rank`` of compiled step ``c`` (SIGSTOP), then call ``c(*args)``: it raises
    CollectiveError within BOUND and every worker of the failed job is gone. Returns the error
    and the old workers' pids."""
    pids = c.on_workers(worker_pid)
    os.kill(pids[rank], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as err:
        c(*args)
    assert time.monotonic() - start < BOUND
    assert pids_gone(pids)                                  # stopped at once, nothing left
    return err.value, pids


def autopar_threads():
    """Live threads but the main one and the fork server's reader, which serves every job of
    this process (runtime/forkserver.py)."""
    return {t for t in threading.enumerate() if t.is_alive() and t is not threading.main_thread()
            and t.name != "autopar-forkserver"}


# --- tests --------------------------------------------------------------------------------------

def test_a_python_exception_in_a_worker_is_a_worker_error():
    j = Job(3, timeout=TIMEOUT)
    with pytest.raises(WorkerError) as err:
        j.call(raise_on, [((1,),)] * 3)
    e = err.value
    assert isinstance(e, AutoparError) and isinstance(e, RuntimeError)
    assert not isinstance(e, CollectiveError)
    assert e.rank == 1 and e.kind == "ValueError"
    assert "Traceback" in e.traceback and "raise_on" in e.traceback
    assert "bad value on rank 1" in e.traceback
    msg = str(e)
    assert "rank 1 raised ValueError" in msg and "test_native_failures.raise_on" in msg
    assert "bad value on rank 1" in msg and "Traceback in the worker process" in msg
    # no rank waited in a collective: the job is not failed and still runs
    assert j.failure is None
    assert j.call(ranks, [()] * 3) == [0, 1, 2]
    with pytest.raises(WorkerError) as err:               # several: the lowest rank, others noted
        j.call(raise_on, [((2, 0),)] * 3)
    assert err.value.rank == 0 and "rank 2 failed too: bad value on rank 2" in str(err.value)

    # the others wait in a barrier for the rank that raised: their barrier is aborted
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        j.call(raise_or_barrier, [(1,)] * 3)
    assert time.monotonic() - start < BOUND
    assert err.value.rank == 1 and "no barrier for me" in str(err.value)
    assert all(f"rank {r} failed too" in str(err.value) or f"{r} did not answer" in str(err.value)
               for r in (0, 2))                          # in their aborted barrier, or killed
    assert j.failure
    with pytest.raises(CollectiveError, match="failed"):
        j.call(ranks, [()] * 3)
    j.close()
    assert gone(j.procs)


def test_a_barrier_with_its_own_timeout_outwaits_the_jobs_then_gives_it_back():
    with Job(2, timeout=1.0) as j:
        assert j.call(late_to_barriers, [(1, 2.5, 0.0)] * 2) == [1.0, 1.0]
        with pytest.raises(CollectiveError, match=r"barrier: .*stopped answering.*for 1 s"):
            j.call(late_to_barriers, [(1, 0.0, 2.5)] * 2)


def test_reduction_server_workers_that_disagree_fail_every_rank():
    with Job(3, timeout=TIMEOUT) as j:
        assert j.call(reduce_through_rank_2, [((5, 5),)] * 3) == [10.0, 10.0, 1]
        with pytest.raises(CollectiveError, match=r"requests disagree: rank 1 asks for another"):
            j.call(reduce_through_rank_2, [((5, 6),)] * 3)


def test_a_rank_stuck_in_python_fails_the_call_and_leaves_nothing_behind():
    shm_before = set(os.listdir("/dev/shm"))
    threads_before = autopar_threads()
    j = Job(3, timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as err:
        j.call(sleep_or_barrier, [(1,)] * 3)
    assert time.monotonic() - start < BOUND
    msg = str(err.value)
    stuck = re.search(r"rank\(s\) ([\d, ]+) did not answer", msg)
    assert stuck and "1" in stuck.group(1).split(", ") and "collective_timeout" in msg, msg
    assert j.failure and j.procs[1].wait(5) is not None     # the stuck rank was killed
    j.close()
    assert gone(j.procs)
    j._monitor.join(5)
    assert autopar_threads() <= threads_before
    assert set(os.listdir("/dev/shm")) == shm_before
    with Job(2, timeout=TIMEOUT) as again:                  # the next job in this process works
        assert again.call(ranks, [()] * 2) == [0, 1]


def test_a_compiled_step_on_the_default_backend_restarts_after_a_rank_stops_answering():
    """The default backend is native; a rank stopped with SIGSTOP never answers: the call
    raises CollectiveError within the bound, the failed job's workers are all stopped, and the
    next call runs on a new job with the right values."""
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, progress=False,
                            collective_timeout=TIMEOUT)
    assert cfg.backend is ap.Backend.NATIVE
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    err, pids = stop_rank_and_call(c, 1, p, b)
    assert "rank 1" in str(err)
    assert_same(c(p, b), m.mlp_sgd_step(p, b))              # new workers
    new = c.on_workers(worker_pid)
    assert not set(new) & set(pids)
    c.close()
    assert pids_gone(new)


def test_a_worker_that_imported_another_autopar_fails_the_start_with_that_cause(monkeypatch):
    """The worker checks it imported the caller's package; the start fails with that cause,
    not with a clean-up error (the control socket's folder is gone by then)."""
    from autopar.runtime import launcher
    path, _ = launcher._worker_path()
    monkeypatch.setattr(launcher, "_worker_path", lambda: (path, "/elsewhere/autopar"))
    for fork in (True, False):               # forked from the warm server, or started anew
        with pytest.raises(CollectiveError) as err:
            Job(2, timeout=TIMEOUT, fork=fork)
        msg = str(err.value)
        assert "failed to start: ImportError: the worker imported autopar from" in msg, msg
        assert "the caller from /elsewhere/autopar" in msg
        assert err.value.__context__ is None and err.value.__cause__ is None


def test_a_worker_that_exits_before_connecting_is_named(monkeypatch):
    from autopar.runtime import launcher
    monkeypatch.setattr(launcher, "_worker_command",
                        lambda: [launcher.sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(CollectiveError, match=r"exited with code 3") as err:
        Job(2, timeout=TIMEOUT, fork=False)
    assert err.value.__context__ is None


def test_ranks_that_never_connect_are_named(monkeypatch):
    from autopar.runtime import launcher
    monkeypatch.setattr(launcher, "START_SECONDS", 1.0)
    monkeypatch.setattr(launcher, "_worker_command",
                        lambda: [launcher.sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"rank\(s\) 0 \(pid \d+\), 1 \(pid \d+\) did not "
                                              r"connect within 2 s"):
        Job(2, timeout=TIMEOUT, fork=False)
    assert time.monotonic() - start < BOUND


def nbytes(comm, x):
    return int(x.nbytes)


@pytest.mark.parametrize("size", [8, 64 << 20])
def test_a_rank_stopped_between_calls_fails_the_next_call_whatever_its_arguments(size):
    """SIGSTOP between calls: with small arguments the stopped rank never answers (the call
    has no collective to fail); with large ones the caller's send of its arguments fills the
    socket. Either way the call raises CollectiveError naming the rank within the bound, the
    job's workers are all gone after close, and nothing is left in /dev/shm or as threads."""
    import numpy as np
    shm_before = set(os.listdir("/dev/shm"))
    threads_before = autopar_threads()
    j = Job(2, timeout=TIMEOUT)
    x = np.ones(size // 4, np.float32)
    assert j.call(nbytes, [(x,)] * 2) == [size, size]
    os.kill(j.procs[1].pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as err:
        j.call(nbytes, [(x,)] * 2)
    assert time.monotonic() - start < BOUND
    assert re.search(r"rank(\(s\))? 1\b", str(err.value)), str(err.value)
    assert "collective_timeout" in str(err.value)
    with pytest.raises(CollectiveError, match="failed"):
        j.call(ranks, [()] * 2)
    start = time.monotonic()
    j.close()
    assert time.monotonic() - start < BOUND and gone(j.procs)
    j._monitor.join(5)
    assert autopar_threads() <= threads_before
    assert set(os.listdir("/dev/shm")) == shm_before
    with Job(2, timeout=TIMEOUT) as again:
        assert again.call(ranks, [()] * 2) == [0, 1]


def _children() -> set:
    """Pids of this process's live child processes, the workers its fork servers forked
    counted as children and the servers and their warm workers waiting for a job not (they
    serve every job of this process, runtime/forkserver.py)."""
    from autopar.runtime import forkserver
    servers = forkserver.kept_pids()
    parents = {str(os.getpid())} | {str(p) for p in servers}
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] in parents and fields[0] != "Z":
                out.add(int(pid))
    return out - servers


@pytest.mark.slow
def test_soak_500_calls_with_workers_killed_at_random_moments():
    """A compiled data-parallel step called 500 times on the native backend while a thread
    kills a random worker (SIGKILL) 10 times at random moments (before, during or between
    calls): every call returns the single-device answer or raises CollectiveError, and after
    close the processes, file descriptors, threads and /dev/shm are as they were before."""
    import random
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    want = m.mlp_sgd_step(p, b)
    Job(2, timeout=TIMEOUT).close()      # the fork server, which stays, is started before
    before = (_children(), len(os.listdir("/proc/self/fd")), autopar_threads(),
              set(os.listdir("/dev/shm")))
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, progress=False,
                            collective_timeout=TIMEOUT)
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    rng = random.Random(0)
    calls, kills = 500, sorted(rng.sample(range(5, 495), 10))
    done = [0]
    killed = []

    def killer():
        for at in kills:
            while done[0] < at:
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.02))            # somewhere in the next call or two
            job = getattr(c._runner, "job", None)
            while (job is None or job.closed) and done[0] < calls:
                time.sleep(0.001)   # a killed job is replaced at the next call: kill that one
                job = getattr(c._runner, "job", None)
            if job is not None and not job.closed:
                proc = rng.choice(job.procs)
                try:
                    proc.kill()
                    killed.append(proc.pid)
                except OSError:
                    pass

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    answered = failed = 0
    try:
        for _ in range(calls):
            try:
                got = c(p, b)
            except CollectiveError:
                failed += 1
            else:
                assert_same(got, want)
                answered += 1
            done[0] += 1
    finally:
        thread.join(30)
        c.close()
    assert answered + failed == calls and len(killed) == len(kills)
    assert 1 <= failed <= len(kills) and answered >= calls - len(kills)
    assert pids_gone(killed)
    deadline = time.monotonic() + 10          # a closed job's monitor stops within 50 ms
    while time.monotonic() < deadline and (
            _children() - before[0] or len(os.listdir("/proc/self/fd")) > before[1]
            or autopar_threads() - before[2]):
        time.sleep(0.1)
    assert _children() <= before[0]
    assert len(os.listdir("/proc/self/fd")) <= before[1]
    assert autopar_threads() <= before[2]
    assert set(os.listdir("/dev/shm")) == before[3]
    print(f"soak: {answered} answered, {failed} CollectiveError, {len(killed)} workers killed")


# --- sharing, forking and interrupting a job (found by an outside bug hunt) ------------------

def rank_times(comm, x):
    return x * (comm.rank + 1)


def test_threads_sharing_a_job_each_get_their_own_answers():
    """Calls from several threads run one after another: no thread reads another's answer."""
    with Job(2, timeout=TIMEOUT) as j:
        got, errors = {}, []

        def worker(t):
            try:
                for k in range(20):
                    x = np.full(4, float(100 * t + k), np.float32)
                    got[t, k] = j.call(rank_times, [(x,)] * 2)
            except Exception as e:        # noqa: BLE001 - reported by the assertion below
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND)
        assert not errors, errors
        for (t, k), answers in got.items():
            assert [float(a[0]) for a in answers] == [100 * t + k, 2 * (100 * t + k)]
        assert len(got) == 60


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # JAX's; the child leaves by
def test_a_forked_child_runs_its_own_workers_and_leaves_the_parents_alone():   # os._exit
    """After os.fork the child's copy of a compiled step starts workers of its own (its
    answers right); the parent's workers keep running and answering."""
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="native",
                            progress=False, collective_timeout=TIMEOUT)
    with ap.compile(m.mlp_sgd_step, p, b, config=cfg) as c:
        want = m.mlp_sgd_step(p, b)
        assert_same(c(p, b), want)
        parents = c.on_workers(worker_pid)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:                      # the child: report, then leave without JAX's exit
            ok = False
            try:
                got = c(p, b)
                ok = c.on_workers(worker_pid) != parents and all(
                    np.allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
                    for x, y in zip(jax_leaves(got), jax_leaves(want)))
                c.close()
            finally:
                os.write(write, b"1" if ok else b"0")
                os._exit(0)
        os.close(write)
        import select
        if not select.select([read], [], [], BOUND)[0]:      # a child stuck in its call
            os.kill(pid, signal.SIGKILL)
        assert os.read(read, 1) == b"1"
        os.waitpid(pid, 0)
        assert all(os.path.exists(f"/proc/{q}") for q in parents)
        assert c.on_workers(worker_pid) == parents
        assert_same(c(p, b), want)


def test_a_spawn_interrupted_while_waiting_drops_its_late_worker(monkeypatch):
    """Ctrl-C while the fork server forks a worker: that worker's pid still comes; the next
    spawn kills it and takes its own, rather than every later job pairing ranks with the
    previous job's pids."""
    from autopar.runtime import forkserver

    class Interrupted(threading.Condition):
        first = True

        def wait(self, timeout=None):
            if Interrupted.first:
                Interrupted.first = False
                raise KeyboardInterrupt
            return super().wait(timeout)
    srv = forkserver._Server.__new__(forkserver._Server)
    srv.sock, srv.exits, srv.alive, srv.idle, srv.pids, srv.stale = None, {}, True, set(), [], 0
    srv.lock, srv.changed = threading.Lock(), Interrupted()
    killed = []
    monkeypatch.setattr(forkserver, "_send", lambda *a, **k: None)
    monkeypatch.setattr(forkserver.Forked, "kill", lambda self: killed.append(self.pid))
    with pytest.raises(KeyboardInterrupt):
        srv.spawn(["worker"], (), "/", "token")
    assert srv.stale == 1
    srv.pids += [111, 222]              # the interrupted request's answer, then this one's
    assert srv.spawn(["worker"], (), "/", "token").pid == 222
    assert killed == [111] and srv.stale == 0 and srv.pids == []


def test_a_caller_killed_leaves_no_folders_behind(tmp_path):
    """A caller killed mid-job (SIGKILL: no clean-up of its own): its ranks exit and remove
    the job's XLA cache folder; the control socket's folder went once the ranks connected."""
    import subprocess
    import sys
    code = ("import numpy as np, autopar as ap, models as m, os, signal\n"
            "p, b = m.mlp_params(), m.mlp_batch()\n"
            "cfg = ap.ParallelConfig(parallel_mode='data_parallel', device_num=2, "
            "backend='native', progress=False)\n"
            "c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)\n"
            "c(p, b)\n"
            "print(sorted(os.listdir(os.environ['TMPDIR'])), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), JAX_COMPILATION_CACHE_DIR="",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert "autopar-xla-" in out.stdout, out.stdout + out.stderr    # the job's cache, in use
    assert "'autopar-" not in out.stdout.replace("'autopar-xla-", "")   # no control folder
    deadline = time.monotonic() + BOUND
    while [n for n in os.listdir(tmp_path) if n.startswith("autopar-")] and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert [n for n in os.listdir(tmp_path) if n.startswith("autopar-")] == []


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_fresh_workers_loading_beside_warm_ones_are_slow_not_stuck():
    """A 4-rank job right after a closed 2-rank one gets warm workers (JAX started) and fresh
    ones (starting JAX, compiling); on a machine kept busy by CPU burners the fresh ones answer
    the load many collective timeouts after the warm ones, and still run: a late rank that
    is using a core while the program loads is slow, not stuck."""
    import subprocess
    import sys
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        p, b = m.gpt_params(layers=2), m.gpt_batch(batch=4)
        cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2,
                                collective_timeout=0.3)
        with ap.compile(m.gpt_sgd_step, p, b, config=cfg) as two:
            two(p, b)                                  # closing readies 2 warm workers
        with ap.compile(m.gpt_sgd_step, p, b,
                        config=cfg.replace(device_num=4, mesh_shape=(4,))) as four:
            assert_same(four(p, b), m.gpt_sgd_step(p, b))
            assert four.timings["start"] > 2 * cfg.collective_timeout     # really late
    finally:
        for q in burners:
            q.kill()
            q.wait()
