"""Tracing into the graph IR: inlining, shapes, printed form, errors."""
import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.trace import trace


@jax.custom_vjp
def clip_grad(x):
    return x


clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))


def test_inlines_jit_custom_jvp_and_vjp():
    @jax.jit
    def inner(x):
        return jax.nn.relu(x) * 2.0

    def f(params, x):
        return jnp.sum(clip_grad(inner(x @ params["w"])))

    g = trace(jax.grad(f), {"w": jnp.ones((4, 3))}, jnp.ones((2, 4)))
    prims = {n.prim for n in g.nodes}
    assert not prims & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
    assert "dot_general" in prims
    for n in g.nodes:
        for v in n.outputs:
            assert isinstance(v.shape, tuple)
    assert g.out_tree == jax.tree.structure({"w": 0})
    fwd = trace(f, {"w": jnp.ones((4, 3))}, jnp.ones((2, 4)))        # the calls themselves
    assert [n.prim for n in fwd.nodes] == ["dot_general", "max", "mul", "reduce_sum"]


def test_drops_operators_nothing_reads():
    """The gradient of a masked softmax leaves a (B, H, T, T) zeros broadcast nobody reads; kept,
    it was planned and held as the largest value of the first pipeline stage."""
    def f(x):
        _ = jnp.sin(x)                                       # dead in the user's own code
        att = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), x, -1e9)
        return jnp.sum(jax.nn.softmax(att, -1) ** 2)

    g = trace(jax.value_and_grad(f), jnp.ones((2, 3, 4, 4)))
    assert "sin" not in {n.prim for n in g.nodes}
    outs = {o.id for o in g.outputs if hasattr(o, "id")}
    for n in g.nodes:
        assert any(g.users[v.id] or v.id in outs for v in n.outputs), n
    assert [n.id for n in g.nodes] == list(range(len(g.nodes)))


def test_printed_form_is_stable():
    def f(w, x):
        return jnp.tanh(x @ w) * 2.0
    g = trace(f, jnp.ones((4, 3)), jnp.ones((2, 4)))
    assert str(g) == (
        "graph(%0:f32[4,3], %1:f32[2,4]) {\n"
        "  %2:f32[2,3] = dot_general(%1, %0) {dimension_numbers=(((1,), (0,)), ((), ()))}\n"
        "  %3:f32[2,3] = tanh(%2)\n"
        "  %4:f32[2,3] = mul(%3, 2.0)\n"
        "  return %4\n"
        "}")
    assert str(trace(f, jnp.ones((4, 3)), jnp.ones((2, 4)))) == str(g)


def test_unsupported_primitive_names_it():
    def f(params, x):           # an approximate top-k: no rule
        return jax.lax.approx_max_k(x @ params, 2)[0]
    a = jnp.eye(4)
    with pytest.raises(ap.RuleError) as e:
        ap.compile(f, a, a)
    msg = str(e.value)
    assert "'approx_top_k'" in msg and "f32[4,4]" in msg and "test_trace.py" in msg
