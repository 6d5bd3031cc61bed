"""The native collectives (autopar._native) on worker processes, against numpy.

One 8-rank job runs every case; groups are its first n ranks, so group sizes 1 to 8 share the
workers. Values are small integers, so every sum, product, max and min is exact in every dtype
(float16 and bfloat16 included) and results must match numpy exactly.
"""
import os
import time

import numpy as np
import pytest

from autopar import _native
from autopar.errors import CollectiveError
from autopar.runtime.launcher import Job

pytestmark = pytest.mark.native

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
SIZES = [0, 1, 7, 65537]
GROUPS = range(1, 9)


def dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def data(rank, count, name, op="sum", salt=0):
    rng = np.random.default_rng(rank * 7919 + count + salt)
    vals = rng.choice([-1, 1, 2], count) if op == "prod" else rng.integers(-8, 9, count)
    return vals.astype(dtype(name))


@pytest.fixture(scope="module")
def job():
    with Job(8, timeout=20.0) as j:
        yield j


# --- per-rank functions (run in the workers) -------------------------------------------------

def run_all_reduce(comm, cases):
    out = []
    for algo, name, n, count, op in cases:
        if comm.rank >= n:
            out.append(None)
            continue
        x = data(comm.rank, count, name, op)
        comm.all_reduce(x, list(range(n)), op, algo)
        out.append(x)
    return out


def run_others(comm, cases):
    out = []
    for kind, name, n, count in cases:
        r = comm.rank
        if r >= n:
            out.append(None)
            continue
        group = list(range(n))
        x = data(r, count, name)
        if kind == "reduce_scatter":
            y = np.empty(np.array_split(np.arange(count), n)[r].size, x.dtype)
            comm.reduce_scatter(x, y, group)
        elif kind == "all_gather":
            y = np.empty(count * n, x.dtype)
            comm.all_gather(x, y, group)
        elif kind == "all_to_all":
            x = data(r, count * n, name)
            y = np.empty_like(x)
            comm.all_to_all(x, y, group)
        elif kind == "broadcast":
            y = x.copy()
            comm.broadcast(y, group, n - 1)
        elif kind == "send_recv":       # a ring of point-to-point messages
            y = np.empty_like(x)
            if n == 1:
                y = x.copy()
            elif r % 2 == 0:
                comm.send(x, (r + 1) % n)
                comm.recv(y, (r - 1) % n)
            else:
                comm.recv(y, (r - 1) % n)
                comm.send(x, (r + 1) % n)
        elif kind == "barrier":
            comm.barrier(group)
            y = x
        out.append(y)
    return out


def run_reduction_server(comm, cases):
    """Per case (workers, reducers, [(dtype, count, op)]): the first ``workers`` ranks
    all-reduce through the next ``reducers`` ranks, which serve until released."""
    out = []
    for w, nr, items in cases:
        workers, reducers = list(range(w)), list(range(w, w + nr))
        if comm.rank in workers:
            got = []
            for name, count, op in items:
                x = data(comm.rank, count, name, op)
                comm.all_reduce(x, workers, op, "reduction_server", reducers)
                got.append(x)
            comm.release_reducers(reducers, workers)
            out.append(got)
        elif comm.rank in reducers:
            out.append(comm.serve_reductions(workers, reducers))
        else:
            out.append(None)
    return out


def die_or_reduce(comm, victim, folder):
    """The victim exits in the middle of a large all-reduce; the others record what they saw."""
    x = np.ones(1 << 22, np.float32)
    if comm.rank == victim:
        import threading
        threading.Timer(0.05, os._exit, (3,)).start()
        while True:
            comm.all_reduce(x, list(range(comm.size)), "sum", "ring")
    start = time.monotonic()
    try:
        while True:
            comm.all_reduce(x, list(range(comm.size)), "sum", "ring")
    except CollectiveError as e:
        with open(os.path.join(folder, str(comm.rank)), "w") as f:
            f.write(f"{time.monotonic() - start}\n{e.rank}\n{e}")
        raise


def link_kinds(comm):
    return [comm.link_kind(p) for p in range(comm.size)]


# --- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", sorted(_native.ALLREDUCE_ALGORITHMS))
def test_all_reduce_every_dtype_group_size_and_length(job, algo):
    cases = [(algo, name, n, count, "sum") for name in DTYPES for n in GROUPS for count in SIZES]
    cases += [(algo, name, n, 1001, op) for name in ("float32", "bfloat16", "int64")
              for n in (3, 8) for op in ("prod", "max", "min")]
    results = job.call(run_all_reduce, [(cases,)] * 8)
    reducer = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
    for i, (_, name, n, count, op) in enumerate(cases):
        want = reducer[op].reduce([data(r, count, name, op) for r in range(n)]).astype(dtype(name))
        for r in range(n):
            got = results[r][i]
            assert got.dtype == dtype(name) and np.array_equal(got, want), (algo, name, n, count, op, r)


def test_reduction_server_every_dtype_reduction_and_reducer_count(job):
    items = [(name, count, "sum") for name in DTYPES for count in (0, 1, 7, 65537)]
    items += [(name, 1001, op) for name in ("float32", "int64") for op in ("prod", "max", "min")]
    cases = [(2, 1, items), (3, 2, items), (4, 4, items[:8]), (5, 3, items[:8])]
    results = job.call(run_reduction_server, [(cases,)] * 8)
    reducer = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
    for c, (w, nr, its) in enumerate(cases):
        for r in range(w, w + nr):
            assert results[r][c] == len(its)                  # every reducer served every one
        for i, (name, count, op) in enumerate(its):
            want = reducer[op].reduce([data(r, count, name, op) for r in range(w)])
            for r in range(w):
                got = results[r][c][i]
                assert got.dtype == dtype(name) and np.array_equal(got, want.astype(dtype(name)))


def test_other_collectives_every_dtype_and_group_size(job):
    kinds = ["reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv", "barrier"]
    cases = [(k, name, n, count) for k in kinds for name in DTYPES for n in GROUPS
             for count in (0, 1, 7, 4099)]
    results = job.call(run_others, [(cases,)] * 8)
    for i, (kind, name, n, count) in enumerate(cases):
        xs = [data(r, count, name) for r in range(n)]
        for r in range(n):
            got = results[r][i]
            if kind == "reduce_scatter":
                want = np.array_split(np.add.reduce(xs).astype(dtype(name)), n)[r]
            elif kind == "all_gather":
                want = np.concatenate(xs)
            elif kind == "all_to_all":
                blocks = [np.split(data(s, count * n, name), n)[r] for s in range(n)]
                want = np.concatenate(blocks)
            elif kind == "broadcast":
                want = xs[n - 1]
            elif kind == "send_recv":
                want = xs[(r - 1) % n]
            else:
                want = xs[r]
            assert np.array_equal(got, want), (kind, name, n, count, r)


def test_large_all_reduce_matches_numpy(job):
    algos = ("ring", "halving_doubling", "2d_torus", "direct")   # direct: 2 MB blocks, 8 pieces
    cases = [(a, "float32", 8, (1 << 22) + 3, "sum") for a in algos]
    results = job.call(run_all_reduce, [(cases,)] * 8)
    want = np.add.reduce([data(r, (1 << 22) + 3, "float32") for r in range(8)])
    assert all(np.array_equal(results[r][i], want) for r in range(8) for i in range(len(algos)))


def test_two_hosts_over_tcp_run_the_hierarchical_algorithms():
    with Job(4, hosts=[0, 0, 1, 1], inter_host="tcp", timeout=20.0) as j:
        kinds = j.call(link_kinds, [()] * 4)
        assert kinds[0] == ["none", "shm", "tcp", "tcp"] and kinds[3] == ["tcp", "tcp", "shm", "none"]
        algos = sorted(_native.ALLREDUCE_ALGORITHMS)
        cases = [(a, name, 4, count, "sum") for a in algos for name in ("float32", "bfloat16")
                 for count in (0, 5, 70001)]
        results = j.call(run_all_reduce, [(cases,)] * 4)
        for i, (_, name, n, count, _) in enumerate(cases):
            want = np.add.reduce([data(r, count, name) for r in range(4)]).astype(dtype(name))
            assert all(np.array_equal(results[r][i], want) for r in range(4))


def test_multi_stream_tcp_carries_every_collective_in_order():
    """Three TCP connections per pair of hosts, a message cut into 256 KiB chunks spread over
    them (tcp.cc: MultiTcpLink): every collective's bytes arrive whole and in order, at sizes
    of one chunk, several, and odd lengths whose elements straddle chunk boundaries."""
    with Job(4, hosts=[0, 1, 2, 3], inter_host="tcp", timeout=20.0, tcp_streams=3) as j:
        assert j.call(link_kinds, [()] * 4)[1] == ["tcp x3", "none", "tcp x3", "tcp x3"]
        sizes = (0, 5, 70001, (1 << 20) + 3)
        cases = [(a, name, 4, count, "sum") for a in sorted(_native.ALLREDUCE_ALGORITHMS)
                 for name in ("float32", "float64", "float16") for count in sizes]
        results = j.call(run_all_reduce, [(cases,)] * 4)
        for i, (algo, name, n, count, _) in enumerate(cases):
            want = np.add.reduce([data(r, count, name) for r in range(4)]).astype(dtype(name))
            assert all(np.array_equal(results[r][i], want) for r in range(4)), cases[i]
        kinds = ["reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv"]
        cases = [(k, "float32", 4, count) for k in kinds for count in (7, 300001)]
        results = j.call(run_others, [(cases,)] * 4)
        for i, (kind, name, n, count) in enumerate(cases):
            xs = [data(r, count, name) for r in range(n)]
            want = {"reduce_scatter": lambda r: np.array_split(np.add.reduce(xs), n)[r],
                    "all_gather": lambda r: np.concatenate(xs),
                    "all_to_all": lambda r: np.concatenate(
                        [np.split(data(s, count * n, name), n)[r] for s in range(n)]),
                    "broadcast": lambda r: xs[n - 1],
                    "send_recv": lambda r: xs[(r - 1) % n]}[kind]
            assert all(np.array_equal(results[r][i], want(r)) for r in range(n)), cases[i]


def test_a_dead_rank_fails_every_rank_fast_and_leaves_nothing_behind(tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    j = Job(4, timeout=10.0)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as err:
        j.call(die_or_reduce, [(2, str(tmp_path))] * 4)
    assert time.monotonic() - start < 10.0
    assert "rank 2" in str(err.value)
    for r in (0, 1, 3):                        # every survivor raised CollectiveError itself
        seconds, rank, message = (tmp_path / str(r)).read_text().split("\n", 2)
        assert float(seconds) < 10.0 and int(rank) == r and "rank 2" in message, message
    j.close()
    assert all(p.poll() is not None for p in j.procs)
    assert set(os.listdir("/dev/shm")) == shm_before
    with Job(2) as again:                      # the next job in this process works
        assert again.call(link_kinds, [()] * 2) == [["none", "shm"], ["shm", "none"]]


def test_rendezvous_refuses_a_wrong_token():
    """Rank 0 admits only hellos carrying the job's token: a rank with another token never
    joins, and both sides fail with CollectiveError at the timeout instead of connecting."""
    import socket
    import threading
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address, errors = f"127.0.0.1:{port}", {}

    def rank(r, token):
        comm = _native.Comm(r, 2, -1, [0, 1], 1.5)
        try:
            comm.connect_tcp(address, token)
        except CollectiveError as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(0, "the-job")),
               threading.Thread(target=rank, args=(1, "an-intruder"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert set(errors) == {0, 1}
    assert "wrong job token" in str(errors[0]) and errors[0].rank == 0
    assert errors[1].rank == 1


def test_bench_prints_one_json_measurement_per_op_size_and_algorithm():
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "autopar.tools.bench", "--op", "all", "--ranks", "3",
                          "--size", "4KB", "1000", "--algorithm", "ring", "tree", "--json"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2 * (2 + 4)                    # all_reduce twice, four others once, per size
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                       "broadcast"}
    for r in rows:
        assert set(r) == {"op", "ranks", "bytes", "algorithm", "dtype", "latency_us", "busbw_gbs",
                          "net_bytes_per_call"}
        assert r["ranks"] == 3 and r["bytes"] in (4096, 1000) and r["dtype"] == "float32"
        assert r["latency_us"] > 0 and r["busbw_gbs"] > 0


def test_bench_buffers_start_on_a_page_zeroed():
    """Every implementation the benchmarks time gets its buffers placed alike: where a buffer
    starts within its page sets how fast a copy between two runs (``bench.zeros``)."""
    from autopar.tools import bench
    for op, (n_in, n_out) in {"all_gather": (250, 500), "reduce_scatter": (500, 250),
                              "all_reduce": (500, 500)}.items():
        x, y = bench.buffers(op, 2000, 2, np.float32)
        assert (x.size, y.size) == (n_in, n_out)
        assert x.ctypes.data % 4096 == 0 and y.ctypes.data % 4096 == 0
        assert not x.any() and not y.any() and x.flags.writeable


def directness(comm):
    return comm.direct


@pytest.mark.slow
@pytest.mark.parametrize("direct", [True, False])
def test_large_messages_single_copy_and_through_the_slots(monkeypatch, direct):
    # From 1 MB a send is read by the receiver straight from the sender's memory
    # (process_vm_readv) unless the job is started with direct=False (RuntimeOptions.direct);
    # both paths give numpy's values. The workers' environment says the opposite: the native
    # Comm takes only its argument. Four ranks on two hosts (more only take turns on this
    # machine's cores; smaller messages go through every group size of 8 ranks elsewhere).
    monkeypatch.setenv("AUTOPAR_DIRECT", "0" if direct else "1")
    count = 262_147                     # float32: 1 MB + 12 bytes per rank
    cases = [(a, "float32", n, n * count, "sum") for a in sorted(_native.ALLREDUCE_ALGORITHMS)
             for n in (3, 4)]
    others = [(k, name, n, count) for k in ("reduce_scatter", "all_gather", "all_to_all", "broadcast",
                                            "send_recv") for name in ("float32", "float64") for n in (2, 3, 4)]
    with Job(4, hosts=[0, 0, 1, 1], timeout=20.0, direct=direct) as j:
        assert j.call(directness, [()] * 4) == [direct] * 4
        reduced = j.call(run_all_reduce, [(cases,)] * 4)
        rest = j.call(run_others, [(others,)] * 4)
    for i, (algo, name, n, c, _) in enumerate(cases):
        want = np.add.reduce([data(r, c, name) for r in range(n)])
        assert all(np.array_equal(reduced[r][i], want) for r in range(n)), (algo, n)
    for i, (kind, name, n, c) in enumerate(others):
        xs = [data(r, c, name) for r in range(n)]
        want = {"reduce_scatter": lambda r: np.array_split(np.add.reduce(xs), n)[r],
                "all_gather": lambda r: np.concatenate(xs),
                "all_to_all": lambda r: np.concatenate([np.split(data(s, c * n, name), n)[r]
                                                        for s in range(n)]),
                "broadcast": lambda r: xs[n - 1],
                "send_recv": lambda r: xs[(r - 1) % n]}[kind]
        assert all(np.array_equal(rest[r][i], want(r)) for r in range(n)), (kind, name, n)
