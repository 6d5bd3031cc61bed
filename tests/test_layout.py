"""Layout, mesh, topology and config values: text forms, conversions, validation."""
import itertools

import pytest
from jax.sharding import PartitionSpec as P

import autopar as ap
from autopar import Layout, LogicalMesh, Topology


MESH = LogicalMesh.create((2, 4))


def all_layouts(rank, names):
    for pick in itertools.product(["-", "+", *range(rank)], repeat=len(names)):
        groups = [[a for a, c in zip(names, pick) if c == d] for d in range(rank)]
        partial = {a for a, c in zip(names, pick) if c == "+"}
        for dims in itertools.product(*[itertools.permutations(g) for g in groups]):
            yield Layout(dims, partial)


def test_text_round_trip_every_layout():
    n = 0
    for rank in range(4):
        for lay in all_layouts(rank, ("x", "y", "z")):
            assert Layout.parse(str(lay)) == lay
            assert eval(repr(lay), {"Layout": Layout}) == lay
            n += 1
    assert n == 314          # every layout of rank 0-3 over three axes
    assert str(Layout.parse("[x,(y,z),_] sum{w}")) == "[x,(y,z),_] sum{w}"
    assert str(Layout.replicated(2)) == "[_,_]"


def test_strategy_mapping_is_documented_and_deterministic():
    assert str(Layout.from_strategy((2, 4), MESH)) == "[x,y]"
    assert str(Layout.from_strategy((8, 1), MESH)) == "[(x,y),_]"
    assert str(Layout.from_strategy((4, 2), MESH)) == "[y,x]"
    assert str(Layout.from_strategy((1, 4), MESH)) == "[_,y]"
    sq = LogicalMesh.create((2, 2))
    assert str(Layout.from_strategy((2, 2), sq)) == "[x,y]"
    for counts in [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (8, 1), (1, 8)]:
        assert Layout.from_strategy(counts, MESH).to_strategy(MESH) == counts
    with pytest.raises(ap.LayoutError, match="multiply to 3"):
        Layout.from_strategy((3, 1), MESH)


def test_mindspore_tensor_map_round_trip():
    for lay in all_layouts(2, ("x", "y")):
        if lay.partial:
            continue
        dm, tmap = lay.to_tensor_map(MESH)
        assert dm == (2, 4)
        assert Layout.from_tensor_map(dm, tmap, MESH) == lay
    # MindSpore counts device-matrix axes from the right: y (last) is 0, x is 1
    assert Layout.parse("[x,_]").to_tensor_map(MESH) == ((2, 4), (1, -1))
    assert Layout.parse("[_,y]").to_tensor_map(MESH) == ((2, 4), (-1, 0))
    assert Layout.parse("[(x,y),_]").to_tensor_map(MESH) == ((2, 4), ((1, 0), -1))


def test_partition_spec_round_trip():
    assert Layout.parse("[(x,y),_,z]").to_partition_spec() == P(("x", "y"), None, "z")
    for lay in all_layouts(3, ("x", "y")):
        if not lay.partial:
            assert Layout.from_partition_spec(lay.to_partition_spec(), 3) == lay
    with pytest.raises(ap.LayoutError, match="partial"):
        Layout.parse("[x] sum{y}").to_partition_spec()


def test_layout_validation():
    with pytest.raises(ap.LayoutError, match="twice"):
        Layout((("x",), ("x",)))
    with pytest.raises(ap.LayoutError, match="does not divide"):
        Layout.parse("[y,_]").check((6, 4), MESH)
    with pytest.raises(ap.LayoutError, match="has 2 dimensions"):
        Layout.parse("[y,_]").check((8,), MESH)
    assert Layout.parse("[y,x]").local_shape((8, 6), MESH) == (2, 3)


def test_mesh_levels_and_topology():
    topo = Topology.cluster(hosts=2, per_host=8)
    mesh = LogicalMesh.create((2, 8), ("dp", "tp"), topo)
    assert mesh.level("tp").name == "gpu" and mesh.level("dp").name == "node"
    m3 = LogicalMesh.create((4, 4), ("a", "b"), topo)      # a spans the NIC: its slowest level
    assert m3.level("b").name == "gpu" and m3.level("a").name == "node"
    with pytest.raises(ap.ConfigError, match="devices"):
        LogicalMesh.create((3,), topology=Topology.local(4))
    assert "host=4" in str(Topology.local(4))


def test_config_validation():
    c = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4),
                          max_device_memory="16GB")
    assert c.max_device_memory == 16 * 2 ** 30 and c.logical_mesh().axis_names == ("x", "y")
    assert ap.ParallelConfig(parallel_mode="data_parallel", device_num=4).mesh_shape == (4,)
    with pytest.raises(ap.ConfigError, match="'stand_alone', 'data_parallel'"):
        ap.ParallelConfig(parallel_mode="model_parallel")
    with pytest.raises(ap.ConfigError, match="mesh_shape"):
        ap.ParallelConfig(parallel_mode="data_parallel", device_num=8, mesh_shape=(2, 2))
    with pytest.raises(ap.ConfigError, match="stand_alone"):
        ap.ParallelConfig(device_num=4)
    with pytest.raises(ap.ConfigError, match="16GB"):
        ap.ParallelConfig(max_device_memory="lots")


def test_conversions_reject_mismatched_input():
    with pytest.raises(ap.LayoutError, match="tensor_map"):
        Layout.from_tensor_map((2, 4), (2, -1), MESH)
    with pytest.raises(ap.LayoutError, match="3 entries"):
        Layout.from_partition_spec(P("x", "y", None), 2)
    with pytest.raises(ap.LayoutError, match="not on"):
        Layout.parse("[w,_]").local_shape((4, 4), MESH)
    with pytest.raises(ap.ConfigError, match="identifiers"):
        LogicalMesh.create((2, 2), ("t,p", "q"))
