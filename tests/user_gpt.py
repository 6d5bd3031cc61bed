"""A GPT written the way users write one, not the way autopar's own tests do.

In: nothing. Out: ``init(layers, d, vocab)`` parameters (a dict holding a *list* of blocks,
separate query/key/value projections), ``step(params, batch)`` an SGD training step,
``megatron(params, axis)`` Megatron-LM's tensor-parallel split of those parameters over a
mesh axis as an ``in_strategy`` entry (column-parallel q/k/v and fc1, row-parallel out and fc2), and
``batch(B, T, vocab)``; ``loss(..., remat=True)`` wraps each block in ``jax.checkpoint``. The layer norm computes ``x - mean`` twice, as most hand-written ones
do, and the LM head is tied to the embedding. Its attention scale is a Python float: a NumPy
one (``np.sqrt(hd)``) would turn a bf16 model's activations into float32 from there on.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np


def layer_norm(x, g, b, eps=1e-5):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) / jnp.sqrt(v + eps) * g + b


def block(x, p, heads):
    B, T, D = x.shape
    hd = D // heads
    h = layer_norm(x, p["ln1_g"], p["ln1_b"])

    def split_heads(w):
        return (h @ p[w]).reshape(B, T, heads, hd).transpose(0, 2, 1, 3)

    q, k, v = split_heads("wq"), split_heads("wk"), split_heads("wv")
    att = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(hd)   # a Python float keeps bf16
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -1e9)
    y = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(att, -1), v)
    x = x + y.transpose(0, 2, 1, 3).reshape(B, T, D) @ p["wo"] + p["bo"]
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss(params, batch, heads=4, remat=False):
    """``remat``: recompute each block in the backward pass (``jax.checkpoint``), as large
    models are trained, instead of keeping its activations."""
    tokens, labels = batch
    x = params["wte"][tokens]
    run = jax.checkpoint(block, static_argnums=(2,)) if remat else block
    for blk in params["blocks"]:
        x = run(x, blk, heads)
    logits = layer_norm(x, params["lnf_g"], params["lnf_b"]) @ params["wte"].T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


def step(params, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def init(layers=2, d=64, vocab=128, seed=0):
    r = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(r.normal(0, 0.02, s), jnp.float32)
    ones, zeros = jnp.ones(d), jnp.zeros(d)

    def blk():
        return {"ln1_g": ones, "ln1_b": zeros, "wq": w(d, d), "wk": w(d, d), "wv": w(d, d),
                "wo": w(d, d), "bo": zeros, "ln2_g": ones, "ln2_b": zeros,
                "w1": w(d, 4 * d), "b1": jnp.zeros(4 * d), "w2": w(4 * d, d), "b2": zeros}
    return {"wte": w(vocab, d), "lnf_g": ones, "lnf_b": zeros,
            "blocks": [blk() for _ in range(layers)]}


def megatron(params, axis):
    """Megatron's splits over mesh axis ``axis``, as layouts (column-parallel q, k, v, fc1)."""
    col, row = f"[_,{axis}]", f"[{axis},_]"
    split = dict(wq=col, wk=col, wv=col, wo=row, w1=col, b1=f"[{axis}]", w2=row)
    return {"wte": None, "lnf_g": None, "lnf_b": None,
            "blocks": [{k: split.get(k) for k in b} for b in params["blocks"]]}


def batch(B=8, T=16, vocab=128, seed=1):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.integers(0, vocab, (B, T)), jnp.int32),
            jnp.asarray(r.integers(0, vocab, (B, T)), jnp.int32))
