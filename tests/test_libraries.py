"""Models written with Flax NNX and Equinox, trained with optax, compile in every parallel mode
and give the single-device step's values.

Both libraries are used the functional way autopar compiles: the step is a pure function of
pytrees. Flax NNX: ``graphdef, state = nnx.split(model)``, the step merges ``state`` back into a
module inside the loss. Equinox: ``params, static = eqx.partition(model, eqx.is_array)``, the
step ``eqx.combine``s them. The parameters are the first argument, the optax state the second,
the batch the third (``batch_argnums=(2,)``).
"""
import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import equinox as eqx           # the test extra installs both (pip install -e ".[test]")
from flax import nnx

import autopar as ap

RTOL, ATOL = 1e-5, 1e-6
B, T, D, HEADS, VOCAB = 8, 8, 16, 4, 32


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=RTOL, atol=ATOL), a, b)


def reference(step, args):
    """The plain single-device step, jitted: executed eagerly, op by op, the NNX step takes 10 s."""
    return jax.jit(step)(*args)


def config(mode, **kw):
    """``mode``: a parallel_mode, or (auto_parallel, search_mode)."""
    if isinstance(mode, tuple):
        mode, kw["search_mode"] = mode
    kw.setdefault("backend", "jax")
    kw.setdefault("device_num", 1 if mode == "stand_alone" else 4)
    return ap.ParallelConfig(parallel_mode=mode, progress=False, **kw)


# ---------------------------------------------------------------- Flax NNX

class NNXTransformer(nnx.Module):
    """Token embedding, one pre-norm causal self-attention + MLP block, a linear head."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, 2 * D, rngs=rngs)
        self.fc2 = nnx.Linear(2 * D, D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(tokens))
        x = x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


def nnx_step(graphdef, opt, tensor_parallel=False):
    """The functional NNX training step; ``tensor_parallel``: the MLP's kernels are annotated
    Megatron-style over mesh axis y (fc1 by columns, fc2 by rows)."""
    def loss_fn(state, batch):
        tokens, labels = batch
        model = nnx.merge(graphdef, state)
        if tensor_parallel:
            model.fc1.kernel.set_value(ap.shard(model.fc1.kernel.get_value(), "[_,y]"))
            model.fc2.kernel.set_value(ap.shard(model.fc2.kernel.get_value(), "[y,_]"))
        logits = model(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(state, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return loss, optax.apply_updates(state, updates), opt_state
    return step


@pytest.fixture(scope="module")
def nnx_case():
    graphdef, state = nnx.split(NNXTransformer(nnx.Rngs(0)))
    # SGD with momentum, not Adam: the attention key bias has a mathematically zero gradient,
    # and Adam turns its rounding noise into lr-sized updates under any change of summation
    # order (the jitted single-device step differs from the eager one as much)
    opt = optax.sgd(0.1, momentum=0.9)
    r = np.random.default_rng(1)
    batch = (jnp.asarray(r.integers(0, VOCAB, (B, T)), jnp.int32),
             jnp.asarray(r.integers(0, VOCAB, (B, T)), jnp.int32))
    args = (state, opt.init(state), batch)
    step = nnx_step(graphdef, opt)
    return graphdef, opt, args, reference(step, args)


def _slow_compute_fast_links(n):
    local = ap.Topology.local(n)
    return dataclasses.replace(local, flops=local.flops / 10, mem_bandwidth=local.mem_bandwidth / 10,
                               levels=tuple(dataclasses.replace(lv, alpha=lv.alpha / 10,
                                                                beta=lv.beta / 10)
                                            for lv in local.levels))


# auto_parallel's default search, and the dynamic programming one, which splits weights
# (attention heads, MLP columns and rows) on its own
AUTO_DP = ("auto_parallel", "dynamic_programming")
MODE_IDS = lambda m: "/".join(m) if isinstance(m, tuple) else m


@pytest.mark.parametrize("mode", ["stand_alone", "data_parallel", "auto_parallel", AUTO_DP],
                         ids=MODE_IDS)
def test_nnx_transformer(nnx_case, mode):
    graphdef, opt, args, want = nnx_case
    step = nnx_step(graphdef, opt)
    # on the local preset this model is small enough that every operator replicated is its
    # cheapest plan (0.3% under splitting weights); with compute 10x slower and links 10x
    # faster, splitting weights pays and the search's own plan is kept
    kw = {"topology": _slow_compute_fast_links(4)} if mode == AUTO_DP else {}
    c = ap.compile(step, *args, config=config(mode, **kw), batch_argnums=(2,))
    assert_same(c(*args), want)
    if mode == AUTO_DP:                                     # some weights are split
        assert any(i.layout.axes for i in c.strategy.inputs if i.is_param)
    if mode == "data_parallel":
        assert {x.kind for x in c.collectives()} == {"all_reduce"}
    if mode == "stand_alone":
        assert c.collectives() == []


def test_nnx_transformer_semi_auto_megatron(nnx_case):
    graphdef, opt, args, want = nnx_case
    step = nnx_step(graphdef, opt, tensor_parallel=True)
    cfg = config("semi_auto_parallel", mesh_shape=(2, 2))
    c = ap.compile(step, *args, config=cfg, batch_argnums=(2,),
                   in_strategy=(None, None, ((2, 1), (2, 1))))     # the batch over x
    assert_same(c(*args), want)
    shards = {str(o.out_layouts[0]) for o in c.strategy.ops if o.prim == "autopar_shard"}
    assert shards == {"[_,y]", "[y,_]"}, shards
    lay = {i.name: str(i.layout) for i in c.strategy.inputs}
    assert lay["arg2.0"] == lay["arg2.1"] == "[x,_]"


@pytest.mark.native
def test_nnx_transformer_native_backend(nnx_case):
    graphdef, opt, args, want = nnx_case
    step = nnx_step(graphdef, opt)
    c = ap.compile(step, *args, config=config("auto_parallel", backend="native", device_num=2),
                   batch_argnums=(2,))
    try:
        assert_same(c(*args), want)
    finally:
        c.close()


# ---------------------------------------------------------------- Equinox

class EqxAttention(eqx.Module):
    """Pre-norm causal self-attention with a residual, then a linear read-out per position,
    on one (T, D) sequence (batched with jax.vmap in the loss)."""
    ln: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.ln = eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
        self.out = eqx.nn.Linear(D, 4, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.ln)(x)
        h = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((x.shape[0],) * 2, bool)))
        return jax.vmap(self.out)(h)


def eqx_step(static, opt):
    def loss_fn(params, batch):
        x, y = batch
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, eqx.apply_updates(params, updates), opt_state
    return step


def _eqx_case(model, x_shape, y_shape):
    params, static = eqx.partition(model, eqx.is_array)
    opt = optax.adam(1e-2)
    r = np.random.default_rng(1)
    batch = (jnp.asarray(r.normal(size=x_shape), jnp.float32),
             jnp.asarray(r.normal(size=y_shape), jnp.float32))
    args = (params, opt.init(params), batch)
    step = eqx_step(static, opt)
    return step, args, reference(step, args)


@pytest.fixture(scope="module")
def eqx_mlp():
    return _eqx_case(eqx.nn.MLP(D, 8, 2 * D, depth=2, key=jax.random.PRNGKey(0)), (B, D), (B, 8))


@pytest.fixture(scope="module")
def eqx_attention():
    return _eqx_case(EqxAttention(jax.random.PRNGKey(0)), (B, T, D), (B, T, 4))


def mlp_in_strategy(params):
    """Megatron over y for the MLP's first two layers: layer 0 by output features (rows of
    eqx's (out, in) weight), layer 1 by input features; everything else unconstrained."""
    spec = jax.tree.map(lambda _: None, params)
    where = lambda p: (p.layers[0].weight, p.layers[0].bias, p.layers[1].weight)
    return eqx.tree_at(where, spec, ("[y,_]", "[y]", "[_,y]"), is_leaf=lambda x: x is None)


@pytest.mark.parametrize("mode", ["stand_alone", "data_parallel", "semi_auto_parallel",
                                  "auto_parallel", AUTO_DP], ids=MODE_IDS)
@pytest.mark.parametrize("case", ["eqx_mlp", "eqx_attention"])
def test_equinox(request, case, mode):
    step, args, want = request.getfixturevalue(case)
    kw, in_strategy = {}, None
    if mode == "semi_auto_parallel":
        kw["mesh_shape"] = (2, 2)
        batch = ((2, 1), (2, 1)) if case == "eqx_mlp" else ((2, 1, 1), (2, 1, 1))
        params = mlp_in_strategy(args[0]) if case == "eqx_mlp" else None
        in_strategy = (params, None, batch)
    c = ap.compile(step, *args, config=config(mode, **kw), batch_argnums=(2,),
                   in_strategy=in_strategy)
    assert_same(c(*args), want)
    lay = {i.name: str(i.layout) for i in c.strategy.inputs}
    if mode == "semi_auto_parallel":
        assert lay["arg2.0"].startswith("[x,")
        if case == "eqx_mlp":
            assert lay["layers.0.weight"] == "[y,_]" and lay["layers.1.weight"] == "[_,y]"
    if mode == "data_parallel":
        assert {x.kind for x in c.collectives()} == {"all_reduce"}


@pytest.mark.native
def test_equinox_native_backend(eqx_attention):
    step, args, want = eqx_attention
    c = ap.compile(step, *args, config=config("auto_parallel", backend="native", device_num=2),
                   batch_argnums=(2,))
    try:
        assert_same(c(*args), want)
    finally:
        c.close()


# ---------------------------------------------------------------- convolutions and pooling

class NNXCNN(nnx.Module):
    """A convolution, a depthwise (grouped) convolution, average and max pooling, a head."""

    def __init__(self, rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), feature_group_count=8, rngs=rngs)
        self.head = nnx.Linear(8 * 2 * 2, 10, rngs=rngs)

    def __call__(self, x):                                   # x: (B, 8, 8, 1)
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


@pytest.fixture(scope="module")
def nnx_cnn():
    graphdef, state = nnx.split(NNXCNN(nnx.Rngs(0)))
    opt = optax.sgd(0.1, momentum=0.9)
    r = np.random.default_rng(1)
    batch = (jnp.asarray(r.normal(size=(B, 8, 8, 1)), jnp.float32),
             jnp.asarray(r.integers(0, 10, (B,)), jnp.int32))
    args = (state, opt.init(state), batch)
    step = nnx_step(graphdef, opt)
    return step, args, reference(step, args)


@pytest.fixture(scope="module")
def eqx_cnn():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    model = eqx.nn.Sequential([eqx.nn.Conv2d(1, 4, 3, key=k1), eqx.nn.Lambda(jax.nn.relu),
                               eqx.nn.MaxPool2d(2, 2), eqx.nn.AvgPool2d(2, 2),
                               eqx.nn.Lambda(jnp.ravel), eqx.nn.Linear(4, 10, key=k2)])
    return _eqx_case(model, (B, 1, 8, 8), (B, 10))   # (1,8,8) -> (4,6,6) -> (4,3,3) -> (4,1,1)


@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
@pytest.mark.parametrize("case", ["nnx_cnn", "eqx_cnn"])
def test_cnn(request, case, mode):
    step, args, want = request.getfixturevalue(case)
    c = ap.compile(step, *args, config=config(mode), batch_argnums=(2,))
    assert_same(c(*args), want)
    convs = [o for o in c.strategy.ops if o.prim == "conv_general_dilated"]
    assert convs
    if mode == "data_parallel":
        assert all(o.out_layouts[0].dims[0] for o in convs if o.out_shapes[0][0] == B)
    else:            # its own choice (an 8-row batch may stay whole), never priced above dp's
        dp = ap.plan(step, *args, config=config("data_parallel"), batch_argnums=(2,))
        assert c.strategy.step_time <= dp.step_time * (1 + 1e-9)


def test_window_rules_compute_the_unsharded_result(nnx_cnn, eqx_cnn):
    """Every candidate of every convolution and pooling node of both CNN steps (forward and
    backward, grouped convolutions included), run sharded on a 2 x 2 mesh."""
    from types import SimpleNamespace

    from autopar.mesh import LogicalMesh
    from autopar.strategies.rule_check import check_graphs
    from autopar.strategies.rules import window
    from autopar.trace import trace
    nodes = [n for step, args, _ in (nnx_cnn, eqx_cnn) for n in trace(step, *args).nodes
             if n.prim in window.RULES]
    assert {n.prim for n in nodes} == set(window.RULES) - {"reduce_window_min"}
    mesh = LogicalMesh.create((2, 2))
    jm = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), mesh.axis_names)
    report = check_graphs([SimpleNamespace(nodes=nodes)], mesh, jm)
    assert report.ok and report.checked > 3 * report.nodes, str(report)


# ---------------------------------------------------------------- hybrid_parallel

@pytest.mark.native
def test_hybrid_parallel_by_hand():
    """Both libraries' models in hybrid_parallel: the per-device step means its loss over the
    devices with ap.comm.all_reduce; JAX's shard_map semantics sum the replicated parameters'
    gradients, so the step is the single-device one (native and JAX backends)."""
    params, static = eqx.partition(eqx.nn.MLP(D, 8, 2 * D, depth=2, key=jax.random.PRNGKey(0)),
                                   eqx.is_array)
    graphdef, state = nnx.split(NNXTransformer(nnx.Rngs(0)))
    r = np.random.default_rng(1)
    eqx_batch = (jnp.asarray(r.normal(size=(B, D)), jnp.float32),
                 jnp.asarray(r.normal(size=(B, 8)), jnp.float32))
    nnx_batch = (jnp.asarray(r.integers(0, VOCAB, (B, T)), jnp.int32),
                 jnp.asarray(r.integers(0, VOCAB, (B, T)), jnp.int32))

    def eqx_loss(p, batch):
        x, y = batch
        return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

    def nnx_loss(s, batch):
        tokens, labels = batch
        logits = nnx.merge(graphdef, s)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    for loss_fn, p, batch, backend in ((eqx_loss, params, eqx_batch, "native"),
                                       (nnx_loss, state, nnx_batch, "jax")):
        def single(p, batch):
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            return loss, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

        def per_device(p, batch):
            mean = lambda q: ap.comm.all_reduce(loss_fn(q, batch), "x") / 4
            loss, g = jax.value_and_grad(mean)(p)
            return loss, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

        c = ap.compile(per_device, p, batch, config=config("hybrid_parallel", backend=backend))
        assert_same(c(p, batch), reference(single, (p, batch)))
        assert {x.kind for x in c.collectives()} == {"all_reduce"}
