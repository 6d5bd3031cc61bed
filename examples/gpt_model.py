"""A small GPT written in plain JAX, shared by the GPT examples; run it alone to train it on one
device for a few steps.

In: sizes. Out: ``init(...)`` parameters, ``batch(...)`` random token/label arrays,
``loss(params, batch)`` (token embedding, learned positions, pre-LayerNorm blocks with causal
multi-head attention and a GELU MLP, a tied LM head, softmax cross-entropy) and
``sgd_step(params, batch)``. ``stages`` > 0 wraps the blocks in ``ap.pipeline_stage`` evenly.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import autopar as ap


def init(vocab=128, seq=16, d=64, layers=2, seed=0, abstract=False):
    """Parameters; ``abstract=True`` gives shapes only (``jax.ShapeDtypeStruct``), for planning
    a model without allocating it."""
    r = np.random.default_rng(seed)
    w = (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)) if abstract else (
        lambda *s: jnp.asarray(r.normal(0, 0.02, s), jnp.float32))
    one = (lambda n: jax.ShapeDtypeStruct((n,), jnp.float32)) if abstract else jnp.ones
    zero = (lambda n: jax.ShapeDtypeStruct((n,), jnp.float32)) if abstract else jnp.zeros
    p = {"wte": w(vocab, d), "wpe": w(seq, d), "lnf_g": one(d), "lnf_b": zero(d)}
    for i in range(layers):
        p[f"h{i}"] = {"ln1_g": one(d), "ln1_b": zero(d), "wqkv": w(d, 3 * d), "bqkv": zero(3 * d),
                      "wo": w(d, d), "bo": zero(d), "ln2_g": one(d), "ln2_b": zero(d),
                      "w1": w(d, 4 * d), "b1": zero(4 * d), "w2": w(4 * d, d), "b2": zero(d)}
    return p


def batch(size=8, seq=16, vocab=128, seed=1, abstract=False):
    if abstract:
        return (jax.ShapeDtypeStruct((size, seq), jnp.int32),) * 2
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.integers(0, vocab, (size, seq)), jnp.int32) for _ in range(2))


def _norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _attention(x, blk, heads):
    B, T, D = x.shape
    q, k, v = jnp.split(x @ blk["wqkv"] + blk["bqkv"], 3, axis=-1)
    split = lambda t: t.reshape(B, T, heads, D // heads).transpose(0, 2, 1, 3)
    att = (split(q) @ split(k).transpose(0, 1, 3, 2)) * (D // heads) ** -0.5
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -1e9), axis=-1)
    return (att @ split(v)).transpose(0, 2, 1, 3).reshape(B, T, D) @ blk["wo"] + blk["bo"]


def loss(params, batch, heads=4, stages=0):
    tokens, labels = batch
    x = params["wte"][tokens] + params["wpe"][:tokens.shape[1]]
    blocks = sorted((k for k in params if k.startswith("h")), key=lambda k: int(k[1:]))
    for i, name in enumerate(blocks):
        blk = params[name]
        with ap.pipeline_stage(i * stages // len(blocks)) if stages else contextlib.nullcontext():
            x = x + _attention(_norm(x, blk["ln1_g"], blk["ln1_b"]), blk, heads)
            h = _norm(x, blk["ln2_g"], blk["ln2_b"])
            x = x + jax.nn.gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"]
    logits = _norm(x, params["lnf_g"], params["lnf_b"]) @ params["wte"].T     # tied head
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def sgd_step(params, batch, lr=0.1):
    value, grads = jax.value_and_grad(loss)(params, batch)
    return value, jax.tree.map(lambda p, g: p - lr * g, params, grads)


def check_same(got, want, what):
    """Assert two result pytrees agree to float32 rounding, and say so."""
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6), got, want)
    print(f"{what}: loss {float(got[0]):.6f}, the same as the single-device step")


if __name__ == "__main__":
    params, data = init(), batch()
    step = jax.jit(sgd_step)
    for i in range(5):
        value, params = step(params, data)
        print(f"step {i}: loss {float(value):.4f}")
