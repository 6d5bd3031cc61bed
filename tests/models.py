"""Small single-device training steps used across the tests and examples.

In: nothing. Out: builders returning ``(step, params, batch)`` where ``step(params, batch)``
is an ordinary JAX training step returning ``(loss, new_params)`` (plus optimizer state for Adam).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

import autopar as ap


def _jit_when_concrete(step):
    """``step`` itself when traced (by autopar or by ``jax.jit``), so every plan sees the same
    operators; called on concrete arrays (the single-device reference the tests compare with)
    it runs compiled as one program, as a user's ``jax.jit(step)`` would, instead of one XLA
    compilation per operator (17 s for the 2-block GPT's step here; 1 s jitted)."""
    compiled = {}

    @functools.wraps(step)
    def run(*args, **kw):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kw))):
            return step(*args, **kw)
        key = tuple(sorted(kw.items()))
        if key not in compiled:
            compiled[key] = jax.jit(functools.partial(step, **kw))
        return compiled[key](*args)
    return run


def _rng(seed):
    return np.random.default_rng(seed)


def sgd(params, grads, lr=0.1):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def adam(params, grads, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-6):
    """Adam. eps is 1e-6, not 1e-8: the attention key bias has a mathematically zero gradient,
    and with a tiny eps Adam would amplify its 1e-10 rounding noise into lr-sized updates that
    differ with any change of summation order (single device or sharded alike)."""
    m, v, t = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    mhat_scale = 1.0 / (1 - b1 ** t)
    vhat_scale = 1.0 / (1 - b2 ** t)
    new = jax.tree.map(
        lambda p, m, v: p - lr * (m * mhat_scale) / (jnp.sqrt(v * vhat_scale) + eps), params, m, v)
    return new, (m, v, t)


# ---------------------------------------------------------------- MLP

def mlp_params(sizes=(16, 32, 16), seed=0, bias=True):
    r = _rng(seed)
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        p[f"w{i + 1}"] = jnp.asarray(r.normal(0, a ** -0.5, (a, b)), jnp.float32)
        if bias:
            p[f"b{i + 1}"] = jnp.asarray(r.normal(0, 0.1, (b,)), jnp.float32)
    return p


def mlp_apply(params, x):
    n = len([k for k in params if k.startswith("w")])
    for i in range(1, n + 1):
        x = x @ params[f"w{i}"]
        if f"b{i}" in params:
            x = x + params[f"b{i}"]
        if i < n:
            x = jax.nn.relu(x)
    return x


def mlp_loss(params, batch):
    x, y = batch
    return jnp.mean((mlp_apply(params, x) - y) ** 2)


@_jit_when_concrete
def mlp_sgd_step(params, batch):
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    return loss, sgd(params, grads)


def mlp_batch(batch=8, sizes=(16, 32, 16), seed=1):
    r = _rng(seed)
    x = jnp.asarray(r.normal(size=(batch, sizes[0])), jnp.float32)
    y = jnp.asarray(r.normal(size=(batch, sizes[-1])), jnp.float32)
    return x, y


@_jit_when_concrete
def mlp_adam_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    new, opt_state = adam(params, grads, opt_state)
    return loss, new, opt_state


def momentum_init(params):
    return jax.tree.map(jnp.zeros_like, params)


@_jit_when_concrete
def mlp_momentum_step(params, velocity, batch, lr=0.1, mu=0.9):
    """SGD with momentum (heavy ball): v <- mu v + g, p <- p - lr v."""
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    velocity = jax.tree.map(lambda v, g: mu * v + g, velocity, grads)
    return loss, jax.tree.map(lambda p, v: p - lr * v, params, velocity), velocity


def adam_init(params):
    z = jax.tree.map(jnp.zeros_like, params)
    return (z, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))


# ---------------------------------------------------------------- GPT block

def gpt_params(vocab=64, seq=8, d=32, heads=4, layers=1, seed=0, abstract=False):
    """GPT parameters; ``abstract=True`` gives jax.ShapeDtypeStructs (nothing allocated)."""
    r = _rng(seed)

    def w(*shape, scale=0.02):
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        return jnp.asarray(r.normal(0, scale, shape), jnp.float32)

    def ones(n):
        return jax.ShapeDtypeStruct((n,), jnp.float32) if abstract else jnp.ones((n,))

    zeros = ones if abstract else (lambda n: jnp.zeros((n,)))
    p = {"wte": w(vocab, d), "wpe": w(seq, d), "lnf_g": ones(d), "lnf_b": zeros(d)}
    for i in range(layers):
        p[f"h{i}"] = {
            "ln1_g": ones(d), "ln1_b": zeros(d),
            "wqkv": w(d, 3 * d), "bqkv": zeros(3 * d),
            "wo": w(d, d), "bo": zeros(d),
            "ln2_g": ones(d), "ln2_b": zeros(d),
            "w1": w(d, 4 * d), "b1": zeros(4 * d),
            "w2": w(4 * d, d), "b2": zeros(d),
        }
    return p


def layer_norm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def attention(x, blk, heads):
    B, T, D = x.shape
    qkv = x @ blk["wqkv"] + blk["bqkv"]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    hd = D // heads
    q = q.reshape(B, T, heads, hd).transpose(0, 2, 1, 3)
    k = k.reshape(B, T, heads, hd).transpose(0, 2, 1, 3)
    v = v.reshape(B, T, heads, hd).transpose(0, 2, 1, 3)
    att = (q @ k.transpose(0, 1, 3, 2)) * (hd ** -0.5)
    mask = jnp.tril(jnp.ones((T, T), bool))
    att = jnp.where(mask, att, -1e9)
    att = jax.nn.softmax(att, axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
    return y @ blk["wo"] + blk["bo"]


def gpt_apply(params, tokens, heads=4, stages=0):
    """``stages`` > 0: the blocks are spread evenly over that many ``ap.pipeline_stage``s."""
    T = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:T]
    names = sorted((k for k in params if k.startswith("h")), key=lambda k: int(k[1:]))
    for i, name in enumerate(names):
        blk = params[name]
        with ap.pipeline_stage(i * stages // len(names)) if stages else contextlib.nullcontext():
            x = x + attention(layer_norm(x, blk["ln1_g"], blk["ln1_b"]), blk, heads)
            h = layer_norm(x, blk["ln2_g"], blk["ln2_b"])
            x = x + (jax.nn.gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"])
    x = layer_norm(x, params["lnf_g"], params["lnf_b"])
    return x @ params["wte"].T                               # tied LM head


def gpt_loss(params, batch, heads=4, stages=0):
    tokens, labels = batch
    logits = gpt_apply(params, tokens, heads, stages)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


@_jit_when_concrete
def gpt_adam_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(gpt_loss)(params, batch)
    new, opt_state = adam(params, grads, opt_state)
    return loss, new, opt_state


@_jit_when_concrete
def gpt_momentum_step(params, velocity, batch, lr=0.1, mu=0.9):
    loss, grads = jax.value_and_grad(gpt_loss)(params, batch)
    velocity = jax.tree.map(lambda v, g: mu * v + g, velocity, grads)
    return loss, jax.tree.map(lambda p, v: p - lr * v, params, velocity), velocity


@_jit_when_concrete
def gpt_pipeline_step(params, batch, stages=2):
    """SGD on a GPT whose blocks are annotated with ``stages`` pipeline stages."""
    loss, grads = jax.value_and_grad(functools.partial(gpt_loss, stages=stages))(params, batch)
    return loss, sgd(params, grads)


@_jit_when_concrete
def gpt_pipeline_adam_step(params, opt_state, batch, stages=2):
    loss, grads = jax.value_and_grad(functools.partial(gpt_loss, stages=stages))(params, batch)
    new, opt_state = adam(params, grads, opt_state)
    return loss, new, opt_state


@_jit_when_concrete
def gpt_sgd_step(params, batch):
    loss, grads = jax.value_and_grad(gpt_loss)(params, batch)
    return loss, sgd(params, grads)


def gpt_batch(batch=4, seq=8, vocab=64, seed=1, abstract=False):
    if abstract:
        return (jax.ShapeDtypeStruct((batch, seq), jnp.int32),) * 2
    r = _rng(seed)
    tokens = jnp.asarray(r.integers(0, vocab, (batch, seq)), jnp.int32)
    labels = jnp.asarray(r.integers(0, vocab, (batch, seq)), jnp.int32)
    return tokens, labels
