"""The collective cost table (strategies/comm_cost.py) and how the redistribution planner
prices steps with it: per-axis topology levels, the native all-reduce algorithms under their
own names, the 2D ones for groups that span two levels, the choice by message size."""
import numpy as np
import pytest

from autopar.layout import Layout
from autopar.mesh import LogicalMesh
from autopar.redistribution.planner import Planner, Step
from autopar.strategies.comm_cost import ALL_REDUCE, all_reduce_times, collective_time
from autopar.errors import ConfigError
from autopar.topology import Topology

F32 = np.float32
MESH24 = LogicalMesh.create((2, 4))


def L(text):
    return Layout.parse(text)


def test_cost_uses_each_axis_topology_level():
    mesh = LogicalMesh.create((2, 4), topology=Topology.cluster(2, 4))
    pl = Planner(mesh)
    for axis in ("x", "y"):
        lv = mesh.level(axis)
        c = pl.cost(L(f"[{axis}]"), L("[_]"), (64,), F32)
        n = mesh.axis_size(axis)
        assert c == collective_time("all_gather", 64 // n * 4, n, lv.alpha, lv.beta)[0]
    assert mesh.level("x") != mesh.level("y")


def test_a_level_prices_each_collective_kind_at_its_own_measured_rate(tmp_path):
    """``Level.betas`` (what ``autopar calibrate`` measures per kind) prices that kind's bytes;
    a kind it does not name, and a send between stages, use ``beta``; a topology file keeps
    them; a kind that is not a collective is refused."""
    from dataclasses import replace
    from autopar.topology import Level
    base = Topology.local(2)
    slow = replace(base, levels=(replace(base.levels[0], betas={"all_to_all": 1e-9}),))
    assert slow.levels[0].betas == (("all_to_all", 1e-9),)
    before, after = (Planner(LogicalMesh.create((2,), topology=t)) for t in (base, slow))
    nbytes, lv = 1 << 22, base.levels[0]
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        assert after.step_time(kind, ("x",), nbytes) == before.step_time(kind, ("x",), nbytes)
    t = after.step_time("all_to_all", ("x",), nbytes)[0]
    assert t == collective_time("all_to_all", nbytes, 2, lv.alpha, 1e-9)[0]
    assert t > 3 * before.step_time("all_to_all", ("x",), nbytes)[0]
    slow.save(tmp_path / "t.json")
    assert Topology.load(tmp_path / "t.json") == slow and "all_to_all:1GB/s" in str(slow)
    with pytest.raises(ConfigError, match="collective kinds"):
        Level("host", 2, 5e-6, 1e-10, betas={"send": 1e-9})
    with pytest.raises(ConfigError, match="every kind's beta > 0"):
        Topology((Level("host", 2, 5e-6, 1e-10, betas={"all_gather": 0.0}),))


def test_all_reduce_algorithms_are_the_native_ones():
    from autopar import _native
    assert set(ALL_REDUCE) == set(_native.ALLREDUCE_ALGORITHMS) | {"reduction_server"}
    seen = set()
    for n in range(2, 17):
        for hosts in [h for h in range(1, n + 1) if n % h == 0]:
            inner = (n // hosts, 3e-6, 1e-11) if hosts > 1 else None
            for nbytes in (4, 1 << 12, 1 << 20, 1 << 28):
                for shared in (False, True) if hosts == 1 else (False,):
                    seen |= set(all_reduce_times(nbytes, n, 1e-5, 1e-9, inner, 0.0, shared))
                    seen.add(collective_time("all_reduce", nbytes, n, 1e-5, 1e-9, inner,
                                             shared=shared)[1])
    assert seen == set(_native.ALLREDUCE_ALGORITHMS)
    # every other kind names the one algorithm the native runtime runs for it
    assert {collective_time(k, 1 << 20, 8, 1e-5, 1e-9)[1] for k in
            ("all_gather", "reduce_scatter", "all_to_all", "broadcast")} == {"ring", "pairwise",
                                                                            "chain"}


def test_two_level_all_reduce_is_priced_two_dimensional():
    mesh = LogicalMesh.create((2, 4), topology=Topology.cluster(2, 4))
    node, gpu = mesh.level("x"), mesh.level("y")
    pl, nbytes = Planner(mesh), 64 << 20
    sec, algo = pl.step_time("all_reduce", ("x", "y"), nbytes)
    flat = all_reduce_times(nbytes, 8, node.alpha, node.beta)
    assert algo == "2d_torus" and sec < flat["ring"] / 2
    assert sec == all_reduce_times(nbytes, 8, node.alpha, node.beta, (4, gpu.alpha, gpu.beta),
                                   1 / mesh.topology.mem_bandwidth)["2d_torus"]
    # the planner may compose the same three phases itself, with recursive doubling between the
    # 2 hosts where the native 2d_torus runs a ring; never costlier than the one 2D step
    plan = pl.plan(L("[_] sum{x,y}"), L("[_]"), (nbytes // 4,), F32)
    assert plan.cost <= sec
    assert plan.steps in ((Step("all_reduce", ("x", "y")),),
                          (Step("reduce_scatter", ("y",), 0), Step("all_reduce", ("x",)),
                           Step("all_gather", ("y",), 0)))
    # one level only, or a tiny message: a flat algorithm; inside a host (the gpu level) the
    # direct one, across hosts never
    for axes, n in ((("x", "y"), 4), ("y", nbytes), ("x", nbytes)):
        assert pl.step_time("all_reduce", axes, n)[1] in ("ring", "halving_doubling",
                                                          "recursive_doubling", "direct")
    assert pl.step_time("all_reduce", "y", nbytes)[1] == "direct"
    assert pl.step_time("all_reduce", "x", nbytes)[1] != "direct"
    # one topology level (this host): never a 2D algorithm
    assert Planner(MESH24).step_time("all_reduce", ("x", "y"), nbytes)[1] == "direct"
    assert Planner(MESH24).step_time("all_reduce", ("x", "y"), 4096)[1] == "recursive_doubling"


def test_all_reduce_choice_by_message_size():
    a, b = 5e-6, 1 / 4e9
    for nbytes in (4, 1 << 12):                      # latency-bound: log2(n) whole-buffer steps
        t = all_reduce_times(nbytes, 8, a, b)
        assert collective_time("all_reduce", nbytes, 8, a, b) == (t["recursive_doubling"],
                                                                  "recursive_doubling")
        assert t["recursive_doubling"] == pytest.approx(3 * (a + nbytes * b))
        assert t["halving_doubling"] == pytest.approx(6 * a + 1.75 * nbytes * b)
        # tree.cc runs its two trees one after the other: 4 messages per level
        assert t["tree"] == pytest.approx(24 * a + 8 * nbytes * b) and t["tree"] > t["ring"]
    assert collective_time("all_reduce", 4, 6, a, b)[1] == "recursive_doubling"   # 2 + 2 folds
    big = 64 << 20                                   # bandwidth-bound: 2(n-1)/n B bytes
    assert collective_time("all_reduce", big, 8, a, b)[1] == "halving_doubling"
    assert collective_time("all_reduce", big, 6, a, b)[1] == "ring"    # no fold of 2 ranks
    # reducing costs: at 2 ranks recursive doubling (one whole-buffer exchange, reduced whole)
    # wins for small messages only
    g = 1 / 10e9
    assert collective_time("all_reduce", 1 << 10, 2, a, b, gamma=g)[1] == "recursive_doubling"
    assert collective_time("all_reduce", 1 << 20, 2, a, b, gamma=g)[1] == "ring"
    # ranks sharing a host's memory: direct for large messages, never for a few bytes
    for n in (2, 3, 4, 8):
        assert collective_time("all_reduce", 4, n, a, b, gamma=g, shared=True)[1] == \
            "recursive_doubling"
        assert collective_time("all_reduce", 1 << 20, n, a, b, gamma=g, shared=True)[1] == "direct"
        t = all_reduce_times(1 << 20, n, a, b, gamma=g, shared=True)
        assert t["direct"] == pytest.approx((n + (n - 1).bit_length()) * a
                                            + 1.5 * (n - 1) / n * (1 << 20) * b
                                            + (n - 1) / n * (1 << 20) * g)


@pytest.mark.parametrize("axes", ["x", ("x", "y")])
def test_all_reduce_prices_pick_what_step_time_picks_at_every_size(axes):
    """The affine prices a runtime uses for fused buckets choose the planner's algorithm."""
    mesh = LogicalMesh.create((2, 4), topology=Topology.cluster(2, 4))
    planner = Planner(mesh)
    prices = planner.all_reduce_prices(axes)
    assert [a for a, _, _ in prices] == [a for a in ALL_REDUCE if a in {p[0] for p in prices}]
    for nbytes in [0, 1, 100, 4096, 65536, 1 << 20, 1 << 24, 1 << 28]:
        cheapest = min(prices, key=lambda p: p[1] + p[2] * nbytes)[0]
        assert cheapest == planner.step_time("all_reduce", axes, nbytes)[1], nbytes


def test_reduction_server_is_offered_for_whole_mesh_groups_when_the_topology_has_reducers():
    """A worker of a Reduction Server sends its buffer once (the ring 2(n-1)/n times): with
    reducers enough that theirs NICs keep up it wins over hosts; a group inside one host, a
    group of part of the mesh, or a topology without reducers never gets it."""
    def pick(preset, shape, axes, nbytes):
        mesh = LogicalMesh.create(shape, topology=Topology.preset(preset, 4))
        return Planner(mesh).step_time("all_reduce", axes, nbytes)[1]
    assert pick("cluster:4x1+r4", (4,), "x", 16 << 20) == "reduction_server"
    assert pick("cluster:4x1", (4,), "x", 16 << 20) == "halving_doubling"
    assert pick("cluster:4x1+r2", (4,), "x", 16 << 20) == "halving_doubling"   # 2 B through each
    assert pick("cluster:2x2+r4", (4,), "x", 16 << 20) == "2d_torus"    # two ranks per NIC
    assert pick("cluster:4x1+r4", (2, 2), "x", 16 << 20) != "reduction_server"   # part of it
    t = Topology.preset("cluster:4x1+r4", 4)
    assert t.reducers == 4 and "+ 4 reducers" in str(t)
    assert Topology.from_dict(t.to_dict()) == t
    assert t.inner(2).reducers == 0                       # a pipeline stage reduces alone
    with pytest.raises(ConfigError, match=r"\+rN"):
        Topology.preset("cluster:4x1+rx", 4)
    with pytest.raises(ConfigError, match="0 to 64 reducer"):
        Topology(t.levels, reducers=-1)
