"""Control flow in a step (autopar.trace_control): ``lax.scan`` and static ``fori_loop``
unrolled, ``lax.cond`` / ``lax.switch`` computed as a select of their branches; the sharded
step gives the single-device step's values. Too long a scan and a ``while_loop`` are refused
with the user's line."""
import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.trace import trace
from autopar.trace_control import MAX_UNROLL
from test_random import assert_same, case as random_case


def case():
    p, _, b = random_case()
    return p, b


def mse(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def accumulating_step(p, batch):
    """Gradient accumulation over 4 micro-batches with scan; the learning rate by cond."""
    x, y = batch

    def body(acc, xy):
        value, grads = jax.value_and_grad(mse)(p, *xy)
        return jax.tree.map(jnp.add, acc, (value, grads)), value

    zero = (jnp.float32(0), jax.tree.map(jnp.zeros_like, p))
    (value, grads), per_micro = jax.lax.scan(body, zero, (x.reshape(4, 2, 16),
                                                          y.reshape(4, 2, 16)))
    lr = jax.lax.cond(value > 4.0, lambda: 0.05, lambda: 0.1)
    return value / 4, jax.tree.map(lambda a, g: a - lr * g / 4, p, grads), per_micro


def layer_stack_step(p, batch):
    """Two layers through a (reversed) scan over stacked weights, a static fori_loop and a
    three-way switch."""
    x, y = batch

    def loss(p):
        ws = jnp.stack([p["w1"][:, :16], p["w2"][:16, :]])
        h, hs = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h.sum()), x, ws, reverse=True)
        h = jax.lax.fori_loop(0, 3, lambda i, h: h * 0.9 + 0.01 * i, h)
        h = jax.lax.switch(jnp.argmax(hs) % 3, [lambda h: h, jnp.sin, jnp.cos], h)
        return jnp.mean((h - y) ** 2)

    value, grads = jax.value_and_grad(loss)(p)
    return value, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)


# (data_parallel rightly warns that accumulating_step's chunks of rows end the batch split)
@pytest.mark.filterwarnings("ignore:data_parallel. the batch's row split ends")
@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel", "auto_parallel"])
@pytest.mark.parametrize("step", [accumulating_step, layer_stack_step])
def test_scans_and_conds_match_single_device(step, mode):
    p, b = case()
    cfg = ap.ParallelConfig(parallel_mode=mode, device_num=4, backend="jax", progress=False)
    ins = ({"w1": (1, 4), "w2": (4, 1)}, None) if mode == "semi_auto_parallel" else None
    c = ap.compile(step, p, b, config=cfg, in_strategy=ins)
    assert_same(c(p, b), jax.jit(step)(p, b))


def test_a_scan_is_unrolled_and_a_cond_selects():
    p, b = case()
    prims = [n.prim for n in trace(accumulating_step, p, b).nodes]
    assert "scan" not in prims and "cond" not in prims
    assert prims.count("dot_general") == 4 * 5    # per micro-batch: 2 forward, 3 backward
    assert "select_n" in prims


def test_too_long_a_scan_is_refused_with_the_line_and_a_while_loop_runs_whole():
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="jax",
                            progress=False)
    xs = jnp.ones((MAX_UNROLL + 1, 4))
    with pytest.raises(ap.RuleError, match=f"scan of {MAX_UNROLL + 1} iterations at .*"
                                           "test_control_flow"):
        ap.compile(lambda w, xs: jax.lax.scan(lambda c, x: (c + x @ w, None), xs[0], xs)[0],
                   jnp.ones((4, 4)), xs, config=cfg)

    def grow(w, x):             # a trip count known only at run time: one operator
        return jax.lax.while_loop(lambda v: v.sum() < 100.0, lambda v: v @ w + 1.0, x)
    w, x = jnp.full((4, 4), 0.5), jnp.ones((2, 4))
    assert_same(ap.compile(grow, w, x, config=cfg)(w, x), jax.jit(grow)(w, x))


@pytest.mark.filterwarnings("ignore:data_parallel. the batch's row split ends")   # (rightly)
@pytest.mark.native
def test_accumulating_scan_on_the_native_runtime_matches_single_device():
    p, b = case()
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="native",
                            progress=False)
    with ap.compile(accumulating_step, p, b, config=cfg) as c:
        assert_same(c(p, b), jax.jit(accumulating_step)(p, b))
