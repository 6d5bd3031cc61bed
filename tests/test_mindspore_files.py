"""MindSpore's strategy checkpoint files, as autopar writes and reads them.

The protobuf bytes are checked with a reader written here from MindSpore's node_strategy.proto
(field numbers and wire types, nothing shared with the writer), field by field: what
MindSpore's own reader would see. Planning only (no devices run).
"""
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import models as m
from autopar.errors import LayoutError
from autopar.strategies import mindspore_ckpt as mc
from test_api import assert_same


def fields(data: bytes) -> list:
    """Protobuf wire format -> [(field number, value)]: varints as ints, length-delimited as
    bytes (proto2 repeated scalars are unpacked: one entry per element)."""
    out, i = [], 0
    while i < len(data):
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(data, i)
        elif wire == 2:
            n, i = varint(data, i)
            value, i = data[i:i + n], i + n
        else:
            raise AssertionError(f"wire type {wire} is not in MindSpore's messages")
        out.append((number, value))
    return out


def varint(data, i):
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def signed(v):                     # int32 -1 is written as a 10-byte two's complement varint
    return v - (1 << 64) if v >= 1 << 63 else v


def layouts(data: bytes) -> dict:
    """ParallelStrategyMap bytes -> {param: (dev_matrix, [tensor maps], field, step, size)}."""
    out = {}
    for number, item in fields(data):
        if number != 3:                                   # parallel_layout_item
            continue
        name, lay = [v for _, v in fields(item)]
        f = fields(lay)
        dev = [[v for _, v in fields(x)] for n, x in f if n == 1]
        maps = [[signed(v) for _, v in fields(x)] for n, x in f if n == 2]
        scalars = {n: v for n, v in f if n in (5, 6, 7)}
        assert [n for n, _ in f if n in (3, 4)] == [3, 4]  # one empty split shape and offset
        out[name.decode()] = (dev, maps, scalars[5], scalars[6], scalars[7])
    return out


def semi_auto_plan(w1):
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4))
    return ap.plan(m.mlp_sgd_step, p, b, config=cfg,
                   in_strategy=({"w1": w1, "b1": None, "w2": (4, 1), "b2": None}, None))


def test_a_ckpt_name_writes_mindspores_protobuf_field_by_field(tmp_path):
    s = semi_auto_plan(ap.Layout.parse("[_,(x,y)]"))        # w1's columns over both axes
    s.save(tmp_path / "strategy.ckpt")
    data = (tmp_path / "strategy.ckpt").read_bytes()
    top = fields(data)
    assert top[0] == (1, 0)                                  # current_stage
    ops = [fields(v) for n, v in top if n == 2]              # parallel_strategy_item
    assert len(ops) == len(s.ops)
    dot = next(f for f in ops if f[0][1].startswith(b"dot_general"))
    stage, *strategies = fields(dot[1][1])                   # parallel_strategys
    assert stage == (1, 0) and all(n == 2 for n, _ in strategies)
    assert [[v for _, v in fields(x)] for _, x in strategies] == [[1, 1], [1, 8]]
    got = layouts(data)
    # one dimension over two axes: one TensorMap per dimension, the axes counted from the last
    assert got["w1"] == ([[2, 4]], [[-1], [1, 0]], 0, 0, 0)
    # a 1-D tensor so split gets an empty second TensorMap; plain layouts one TensorMap
    assert got["b1"] == ([[2, 4]], [[1, 0], []], 0, 0, 0)
    assert got["w2"] == ([[2, 4]], [[0, -1]], 0, 0, 0)
    assert got["b2"] == ([[2, 4]], [[-1]], 0, 0, 0)
    # and read back as to_mindspore gives it, less the shapes protobuf does not hold
    want = s.to_mindspore()
    for p in want["parallel_layout_item"].values():
        del p["tensor_shape"]
    assert mc.read(tmp_path / "strategy.ckpt") == want


def test_mindspore_json_refuses_what_it_cannot_hold_and_writes_the_rest(tmp_path):
    # b1 follows w1's columns: [(x,y)] (the first parameter in name order)
    with pytest.raises(LayoutError, match=r"b1's layout \[\(x,y\)\] splits dimension 0 over "
                                          r"several mesh axes.*strategy\.ckpt"):
        semi_auto_plan(ap.Layout.parse("[_,(x,y)]")).save(tmp_path / "s.json", format="mindspore")
    assert not (tmp_path / "s.json").exists()
    semi_auto_plan((1, 4)).save(tmp_path / "s.json", format="mindspore")
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["parallel_layout_item"]["w1"]["tensor_map"] == [-1, 0]
    assert mc.read(tmp_path / "s.json") == d


def test_the_file_name_picks_the_format_and_load_says_what_a_mindspore_file_is(tmp_path):
    s = semi_auto_plan((1, 4))
    s.save(tmp_path / "s.json")                               # autopar's own: loads back
    assert ap.Strategy.load(tmp_path / "s.json").to_json() == s.to_json()
    s.save(tmp_path / "plan")                                # no .json: MindSpore's protobuf
    assert mc.read(tmp_path / "plan")["parallel_layout_item"]["w1"]["tensor_map"] == [-1, 0]
    got = ap.Strategy.load(tmp_path / "plan")                # its layouts, to plan around
    assert isinstance(got, mc.MindSporeLayouts)
    assert dict(got.params)["w1"].tensor_map == (-1, 0)
    s.save(tmp_path / "m.json", format="mindspore")
    assert ap.Strategy.load(tmp_path / "m.json") == mc.MindSporeLayouts(
        str(tmp_path / "m.json"), got.stage, got.params, got.ops)
    (tmp_path / "junk").write_bytes(b"\xff\xfe not protobuf")
    with pytest.raises(LayoutError, match="not a MindSpore strategy checkpoint"):
        ap.Strategy.load(tmp_path / "junk")
    with pytest.raises(LayoutError, match="format='yaml'"):
        s.save(tmp_path / "s.yaml", format="yaml")


def test_protobuf_round_trip_of_every_tensor_map_form():
    d = {"current_stage": 1, "parallel_strategy_item": {
            "MatMul-op0": {"stage": 1, "parallel_strategy": [[2, 1], [1, 4]]}},
         "parallel_layout_item": {
            "scalar": {"dev_matrix": [8], "tensor_map": [], "field": 0,
                       "opt_weight_shard_step": 0, "opt_weight_shard_size": 0},
            "plain": {"dev_matrix": [2, 4], "tensor_map": [1, -1], "field": 0,
                      "opt_weight_shard_step": 1, "opt_weight_shard_size": 2},
            "one_dim_nested": {"dev_matrix": [2, 4], "tensor_map": [[1, 0]], "field": 0,
                               "opt_weight_shard_step": 0, "opt_weight_shard_size": 0},
            "nested": {"dev_matrix": [2, 2, 2], "tensor_map": [[2, 0], -1, 1], "field": 0,
                       "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}
    assert mc.loads(mc.dumps(d)) == d


def test_a_pipeline_writes_one_file_per_stage_as_mindspores_stages_do(tmp_path):
    """MindSpore's stages each save their own file and merge_pipeline_strategys joins a folder
    of them: every parameter is in the file of each stage that reads it (the tied embedding
    in both), every operator in its stage's, current_stage numbering the stages."""
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, pipeline_stages=2,
                            micro_batches=2)
    s = ap.plan(m.gpt_pipeline_step, p, b, config=cfg)
    s.save(tmp_path / "pp.ckpt")
    files = sorted((tmp_path / "pp.ckpt").iterdir())
    assert [f.name for f in files] == ["stage0.ckpt", "stage1.ckpt"]
    got = [mc.read(f) for f in files]
    assert [g["current_stage"] for g in got] == [0, 1]
    params = [set(g["parallel_layout_item"]) for g in got]
    assert params[0] | params[1] == {i.name for i in s.inputs if i.is_param}
    assert params[0] & params[1] == {"wte"}                      # embedding and tied head
    for k, g in enumerate(got):
        assert set(g["parallel_strategy_item"]) == {o.name for o in s.ops if o.stage == k}
        assert {v["stage"] for v in g["parallel_strategy_item"].values()} == {k}
    s.save(tmp_path / "pp.json", format="mindspore")             # the same in MindSpore's JSON
    assert sorted(f.name for f in (tmp_path / "pp.json").iterdir()) == ["stage0.json",
                                                                       "stage1.json"]
    for folder in ("pp.ckpt", "pp.json"):         # loaded back by the path it was saved to
        back = ap.Strategy.load(tmp_path / folder)
        assert back.files == 2 and "2 stage files" in str(back)
        assert dict(back.ops) == {o.name: tuple(l.to_strategy(st_mesh(s, o.stage))
                                                for l in o.in_layouts) for o in s.ops}
        assert {name for name, _ in back.params} == {i.name for i in s.inputs if i.is_param}
    (tmp_path / "empty").mkdir()
    with pytest.raises(ap.LayoutError, match="without stage files"):
        ap.Strategy.load(tmp_path / "empty")


def st_mesh(strategy, stage):
    from autopar.mesh import LogicalMesh
    st = next(x for x in strategy.stages if x.index == stage)
    return LogicalMesh.create(st.mesh_shape, st.axis_names)


# ---------------------------------------------------------------- parallel optimizer fields
def ms_rank_slices(item: dict, shape, nranks: int) -> list:
    """MindSpore's reading of one parameter's fields, written from its documented rule and
    nothing of autopar's: ranks row-major over ``dev_matrix``; a dimension's tensor map names
    device dims counted from the last (the first named most significant); the ranks holding one
    tensor-parallel slice, ascending, are R, and ``opt_weight_shard_step`` is
    (R[-1] - R[0]) / (|R| - 1); ``size`` consecutive ones of R split dimension 0 of that slice
    into ``size`` parts, the j-th holding part j. -> per rank, [start, stop) per dimension."""
    dm = item["dev_matrix"]
    def coords(r):
        out = []
        for s in reversed(dm):
            out.append(r % s)
            r //= s
        return out[::-1]
    def tp_box(r):
        c, box = coords(r), []
        for n, t in zip(shape, item["tensor_map"]):
            idx, k = 0, 1
            for dim in ([] if t == -1 else t if isinstance(t, list) else [t]):
                pos = len(dm) - 1 - dim
                idx, k = idx * dm[pos] + c[pos], k * dm[pos]
            box.append([idx * n // k, (idx + 1) * n // k])
        return box
    boxes = [tp_box(r) for r in range(nranks)]
    step, size = item["opt_weight_shard_step"], item["opt_weight_shard_size"]
    if size == 0:
        return boxes
    out = []
    for r in range(nranks):
        group = [q for q in range(nranks) if boxes[q] == boxes[r]]
        assert step == (group[-1] - group[0]) // (len(group) - 1)
        j = group.index(r) % size
        (a, b), *rest = boxes[r]
        out.append([[a + j * (b - a) // size, a + (j + 1) * (b - a) // size], *rest])
    return out


def autopar_update_slices(s, name):
    from autopar.mesh import LogicalMesh
    mesh = LogicalMesh.create(s.mesh_shape, s.axis_names)
    i = next(i for i in s.inputs if i.name == name)
    return [[[sl.start or 0, n if sl.stop is None else sl.stop]
             for sl, n in zip((i.update or i.layout).block(tuple(i.shape), mesh.coords(r), mesh),
                              i.shape)] for r in range(mesh.size)]


@pytest.mark.parametrize("w1", [(1, 4), (4, 1), (1, 1)])
def test_optimizer_shard_fields_mean_what_mindspore_means(tmp_path, w1):
    """Megatron-style layouts on a 2x4 mesh with the parallel optimizer: each parameter's
    update (what each rank stores of it and its optimizer state) is the slice MindSpore's rule
    gives the fields written: dimension 0 of the tensor-parallel slice, split inside it."""
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4),
                            enable_parallel_optimizer=True, parallel_optimizer_threshold=0)
    s = ap.plan(m.mlp_sgd_step, p, b, config=cfg,
                in_strategy=({"w1": w1, "b1": None, "w2": (4, 1), "b2": None}, None))
    s.save(tmp_path / "s.ckpt")
    items = mc.read(tmp_path / "s.ckpt")["parallel_layout_item"]
    shapes = {i.name: i.shape for i in s.inputs}
    assert {n for n, i in items.items() if i["opt_weight_shard_size"]} == set(items)
    for name, item in items.items():
        assert ms_rank_slices(item, shapes[name], 8) == autopar_update_slices(s, name), name
    if w1 == (1, 4):          # w1 [_,y]: x splits rows (ranks 0 and 4 share a column block)
        assert (items["w1"]["opt_weight_shard_step"], items["w1"]["opt_weight_shard_size"]) \
            == (4, 2)
    assert (items["b2"]["opt_weight_shard_step"], items["b2"]["opt_weight_shard_size"]) == (1, 8)


def narrow_step(params, x):
    """A parameter whose dimension 0 (6) no 4-way split divides."""
    import jax
    import jax.numpy as jnp
    g = jax.grad(lambda p: jnp.mean((x @ p["w"].T) ** 2))(params)
    return jax.tree.map(lambda a, d: a - 0.1 * d, params, g)


def test_an_update_mindspore_cannot_describe_is_refused_or_replanned(tmp_path):
    import jax.numpy as jnp
    p, x = {"w": jnp.ones((6, 64), jnp.float32)}, jnp.ones((8, 64), jnp.float32)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, backend="jax",
                            enable_parallel_optimizer=True, parallel_optimizer_threshold=0)
    s = ap.plan(narrow_step, p, x, config=cfg)
    assert s.inputs[0].update == ap.Layout.parse("[_,x]")   # autopar's own: dimension 1
    s.save(tmp_path / "own.json")
    with pytest.raises(LayoutError, match=r"w's update runs in \[_,x\].*dimension 0.*"
                                          r"strategy_ckpt_save_file"):
        s.save(tmp_path / "s.ckpt")
    # asked for MindSpore's file, compile keeps MindSpore's rule (w's update replicated) ...
    ms = ap.compile(narrow_step, p, x, config=cfg.replace(
        strategy_ckpt_save_file=str(tmp_path / "ms.ckpt")))
    assert ms.strategy.inputs[0].update is None
    assert_same(ms(p, x), narrow_step(p, x))
    item = mc.read(tmp_path / "ms.ckpt")["parallel_layout_item"]["w"]
    assert (item["opt_weight_shard_step"], item["opt_weight_shard_size"]) == (0, 0)
    # ... also re-planning an update a search (here: a loaded plan in auto_parallel) chose
    again = ap.compile(narrow_step, p, x, config=cfg.replace(
        parallel_mode="auto_parallel", strategy_ckpt_load_file=str(tmp_path / "own.json"),
        strategy_ckpt_save_file=str(tmp_path / "again.ckpt")))
    assert again.strategy.inputs[0].update is None and (tmp_path / "again.ckpt").exists()
    assert_same(again(p, x), narrow_step(p, x))


def test_a_mindspore_file_is_a_plan_to_compile_around(tmp_path):
    """A strategy file in MindSpore's format (autopar's here, so its operator names match)
    loaded by strategy_ckpt_load_file with device_num alone: the mesh comes from its device
    matrices, the parameters keep its layouts, the operators its tuples; the step runs."""
    p, b = m.mlp_params(), m.mlp_batch()
    first = semi_auto_plan(ap.Layout.parse("[_,(x,y)]"))
    first.save(tmp_path / "s.ckpt")
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, backend="jax",
                            strategy_ckpt_load_file=str(tmp_path / "s.ckpt"))
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    assert c.strategy.mesh_shape == (2, 4)
    layouts = lambda s: {i.name: str(i.layout) for i in s.inputs if i.is_param}
    assert layouts(c.strategy) == layouts(first)
    tuples = lambda s: {o.name: o for o in s.ops}
    mesh = ap.LogicalMesh.create((2, 4))
    for name, o in tuples(first).items():
        assert [l.to_strategy(mesh) for l in tuples(c.strategy)[name].in_layouts] == \
            [l.to_strategy(mesh) for l in o.in_layouts], name
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    with pytest.raises(LayoutError, match="none of its parameters"):
        ap.compile(lambda q, x: jnp.sum(q["v"] * x), {"v": jnp.ones((4,))}, jnp.ones((8, 4)),
                   config=cfg)
    with pytest.raises(ap.ConfigError, match="semi_auto_parallel or auto_parallel"):
        ap.compile(m.mlp_sgd_step, p, b, config=cfg.replace(parallel_mode="data_parallel"))


# ---------------------------------------------------------------- a pipeline's files as MindSpore writes them

PIPELINE = Path(__file__).parent / "data" / "mindspore_pipeline"


def pipeline_step(p, x, y):
    """The network MindSpore wrote the files for: two blocks, one per stage, SGD."""
    def loss(p):
        h = x
        for i in range(2):
            with ap.pipeline_stage(i):
                h = jax.nn.relu(h @ p[f"h{i}"]["w1"]) @ p[f"h{i}"]["w2"]
        return jnp.mean((h - y) ** 2)
    value, g = jax.value_and_grad(loss)(p)
    return value, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


@pytest.mark.parametrize("files", ["ranks", "src_strategy", "merged"])
def test_a_pipelines_files_as_mindspore_writes_them_compile_and_run(tmp_path, files):
    """A folder of per-rank stage files with MindSpore's names (each file's stage read from its
    operators: the dry run writes one current_stage in both), or merge_pipeline_strategys'
    merged file (its stage prefixes stripped): each parameter keeps MindSpore's layout on its
    stage, the mesh (2, 2, 2) comes from the files' device matrices, and the step runs to the
    single-device values."""
    if files == "merged":
        path = PIPELINE / "net_pipeline_merged.ckpt"
    else:
        path = tmp_path / "strategy"
        path.mkdir()
        for rank in (0, 4):
            name = f"net_pipeline_r{rank}.ckpt" if files == "ranks" else f"src_strategy_{rank}.ckpt"
            shutil.copy(PIPELINE / f"net_pipeline_r{rank}.ckpt", path / name)
    layouts = ap.Strategy.load(path)
    assert dict(layouts.param_stages)["h0.w1"] == 0 and dict(layouts.param_stages)["h1.w2"] == 1
    r = np.random.default_rng(0)
    p = {f"h{i}": {w: jnp.asarray(r.normal(0, .2, (32, 32)), jnp.float32) for w in ("w1", "w2")}
         for i in range(2)}
    x, y = (jnp.asarray(r.normal(size=(16, 32)), jnp.float32) for _ in range(2))
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2,
                            micro_batches=2, backend="jax", progress=False)
    with pytest.warns(ap.AutoparWarning, match="accu_grads"):     # MindSpore's own state
        c = ap.compile(pipeline_step, p, x, y, config=cfg, strategy=layouts)
    assert [st.mesh_shape for st in c.strategy.stages] == [(2, 2), (2, 2)]
    got = {i.name: str(i.layout) for i in c.strategy.inputs}
    # stage 0: dev (2, 2), w1 columns over the last dimension; stage 1: dev (4,), over all four
    assert got["h0.w1"] == "[_,z]" and got["h0.w2"] == "[z,_]"
    assert got["h1.w1"] == "[_,(y,z)]" and got["h1.w2"] == "[(y,z),_]"
    ref = jax.jit(pipeline_step)(p, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6), c(p, x, y), ref)
    with pytest.raises(ap.ConfigError, match="2 pipeline stages; set pipeline_stages=2"):
        ap.compile(pipeline_step, p, x, y, strategy=layouts,
                   config=cfg.replace(pipeline_stages=1, micro_batches=1))


def test_a_parameter_name_mindspores_transforms_cannot_read_is_warned_about(tmp_path):
    """MindSpore's checkpoint transforms read 'N-name' as merge_pipeline_strategys' stage
    prefix, so a parameter named with a hyphen breaks them: saving a MindSpore file warns,
    naming it (autopar's own JSON does not)."""
    p = {"block-0": {"w": jnp.ones((8, 8))}, "head": jnp.ones((8, 4))}
    step = lambda p, x: jnp.sum((x @ p["block-0"]["w"] @ p["head"]) ** 2)
    s = ap.plan(step, p, jnp.ones((8, 8)), config=ap.ParallelConfig(
        parallel_mode="data_parallel", device_num=2, progress=False))
    with pytest.warns(ap.AutoparWarning, match="'block-0.w' has a hyphen.*rank_list_for_transform"):
        s.save(tmp_path / "s.ckpt")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.save(tmp_path / "s.json")
