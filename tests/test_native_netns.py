"""The native runtime across "hosts" that are Linux network namespaces joined by veth pairs.

Each test host is a namespace made here (``autopar.tools.netns``), with its own loopback and
address; its ranks run inside it (``Job(namespaces=...)``), share memory with each other and
reach the other host only over TCP through the veth pair. Needs root and ``ip`` (skipped with the reason
otherwise); every namespace and link is removed after.
"""
import re
import subprocess

import numpy as np
import pytest

from autopar import _native
from autopar.runtime.launcher import Job
from autopar.tools import netns

from test_native import data, dtype, link_kinds, run_all_reduce


WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.native,
              pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")]


@pytest.fixture
def hosts():
    places, names = netns.make(2)
    try:
        yield places
    finally:
        netns.remove(names)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in names)


def test_two_namespace_hosts_run_every_all_reduce_over_their_veth(hosts):
    with Job(4, hosts=[0, 0, 1, 1], inter_host="tcp", timeout=20.0, namespaces=hosts) as j:
        kinds = j.call(link_kinds, [()] * 4)
        assert kinds[0] == ["none", "shm", "tcp", "tcp"] and kinds[3] == ["tcp", "tcp", "shm", "none"]
        algos = sorted(_native.ALLREDUCE_ALGORITHMS)
        cases = [(a, "float32", 4, count, "sum") for a in algos for count in (5, 70001)]
        results = j.call(run_all_reduce, [(cases,)] * 4)
        for i, (_, name, n, count, _) in enumerate(cases):
            want = np.add.reduce([data(r, count, name) for r in range(4)]).astype(dtype(name))
            assert all(np.array_equal(results[r][i], want) for r in range(4)), cases[i]
        peers = j.call(tcp_peers, [()] * 4)
    # the TCP links really cross the namespaces: rank 0's peers on host 1 are at host 1's address
    assert peers[0] == {"10.231.1.2"} and peers[2] == {"10.231.1.1"}, peers


def tcp_peers(comm):
    """The remote addresses of this worker's established TCP connections (from /proc)."""
    out = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "01":                              # ESTABLISHED
            ip = f[2].split(":")[0]
            out.add(".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out - {"127.0.0.1"}


def test_namespaces_need_tcp_and_every_host():
    from autopar.errors import ConfigError
    with pytest.raises(ConfigError, match="inter_host='tcp'"):
        Job(2, hosts=[0, 1], namespaces={0: ("x", "10.0.0.1"), 1: ("y", "10.0.0.2")})
    with pytest.raises(ConfigError, match=r"host\(s\) \[1\]"):
        Job(2, hosts=[0, 1], inter_host="tcp", namespaces={0: ("x", "10.0.0.1")})


def test_a_step_planned_for_two_hosts_runs_across_them_with_hierarchical_all_reduces(hosts):
    """A data-parallel GPT step planned on a 2 hosts x 2 devices topology: its gradient
    all-reduce is a hierarchical one, the cost table's pick for that topology, and run
    across the two namespace hosts it gives the single-device step's results."""
    import jax
    import autopar as ap
    import models as m
    from autopar.runtime.native_backend import NativeRunner, RuntimeOptions
    p, b = m.gpt_params(vocab=256, d=128), m.gpt_batch(batch=8, vocab=256)   # 0.9 MB of gradients
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4,
                            topology=ap.Topology.preset("cluster:2x2", 4))
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    grads = max((x for x in c.program.collectives() if x.kind == "all_reduce"),
                key=lambda x: x.bytes)
    assert grads.algorithm in ("2d_ring", "2d_torus", "2d_mesh"), grads
    runner = NativeRunner(c.program, timeout=30.0,
                          options=RuntimeOptions(hosts=(hosts[0], hosts[1])))
    try:
        got = jax.tree.unflatten(c.program.out_tree, runner(jax.tree.leaves((p, b))))
        peers = runner.job.call(tcp_peers, [()] * 4)
    finally:
        runner.close()
    want = m.gpt_sgd_step(p, b)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
    assert peers[0] == {"10.231.1.2"} and peers[3] == {"10.231.1.1"}, peers


def test_four_streams_per_pair_each_carry_a_share_of_a_capped_link():
    """Two hosts of one rank, four TCP connections between them, each flow capped by a class
    of its own (``netns.cap_flows``): a 16 MB all-reduce gives numpy's sum, and every one of
    the four flows in each direction carried a share of it (the chunks went to all of them)."""
    places, names = netns.make(2, rate="4gbit", per_flow=True)
    try:
        with Job(2, hosts=[0, 1], inter_host="tcp", timeout=20.0, namespaces=places,
                 tcp_streams=4) as j:
            assert j.call(link_kinds, [()] * 2) == [["none", "tcp x4"], ["tcp x4", "none"]]
            flows = j.call(netns.tcp_flows, [()] * 2)
            assert all(len(set(f)) == 4 for f in flows), flows
            netns.cap_flows(names, dict(enumerate(flows)), "1gbit")
            count = 1 << 22
            results = j.call(run_all_reduce, [([("ring", "float32", 2, count, "sum")],)] * 2)
            want = data(0, count, "float32") + data(1, count, "float32")
            assert all(np.array_equal(results[r][0], want) for r in range(2))
        for h, ns in enumerate(names):
            shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev",
                                    f"{ns[:-2]}v{h}"], capture_output=True, text=True).stdout
            sent = [int(b) for b in re.findall(r"class htb 1:[a-d] parent .*?\n Sent (\d+) bytes",
                                               shown, re.S)]
            # the ring moves 16 MB each way (two halves); no flow went without its share
            assert len(sent) == 4 and min(sent) > 2 << 20, (h, sent, shown)
    finally:
        netns.remove(names)


def reduce_through_servers(comm, workers, reducers, count):
    """Workers all-reduce through the reducers, returning (result, bytes sent to each rank)."""
    if comm.rank in reducers:
        return comm.serve_reductions(workers, reducers)
    x = data(comm.rank, count, "float32")
    before = comm.bytes_sent()
    comm.all_reduce(x, workers, "sum", "reduction_server", reducers)
    sent = [b - a for a, b in zip(before, comm.bytes_sent())]
    comm.release_reducers(reducers, workers)
    return x, sent


def test_reduction_server_across_three_hosts_on_a_bridge():
    """Workers on hosts 0 and 1, two reducers on host 2 (three namespaces on a bridge): the
    sum is numpy's, and each worker sent each reducer its half of the buffer once (plus a
    request and two frames), nothing to the other worker."""
    places, names = netns.make(3, rate="2gbit")
    try:
        with Job(4, hosts=[0, 1, 2, 2], inter_host="tcp", timeout=20.0, namespaces=places) as j:
            assert j.call(link_kinds, [()] * 4)[2] == ["tcp", "tcp", "none", "shm"]
            count = (1 << 20) + 3
            got = j.call(reduce_through_servers, [([0, 1], [2, 3], count)] * 4)
    finally:
        netns.remove(names)
    want = data(0, count, "float32") + data(1, count, "float32")
    assert got[2] == got[3] == 1
    for w in (0, 1):
        x, sent = got[w]
        assert np.array_equal(x, want)
        halves = [(count + 1) // 2 * 4, count // 2 * 4]
        extra = [sent[2] - halves[0], sent[3] - halves[1]]        # the request and frames
        assert sent[1 - w] == 0 and extra[0] == extra[1] and 0 < extra[0] <= 512, sent


def test_the_readme_block_runs_as_written():
    """README's "The native runtime across hosts" block, with the "Using it" block's step and
    arguments: a data-parallel step on two namespace hosts of two ranks each returns the
    single-device step's values."""
    import os

    import jax

    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    block = lambda after, before: re.search(
        r"```python\n(.*?)```", text[text.index(after):text.index(before)], re.S).group(1)
    using = block("## Using it", "### `ap.compile(")
    names = {}
    exec(compile(using[:using.index("cfg = ")], "README.md", "exec"), names)
    try:
        exec(compile(block("### The native runtime across hosts", "### Command line"),
                     "README.md", "exec"), names)
        want = jax.tree.leaves(jax.jit(names["step"])(names["params"], names["batch"]))
        assert len(names["out"]) == len(want)
        for got, w in zip(names["out"], want):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    finally:
        if "runner" in names:
            names["runner"].close()
        if "names" in names:
            netns.remove(names["names"])
