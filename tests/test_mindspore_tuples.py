"""MindSpore's operator-level tuples and Layout constructor, as MindSpore means them.

``ap.shard(fn, in_strategy, out_strategy)`` derives the operator's device matrix as MindSpore
2.10 does (one dimension per loop of the operator in order of first appearance, then the
repeat; a Gather splitting its table along the gathered axis puts the repeat first), with
``device_num`` alone: every rank holds the slice of each parameter that MindSpore's own files
give it (``tests/data/mindspore_ops``); ``ap.Layout((2, 4), ("dp", "mp"))("dp", "None")``
gives MindSpore's tensor map. Each rank's slice is checked against MindSpore's rule written
independently (``test_mindspore_files.ms_rank_slices``); the tensor maps of the Layout form are
the ones MindSpore 2.10's ``mindspore.Layout(...).to_dict()`` prints. Planning, and one run on
8 CPU devices.
"""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
from autopar.device_matrix import DeviceSpec
from autopar.errors import LayoutError
from autopar.mesh import LogicalMesh
from test_api import assert_same
from test_mindspore_files import ms_rank_slices

X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 32)), jnp.float32)
W = jnp.asarray(np.random.default_rng(1).normal(size=(32, 64)), jnp.float32)


def matmuls(*strategies, out=None):
    """x @ w, then (h @ w.T), each a MindSpore-annotated MatMul."""
    def step(x, w):
        h = x
        for s in strategies:
            h = ap.shard(jnp.matmul, in_strategy=s, out_strategy=out)(
                h, w if h.shape[1] == w.shape[0] else w.T)
        return jnp.sum(h * h)
    return step


def config(**kw):
    return ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, backend="jax",
                             **kw)


def slices(layout, shape, mesh):
    return [[[sl.start or 0, n if sl.stop is None else sl.stop]
             for sl, n in zip(layout.block(shape, mesh.coords(r), mesh), shape)]
            for r in range(mesh.size)]


def ms_slices(dev_matrix, tensor_map, shape):
    item = {"dev_matrix": list(dev_matrix), "tensor_map": tensor_map,
            "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
    return ms_rank_slices(item, shape, 8)


@pytest.mark.parametrize("tuples, mesh, dev_matrix, x_map, w_map", [
    (((2, 1), (1, 4)), (2, 4), (2, 1, 4), [2, -1], [-1, 0]),      # MindSpore's own example
    (((4, 1), (1, 2)), (4, 2), (4, 1, 2), [2, -1], [-1, 0]),      # on mesh (2, 4) it was wrong
    (((2, 1), (1, 2)), (2, 2, 2), (2, 1, 2, 2), [3, -1], [-1, 1]),  # repeat 2, rightmost
    (((1, 2), (2, 4)), (2, 4), (1, 2, 4), [-1, 1], [1, 0]),       # contracted dimension split
])
def test_operator_tuples_derive_mindspores_device_matrix(tuples, mesh, dev_matrix, x_map, w_map):
    s = ap.plan(matmuls(tuples), X, W, config=config())
    assert s.mesh_shape == mesh
    m = LogicalMesh.create(s.mesh_shape, s.axis_names)
    dot = next(o for o in s.ops if o.name.startswith("dot_general"))
    x_layout, w_layout = dot.in_layouts
    # each rank's slice of x and w is the one MindSpore's device matrix gives it
    assert slices(x_layout, X.shape, m) == ms_slices(dev_matrix, x_map, X.shape)
    assert slices(w_layout, W.shape, m) == ms_slices(dev_matrix, w_map, W.shape)


def test_two_device_matrices_share_the_mesh_that_refines_both_and_run():
    step = matmuls(((2, 1), (1, 4)), ((4, 1), (1, 2)))
    c = ap.compile(step, X, W, config=config())
    assert c.strategy.mesh_shape == (2, 2, 2)
    m = LogicalMesh.create(c.strategy.mesh_shape, c.strategy.axis_names)
    dots = [o for o in c.strategy.ops if o.name.startswith("dot_general")]
    assert slices(dots[1].in_layouts[0], (16, 64), m) == ms_slices((4, 1, 2), [2, -1], (16, 64))
    assert slices(dots[1].in_layouts[1], (64, 32), m) == ms_slices((4, 1, 2), [-1, 0], (64, 32))
    assert_same(c(X, W), step(X, W))


def test_out_strategy_reduce_scatters_over_the_contracted_devices():
    s = ap.plan(matmuls(((2, 4), (4, 1)), out=((8, 1),)), X, W, config=config())
    m = LogicalMesh.create(s.mesh_shape, s.axis_names)
    shard = [o for o in s.ops if o.name.startswith("autopar_shard")][-1]
    # rows over (i's 2 devices, then k's 4): MindSpore's tensor map [(2, 1), -1] on (2, 4, 1)
    assert slices(shard.out_layouts[0], (16, 64), m) == ms_slices((2, 4, 1), [[2, 1], -1],
                                                                   (16, 64))


def test_mindspores_layout_constructor():
    dp_mp = ap.Layout((2, 4), ("dp", "mp"))
    # the tensor maps MindSpore 2.10 prints for the same calls
    assert dp_mp("dp", "None") == DeviceSpec((2, 4), (1, -1), ("dp", "mp"))
    assert dp_mp(("dp", "mp"), "None").tensor_map == ((1, 0), -1)
    assert ap.Layout((2, 2, 2), ("a", "b", "c"))(("c", "a"), "b").tensor_map == ((0, 2), 1)
    with pytest.raises(LayoutError, match="'tp' is not one of its aliases"):
        dp_mp("tp", "None")
    with pytest.raises(LayoutError, match="one distinct alias"):
        ap.Layout((2, 4), ("dp",))
    assert ap.Layout.parse("[x,_]") == ap.Layout(((("x",), ())))   # autopar's form unchanged


def test_layout_objects_name_the_mesh_axes_and_run():
    p, b = {"w1": W, "w2": W.T}, X
    def step(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
    dp_mp = ap.Layout((2, 4), ("dp", "mp"))
    c = ap.compile(step, p, b, config=config(), in_strategy=(
        {"w1": dp_mp("None", "mp"), "w2": dp_mp("mp", "None")}, dp_mp("dp", "None")))
    assert (c.strategy.mesh_shape, c.strategy.axis_names) == ((2, 4), ("dp", "mp"))
    inputs = {i.name: str(i.layout) for i in c.strategy.inputs}
    assert inputs == {"w1": "[_,mp]", "w2": "[mp,_]", "arg1": "[dp,_]"}
    assert_same(c(p, b), step(p, b))


def test_tuples_mindspore_refuses_are_refused_with_the_reason():
    with pytest.raises(LayoutError, match="two ways"):           # k split 2 and 4
        ap.plan(matmuls(((1, 2), (4, 1))), X, W, config=config())
    with pytest.raises(LayoutError, match="does not fit the mesh"):
        ap.plan(matmuls(((4, 1), (1, 2))), X, W, config=config(mesh_shape=(2, 4)))
    six = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=6)
    x, w = jnp.ones((6, 6)), jnp.ones((6, 6))
    with pytest.raises(LayoutError, match="which no single mesh holds"):
        ap.plan(matmuls(((2, 1), (1, 3)), ((3, 1), (1, 2))), x, w, config=six)


def moved(c):
    return sorted((x.kind.value, x.shape, x.bytes) for x in c.collectives())


def test_unannotated_operators_get_mindspores_batch_split():
    """semi_auto's unannotated="batch": an operator without a strategy splits its batch
    dimension over every device (MindSpore's default), so a step with no annotation at all
    moves exactly what data parallelism moves; autopar's default propagates (nothing to
    propagate here: one device's work, replicated)."""
    import models as m
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=4, backend="jax")
    batch = ap.compile(m.mlp_sgd_step, p, b, config=cfg.replace(unannotated="batch"))
    dp = ap.compile(m.mlp_sgd_step, p, b, config=cfg.replace(parallel_mode="data_parallel"))
    assert moved(batch) == moved(dp) and {x.kind.value for x in batch.collectives()} == \
        {"all_reduce"}
    dots = [o for o in batch.strategy.ops if o.name.startswith("dot_general")]
    assert all(str(o.in_layouts[0]).startswith("[x,") for o in dots)
    assert_same(batch(p, b), m.mlp_sgd_step(p, b))
    prop = ap.plan(m.mlp_sgd_step, p, b, config=cfg)
    assert not any(o.in_layouts[0].axes for o in prop.ops if o.name.startswith("dot_general"))


def test_batch_split_around_an_annotated_operator():
    """The annotated MatMul keeps MindSpore's tuples; the unannotated operators reading the
    batch split it over all 8 devices, as in MindSpore."""
    def step(x, w):
        h = ap.shard(jnp.matmul, in_strategy=((2, 1), (1, 4)))(x, w)
        return jnp.sum(jnp.tanh(h) @ w.T)
    c = ap.compile(step, X, W, config=config(unannotated="batch"), batch_argnums=(0,))
    assert c.strategy.mesh_shape == (2, 4)
    dots = [o for o in c.strategy.ops if o.name.startswith("dot_general")]
    assert [str(l) for l in dots[0].in_layouts] == ["[x,_]", "[_,y]"]
    tanh = next(o for o in c.strategy.ops if o.name.startswith("tanh"))
    assert str(tanh.in_layouts[0]) == "[(x,y),_]"
    assert_same(c(X, W), step(X, W))
    with pytest.raises(ap.ConfigError, match="semi_auto_parallel's choice"):
        ap.ParallelConfig(parallel_mode="auto_parallel", device_num=8, unannotated="batch")
    with pytest.raises(ap.ConfigError, match="choose 'propagate'"):
        ap.ParallelConfig(unannotated="data")


def test_argument_tuples_with_device_num_alone_are_mindspores_tensor_layouts():
    """in_strategy tuples with device_num alone: each tensor on its own device matrix
    ([repeat] + tuple, as MindSpore lays out a cell's inputs), the mesh refining them all."""
    import models as m
    p, b = m.mlp_params(), m.mlp_batch()
    c = ap.compile(m.mlp_sgd_step, p, b, config=config(), in_strategy=(
        {"w1": (2, 2), "b1": None, "w2": (4, 1), "b2": None}, None))
    assert c.strategy.mesh_shape == (2, 2, 2)
    mesh = LogicalMesh.create(c.strategy.mesh_shape, c.strategy.axis_names)
    got = {i.name: i.layout for i in c.strategy.inputs}
    assert slices(got["w1"], (16, 32), mesh) == ms_slices((2, 2, 2), [1, 0], (16, 32))
    assert slices(got["w2"], (32, 16), mesh) == ms_slices((2, 4, 1), [1, -1], (32, 16))
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    # a mesh of several axes keeps autopar's mapping of a tuple onto its axes
    s = ap.plan(m.mlp_sgd_step, p, b, config=config(mesh_shape=(2, 4)), in_strategy=(
        {"w1": (1, 4), "b1": None, "w2": (4, 1), "b2": None}, None))
    assert {i.name: str(i.layout) for i in s.inputs if i.name in ("w1", "w2")} == \
        {"w1": "[_,y]", "w2": "[y,_]"}


def test_function_tuples_are_checked_against_their_arguments():
    """ap.shard(fn, in_strategy=...): a tuple per argument of whole split counts >= 1, one per
    dimension (one of the wrong length was taken silently, a 0 divided by zero)."""
    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    for bad, says in [(((2, 1, 1), (1, 1)), "argument 0 has 2 dimension"),
                      (((2, 1), (1,)), "argument 1 has 2 dimension"),
                      (((0, 1), (1, 1)), "not a tuple of split counts"),
                      ((("a", 1), (1, 4)), "not a tuple of split counts"),
                      (((2.0, 1), (1, 4)), "not a tuple of split counts")]:
        with pytest.raises(ap.LayoutError, match=says):
            ap.shard(jnp.matmul, in_strategy=bad)(x, w)


DATA = Path(__file__).parent / "data" / "mindspore_ops"
CASES = json.loads((DATA / "cases.json").read_text())["ops"]
FNS = {"matmul": jnp.matmul, "batch_matmul": jnp.matmul, "add": jnp.add, "mul": jnp.multiply,
       "reduce_sum": lambda x: jnp.sum(x, axis=1), "softmax": jax.nn.softmax,
       "gather": lambda t, i: jnp.take(t, i, axis=0)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_holds_the_slice_mindspores_own_file_gives_it(name):
    """One operator per MindSpore 2.10 file, annotated with the same tuples, device_num=8 and
    no mesh: each parameter's slice on every rank is the one MindSpore wrote (its repeat
    dimension placed as its operators place it); Softmax over a split axis is refused, as
    MindSpore refuses it."""
    op, shapes, tuples, _ = CASES[name]
    tuples = tuple(tuple(t) for t in tuples)
    fn = FNS[op]
    if op == "gather":
        def step(p, idx):
            return jnp.sum(ap.shard(fn, in_strategy=tuples)(p["p0"], idx) ** 2)
        args = ({"p0": jnp.ones(shapes[0])}, jnp.zeros(shapes[1], jnp.int32))
    else:
        def step(p):
            return jnp.sum(ap.shard(fn, in_strategy=tuples)(
                *[p[f"p{i}"] for i in range(len(shapes))]) ** 2)
        args = ({f"p{i}": jnp.ones(s) for i, s in enumerate(shapes)},)
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, progress=False)
    path = DATA / f"{name}.ms.json"
    if not path.exists():                       # MindSpore wrote none: it refused the tuples
        with pytest.raises(ap.LayoutError, match="MindSpore's Softmax refuses"):
            ap.plan(step, *args, config=cfg)
        return
    written = json.loads(path.read_text())["params"]
    s = ap.plan(step, *args, config=cfg)
    mesh = LogicalMesh.create(s.mesh_shape, s.axis_names)
    params = [i for i in s.inputs if i.name in written]
    assert {i.name for i in params} == set(written)
    for i in params:
        assert slices(i.layout, i.shape, mesh) == ms_rank_slices(written[i.name], i.shape, 8), \
            (i.name, str(i.layout), s.mesh_shape, written[i.name])


def test_layout_takes_mindspores_rank_list_and_interleaved_parallel_as_mindspore_means_them():
    """rank_list: the devices in order is accepted, a reordering refused with what it means
    in MindSpore and the fix; interleaved_parallel: an in-device split, left out of the device
    matrix (a dimension on it is not split across devices), with a warning that autopar runs
    the operator whole."""
    assert ap.Layout((2, 4), ("dp", "mp"), rank_list=list(range(8)))("dp", "None") == \
        ap.Layout((2, 4), ("dp", "mp"))("dp", "None")
    with pytest.raises(ap.LayoutError, match="in MindSpore, rank_list names the ranks.*"
                                             "Leave rank_list out"):
        ap.Layout((2, 4), ("dp", "mp"), rank_list=[1, 0, 2, 3, 4, 5, 6, 7])
    with pytest.raises(ap.LayoutError, match="MindSpore's form"):
        ap.Layout(((), ()), rank_list=[0])
    layout = ap.Layout((2, 2, 4), ("dp", "interleaved_parallel", "mp"))
    with pytest.warns(ap.AutoparWarning, match="2 slices one after another.*runs it whole"):
        spec = layout(("dp", "interleaved_parallel"), "mp")
    assert spec == DeviceSpec((2, 4), (1, 0), ("dp", "mp"))
    s = ap.plan(lambda x: jnp.sum(x * x), X, config=config(), in_strategy=(spec,))
    m = LogicalMesh.create(s.mesh_shape, s.axis_names)
    assert slices(s.inputs[0].layout, X.shape, m) == ms_slices((2, 4), [1, 0], X.shape)
