"""JAX's sharding types in and out: PartitionSpec wherever a layout is taken, a jax Mesh as the
config's mesh, the plan handed back as NamedShardings that jax.jit runs as it is, and arguments
already placed on that mesh taken as they are."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar as ap


def step(w, x):
    return jnp.sum(ap.shard(jnp.tanh(x @ w), P("x", "y")) ** 2)


def mlp(params, x):
    """A loss and the new parameters: results that are state, laid out as the arguments."""
    def loss(p):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
    g = jax.grad(loss)(params)
    return loss(params), jax.tree.map(lambda p, d: p - 0.1 * d, params, g)


W = np.arange(16 * 32, dtype=np.float32).reshape(16, 32) / 512
X = np.linspace(-1, 1, 8 * 16, dtype=np.float32).reshape(8, 16)
PARAMS = {"w1": np.linspace(-1, 1, 16 * 64, dtype=np.float32).reshape(16, 64),
          "w2": np.linspace(1, -0.5, 64 * 8, dtype=np.float32).reshape(64, 8)}


def semi(**kw):
    return ap.ParallelConfig(parallel_mode="semi_auto_parallel", mesh_shape=(2, 4),
                             mesh_axis_names=("x", "y"), backend="jax", **kw)


def layouts(s):
    return [str(i.layout) for i in s.inputs]


def test_partition_specs_are_taken_wherever_a_layout_is():
    c = ap.compile(step, W, X, config=semi(), in_strategy=(P(None, "y"), P("x")))
    assert layouts(c.strategy) == ["[_,y]", "[x,_]"]
    np.testing.assert_allclose(c(W, X), step(W, X), rtol=1e-5)
    shard_op = next(o for o in c.strategy.ops if o.prim == "autopar_shard")
    assert str(shard_op.out_layouts[0]) == "[x,y]"             # ap.shard(value, P(...))
    s = ap.plan(step, W, X, config=semi(dataset_strategy=(P("x"),)), batch_argnums=(1,))
    assert layouts(s)[1] == "[x,_]"
    # an operator's tuple entries: a PartitionSpec next to split counts
    matmul = ap.shard(jnp.matmul, in_strategy=(P("x", None), (1, 4)))
    s = ap.plan(lambda w, x: jnp.sum(matmul(x, w)), W, X, config=semi(), in_strategy=None)
    dot = next(o for o in s.ops if o.prim == "dot_general")
    assert [str(l) for l in dot.in_layouts] == ["[x,_]", "[_,y]"]


def test_a_tuple_of_axis_names_is_refused_with_the_partition_spec_to_write():
    with pytest.raises(ap.LayoutError, match=r"write a PartitionSpec, P\('x', None\)"):
        ap.plan(step, W, X, config=semi(), in_strategy=(("x", None), None))
    with pytest.raises(ap.LayoutError, match="PartitionSpec, e.g. P"):
        ap.plan(step, W, X, config=semi(), in_strategy=((1.5, 1), None))
    with pytest.raises(ap.LayoutError, match="names axis 'q'"):
        ap.plan(step, W, X, config=semi(), in_strategy=(P(None, "q"), None))
    with pytest.raises(ap.LayoutError, match="UNCONSTRAINED"):
        ap.plan(step, W, X, config=semi(), in_strategy=(P(P.UNCONSTRAINED, None), None))


def test_a_jax_mesh_is_the_config_mesh_and_its_devices_run_the_step():
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices()[::-1])
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", mesh=mesh, backend="jax")
    assert (cfg.device_num, cfg.mesh_shape, cfg.mesh_axis_names) == (8, (2, 4), ("x", "y"))
    c = ap.compile(step, W, X, config=cfg, in_strategy=(P(None, "y"), P("x")))
    assert c.in_shardings[0].mesh is mesh
    out = c(W, X)
    assert set(out.devices()) <= set(mesh.devices.flat)
    abstract = ap.ParallelConfig(parallel_mode="auto_parallel",
                                 mesh=AbstractMesh((4, 2), ("dp", "mp")))
    assert abstract.logical_mesh().shape == (4, 2)
    with pytest.raises(ap.ConfigError, match="differs from the mesh's"):
        ap.ParallelConfig(parallel_mode="auto_parallel", mesh=mesh, mesh_shape=(8,))
    with pytest.raises(ap.ConfigError, match="jax.sharding.Mesh or AbstractMesh"):
        ap.ParallelConfig(parallel_mode="auto_parallel", mesh=(2, 4))


def test_the_plan_comes_out_as_named_shardings_that_jax_jit_runs():
    megatron = ({"w1": P(None, "y"), "w2": P("y", None)}, P("x"))
    c = ap.compile(mlp, PARAMS, X, config=semi(), in_strategy=megatron)
    ins, outs = c.in_shardings, c.out_shardings
    assert isinstance(ins[0]["w1"], NamedSharding) and ins[0]["w1"].spec == P(None, "y")
    assert ins[1].spec == P("x", None)
    assert outs[1]["w2"].spec == P("y", None) and outs[0].spec == P()   # new state, loss
    jitted = jax.jit(mlp, in_shardings=ins, out_shardings=outs)
    want = mlp(PARAMS, X)
    for got in (jitted(PARAMS, X), c(PARAMS, X)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got, want)
    assert jitted(PARAMS, X)[1]["w1"].sharding.is_equivalent_to(outs[1]["w1"], 2)
    s = ap.plan(mlp, PARAMS, X, config=semi(), in_strategy=megatron)
    got_in, got_out = s.shardings(c.in_shardings[1].mesh)
    assert jax.tree.map(lambda a: a.spec, (got_in, got_out)) == \
        jax.tree.map(lambda a: a.spec, (ins, outs))
    flat_in, flat_out = ap.Strategy.from_json(s.to_json()).shardings(
        AbstractMesh((2, 4), ("x", "y")))             # from a file: flat, one per leaf
    assert [a.spec for a in flat_in] == [a.spec for a in jax.tree.leaves(ins)]
    assert len(flat_out) == len(jax.tree.leaves(outs))
    with pytest.raises(ap.ConfigError, match="give a mesh like the plan's"):
        s.shardings(jax.make_mesh((8,), ("x",)))


def test_arguments_placed_in_the_plans_shardings_are_taken_without_a_transfer(monkeypatch):
    c = ap.compile(mlp, PARAMS, X, config=semi(), in_strategy=(
        {"w1": P(None, "y"), "w2": P("y", None)}, P("x")))
    placed = jax.device_put((PARAMS, X), c.in_shardings)
    c(*placed)                                           # compiled, runner started
    moved = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: moved.append(a) or real(*a, **k))
    loss, new = c(*placed)
    loss, new = c(new, placed[1])                        # the step's own results, fed back
    assert moved == []
    assert new["w1"].sharding.is_equivalent_to(c.out_shardings[1]["w1"], 2)


def test_the_surface_reads_as_jax_users_expect():
    import inspect
    fields = inspect.signature(ap.ParallelConfig).parameters
    assert {"parallel_mode", "mesh", "mesh_shape", "max_device_memory"} <= set(fields)

    @ap.parallel(config=semi())
    def train_step(w, x):
        """One step."""
        return step(w, x)
    assert train_step.__name__ == "train_step" and train_step.__doc__ == "One step."
    assert list(inspect.signature(train_step).parameters) == ["w", "x"]

    c = ap.compile(mlp, PARAMS, X, config=semi(), in_strategy=(
        {"w1": P(None, "y"), "w2": P("y", None)}, P("x")))
    for thing in (c, c.strategy, c.program):
        text = repr(thing)
        assert "\n" not in text and len(text) < 300, text
    assert repr(c).startswith("Compiled(mlp, semi_auto_parallel on jax, Mesh(x=2, y=4)")
    assert "mesh (x=2, y=4)" in repr(c.strategy) and "peak" in repr(c.strategy)
    html = c.strategy._repr_html_()
    assert html.count("<tr>") == 1 + len(c.strategy.inputs) and "<code>[_,y]</code>" in html
    import importlib.resources
    assert importlib.resources.files("autopar").joinpath("py.typed").is_file()


@pytest.mark.parametrize("transform, x", [
    (lambda f: jax.grad(lambda p, x: f(p, x)[0]), X),
    (jax.jit, X),
    (lambda f: jax.vmap(f, in_axes=(None, 0)), X[None]),
])
def test_tracing_a_compiled_step_says_what_to_do_instead(transform, x):
    c = ap.compile(mlp, PARAMS, X, config=semi())
    with pytest.raises(ap.ConfigError, match="inside a JAX transformation.*in_shardings"):
        transform(c)(PARAMS, x)


def scaled(params, x, scale, activation):
    """A step with two static arguments: a number and a name, as jax.jit users write them."""
    f = {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation]
    return jnp.sum(f(x @ params["w1"]) @ params["w2"]) * scale


def test_static_arguments_are_part_of_the_plan_as_in_jax_jit():
    c = ap.compile(scaled, PARAMS, X, 2.0, "relu", config=semi(), static_argnums=(2,),
                   static_argnames=("activation",),
                   in_strategy=({"w1": P(None, "y"), "w2": P("y", None)}, P("x"), None, None))
    assert [str(i.layout) for i in c.strategy.inputs] == ["[_,y]", "[y,_]", "[x,_]"]
    np.testing.assert_allclose(c(PARAMS, X, 2.0, "relu"), scaled(PARAMS, X, 2.0, "relu"),
                               rtol=1e-5)
    np.testing.assert_allclose(c(PARAMS, X, scale=2.0, activation="relu"),
                               scaled(PARAMS, X, 2.0, "relu"), rtol=1e-5)
    with pytest.raises(ap.ConfigError, match="compiled for static argument 3 = 'relu'"):
        c(PARAMS, X, 2.0, "tanh")
    with pytest.raises(ap.LayoutError, match="static argument"):
        ap.compile(scaled, PARAMS, X, 2.0, "relu", config=semi(), static_argnums=(2, 3),
                   in_strategy=(None, None, (1,), None))
    with pytest.raises(ap.ConfigError, match="not hashable"):
        ap.compile(scaled, PARAMS, X, [2.0], "relu", config=semi(), static_argnums=(2, 3))

    @ap.parallel(config=semi(), static_argnums=(2, 3))
    def decorated(params, x, scale, activation):
        return scaled(params, x, scale, activation)
    for act in ("relu", "tanh"):                        # compiled once per static value
        np.testing.assert_allclose(decorated(PARAMS, X, 0.5, act), scaled(PARAMS, X, 0.5, act),
                                   rtol=1e-5)
    assert len(decorated._cache) == 2


def test_donated_arguments_buffers_are_reused_on_the_jax_backend():
    c = ap.compile(mlp, PARAMS, X, config=semi(), donate_argnums=(0,),
                   in_strategy=({"w1": P(None, "y"), "w2": P("y", None)}, P("x")))
    params = jax.device_put(PARAMS, c.in_shardings[0])
    want = mlp(PARAMS, X)
    loss, new = c(params, X)
    np.testing.assert_allclose(loss, want[0], rtol=1e-5)
    assert params["w1"].is_deleted() and params["w2"].is_deleted()   # as jax.jit donates
    loss, _ = c(new, X)                                  # the donated step's own results
    assert not jax.device_put(X).is_deleted()


def init_model(key, d=64, hidden=256):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d, hidden)) / 8, "w2": jax.random.normal(k2, (hidden, 8))}


def test_parameters_are_initialised_in_the_plans_layouts_never_whole_on_a_device():
    key = jax.random.key(0)
    abstract = jax.eval_shape(init_model, key)            # the model is never built whole
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    megatron = ({"w1": P(None, ("x", "y")), "w2": P(("x", "y"), None)}, P())
    c = ap.compile(mlp, abstract, x, config=semi(), in_strategy=megatron)
    params = c.init(init_model, key)
    want = init_model(key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), params, want)
    assert params["w1"].sharding.is_equivalent_to(c.in_shardings[0]["w1"], 2)
    assert {s.data.shape for s in params["w1"].addressable_shards} == {(64, 32)}
    # per device, XLA's own accounting of the initialisation: a share of the whole model
    whole = sum(a.nbytes for a in jax.tree.leaves(want))
    sharded = jax.jit(init_model, out_shardings=c.in_shardings[0]).lower(key).compile()
    alone = jax.jit(init_model).lower(key).compile()
    held = lambda m: m.memory_analysis().output_size_in_bytes + \
        m.memory_analysis().temp_size_in_bytes
    assert sharded.memory_analysis().output_size_in_bytes <= whole / 8 + 64     # + tuple
    assert held(sharded) < whole and held(sharded) <= held(alone) / 4    # temporaries too
    loss, new = c(params, np.ones((8, 64), np.float32))   # the step runs on them as they are
    np.testing.assert_allclose(loss, mlp(want, np.ones((8, 64), np.float32))[0], rtol=1e-5)
    with pytest.raises(ap.ConfigError, match="matches none of the step's arguments"):
        c.init(lambda k: {"w1": jnp.zeros((3, 3))}, key)
    native = ap.compile(mlp, abstract, x, config=semi().replace(backend="native"),
                        in_strategy=megatron)
    with pytest.raises(ap.ConfigError, match="use backend='jax' or 'xla'"):
        native.init(init_model, key)


def test_plan_takes_static_arguments_too():
    s = ap.plan(scaled, PARAMS, X, 2.0, "relu", config=semi(), static_argnames="activation",
                static_argnums=2)
    assert [i.name for i in s.inputs] == ["w1", "w2", "arg1"]
