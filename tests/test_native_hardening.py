"""Hardening of the native runtime: the binding refuses arguments the C++
code cannot use (NativeArgumentError, naming the argument and its range) before anything moves;
ranks that disagree on a collective's size fail with CollectiveError on every rank, naming both
sizes, instead of reading or writing each other's memory at wrong offsets; the TCP rendezvous
drops strangers (silent, garbage, a wrong token, a huge claimed length, an early close) without
stalling or failing the job. Small jobs (2-3 ranks)."""
import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from autopar import _native
from autopar.errors import AutoparError, CollectiveError, NativeArgumentError
from autopar.runtime import launcher
from autopar.runtime.launcher import Job

pytestmark = pytest.mark.native


# --- the binding's argument checks (in this process, no workers) ---------------------------

@pytest.fixture(scope="module")
def segment():
    return _native.Segment.create(2)


@pytest.mark.parametrize("args, match", [
    ((100_000_000, 2), r"rank=100000000 must be in \[0, size\) = \[0, 2\)"),
    ((-1, 2), r"rank=-1 must be in \[0, size\)"),
    ((0, 3), r"size=3 does not match the segment's 2 ranks"),
    ((0, 100_000_000), r"size=100000000 must be in \[1, 65536\]"),
    ((0, 0), r"size=0 must be in \[1, 65536\]"),
    ((0, 2, "closed"), r"fd=\d+ is not an open descriptor"),
    ((0, 2, -7), r"fd=-7 must be -1 \(no shared memory\)"),
    ((0, 2, "file"), r"fd=\d+ is not an autopar segment"),
    ((0, 2, "segment", [0]), r"hosts names 1 ranks' hosts; it must name all 2"),
    ((0, 2, "segment", [0, -1]), r"hosts\[1\]=-1 must be a host id >= 0"),
    ((0, 2, "segment", [], float("nan")), r"timeout=nan must be a finite number of seconds"),
    ((0, 2, "segment", [], float("inf")), r"timeout=inf must be a finite number"),
    ((0, 2, "segment", [], 0.0), r"timeout=0 must be a finite number"),
    ((0, 2, "segment", [], -1.0), r"timeout=-1 must be a finite number"),
])
def test_comm_refuses_arguments_that_do_not_fit_the_segment(segment, tmp_path, args, match):
    rank, size, fd, *rest = args + ("segment",) * (3 - len(args))
    if fd == "segment":
        fd = segment.fd
    elif fd == "closed":
        fd = os.open(os.devnull, os.O_RDONLY)
        os.close(fd)
    elif fd == "file":
        path = tmp_path / "not-a-segment"
        path.write_bytes(b"\0" * 8192)
        fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(NativeArgumentError, match=match) as err:
            _native.Comm(rank, size, fd, *rest)
    finally:
        if args[2:3] == ("file",):
            os.close(fd)
    assert isinstance(err.value, AutoparError) and isinstance(err.value, ValueError)
    assert str(err.value).startswith("Comm: ")


@pytest.mark.parametrize("args, match", [
    ((0,), r"nranks=0 must be in \[1, 256\]"),
    ((257,), r"nranks=257 must be in \[1, 256\]"),
    ((2, 0), r"slots=0 must be in \[1, 4096\]"),
    ((2, 8, 0), r"slot_bytes=0 must be in \[1, 67108864\]"),
])
def test_segment_create_refuses_sizes_out_of_range(args, match):
    with pytest.raises(NativeArgumentError, match=match):
        _native.Segment.create(*args)


def f32(n=8):
    return np.arange(n, dtype=np.float32)


@pytest.mark.parametrize("call, match", [
    (lambda c: c.all_reduce(f32(), [0, 0]), r"all_reduce: rank 0 appears twice in ranks"),
    (lambda c: c.all_reduce(f32(), [0, 2]), r"all_reduce: ranks\[1\]=2 is outside \[0, 2\)"),
    (lambda c: c.all_reduce(f32(), [-1, 0]), r"ranks\[0\]=-1 is outside \[0, 2\)"),
    (lambda c: c.all_reduce(f32(), [1]), r"rank 0 \(this one\) is not in ranks"),
    (lambda c: c.barrier([]), r"barrier: ranks is empty"),
    (lambda c: c.all_reduce(f32(), [0], "mean"), r"all_reduce: op='mean' must be sum, prod"),
    (lambda c: c.all_reduce(f32(), [0], "sum", "magic"), r"algorithm='magic' is not one of"),
    (lambda c: c.all_reduce(np.ones(4, np.uint8), [0]), r"array must be a float32, .* not uint8"),
    (lambda c: c.all_reduce(np.ones(4, np.complex64), [0]), r"not complex64"),
    (lambda c: c.all_reduce(np.ones(4, ">f4"), [0]), r"array has a big-endian dtype"),
    (lambda c: c.all_reduce(np.ones((4, 3), np.float32).T, [0]), r"must be C-contiguous"),
    (lambda c: c.all_reduce(np.frombuffer(bytearray(17), np.float32, 4, 1), [0]),
     r"must be writable|must be aligned"),
    (lambda c: c.all_reduce(np.frombuffer(bytes(16), np.float32), [0]), r"must be writable"),
    (lambda c: c.reduce_scatter(f32(8), np.empty(7, np.float32), [0]),
     r"reduce_scatter: output must hold this rank's block of the input: 8 elements"),
    (lambda c: c.reduce_scatter(f32(8), np.empty(8, np.float64), [0]), r"not 8 of float64"),
    (lambda c: c.all_gather(f32(4), np.empty(5, np.float32), [0]),
     r"all_gather: output must hold group size x input elements \(1 x 4\)"),
    (lambda c: (lambda x: c.all_gather(x[:4], x[2:6], [0]))(f32()), r"input and output share memory"),
    (lambda c: c.all_gather(np.array([None]), np.empty(1, object), [0]), r"holds Python objects"),
    (lambda c: c.all_to_all(f32(4), np.empty(4, np.int32), [0]), r"same dtype and size"),
    (lambda c: c.broadcast(f32(), [0], 1), r"broadcast: root=1 must be a position in the group, in \[0, 1\)"),
    (lambda c: c.send(f32(), 0), r"send: peer=0 must be another rank in \[0, 2\), not this one"),
    (lambda c: c.recv(f32(), 5), r"recv: peer=5 must be another rank"),
    (lambda c: c.send(f32(), 1), r"send: no link to rank 1"),
    (lambda c: c.link_kind(2), r"link_kind: peer=2 must be in \[0, 2\)"),
    (lambda c: c.all_reduce(f32(), [0], "sum", "reduction_server"), r"needs reducers"),
    (lambda c: c.all_reduce(f32(), [0], "sum", "ring", [1]), r"for algorithm='reduction_server' only"),
    (lambda c: c.all_reduce(f32(), [0], "sum", "reduction_server", [0]),
     r"rank 0 is both a worker and a reducer"),
    (lambda c: c.all_reduce(f32(), [0], "sum", "reduction_server", [5]), r"reducer 5 is outside"),
    (lambda c: c.all_reduce(f32(), [0], "sum", "reduction_server", [1]), r"no link to rank 1"),
    (lambda c: c.serve_reductions([1], [0, 0]), r"rank 0 appears twice in reducers"),
    (lambda c: c.serve_reductions([1], [1]), r"rank 1 is both a worker and a reducer"),
    (lambda c: c.release_reducers([], [0]), r"release_reducers: reducers is empty"),
    (lambda c: c.connect_tcp("localhost", "token"), r"rendezvous='localhost' must be an IPv4"),
    (lambda c: c.connect_tcp("127.0.0.1:70000", "token"), r"a port in \[1, 65535\]"),
    (lambda c: c.connect_tcp("127.0.0.1:5000", ""), r"token must have 1 to 63 characters"),
    (lambda c: c.connect_tcp("127.0.0.1:5000", "t" * 64), r"token must have 1 to 63"),
    (lambda c: c.connect_tcp("127.0.0.1:5000", "token", "::1"), r"host='::1' must be this rank's IPv4"),
])
def test_collectives_refuse_groups_peers_roots_and_arrays_they_cannot_use(call, match):
    comm = _native.Comm(0, 2, -1, [0, 1], 1.0)        # no links: nothing can move
    with pytest.raises(NativeArgumentError, match=match):
        call(comm)
    x = f32()
    comm.all_reduce(x, [0])                           # the Comm still works afterwards
    assert np.array_equal(x, f32())


# --- ranks that disagree on a size ----------------------------------------------------------

def disagree(comm, kind, algorithm, count):
    """Rank 2 passes one element more than ranks 0 and 1; returns, per rank, whether its
    buffers are as they were, and the CollectiveError it raised (None if none)."""
    n = count + (comm.rank == 2)
    x = np.arange(n, dtype=np.float32)
    guard = np.full(1 << 16, 7, np.float32)       # a neighbour on the heap a stray write would hit
    before = x.copy()
    assert comm.direct                              # single-copy is on: the direct paths run
    try:
        if kind == "all_reduce":
            comm.all_reduce(x, [0, 1, 2], "sum", algorithm)
        else:
            comm.all_gather(x, np.empty(3 * n, np.float32), [0, 1, 2])
    except CollectiveError as e:
        return np.array_equal(x, before), bool((guard == 7).all()), (e.rank, e.cause)
    return np.array_equal(x, before), bool((guard == 7).all()), None


@pytest.mark.parametrize("kind, algorithm, count, untouched", [
    ("all_reduce", "direct", 300_000, True),       # single-copy: peers' memory, process_vm_*
    ("all_gather", "", 1 << 16, True),              # single-copy reads (direct_copy.cc)
    ("all_reduce", "ring", 1000, False),            # through the slots
])
def test_ranks_that_disagree_on_the_size_all_fail_naming_both_sizes(kind, algorithm, count,
                                                                     untouched):
    mine = {r: 4 * (count + (r == 2)) for r in range(3)}
    with Job(3, timeout=10.0) as j:
        results = j.call(disagree, [(kind, algorithm, count)] * 3)
    for r, (same, guard, error) in enumerate(results):
        assert guard, r
        assert error is not None and error[0] == r, (r, results)
        # the rank's own sizes and the other side's, from its own check or from the abort
        assert "ranks disagree on the size" in error[1], error
        assert f"{mine[2]} bytes" in error[1] and f"{mine[0]} bytes" in error[1], error
        if untouched or r == 2:                    # single-copy: checked before any byte moved
            assert same, (r, results)


# --- strangers at the TCP rendezvous --------------------------------------------------------

HELLO = 0x6170746370686931           # tcp.cc's kHello


def hello(token, rank, port, host=b"127.0.0.1"):
    return struct.pack("<Q64sii64s", HELLO, token, rank, port, host)


def open_strangers(port, deadline=30.0):
    """Wait until something listens on port, then connect five strangers to it: (a) one that
    sends nothing, (b) garbage, (c) a well-formed hello with a wrong token, (d) a huge claimed
    length followed by a flood, (e) half a hello and an early close. Returns the open sockets."""
    end = time.monotonic() + deadline
    while True:
        try:
            first = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.002)
    socks = [first]                                                         # (a) silent
    for payload in (os.urandom(200),                                        # (b) garbage
                    hello(b"an-intruder", 1, 9),                            # (c) wrong token
                    struct.pack("<QQ", HELLO, 2 ** 63) + b"\xff" * 65536,   # (d) huge length
                    hello(b"the-job", 1, 9)[:70]):                          # (e) short, closes
        s = socket.create_connection(("127.0.0.1", port), timeout=1)
        try:
            s.sendall(payload)
        except OSError:
            pass                                  # dropped already: that is the point
        socks.append(s)
    socks.pop().close()
    return socks


def tcp_rank(r, address, token, out):
    try:
        comm = _native.Comm(r, 2, -1, [0, 1], 20.0)
        comm.connect_tcp(address, token)
        x = np.full(70001, r + 1, np.float32)
        comm.all_reduce(x, [0, 1], "sum", "ring")
        out[r] = (comm.link_kind(1 - r), x)
    except Exception as e:                        # noqa: BLE001 - asserted by the test
        out[r] = e


def test_strangers_neither_stall_nor_fail_the_rendezvous():
    """The strangers connect before rank 1 does (rank 0 admits nobody else meanwhile); rank 1
    then joins at once, not after a stranger's deadline, and the pair runs an all-reduce."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address, out = f"127.0.0.1:{port}", {}
    zero = threading.Thread(target=tcp_rank, args=(0, address, "the-job", out))
    zero.start()
    strangers = open_strangers(port)
    start = time.monotonic()
    one = threading.Thread(target=tcp_rank, args=(1, address, "the-job", out))
    one.start()
    one.join(30)
    zero.join(30)
    took = time.monotonic() - start
    for s in strangers:
        s.close()
    for r in (0, 1):
        assert not isinstance(out[r], BaseException), out[r]
        kind, x = out[r]
        assert kind == "tcp" and np.array_equal(x, np.full(70001, 3, np.float32))
    assert took < 1.5, took                       # a stranger's 2 s deadline was not waited out


def link_kinds(comm):
    return [comm.link_kind(p) for p in range(comm.size)]


def reduce_ones(comm, count):
    x = np.full(count, comm.rank + 1, np.float32)
    comm.all_reduce(x, list(range(comm.size)), "sum", "ring")
    return x


def test_the_rendezvous_port_is_below_the_ephemeral_range():
    """The other ranks' TCP listeners take ephemeral ports (port 0) in rank 0's namespace before
    rank 0 binds the rendezvous: a rendezvous port from that range was once taken first."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {launcher._free_port() for _ in range(20)}
    assert all(10000 <= port < low for port in ports) and len(ports) > 1


def test_a_tcp_job_starts_and_runs_with_strangers_at_its_rendezvous(monkeypatch):
    """A 2-host job: rank 1 is stopped (SIGSTOP) as it is started and continued only once the
    five strangers are connected to rank 0's rendezvous, so the strangers come first.
    direct=False: rank 0 then goes to the rendezvous without waiting for rank 1's single-copy
    probe. fork=False: the workers are started with Popen, which the test intercepts."""
    port = launcher._free_port()
    monkeypatch.setattr(launcher, "_free_port", lambda: port)
    stopped, found = [], {}
    popen = launcher.subprocess.Popen

    def start_stopped(args, **kwargs):
        proc = popen(args, **kwargs)
        rank = args[next(i for i, a in enumerate(args) if a.endswith("/control")) + 1]
        if rank != "0":                            # after the control socket's path
            os.kill(proc.pid, signal.SIGSTOP)
            stopped.append(proc.pid)
        return proc

    def strangers():
        try:
            found["socks"] = open_strangers(port)
        except OSError as e:
            found["error"] = e
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)

    monkeypatch.setattr(launcher.subprocess, "Popen", start_stopped)
    t = threading.Thread(target=strangers)
    t.start()
    try:
        with Job(2, hosts=[0, 1], inter_host="tcp", timeout=20.0, direct=False,
                 fork=False) as j:
            t.join(30)
            assert len(stopped) == 1 and "error" not in found, found
            assert j.call(link_kinds, [()] * 2) == [["none", "tcp"], ["tcp", "none"]]
            got = j.call(reduce_ones, [(70001,)] * 2)
        assert all(np.array_equal(x, np.full(70001, 3, np.float32)) for x in got)
    finally:
        t.join(30)
        for s in found.get("socks", []):
            s.close()
