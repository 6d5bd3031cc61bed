"""Plan defects public models found, each on a model written as its authors write it: the
collectives the plan runs (kinds and bytes) and the layouts it keeps state in.

- Flax's lm1b example (``examples/lm1b``: ``models.MlpBlock`` with ``nn.Dropout``, its
  ``train_step`` folding the dropout key with ``state.step`` and calling
  ``state.apply_gradients`` of a ``TrainState`` holding ``optax.adamw``), Megatron-annotated
  in semi_auto_parallel: the Adam moments stay split as their weights, nothing is gathered.
- A Nano-MoE's per-token expert choice, ``eo[idx, jnp.arange(B)[:, None], jnp.arange(T)]``, in
  data_parallel: the gather and its backward scatter-add keep the batch split
  (``autopar.index_batching``); nothing but the gradients is reduced.
- Flax's imagenet ResNet stem (conv, BatchNorm with batch statistics, relu, max-pool) and a
  residual block, ``TrainState`` with ``batch_stats`` and SGD momentum, in data_parallel: each
  gradient is all-reduced once, at its size, and the BatchNorm statistics over the batch.
"""
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import autopar as ap
from autopar.index_batching import iota_dim
from autopar.trace import trace


class MlpBlock(nn.Module):
    """lm1b's ``MlpBlock``: Dense, relu, Dropout, Dense, Dropout."""
    mlp_dim: int
    dropout_rate: float = 0.1
    deterministic: bool = False

    @nn.compact
    def __call__(self, inputs):
        x = nn.relu(nn.Dense(self.mlp_dim)(inputs))
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=self.deterministic)
        out = nn.Dense(inputs.shape[-1])(x)
        return nn.Dropout(rate=self.dropout_rate)(out, deterministic=self.deterministic)


class TinyLM(nn.Module):
    """lm1b's decoder reduced to one pre-norm MLP block: shared embedding, tied logits."""
    vocab: int = 64
    emb: int = 32
    mlp_dim: int = 128

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.emb)
        x = embed(tokens)
        x = x + MlpBlock(self.mlp_dim)(nn.LayerNorm()(x))
        return embed.attend(nn.LayerNorm()(x))


def lm1b_train_step(state, batch, dropout_rng):
    """As lm1b's ``train.train_step`` writes it (without label smoothing and weights)."""
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"],
                                rngs={"dropout": dropout_rng})
        onehot = jax.nn.one_hot(batch["targets"], logits.shape[-1])
        return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.fixture(scope="module")
def lm1b():
    model = TinyLM()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 16)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adamw(1e-3))
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    megatron = jax.tree.map(lambda _: None, params)
    megatron["MlpBlock_0"]["Dense_0"] = {"kernel": P(None, "y"), "bias": P("y")}
    megatron["MlpBlock_0"]["Dense_1"] = {"kernel": P("y", None), "bias": None}
    in_strategy = (state.replace(step=None, params=megatron, opt_state=None), None, None)
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=4, mesh_shape=(2, 2),
                            dataset_strategy=(P("x", None), P("x", None)))
    return (state, batch, jax.random.PRNGKey(1)), cfg, in_strategy


def test_lm1b_dropout_keeps_adam_moments_split_as_their_weights(lm1b):
    """The defect: with dropout in the step, propagation priced every new moment as returned
    whole (a gather it never runs: new state stays on the devices in its argument's layout),
    so Dense_0's moments were stored replicated, its gradient all-gathered every step and the
    moment updates run whole on every device."""
    args, cfg, in_strategy = lm1b
    st = ap.plan(lm1b_train_step, *args, config=cfg, in_strategy=in_strategy,
                 batch_argnums=(1,))
    layout = {i.name: str(i.layout) for i in st.inputs}
    for name, lay in layout.items():
        if name.startswith("params."):
            path = name[len("params."):]
            for moment in ("mu", "nu"):
                assert layout[f"opt_state.0.{moment}.{path}"] == lay, (moment, path)
    assert layout["params.MlpBlock_0.Dense_0.kernel"] == "[_,y]"
    # only all-reduces: each gradient once over the batch axis at its local size (the Megatron
    # weights' halves: 25,472 bytes in all), Megatron's two activation reductions of the
    # row-parallel matmul (forward and backward, (4, 16, 32) float32 each) and the loss
    assert {c.kind for c in st.collectives} == {"all_reduce"}
    local_params = sum(
        int(np.prod(i.shape)) * 4 // (2 if i.layout != ap.Layout.replicated(len(i.shape)) else 1)
        for i in st.inputs if i.name.startswith("params."))
    assert local_params == 25_472
    assert sum(c.bytes for c in st.collectives) == local_params + 2 * 4 * 16 * 32 * 4 + 4


def test_lm1b_semi_auto_runs_to_the_single_device_values(lm1b):
    args, cfg, in_strategy = lm1b
    compiled = ap.compile(lm1b_train_step, *args, config=cfg.replace(backend="jax"),
                          in_strategy=in_strategy, batch_argnums=(1,))
    new_state, loss = compiled(*args)
    ref_state, ref_loss = jax.jit(lm1b_train_step)(*args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 (new_state.params, new_state.opt_state), (ref_state.params, ref_state.opt_state))


E, B, T, D = 4, 8, 16, 32


def moe_step(p, x, y):
    """Top-1 routing as Nano-MoE writes it: every expert on every token, each token's choice
    picked out by fancy indexing, scaled by its gate probability."""
    def loss(p):
        logits = x @ p["gate"]
        idx = jnp.argmax(logits, -1)
        eo = jnp.einsum("btd,edh->ebth", x, p["experts"])
        b, t = jnp.arange(B)[:, None], jnp.arange(T)[None, :]
        out = eo[idx, b, t] * jax.nn.softmax(logits, -1).max(-1, keepdims=True)
        return jnp.mean((out - y) ** 2)
    value, g = jax.value_and_grad(loss)(p)
    return value, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


@pytest.fixture(scope="module")
def moe():
    r = np.random.default_rng(0)
    p = {"gate": jnp.asarray(r.normal(size=(D, E)), jnp.float32),
         "experts": jnp.asarray(r.normal(size=(E, D, D)) * .1, jnp.float32)}
    return (p, jnp.asarray(r.normal(size=(B, T, D)), jnp.float32),
            jnp.asarray(r.normal(size=(B, T, D)), jnp.float32))


def test_batch_aligned_expert_gather_keeps_the_batch_split(moe):
    """The defect: the gather read the expert outputs whole (a 64 KB all-gather of them, and of
    the indices) and the backward scatter-add ran whole on every device."""
    st = ap.plan(moe_step, *moe, config=ap.ParallelConfig(parallel_mode="data_parallel",
                                                          device_num=4))
    ops = {o.prim: o for o in st.ops if o.prim in ("gather", "scatter-add")}
    assert [str(l) for l in ops["gather"].in_layouts] == ["[_,x,_,_]", "[x,_,_]"]
    assert str(ops["scatter-add"].out_layouts[0]) == "[_,x,_,_]"
    assert {c.kind for c in st.collectives} == {"all_reduce"}
    grads = 4 * (D * E + E * D * D)
    assert sum(c.bytes for c in st.collectives) == grads + 4       # and the loss


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
def test_batch_aligned_expert_gather_runs_to_the_single_device_values(moe, backend):
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend=backend)
    got = ap.compile(moe_step, *moe, config=cfg)(*moe)
    ref = jax.jit(moe_step)(*moe)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6), got, ref)


def test_only_proved_positions_become_batching_dimensions():
    """A column is batched only where it equals the position along one index dimension: a
    reversed or offset arange, or one of another length, stays an index."""
    def gathers(index):
        g = trace(lambda eo, idx: eo[idx, index(), jnp.arange(T)[None, :]],
                  jax.ShapeDtypeStruct((E, B, T, D), jnp.float32),
                  jax.ShapeDtypeStruct((B, T), jnp.int32))
        (node,) = [n for n in g.nodes if n.prim == "gather"]
        return node.params["dimension_numbers"].operand_batching_dims
    assert gathers(lambda: jnp.arange(B)[:, None]) == (1, 2)
    assert gathers(lambda: np.arange(B)[:, None]) == (1, 2)         # a NumPy constant
    assert gathers(lambda: jnp.arange(B)[::-1, None]) == (2,)
    assert gathers(lambda: np.arange(B)[::-1, None]) == (2,)
    assert gathers(lambda: jnp.arange(B)[:, None] + 1) == (2,)
    assert gathers(lambda: jnp.arange(B)[:, None] % 4) == (2,)
    g = trace(lambda n: jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)) + n,
              jax.ShapeDtypeStruct((), jnp.int32))
    made = {v.id: n for n in g.nodes for v in n.outputs}
    bcast = [n for n in g.nodes if n.prim == "broadcast_in_dim"][-1]
    assert iota_dim(bcast.outputs[0], made) == 0
    assert iota_dim(g.outputs[0], made) is None


class ResNetStem(nn.Module):
    """The first layers of Flax's imagenet ``ResNet`` (``models.py``) and one ``ResNetBlock``."""
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train=True):
        conv = functools.partial(nn.Conv, use_bias=False)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5)
        x = conv(16, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        y = nn.relu(norm()(conv(16, (3, 3))(x)))
        y = norm(scale_init=nn.initializers.zeros)(conv(16, (3, 3))(y))
        x = nn.relu(x + y)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class BNTrainState(train_state.TrainState):
    batch_stats: Any


def imagenet_train_step(state, batch):
    """As the imagenet example's ``train_step`` writes it (weight decay, no learning-rate
    schedule, no pmean: data_parallel averages the gradients)."""
    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"],
            mutable=["batch_stats"])
        loss = jnp.mean(optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["label"], 10)))
        weight_l2 = sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1)
        return loss + 0.0001 * 0.5 * weight_l2, new_model_state
    (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads,
                                 batch_stats=new_model_state["batch_stats"]), loss


def test_resnet_stem_data_parallel_reduces_each_gradient_once():
    model = ResNetStem()
    r = np.random.default_rng(0)
    image = jnp.asarray(r.normal(size=(8, 32, 32, 3)), jnp.float32)
    v = model.init(jax.random.PRNGKey(0), image)
    state = BNTrainState.create(apply_fn=model.apply, params=v["params"],
                                tx=optax.sgd(0.1, 0.9), batch_stats=v["batch_stats"])
    batch = {"image": image, "label": jnp.asarray(r.integers(0, 10, (8,)), jnp.int32)}
    st = ap.plan(imagenet_train_step, state, batch, batch_argnums=(1,),
                 config=ap.ParallelConfig(parallel_mode="data_parallel", device_num=4))
    assert {c.kind for c in st.collectives} == {"all_reduce"}
    params = [i for i in st.inputs if i.name.startswith("params.")]
    assert all(str(i.layout).count("x") == 0 for i in params)
    grads = sum(int(np.prod(i.shape)) * 4 for i in params)
    # three BatchNorms: the batch's mean and mean square forward, one more sum backward (the
    # other two backward sums are the scale's and bias's gradients), 16 channels each
    assert sum(c.bytes for c in st.collectives) == grads + 3 * 3 * 16 * 4 + 4
    assert len(st.collectives) == len(params) + 3 * 3 + 1
