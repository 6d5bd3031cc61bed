"""End-to-end: compile in every mode on fake CPU devices and compare with the single device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import models as m

RTOL, ATOL = 1e-5, 1e-6


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=RTOL, atol=ATOL), a, b)


def nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_stand_alone_mlp():
    p, b = m.mlp_params(), m.mlp_batch()
    c = ap.compile(m.mlp_sgd_step, p, b, config=ap.ParallelConfig(backend="jax"))
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    assert c.collectives() == []


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_data_parallel_mlp_golden(mesh):
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", mesh_shape=mesh)
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    kinds = {x.kind for x in c.collectives()}
    assert kinds == {"all_reduce"}, [str(x) for x in c.collectives()]
    assert sum(x.bytes for x in c.collectives()) == nbytes(p) + 4      # gradients + scalar loss
    assert all(i.layout.is_replicated() for i in c.strategy.inputs if i.is_param)
    assert all(i.layout.dims[0] for i in c.strategy.inputs if not i.is_param)


def test_a_step_called_with_other_shapes_or_dtypes_says_which():
    p, b = m.mlp_params(), m.mlp_batch()
    c = ap.compile(m.mlp_sgd_step, p, b, config=ap.ParallelConfig(backend="jax"))
    with pytest.raises(ap.ConfigError, match=r"compiled for arguments \[.*f32\[8,16\].*\] .* "
                                             r"called with \[.*f32\[4,16\].*compile again"):
        c(p, m.mlp_batch(batch=4))
    with pytest.raises(ap.ConfigError, match=r"called with \[.*i32\["):
        c(jax.tree.map(lambda x: np.asarray(x, np.int32), p), b)


def test_on_workers_needs_native_workers():
    """``on_workers`` says why it cannot run: before the first call on the native backend, and
    on the jax backend at all; ``close`` and ``with`` leave a step that still runs."""
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    native = ap.compile(m.mlp_sgd_step, p, b, config=ap.ParallelConfig(
        parallel_mode="data_parallel", device_num=2, progress=False))
    with pytest.raises(ap.ConfigError, match="call it once first"):
        native.on_workers(print)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=2)
    with ap.compile(m.mlp_sgd_step, p, b, config=cfg) as c:
        assert_same(c(p, b), m.mlp_sgd_step(p, b))
        with pytest.raises(ap.ConfigError, match="backend='jax'"):
            c.on_workers(print)
    assert_same(c(p, b), m.mlp_sgd_step(p, b))


def test_data_parallel_adam_mlp():
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    s = m.adam_init(p)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=4)
    c = ap.compile(m.mlp_adam_step, p, s, b, config=cfg, batch_argnums=(2,))
    assert_same(c(p, s, b), m.mlp_adam_step(p, s, b))
    assert {x.kind for x in c.collectives()} == {"all_reduce"}


def test_the_default_batch_leaves_out_the_state_the_step_returns():
    """Without batch_argnums, ``step(params, opt_state, batch)`` and ``step(params, key,
    batch)`` split the batch alone: the optimizer state and the key come back new, so they are
    state, kept whole (before, the optimizer state was taken for a batch and refused)."""
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    s = m.adam_init(p)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=4)
    c = ap.compile(m.mlp_adam_step, p, s, b, config=cfg)
    assert_same(c(p, s, b), m.mlp_adam_step(p, s, b))
    split = [i.name for i in c.strategy.inputs if not i.layout.is_replicated()]
    assert split and all(name.startswith("arg2") for name in split), split

    def keyed(params, key, batch):
        noise = 1e-3 * jax.random.normal(key, params["w1"].shape)
        params = dict(params, w1=params["w1"] + noise)
        return m.mlp_sgd_step(params, batch) + (jax.random.split(key)[0],)
    key = jax.random.PRNGKey(0)
    c = ap.compile(keyed, p, key, b, config=cfg)
    assert_same(c(p, key, b), jax.jit(keyed)(p, key, b))

    def dropped(params, batch, key):           # a key the step does not return: not a batch
        keep = jax.random.bernoulli(key, 0.9, params["w1"].shape)
        return m.mlp_sgd_step(dict(params, w1=jnp.where(keep, params["w1"], 0.0)), batch)
    for key in (jax.random.PRNGKey(1), jax.random.key(1)):
        c = ap.compile(dropped, p, b, key, config=cfg)
        assert_same(c(p, b, key), jax.jit(dropped)(p, b, key))
        assert {i.name.split(".")[0] for i in c.strategy.inputs
                if not i.layout.is_replicated()} == {"arg1"}


def test_data_parallel_gpt():
    # SGD: Adam divides by sqrt(v) and so turns the rounding noise of near-zero gradients
    # (rare tokens, the attention key bias) into lr-sized differences under any reordering.
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=8)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=4)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    assert_same(c(p, b), m.gpt_sgd_step(p, b))
    assert {x.kind for x in c.collectives()} == {"all_reduce"}


def megatron_step(params, batch):
    def loss_fn(params, batch):
        x, y = batch
        for i in (1, 3):
            h = jax.nn.gelu(x @ ap.shard(params[f"w{i}"], (1, 4)) + ap.shard(params[f"b{i}"], (4,)))
            x = h @ ap.shard(params[f"w{i + 1}"], (4, 1)) + params[f"b{i + 1}"]
        return jnp.mean((x - y) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(params, batch)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, g)


def test_megatron_mlp_golden():
    B, H = 32, 128
    p = m.mlp_params(sizes=(H, 4 * H, H, 4 * H, H))
    b = m.mlp_batch(batch=B, sizes=(H, H))
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="semi_auto_parallel", device_num=4)
    c = ap.compile(megatron_step, p, b, config=cfg)
    assert_same(c(p, b), megatron_step(p, b))
    colls = c.collectives()
    act = [x for x in colls if x.shape == (B, H)]
    # one forward all-reduce per block (the row-parallel output) and one backward all-reduce
    # (the gradient of block 2's input); block 1's input is data, so it has no gradient
    assert [x.kind for x in act] == ["all_reduce"] * 3, [str(x) for x in colls]
    assert all(x.bytes == B * H * 4 for x in act)
    # nothing else: the split parameters are returned in their layout (the backend puts the
    # blocks together for the caller), as the next step reads them
    assert [x for x in colls if x not in act] == []
    assert [str(l) for l in c.program.out_layouts[5:]] == ["[_,x]", "[x,_]", "[_,x]", "[x,_]"]


def test_hybrid_2x4_gpt_block():
    p, b = m.gpt_params(d=32, heads=4), m.gpt_batch(batch=4)
    blk = {k: None for k in p["h0"]}
    blk.update(w1=(1, 4), b1=(4,), w2=(4, 1))
    pstrat = {k: None for k in p}
    pstrat["h0"] = blk
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="semi_auto_parallel", device_num=8,
                            mesh_shape=(2, 4))
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg, in_strategy=(pstrat, ((2, 1), (2, 1))))
    assert_same(c(p, b), m.gpt_sgd_step(p, b))
    lay = {i.name: str(i.layout) for i in c.strategy.inputs}
    assert lay["h0.w1"] == "[_,y]" and lay["h0.w2"] == "[y,_]" and lay["arg1.0"] == "[x,_]"


def test_decorator_and_strategy_roundtrip(tmp_path):
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="semi_auto_parallel", device_num=4)

    @ap.parallel(config=cfg, in_strategy=({"w1": (1, 4), "b1": None, "w2": (4, 1), "b2": None}, None))
    def step(params, batch):
        return m.mlp_sgd_step(params, batch)

    c = step.compile(p, b)
    assert_same(step(p, b), m.mlp_sgd_step(p, b))
    c.strategy.save(tmp_path / "s.json")
    loaded = ap.Strategy.load(tmp_path / "s.json")
    assert loaded.to_json() == c.strategy.to_json()
    c2 = ap.compile(m.mlp_sgd_step, p, b, config=cfg, strategy=loaded)
    assert str(c2.program) == str(c.program)
    assert_same(c2(p, b), m.mlp_sgd_step(p, b))
    table = c.strategy.table()
    assert "dot_general" in table and "[_,x]" in table
    for c_ in c.collectives():
        assert c_.kind in ap.program.COLLECTIVE_KINDS and c_.bytes > 0 and c_.axes and c_.dtype == np.float32


def test_mindspore_strategy_file(tmp_path):
    import json
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4))
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg,
                   in_strategy=({"w1": (1, 4), "b1": None, "w2": (4, 1), "b2": None}, None))
    c.strategy.save(tmp_path / "ms.json", format="mindspore")
    d = json.loads((tmp_path / "ms.json").read_text())
    assert d["current_stage"] == 0
    w1 = d["parallel_layout_item"]["w1"]
    assert w1 == {"dev_matrix": [2, 4], "tensor_map": [-1, 0], "tensor_shape": [16, 32], "field": 0,
                  "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
    dots = [v for k, v in d["parallel_strategy_item"].items() if k.startswith("dot_general")]
    assert dots and all(v["stage"] == 0 and len(v["parallel_strategy"]) == 2 for v in dots)


@pytest.mark.parametrize("spec,msg", [((1, 4, 1), "has 3 entries"), ((3, 1), "does not divide"),
                                      ((4, 4), "only 8 devices"), ((1, 3), "does not divide")])
def test_bad_annotations(spec, msg):
    def f(params, x):
        return x @ ap.shard(params["w"], spec)
    p, x = {"w": jnp.ones((8, 16))}, jnp.ones((4, 8))
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8)
    with pytest.raises(ap.LayoutError, match=msg) as e:
        ap.compile(f, p, x, config=cfg)
    assert "test_api.py" in str(e.value)


def test_data_parallel_batch_not_divisible():
    p, b = m.mlp_params(), m.mlp_batch(batch=6)
    with pytest.raises(ap.LayoutError, match="not divisible by device_num=4"):
        ap.compile(m.mlp_sgd_step, p, b, config=ap.ParallelConfig(parallel_mode="data_parallel", device_num=4))


def test_wrong_call_shapes():
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    c = ap.compile(m.mlp_sgd_step, p, b)
    with pytest.raises(ap.ConfigError, match="compile again"):
        c(p, m.mlp_batch(batch=4))


def test_gradients_mean():
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=4,
                            gradients_mean=True)
    assert_same(ap.compile(m.mlp_sgd_step, p, b, config=cfg)(p, b), m.mlp_sgd_step(p, b))
    for mode in ("data_parallel", "semi_auto_parallel", "auto_parallel"):   # alike in each
        with pytest.raises(ap.ConfigError, match=f"gradients_mean=False \\({mode}\\).*multiply "
                                                 "the loss by the degree"):
            ap.compile(m.mlp_sgd_step, p, b, config=cfg.replace(gradients_mean=False,
                                                                parallel_mode=mode))


def test_program_segments_are_local_jaxprs():
    B, H = 32, 128
    p = m.mlp_params(sizes=(H, 4 * H, H, 4 * H, H))
    b = m.mlp_batch(batch=B, sizes=(H, H))
    c = ap.compile(megatron_step, p, b,
                   config=ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=4))
    prog = c.program
    kinds = [type(i).__name__ for i in prog.instructions]
    assert all(not (a == b == "Segment") for a, b in zip(kinds, kinds[1:]))
    segs = prog.segments()
    assert len(segs) >= 2
    dots = set()
    for s in segs:
        j = s.jaxpr()
        assert [tuple(v.aval.shape) for v in j.jaxpr.invars] == [a[0] for a in s.in_avals]
        dots |= {tuple(v.aval.shape) for e in j.jaxpr.eqns if e.primitive.name == "dot_general"
                 for v in e.outvars}
    assert (B, H) in dots            # x @ w1 with w1's 4H columns split 4 ways: local [B, H]
    assert (B, 4 * H) not in dots    # no device computes a whole hidden activation
    assert "segment(" in str(prog)


def test_in_strategy_prefix_covers_subtrees():
    p, b = m.gpt_params(), m.gpt_batch(batch=4)
    pstrat = {k: None for k in p}          # None covers the whole "h0" dict
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="semi_auto_parallel", device_num=2)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg, in_strategy=(pstrat, (2, 1)))
    lay = {i.name: str(i.layout) for i in c.strategy.inputs}
    assert lay["arg1.0"] == "[x,_]" and lay["arg1.1"] == "[x,_]"
    assert_same(c(p, b), m.gpt_sgd_step(p, b))
    with pytest.raises(ap.LayoutError, match="in_strategy"):
        ap.compile(m.gpt_sgd_step, p, b, config=cfg, in_strategy=({"wte": (1, 2)}, None))


def test_in_strategy_for_a_list_of_layers():
    """Models keep their layers in lists (Flax/Equinox style); an in_strategy mirrors the
    list, entry by entry, and None covers a whole layer."""
    r = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(r.normal(0, 0.3, s), jnp.float32)
    params = {"layers": [{"w": w(8, 16), "b": w(16)}, {"w": w(16, 8), "b": w(8)}]}
    x, y = w(16, 8), w(16, 8)

    def step(params, batch):
        def loss(params):
            h = batch[0]
            for layer in params["layers"]:
                h = jnp.tanh(h @ layer["w"] + layer["b"])
            return jnp.mean((h - batch[1]) ** 2)
        l, g = jax.value_and_grad(loss)(params)
        return l, jax.tree.map(lambda a, b: a - 0.1 * b, params, g)

    spec = {"layers": [{"w": (1, 2), "b": (2,)}, None]}
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="semi_auto_parallel", device_num=2)
    c = ap.compile(step, params, (x, y), config=cfg, in_strategy=(spec, None))
    lay = {i.name: str(i.layout) for i in c.strategy.inputs}
    assert lay["layers.0.w"] == "[_,x]" and lay["layers.0.b"] == "[x]"
    assert_same(c(params, (x, y)), step(params, (x, y)))


def test_numpy_float64_and_python_scalar_arguments():
    r = np.random.default_rng(0)
    p, x = {"w": r.normal(size=(16, 8))}, r.normal(size=(16, 16))       # float64 numpy

    def f(params, x, lr):
        loss, g = jax.value_and_grad(lambda q: jnp.sum(jnp.tanh(x @ q["w"])))(params)
        return loss, jax.tree.map(lambda a, b: a - lr * b, params, g)

    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=8)
    c = ap.compile(f, p, x, 0.1, config=cfg, batch_argnums=(1,))
    assert_same(c(p, x, 0.1), f(p, x, 0.1))
    step = ap.parallel(f, config=cfg, batch_argnums=(1,))
    assert_same(step(p, x, 0.1), f(p, x, 0.1))


def test_remat_is_inlined():
    def step(params, batch):
        def loss(q):
            h = jax.checkpoint(lambda h: jnp.tanh(h) * 2)(batch[0] @ q["w1"])
            return jnp.mean((h @ q["w2"] - batch[1]) ** 2)
        l, g = jax.value_and_grad(loss)(params)
        return l, jax.tree.map(lambda a, b: a - 0.1 * b, params, g)
    p, b = m.mlp_params(bias=False), m.mlp_batch()
    c = ap.compile(step, p, b, config=ap.ParallelConfig(backend="jax", parallel_mode="data_parallel",
                                                        device_num=4))
    assert_same(c(p, b), step(p, b))


@pytest.mark.parametrize("spec,mesh", [("[(y,x),_]", (2, 4)), ("[x,y]", (1, 8)), ("[(z,y),x]", (2, 2, 2))])
def test_any_valid_annotation_is_held(spec, mesh):
    def f(params, x):
        return jnp.tanh(x @ ap.shard(params["w"], spec))
    p, x = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)), jnp.float32)}, jnp.ones((8, 16))
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="semi_auto_parallel", mesh_shape=mesh)
    c = ap.compile(f, p, x, config=cfg)
    assert_same(c(p, x), f(p, x))
    held = [o for o in c.strategy.ops if o.prim == "autopar_shard"][0]
    expect = ap.Layout(tuple(tuple(a for a in d if c.program.mesh.axis_size(a) > 1)
                             for d in ap.Layout.parse(spec).dims))
    assert held.out_layouts == (expect,)


@pytest.mark.parametrize("spec,msg", [((0, 1), "integer split counts >= 1"), ((2.5, 1), "integer"),
                                      ((2, 2), "mesh_shape"), ("[x,_] sum{y}", "partial sum")])
def test_more_bad_annotations(spec, msg):
    def f(params, x):
        return x @ ap.shard(params["w"], spec)
    p, x = {"w": jnp.ones((8, 16))}, jnp.ones((4, 8))
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8)
    if isinstance(spec, str) or spec == (2, 2):     # (2, 2): no two axes of 2 on (2, 4)
        cfg = cfg.replace(mesh_shape=(2, 4))
    with pytest.raises(ap.LayoutError, match=msg) as e:
        ap.compile(f, p, x, config=cfg)
    assert "test_api.py" in str(e.value)


def test_partial_in_strategy_rejected_at_compile():
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", mesh_shape=(2, 4))
    with pytest.raises(ap.LayoutError, match="arg1.0.*partial sum"):
        ap.compile(m.mlp_sgd_step, p, b, config=cfg, in_strategy=(None, ("[x,_] sum{y}", None)))


def test_strategy_records_collectives_and_memory_timeline():
    """The dump carries every communication step (priced) and the per-device memory timeline,
    and both survive the JSON round trip. Checked against data parallelism's definition: one
    all-reduce over the 4 devices per gradient (the parameter's bytes) and for the scalar loss;
    the arguments (parameters whole, a quarter of the batch) are live throughout and the
    updated parameters at the end, so no entry is below the arguments and the peak is at least
    both."""
    p, b = m.gpt_params(), m.gpt_batch(batch=8)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=4)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    s = c.strategy
    assert {(x.kind, x.axes) for x in s.collectives} == {("all_reduce", ("x",))}
    assert sorted(x.bytes for x in s.collectives) == sorted(
        [4] + [x.nbytes for x in jax.tree.leaves(p)])
    assert all(x.seconds > 0 for x in s.collectives)
    params = sum(x.nbytes for x in jax.tree.leaves(p))
    args = params + sum(x.nbytes for x in jax.tree.leaves(b)) // 4
    assert min(b_ for _, b_ in s.memory_timeline) >= args
    assert s.peak_memory >= args + params
    names = {o.name for o in s.ops} | {i.name for i in s.inputs}
    assert all(x in names or x == "" for o in s.ops for x in o.operands)
    assert any(x in {i.name for i in s.inputs} for o in s.ops for x in o.operands)
    back = ap.Strategy.from_json(s.to_json())
    assert back.collectives == s.collectives and back.memory_timeline == s.memory_timeline
    assert [o.operands for o in back.ops] == [o.operands for o in s.ops]


def test_jax_backend_takes_arrays_placed_on_other_meshes_and_devices():
    """JAX arrays the user placed elsewhere (a mesh with other axis names, a subset or another
    order of the devices, one device) go where the plan wants them (were a KeyError from
    inside shard_map, or jit's incompatible-devices error)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, backend="jax")
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    want = m.mlp_sgd_step(p, b)
    devs = jax.devices()
    for mesh, spec in [(Mesh(np.array(devs[:4]), ("y",)), P("y")),
                       (Mesh(np.array(devs[:4]).reshape(2, 2), ("a", "b")), P("a")),
                       (Mesh(np.array(devs[:2]), ("x",)), P("x")),
                       (Mesh(np.array(devs[:4][::-1]), ("x",)), P("x"))]:
        placed = jax.device_put(b, NamedSharding(mesh, spec))
        assert_same(c(p, placed), want)
    assert_same(c(jax.device_put(p, devs[1]), b), want)


def test_a_compiled_step_takes_its_arguments_by_name_too():
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=2)
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    want = m.mlp_sgd_step(p, b)
    names = list(__import__("inspect").signature(m.mlp_sgd_step).parameters)
    assert_same(c(**dict(zip(names, (p, b)))), want)
    assert_same(c(p, **{names[1]: b}), want)
    with pytest.raises(ap.ConfigError, match="calling the compiled"):
        c(p, nope=b)
    f = ap.parallel(m.mlp_sgd_step, config=cfg)                  # the decorator's too
    assert_same(f(**dict(zip(names, (p, b)))), want)


def test_strategy_prices_an_all_gather_on_its_input_as_the_planner_does():
    """An all-gather moves (n - 1) blocks of its input: the collectives table prices it on the
    rank's input bytes, as the planner priced it, not on the gathered output (n times more)."""
    from autopar.redistribution.planner import Planner
    p, x = {"w": jnp.ones((64, 32))}, jnp.ones((8, 64))
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=4,
                            topology=ap.Topology.cluster(1, 4))
    s = ap.plan(lambda p, x: x @ p["w"], p, x, config=cfg, in_strategy=({"w": "[_,x]"}, None))
    gathers = [c for c in s.collectives if c.kind == "all_gather"]
    assert gathers, [str(c) for c in s.collectives]
    planner = Planner(ap.LogicalMesh.create((4,), ("x",), cfg.topology))
    for c in gathers:
        sent = c.bytes // 4                   # the output is the four blocks of the inputs
        copy = planner.relayout_seconds("all_gather", c.shape, 1, None, c.bytes)
        assert c.seconds == pytest.approx(planner.step_time("all_gather", c.axes, sent)[0] + copy)
        assert c.seconds < planner.step_time("all_gather", c.axes, c.bytes)[0]
