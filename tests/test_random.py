"""Random numbers inside a step (``jax.random`` with a key argument, or keys made in the step)
run sharded and give the single-device step's values, bit for bit in the random draws
(autopar.trace_keys); typed keys as arguments or results are refused with what to pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap

RTOL, ATOL = 1e-5, 1e-6


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=RTOL, atol=ATOL), a, b)


def dropout_step(params, key, batch):
    """A user's MLP step: dropout from a raw key, noise from a folded key, the next key out."""
    x, y = batch

    def loss(p):
        k1, k2 = jax.random.split(key)
        h = jax.nn.relu(x @ p["w1"])
        keep = jax.random.bernoulli(k1, 0.8, h.shape)
        h = jnp.where(keep, h / 0.8, 0.0)
        noise = 0.01 * jax.random.normal(jax.random.fold_in(k2, 3), (y.shape[1],))
        return jnp.mean((h @ p["w2"] + noise - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    next_key, _ = jax.random.split(key)
    return value, jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), next_key


def typed_keys_step(params, batch):
    """Typed keys made in the step: split into three, unpacked, one folded."""
    x, y = batch
    a, _, c = jax.random.split(jax.random.key(7), 3)

    def loss(p):
        keep = jax.random.uniform(jax.random.fold_in(a, 1), x.shape) > 0.3
        h = jnp.where(keep, x, 0.0) @ p["w1"] + jax.random.normal(c, (p["w1"].shape[1],))
        return jnp.mean((h @ p["w2"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)


def case():
    r = np.random.default_rng(0)
    p = {"w1": jnp.asarray(r.normal(0, .3, (16, 32)), jnp.float32),
         "w2": jnp.asarray(r.normal(0, .3, (32, 16)), jnp.float32)}
    b = (jnp.asarray(r.normal(size=(8, 16)), jnp.float32),
         jnp.asarray(r.normal(size=(8, 16)), jnp.float32))
    return p, jax.random.PRNGKey(42), b


MEGATRON = {"w1": (1, 4), "w2": (4, 1)}


@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel", "auto_parallel"])
def test_dropout_from_a_key_argument_matches_single_device_over_two_steps(mode):
    p, key, b = case()
    cfg = ap.ParallelConfig(parallel_mode=mode, device_num=4, backend="jax", progress=False)
    ins = (MEGATRON, None, None) if mode == "semi_auto_parallel" else None
    c = ap.compile(dropout_step, p, key, b, config=cfg, batch_argnums=(2,), in_strategy=ins)
    got, want = c(p, key, b), jax.jit(dropout_step)(p, key, b)
    assert_same(got, want)
    assert_same(c(*got[1:], b), jax.jit(dropout_step)(*want[1:], b))
    prims = {op.prim for op in c.strategy.ops}
    assert "threefry2x32" in prims and "iota_2x32_shape" not in prims   # planned operators:
    if mode == "data_parallel":            # a device draws its rows of the mask, from their
        mask = [op for op in c.strategy.ops    # counters only (not the whole mask's, sliced)
                if op.prim == "threefry2x32" and op.out_shapes[0] == (8, 32)]
        assert mask and {str(lay) for op in mask
                         for lay in op.in_layouts[2:] + op.out_layouts} == {"[x,_]"}


def test_typed_keys_made_in_the_step_match_single_device():
    p, _, b = case()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=4, backend="jax",
                            progress=False)
    c = ap.compile(typed_keys_step, p, b, config=cfg, in_strategy=(MEGATRON, None))
    assert_same(c(p, b), jax.jit(typed_keys_step)(p, b))


def test_random_draws_in_a_pipeline_match_single_device():
    p, key, b = case()
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, backend="jax",
                            pipeline_stages=2, micro_batches=2, progress=False)
    c = ap.compile(dropout_step, p, key, b, config=cfg, batch_argnums=(2,))
    assert_same(c(p, key, b), jax.jit(dropout_step)(p, key, b))


def typed_key_step(w, keys, x):
    """Typed keys in (a dict of streams, as Flax NNX's state holds them) and out."""
    drop, noise = jax.random.split(keys["dropout"])
    h = jnp.where(jax.random.bernoulli(drop, 0.7, x.shape), x, 0.0) @ w
    h = h + 0.01 * jax.random.normal(keys["noise"], h.shape)
    return jnp.mean(h ** 2), {"dropout": noise, "noise": jax.random.fold_in(keys["noise"], 1)}


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
def test_typed_keys_as_arguments_and_results_go_in_and_out_as_keys(backend):
    """Typed PRNG keys among the arguments (``nnx.split`` puts one per Rngs stream in a
    model's state) travel as their data and come back typed; the draws are the single-device
    step's over two steps."""
    w, x = jnp.ones((8, 4)), jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)))
    keys = {"dropout": jax.random.key(0), "noise": jax.random.key(1)}
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend=backend,
                            progress=False)
    with ap.compile(typed_key_step, w, keys, x, config=cfg, batch_argnums=(2,)) as c:
        got, want = c(w, keys, x), jax.jit(typed_key_step)(w, keys, x)
        for _ in range(2):
            assert all(jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
                       for k in got[1].values())
            assert_same((got[0], jax.tree.map(jax.random.key_data, got[1])),
                        (want[0], jax.tree.map(jax.random.key_data, want[1])))
            got, want = c(w, got[1], x), jax.jit(typed_key_step)(w, want[1], x)
    if backend == "jax":                    # the decorator too (it keeps its compiled steps)
        step = ap.parallel(typed_key_step, config=cfg, batch_argnums=(2,))
        assert_same(jax.tree.map(jax.random.key_data, step(w, keys, x)[1]),
                    jax.tree.map(jax.random.key_data, jax.jit(typed_key_step)(w, keys, x)[1]))


@pytest.mark.parametrize("draw", [lambda k, a: jax.random.gamma(k, a),
                                  lambda k, a: jax.random.beta(k, a, 2.0),
                                  lambda k, a: jax.random.poisson(k, a).astype(jnp.float32)])
def test_rejection_samplers_are_refused_with_what_to_do(draw):
    """gamma / beta / dirichlet / poisson draw by loops over keys autopar does not trace: the
    refusal says so and what to do instead."""
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="jax",
                            progress=False)
    with pytest.raises(ap.RuleError, match="rejection loops.*Kumaraswamy"):
        ap.compile(lambda a, k: jnp.sum(draw(k, a)), jnp.full((4,), 2.0),
                   jax.random.PRNGKey(0), config=cfg, batch_argnums=())


@pytest.mark.native
def test_dropout_on_the_native_runtime_matches_single_device():
    p, key, b = case()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=2, backend="native",
                            progress=False)
    c = ap.compile(dropout_step, p, key, b, config=cfg, batch_argnums=(2,),
                   in_strategy=({"w1": (1, 2), "w2": (2, 1)}, None, None))
    try:
        got, want = c(p, key, b), jax.jit(dropout_step)(p, key, b)
        assert_same(got, want)
        assert_same(c(*got[1:], b), jax.jit(dropout_step)(*want[1:], b))
    finally:
        c.close()


def many_draws_step(w, key, x):
    """jax.random's other samplers, each built on random_bits, inside one step."""
    ks = jax.random.split(key, 6)
    picks = jax.random.permutation(ks[2], x.shape[0])
    value = jnp.sum((x[picks] @ w) * jax.random.randint(ks[0], (8, 4), 0, 10))
    value += jnp.sum(jax.random.categorical(ks[1], x @ w))
    value += jax.random.truncated_normal(ks[3], -1.0, 1.0, (4,)).sum()
    value += jax.random.choice(ks[4], 8, (3,), replace=False).sum()
    return value + jax.random.gumbel(ks[5], (8, 4)).sum()


# (data_parallel rightly warns that x[permutation] takes the batch whole)
@pytest.mark.filterwarnings("ignore:data_parallel. the batch's row split ends")
@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
def test_other_samplers_match_single_device(mode):
    r = np.random.default_rng(0)
    w = jnp.asarray(r.normal(size=(4, 4)), jnp.float32)
    x = jnp.asarray(r.normal(size=(8, 4)), jnp.float32)
    key = jax.random.PRNGKey(3)
    cfg = ap.ParallelConfig(parallel_mode=mode, device_num=4, backend="jax", progress=False)
    c = ap.compile(many_draws_step, w, key, x, config=cfg, batch_argnums=(2,))
    assert_same(c(w, key, x), jax.jit(many_draws_step)(w, key, x))
