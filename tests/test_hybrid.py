"""hybrid_parallel: a step that calls ap.comm collectives itself runs as written on both
backends, differentiates as jax.lax's collectives do, and matches the single-device step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import autopar as ap
import models as m


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=rtol, atol=atol), a, b)


def hybrid(backend, **kw):
    return ap.ParallelConfig(parallel_mode="hybrid_parallel", backend=backend, **kw)


def dp_step(params, batch):
    """Data parallel by hand: the mean of the per-device mean losses; the gradient of every
    replicated parameter arrives summed over the devices (JAX's shard_map semantics)."""
    def loss_fn(p):
        return ap.comm.all_reduce(m.mlp_loss(p, batch), "x") / 4
    loss, g = jax.value_and_grad(loss_fn)(params)
    return loss, m.sgd(params, g)


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
def test_data_parallel_by_hand(backend):
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    c = ap.compile(dp_step, p, b, config=hybrid(backend, device_num=4))
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    assert c.strategy.mode == "hybrid_parallel"
    assert [i.layout for i in c.strategy.inputs if not i.is_param] == [ap.Layout((("x",), ()))] * 2
    kinds = [(x.kind, x.axes) for x in c.collectives()]
    assert kinds == [("all_reduce", ("x",))] * len(kinds) and len(kinds) == 5   # loss + 4 grads


def megatron_step(params, batch):
    """Tensor parallel over y (w1 split by columns, w2 by rows, one all-reduce of the second
    layer's partial sums) and data parallel over x (2 x 2 mesh)."""
    def loss_fn(p):
        x, y = batch
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        out = ap.comm.all_reduce(h @ p["w2"], "y") + p["b2"]
        return ap.comm.all_reduce(jnp.mean((out - y) ** 2), "x") / 2
    loss, g = jax.value_and_grad(loss_fn)(params)
    return loss, m.sgd(params, g)


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
def test_tensor_parallel_by_hand(backend):
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    in_strategy = ({"w1": "[_,y]", "b1": "[y]", "w2": "[y,_]", "b2": "[_]"}, "[x,_]")
    c = ap.compile(megatron_step, p, b, in_strategy=in_strategy,
                   config=hybrid(backend, device_num=4, mesh_shape=(2, 2)))
    got = c(p, b)
    assert_same(got, m.mlp_sgd_step(p, b))
    # new parameters keep their arguments' split layouts and come back whole
    lay = {i.name: str(i.layout) for i in c.strategy.inputs}
    assert lay["w1"] == "[_,y]" and lay["w2"] == "[y,_]" and lay["arg1.0"] == "[x,_]"


def mixed(params, x):
    """Every ap.comm collective, forward and backward, on a (2, 2) mesh."""
    def f(w):
        h = x * w                                              # x: [x,y] blocks, w: [y] columns
        i = ap.comm.axis_index("y").astype(jnp.float32)
        g = ap.comm.all_gather(h * (1.0 + i), "y", dim=1)      # [4, 8]
        a = ap.comm.all_to_all(g, ("x", "y"), split_dim=1, concat_dim=0)
        s = ap.comm.reduce_scatter(a, "x", dim=0)
        k = jax.lax.stop_gradient(s)        # max and min have no derivative (as in jax.lax)
        top = ap.comm.all_reduce(jnp.max(k), ("x", "y"), op="max")
        low = ap.comm.all_reduce(jnp.min(k), ("x", "y"), op="min")
        return ap.comm.all_reduce(jnp.sum(s ** 2), ("x", "y")) + top - low
    loss, g = jax.value_and_grad(f)(params)
    return loss, params - 0.01 * g


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
def test_every_collective_matches_jax_shard_map(backend):
    w = jnp.arange(1.0, 9.0, dtype=jnp.float32) / 8            # 8 columns, split over y
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)
    c = ap.compile(mixed, w, x, in_strategy=("[y]", "[x,y]"),
                   config=hybrid(backend, device_num=4, mesh_shape=(2, 2),
                                 mesh_axis_names=("x", "y")))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    want = jax.jit(jax.shard_map(mixed, mesh=mesh, in_specs=(P("y"), P("x", "y")),
                                 out_specs=(P(), P("y"))))(w, x)
    assert_same(c(w, x), want, atol=1e-5)
    kinds = {x.kind for x in c.collectives()}
    assert {"all_gather", "all_to_all", "reduce_scatter", "all_reduce"} <= kinds
    assert {x.op for x in c.collectives() if x.kind == "all_reduce"} >= {"sum", "max", "min"}


def gathered_step(params, batch):
    """The whole batch gathered on every device, then the plain step: the gathered value is
    the same everywhere, so its loss may be returned whole (JAX typed lax.all_gather's result
    as varying and the step was refused)."""
    x, y = (ap.comm.all_gather(v, "x") for v in batch)
    loss, g = jax.value_and_grad(m.mlp_loss)(params, (x, y))
    return loss, m.sgd(params, g)


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
def test_a_loss_over_the_gathered_batch_is_the_single_device_step(backend):
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    n = 4 if backend == "jax" else 2
    with ap.compile(gathered_step, p, b, config=hybrid(backend, device_num=n)) as c:
        assert_same(c(p, b), m.mlp_sgd_step(p, b))


def test_errors_say_what_to_do():
    with pytest.raises(ap.ConfigError, match="hybrid_parallel"):
        ap.comm.all_reduce(jnp.ones(3), "x")
    with pytest.raises(ap.ConfigError, match="'sum', 'max', 'min'"):
        ap.comm.all_reduce(jnp.ones(3), "x", op="mean")
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    with pytest.raises(ap.LayoutError, match="same on every device"):
        ap.plan(lambda p, b: m.mlp_loss(p, b), p, b, config=hybrid("jax", device_num=4))
    with pytest.raises(ap.ConfigError, match="pipeline stages"):
        ap.plan(dp_step, p, b, config=hybrid("jax", device_num=4, pipeline_stages=2))


def power_step(w, x):
    """A distributed power iteration until converged (a while loop, its body all-reducing over
    the devices' rows of x), then a step scaled by the top eigenvalue; the loop's result is
    read by later operators."""
    def body(c):
        v, _, i = c
        nv = ap.comm.all_reduce(x.T @ (x @ v), "x")
        nv = nv / jnp.linalg.norm(nv)
        return nv, jnp.abs(nv - v).max(), i + 1
    v, _, _ = jax.lax.while_loop(lambda c: (c[1] > 1e-6) & (c[2] < 100), body,
                                 (jnp.ones_like(w) / w.size ** 0.5, jnp.float32(1.0), 0))
    top = ap.comm.all_reduce(jnp.sum((x @ v) ** 2), "x")
    return w - 0.1 * v / top


def power_single(w, x):
    def body(c):
        v, _, i = c
        nv = x.T @ (x @ v)
        nv = nv / jnp.linalg.norm(nv)
        return nv, jnp.abs(nv - v).max(), i + 1
    v, _, _ = jax.lax.while_loop(lambda c: (c[1] > 1e-6) & (c[2] < 100), body,
                                 (jnp.ones_like(w) / w.size ** 0.5, jnp.float32(1.0), 0))
    return w - 0.1 * v / jnp.sum((x @ v) ** 2)


def test_a_while_loop_with_collectives_runs_on_jax_devices_and_is_refused_natively():
    """Values made inside a while loop carry the mesh they were traced on: traced with the
    devices' kind they run on, a later operator reading them lowers; the native runtime runs
    no collective inside such a loop and says so when compiling."""
    r = np.random.default_rng(0)
    w, x = r.normal(size=6).astype(np.float32), r.normal(size=(16, 6)).astype(np.float32)
    c = ap.compile(power_step, w, x, config=hybrid("jax", device_num=4))
    assert_same(c(w, x), jax.jit(power_single)(w, x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ap.ConfigError, match=r"while at .*test_hybrid.*ap\.comm\.all_reduce "
                                             r"inside its body.*fori_loop"):
        ap.compile(power_step, w, x, config=hybrid("native", device_num=2))
