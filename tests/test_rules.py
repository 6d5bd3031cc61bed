"""Sharding rules: the table covers the test models, specs read as documented, and every
candidate of every node computes the unsharded result when run sharded (strategies.rule_check)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive

import autopar as ap
import models as M
from autopar.errors import ConfigError, RuleError
from autopar.graph import Node, Value
from autopar.mesh import LogicalMesh
from autopar.strategies.rule_check import CheckReport, check_graph, check_graphs, check_node
from autopar.strategies.candidates import enumerate_candidates
from autopar.strategies.rules import RULES, Rule, parse, rule_for
from autopar.strategies.rules.shape import reshape_groups
from autopar.trace import trace


def _meshes(shape):
    mesh = LogicalMesh.create(shape)
    devices = np.array(jax.devices()[:mesh.size]).reshape(shape)
    return mesh, jax.sharding.Mesh(devices, mesh.axis_names)


@pytest.fixture(scope="module")
def model_graphs():
    p, b = M.mlp_params(), M.mlp_batch()
    graphs = {"mlp_sgd": trace(M.mlp_sgd_step, p, b),
              "mlp_adam": trace(M.mlp_adam_step, p, M.adam_init(p), b)}
    p, b = M.gpt_params(layers=2, heads=4), M.gpt_batch()
    graphs["gpt_sgd"] = trace(M.gpt_sgd_step, p, b)
    graphs["gpt_adam"] = trace(M.gpt_adam_step, p, M.adam_init(p), b)
    return graphs


def _node(fn, prim, *args):
    return next(n for n in trace(fn, *args).nodes if n.prim == prim)


# ---------------------------------------------------------------- coverage

def test_every_model_primitive_has_a_rule(model_graphs):
    prims = {n.prim for g in model_graphs.values() for n in g.nodes}
    for g in model_graphs.values():
        for n in g.nodes:
            rule_for(n).spec(n)
    assert {"dot_general", "gather", "scatter-add", "reshape", "transpose", "split",
            "concatenate", "reduce_sum", "reduce_max", "iota", "select_n", "squeeze",
            "broadcast_in_dim", "add_any", "integer_pow", "pow", "stop_gradient", "rsqrt",
            "tanh", "convert_element_type"} <= prims
    for name in ("erf", "logistic", "slice", "pad", "rev", "dynamic_slice",
                 "dynamic_update_slice", "argmax", "cumsum", "autopar_shard", "scatter"):
        assert name in {p.name for p in RULES}


def test_unknown_primitive_raises_rule_error_naming_it():
    prim = Primitive("my_weird_op")
    x = Value(0, (4, 8), np.dtype("float32"))
    node = Node(0, prim, (x,), (Value(1, (4, 8), np.dtype("float32")),), {}, "model.py:12 (f)")
    with pytest.raises(RuleError) as e:
        rule_for(node)
    msg = str(e.value)
    assert "my_weird_op" in msg and "f32[4,8]" in msg and "model.py:12" in msg


# ---------------------------------------------------------------- specs

def test_dot_general_text_forms():
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    n = _node(lambda x, w: x @ w, "dot_general", x, w)
    assert str(rule_for(n).spec(n)) == "m0 k0+, k0+ n1 -> m0 n1"
    q = jnp.ones((4, 8, 16))
    n = _node(lambda a, b: jnp.einsum("bmk,bnk->bmn", a, b), "dot_general", q, q)
    assert str(rule_for(n).spec(n)) == "b0 m1 k0+, b0 n1 k0+ -> b0 m1 n1"


def test_reduce_max_never_splits_the_reduced_dim():
    n = _node(lambda x: jnp.max(x, axis=1), "reduce_max", jnp.ones((8, 16)))
    spec = rule_for(n).spec(n)
    assert str(spec) == "d0 _ -> d0"
    for mesh_shape in [(2,), (2, 2), (2, 4)]:
        for c in enumerate_candidates(n, spec, LogicalMesh.create(mesh_shape)):
            assert c.in_layouts[0].dims[1] == () and not c.out_layouts[0].partial


def test_reduce_sum_splits_reduced_dims_into_partial_sums():
    n = _node(lambda x: jnp.sum(x, axis=1), "reduce_sum", jnp.ones((8, 16)))
    spec = rule_for(n).spec(n)
    assert str(spec) == "d0 r1+ -> d0" and spec.linear == ((0,),)
    outs = {str(c) for c in enumerate_candidates(n, spec, LogicalMesh.create((2,)))}
    assert "[_,x] -> [_] sum{x}" in outs


def test_reshape_groups_and_spec():
    assert reshape_groups((4, 8, 32), (4, 8, 4, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert reshape_groups((4, 8, 4, 8), (4, 8, 32)) == [([0], [0]), ([1], [1]), ([2, 3], [2])]
    assert reshape_groups((6, 4), (4, 6)) == [([0, 1], [0, 1])]
    assert reshape_groups((4, 8), (4, 8, 1)) == [([0], [0]), ([1], [1])]
    n = _node(lambda x: x.reshape(4, 8, 4, 8), "reshape", jnp.ones((4, 8, 32)))
    assert str(rule_for(n).spec(n)) == "g0 g1 g2 -> g0 g1 g2 _"
    n = _node(lambda x: x.reshape(4, 6), "reshape", jnp.ones((6, 4)))
    spec = rule_for(n).spec(n)
    assert str(spec) == "g0 _ -> g0 _"
    # the major dims may split only where the split divides both (6 and 4)
    assert len(enumerate_candidates(n, spec, LogicalMesh.create((2,)))) == 3   # _, x, sum{x}
    assert len(enumerate_candidates(n, spec, LogicalMesh.create((4,)))) == 2   # _, sum{x}


def test_shape_and_indexing_specs():
    x = jnp.ones((16, 8))
    cases = [
        (lambda x: x[2:6], "slice", "_ d1 -> _ d1"),
        (lambda x: jnp.concatenate([x, x], 1), "concatenate", "d0 _, d0 _ -> d0 _"),
        (lambda x: x[::-1], "rev", "_ d1 -> _ d1"),
        (lambda x: jnp.cumsum(x, 1), "cumsum", "d0 _ -> d0 _"),
        (lambda x: jnp.argmax(x, 1), "argmax", "d0 _ -> d0"),
        (lambda x: jnp.expand_dims(x, 1), "broadcast_in_dim", "d0 d2 -> d0 d1 d2"),
        (lambda x: ap.shard(x, (2, 1)), "autopar_shard", "d0 d1 -> d0 d1"),
        (lambda x: lax.broadcasted_iota(jnp.int32, (8, 8), 0) + x.shape[0], "iota",
         " -> _ d1"),
    ]
    for fn, prim, text in cases:
        n = _node(fn, prim, x)
        assert str(rule_for(n).spec(n)) == text, prim
    n = _node(lambda w, t: w[t], "gather", jnp.ones((64, 32)), jnp.ones((4, 8), jnp.int32))
    assert str(rule_for(n).spec(n)) == "_ w1, i0 i1 _ -> i0 i1 w1"


def test_scatter_add_into_zero_constant_leaves_partial_sums():
    zeros = np.zeros((16, 8), np.float32)
    n = _node(lambda i, u: jnp.asarray(zeros).at[i].add(u), "scatter-add",
              jnp.array([1, 3, 5, 3]), jnp.ones((4, 8)))
    spec = rule_for(n).spec(n)
    assert str(spec) == "_ w1, s0+ _, s0+ w1 -> _ w1"
    cands = enumerate_candidates(n, spec, LogicalMesh.create((2,)))
    assert "[_,_], [x,_], [x,_] -> [_,_] sum{x}" in {str(c) for c in cands}


# ---------------------------------------------------------------- the checker on real graphs

@pytest.mark.slow
def test_rule_check_models_mesh_2x2(model_graphs):
    """Every candidate of every distinct node of the models, run sharded on a 2 x 2 mesh (its
    candidates include each one-axis layout, so this covers a mesh of 2 too)."""
    mesh, jm = _meshes((2, 2))
    graphs = [model_graphs[k] for k in ("mlp_sgd", "mlp_adam", "gpt_adam")]
    report = check_graphs(graphs, mesh, jm)
    assert report.failures == (), str(report)
    assert report.nodes > 100 and report.checked > 2000


_ZERO = np.zeros((16, 8), np.float32)


def _many_ops(x, y, idx, z, w):
    """Primitives of the shape/reduce/indexing families that the models do not use."""
    return [
        x[2:6], x[:, 1:7:2], x[::-1], jnp.pad(x, ((0, 0), (2, 1))),
        lax.pad(x, 0.0, ((1, 1, 1), (0, 0, 0))),
        lax.dynamic_slice(x, (idx[0], 0), (4, 8)), lax.dynamic_update_slice(x, y[:2], (idx[1], 0)),
        jnp.cumsum(x, 0), lax.cummax(x, 1), jnp.cumprod(x, 1), jnp.argmax(x, 1), jnp.argmin(x, 0),
        jnp.min(x, 0), jnp.prod(x, 1), jnp.any(x > 0, 1), jnp.sort(x, 0), lax.top_k(x, 3)[0],
        jnp.stack([x, y], 1), *jnp.unstack(x[:2], axis=0), jnp.tile(x, (1, 2)),
        x.at[idx].set(y[:4]), jnp.asarray(_ZERO).at[idx].add(y[:4]), x.at[idx].add(y[:4]),
        x.at[idx].mul(y[:4]), x.at[idx].max(y[:4]), x.at[idx, 2].add(1.5),
        jnp.concatenate([x, y], 1), jnp.expand_dims(x, 1), x.reshape(2, 4, 2, 8).sum((1, 2)),
        z.reshape(4, 6), z.reshape(24), z.reshape(3, 2, 4), w.reshape(8, 4, 2).reshape(4, 16),
        jnp.clip(x, -0.5, 0.5), ap.shard(x, (2, 1)), jnp.arange(16) * 2, x[idx],
        jnp.take_along_axis(x[:4], jnp.abs(idx[:, None]) % 8, axis=1),
        jnp.where(x > 0, x, 0.0).astype(jnp.int32), (x > 0).astype(jnp.float32),
        jnp.einsum("ij,kj->ik", x, y), jnp.sum(x * y, keepdims=True), jax.nn.gelu(x),
        jax.nn.sigmoid(x), jax.lax.erf(x),
    ]


@pytest.mark.parametrize("shape", [(2, 2), (4,)])
def test_rule_check_other_primitives(shape):
    args = (jnp.ones((16, 8)), jnp.ones((16, 8)), jnp.array([1, 3, 5, 3]), jnp.ones((6, 4)),
            jnp.ones((4, 16)))
    g = trace(_many_ops, *args)
    assert {"slice", "pad", "rev", "dynamic_slice", "dynamic_update_slice", "cumsum", "sort",
            "top_k", "stack", "unstack", "tile", "scatter", "scatter-mul",
            "autopar_shard", "iota", "gather", "scatter-add"} <= {n.prim for n in g.nodes}
    report = check_graph(g, *_meshes(shape))
    assert report.failures == (), str(report)
    assert report.checked > 150


def _random_ops(key, x):
    """What jax.random's threefry becomes on a key's data (autopar.trace_keys), and bitcasts."""
    k1, k2 = jax.random.split(key)
    return [jax.random.bits(k1, (8, 8)), jax.random.uniform(k2, (4, 16)),
            jax.random.normal(jax.random.fold_in(key, 3), (16,)),
            lax.bitcast_convert_type(x, jnp.uint8),
            lax.bitcast_convert_type(x.astype(jnp.uint32), jnp.float32)]


@pytest.mark.parametrize("shape", [(2, 2), (4,)])
def test_rule_check_random_bits(shape):
    g = trace(_random_ops, jax.random.PRNGKey(0), jnp.ones((8, 4)))
    assert {"threefry2x32", "shift_right_logical", "bitcast_convert_type"} <= \
        {n.prim for n in g.nodes}
    report = check_graph(g, *_meshes(shape))
    assert report.failures == (), str(report)
    assert report.checked > 20


# ---------------------------------------------------------------- the checker is not vacuous

_X = jnp.ones((16, 8))
_WRONG = {
    "reduce_max with +": (lambda x: jnp.max(x, 1), "reduce_max", parse("a b+ -> a")),
    "iota split on its axis": (lambda x: lax.broadcasted_iota(jnp.int32, (8, 8), 0) + 1, "iota",
                               parse(" -> a b")),
    "concatenate on a split axis": (lambda x: jnp.concatenate([x, 2 * x], 0), "concatenate",
                                    parse("a b, a b -> a b")),
    "reshape splitting a minor dim": (lambda x: x.reshape(16, 2, 4), "reshape",
                                      parse("a b -> a _ b")),
    "cumsum on a split axis": (lambda x: jnp.cumsum(x, 0), "cumsum", parse("a b -> a b")),
    "exp claimed linear": (jnp.exp, "exp", parse("a b -> a b", linear=((0,),))),
    "mul claimed jointly linear": (lambda x: x * (x + 1), "mul",
                                   parse("a b, a b -> a b", linear=((0, 1),))),
    "slice of a split dim": (lambda x: x[2:10], "slice", parse("a b -> a b")),
    "rev of a split dim": (lambda x: x[::-1], "rev", parse("a b -> a b")),
    "split on a split axis": (lambda x: jnp.split(x, 2, 1), "split", parse("a b -> a b, a b")),
    "gather from a split table": (lambda x: x[jnp.array([1, 3, 5, 3])], "gather",
                                  parse("v+ w, i _ -> i w")),
    "scatter-add operand counted per device": (
        lambda x: x.at[jnp.array([1, 3, 5, 3])].add(jnp.ones((4, 8))), "scatter-add",
        parse("_ w, s+ _, s+ w -> _ w")),
    "convert bool claimed linear": (lambda x: (x > 0).astype(jnp.float32), "convert_element_type",
                                    parse("a b -> a b", linear=((0,),))),
}


@pytest.mark.parametrize("name", sorted(_WRONG))
def test_checker_catches_wrong_rules(name):
    fn, prim, spec = _WRONG[name]
    node = _node(fn, prim, _X)
    mesh, jm = _meshes((2, 2))
    wrong = check_node(node, mesh, jm, np.random.default_rng(0), rule=Rule(lambda n: spec))
    assert wrong.failures and wrong.failures[0].primitive == prim
    assert wrong.failures[0].candidate and wrong.failures[0].error
    right = check_node(node, mesh, jm, np.random.default_rng(0))
    assert right.failures == () and right.checked >= 1


def test_threefry_counters_from_iotas_and_as_one_operator():
    """Random bits' counters (``iota_2x32_shape``) are traced as iotas scaled, broadcast and
    added, which any dimension may split; over 2**32 elements as the same sum in two 32-bit
    words with a carry (a dropout mask over a whole batch of attention scores), equal to
    JAX's words. The operator itself, where a graph has it, splits nothing: the checker runs
    its candidate and catches one that splits it."""
    from jax._src.random.prng import iota_2x32_shape_p
    from autopar.trace import _Builder
    from autopar.trace_keys import add_words, counter_words
    small = trace(lambda k: jax.random.bits(k, (16, 8)), jax.random.PRNGKey(0))
    assert "iota_2x32_shape" not in {n.prim for n in small.nodes}
    huge = trace(lambda k: jax.random.bits(k, (1 << 16, 1 << 16)), jax.random.PRNGKey(0))
    assert "iota_2x32_shape" not in {n.prim for n in huge.nodes}
    assert {"lt", "threefry2x32"} <= {n.prim for n in huge.nodes}          # the carry
    for shape in [(16, 8), (3, 5, 7)]:
        want = iota_2x32_shape_p.bind(shape=shape)
        for wide in (False, True):
            got = counter_words(shape, wide)
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # the carry between the words, on sums past 2**32
    a = np.array([0xFFFFFFFF, 5 << 31, 7], np.uint64)
    b = np.array([1, 3 << 31, 0xFFFFFFF0], np.uint64)
    words = lambda x: (jnp.asarray(x >> 32, jnp.uint32), jnp.asarray(x & 0xFFFFFFFF, jnp.uint32))
    hi, lo = add_words(*words(a), *words(b))
    assert [int(h) << 32 | int(w) for h, w in zip(hi, lo)] == [int(x) for x in a + b]
    eqn = jax.make_jaxpr(lambda: iota_2x32_shape_p.bind(shape=(16, 8)))().eqns[0]
    builder = _Builder()
    builder.add_node(eqn, [], "", "")
    node = builder.nodes[0]
    mesh, jm = _meshes((2, 2))
    right = check_node(node, mesh, jm, np.random.default_rng(0))
    assert right.failures == () and right.checked >= 1
    wrong = check_node(node, mesh, jm, np.random.default_rng(0),
                       rule=Rule(lambda n: parse(" -> a b, a b")))
    assert wrong.failures and wrong.failures[0].primitive == "iota_2x32_shape"


def test_report_text_and_mesh_mismatch():
    node = _node(lambda x: jnp.max(x, 1), "reduce_max", _X)
    mesh, jm = _meshes((2, 2))
    report = check_node(node, mesh, jm, np.random.default_rng(0),
                        rule=Rule(lambda n: parse("a b+ -> a")))
    text = str(report)
    assert text.startswith(f"rule check: {report.checked} candidates of 1 nodes, "
                           f"{len(report.failures)} incorrect")
    assert "reduce_max" in text and "sum{" in text
    assert isinstance(report.merge(CheckReport(1, 2)), CheckReport)
    with pytest.raises(ConfigError):
        check_node(node, LogicalMesh.create((4,)), jm, np.random.default_rng(0))


def _linalg_ops(a, x):
    """A batch of matrices through jnp.linalg, jax.scipy.linalg and jnp.fft, the special
    functions of probability densities, a while loop and reductions by the user's function."""
    spd = a @ jnp.swapaxes(a, -1, -2) + 8.0 * jnp.eye(a.shape[-1])
    chol = jnp.linalg.cholesky(spd)
    w, v = jnp.linalg.eigh(spd)
    q, r = jnp.linalg.qr(a)
    u, s, vt = jnp.linalg.svd(a, full_matrices=False)
    tri = jax.scipy.linalg.solve_triangular(chol, x, lower=True)
    spectrum = jnp.fft.rfft(x, axis=-1)
    return [chol, w, v, q, r, u, s, vt, jnp.linalg.solve(spd, x), jnp.linalg.det(spd), tri,
            jnp.fft.irfft(spectrum, n=x.shape[-1], axis=-1), jnp.abs(jnp.fft.fft2(a)),
            lax.lgamma(spd + 20.0), lax.digamma(spd + 20.0), lax.erfc(x), jnp.sinh(x),
            lax.igamma(jnp.abs(x) + 1.0, jnp.abs(x)), jnp.searchsorted(jnp.sort(x[0, 0]), x),
            lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 1.5, c[1] + 1), (x, 0))[0],
            lax.reduce(x, 0.0, lambda p, q: p + 2.0 * q, (1,)),                 # own reducer
            *lax.reduce((x, a[..., :1, :1] * x), (0.0, 1.0),
                        lambda p, q: (p[0] + q[0], jnp.maximum(p[1], q[1])), (2,))]


@pytest.mark.parametrize("shape", [(2, 2), (4,)])
def test_rule_check_linear_algebra_fft_and_special_functions(shape):
    """Factorisations, solves and transforms split only their batch dimensions, a while loop
    nothing; every candidate runs sharded and gives the unsharded values."""
    r = np.random.default_rng(0)
    a = jnp.asarray(r.normal(size=(4, 6, 6)), jnp.float32)
    x = jnp.asarray(r.normal(size=(4, 6, 8)), jnp.float32)
    g = trace(_linalg_ops, a, x)
    prims = {n.prim for n in g.nodes}
    assert {"cholesky", "eigh", "qr", "svd", "lu", "triangular_solve", "fft", "lgamma",
            "digamma", "erfc", "igamma", "sinh", "while", "reduce"} <= prims
    report = check_graph(g, *_meshes(shape))
    assert report.failures == (), str(report)
    assert report.checked > 40


def test_a_convolutions_flops_are_its_multiply_adds_in_every_direction():
    """The cost model prices a convolution as the contraction it is: 2 x output elements x the
    kernel's input features (of its group) x window, forward and in both gradients (XLA's own
    count for the SAME-padded forward and standard gradients is within 10%: it skips the
    padding), and a depthwise one by its group's single input feature."""
    from autopar.strategies.cost_model import flops

    def conv(x, w, groups=1):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=groups,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (y ** 2).sum()

    x, w = jnp.ones((8, 16, 16, 32)), jnp.ones((3, 3, 32, 64))
    hand = 2 * 8 * 16 * 16 * 64 * (3 * 3 * 32)
    for fn, n in ((conv, 1), (jax.grad(conv, argnums=(0, 1)), 3)):
        got = [flops(node) for node in trace(fn, x, w).nodes
               if node.prim == "conv_general_dilated"]
        assert got == [hand] * n
        xla = jax.jit(fn).lower(x, w).compile().cost_analysis()
        xla = (xla[0] if isinstance(xla, list) else xla)["flops"]
        assert 0.9 < xla / sum(got) < 1.0
    dw = jnp.ones((3, 3, 1, 32))
    depthwise = jax.grad(lambda x, w: conv(x, w, groups=32), argnums=(0, 1))
    got = [flops(node) for node in trace(depthwise, x, dw).nodes
           if node.prim == "conv_general_dilated"]
    assert got == [2 * 8 * 16 * 16 * 32 * 9] * 3
