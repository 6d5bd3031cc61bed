"""GPT as Megatron-LM trains it, written in JAX: the model and step of its published runs.

In: nothing. Out: ``params(layers, h, vocab, seq)`` the fp32 master weights (``abstract=True``:
``jax.ShapeDtypeStruct``s, nothing allocated), ``adam_state(params)`` Adam's fp32 moments,
``train_step(params, m, v, batch, key, ...)`` one mixed-precision Adam step, ``megatron(params,
axis)`` Megatron's tensor-parallel splits as an ``in_strategy`` entry, ``batch(B, seq, vocab)``.

The model is Megatron-LM's GPTModel as its SC'21 runs configure it (Narayanan et al., 2021;
``megatron/model/transformer.py`` of that release): learned position embeddings, pre-norm
blocks of a fused q/k/v projection with bias, causal softmax attention scaled by
1/sqrt(head dim), dropout on the attention probabilities and after the attention and MLP
outputs (0.1), a GeLU MLP of 4h, a final layer norm, the output layer tied to the word
embedding, cross-entropy in fp32. Mixed precision as Megatron runs it: fp32 master weights
cast to bf16 for the forward and backward (bf16 activations and matmuls; layer norms, softmax
and the loss computed in fp32 inside their kernels), fp32 gradients and Adam moments
(beta 0.9/0.95, eps 1e-8, weight decay 0.1 on the matrices), so the state is 16 bytes per
parameter (weights, two moments, the gradient) plus the bf16 copy. Dropout bits come from
``jax.random`` (threefry) keyed per layer. ``remat``: each block recomputed in the backward
pass (``jax.checkpoint``; Megatron-LM's full activation recomputation in these runs).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

COMPUTE = jnp.bfloat16


def params(layers, h, vocab, seq, abstract=False, seed=0):
    """fp32 master weights: ``wte`` (vocab, h), ``wpe`` (seq, h), a list of blocks, the final
    norm; random normal (0.02) or, with ``abstract``, their shapes only."""
    r = np.random.default_rng(seed)
    if abstract:
        w = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
        ones = zeros = lambda *s: w(*s)
    else:
        w = lambda *s: jnp.asarray(r.normal(0, 0.02, s), jnp.float32)
        ones = lambda *s: jnp.ones(s, jnp.float32)
        zeros = lambda *s: jnp.zeros(s, jnp.float32)

    def block():
        return {"ln1_g": ones(h), "ln1_b": zeros(h), "wqkv": w(h, 3 * h), "bqkv": zeros(3 * h),
                "wo": w(h, h), "bo": zeros(h), "ln2_g": ones(h), "ln2_b": zeros(h),
                "w1": w(h, 4 * h), "b1": zeros(4 * h), "w2": w(4 * h, h), "b2": zeros(h)}
    return {"wte": w(vocab, h), "wpe": w(seq, h), "lnf_g": ones(h), "lnf_b": zeros(h),
            "blocks": [block() for _ in range(layers)]}


def adam_state(p):
    """Adam's first and second moments, fp32, shaped as ``p`` (abstract where ``p`` is)."""
    like = lambda x: (jax.ShapeDtypeStruct(x.shape, jnp.float32)
                      if isinstance(x, jax.ShapeDtypeStruct) else jnp.zeros_like(x))
    return jax.tree.map(like, p), jax.tree.map(like, p)


def batch(B, seq, vocab, abstract=False, seed=1):
    if abstract:
        t = jax.ShapeDtypeStruct((B, seq), jnp.int32)
        return t, t
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.integers(0, vocab, (B, seq)), jnp.int32),
            jnp.asarray(r.integers(0, vocab, (B, seq)), jnp.int32))


def layer_norm(x, g, b, eps=1e-5):
    """In fp32, as Megatron's fused layer norm computes it; bf16 in and out."""
    y = x.astype(jnp.float32)
    m = jnp.mean(y, -1, keepdims=True)
    v = jnp.mean(jnp.square(y - m), -1, keepdims=True)
    return ((y - m) * jax.lax.rsqrt(v + eps) * g + b).astype(x.dtype)


def dropout(x, key, rate):
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def block(x, p, key, heads, rate):
    B, T, D = x.shape
    hd = D // heads
    ka, kh1, kh2 = jax.random.split(key, 3) if key is not None else (None,) * 3
    h = layer_norm(x, p["ln1_g"], p["ln1_b"])
    # Megatron's fused projection holds q, k and v head by head, so a column split is a split
    # of the heads
    qkv = (h @ p["wqkv"] + p["bqkv"]).reshape(B, T, heads, 3, hd)
    q, k, v = (qkv[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * jnp.asarray(1 / math.sqrt(hd), x.dtype)
    causal = jnp.tril(jnp.ones((T, T), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -10000.0)
    probs = dropout(jax.nn.softmax(scores, -1).astype(x.dtype), ka, rate)
    y = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3).reshape(B, T, D)
    x = x + dropout(y @ p["wo"] + p["bo"], kh1, rate)
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    return x + dropout(jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], kh2, rate)


def loss(p16, tokens, labels, key, heads, rate=0.1, remat=True):
    """Mean token cross-entropy (fp32) of the bf16 weights ``p16``."""
    x = p16["wte"][tokens] + p16["wpe"][: tokens.shape[1]]
    run = jax.checkpoint(block, static_argnums=(3, 4)) if remat else block
    for i, blk in enumerate(p16["blocks"]):
        x = run(x, blk, None if key is None else jax.random.fold_in(key, i), heads, rate)
    x = layer_norm(x, p16["lnf_g"], p16["lnf_b"])
    logits = (x @ p16["wte"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


def train_step(master, m, v, batch, key, heads, lr=1e-4, rate=0.1, remat=True,
               b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    """One mixed-precision Adam step: the loss and the new master weights and moments."""
    tokens, labels = batch
    p16 = jax.tree.map(lambda w: w.astype(COMPUTE), master)
    value, g16 = jax.value_and_grad(functools.partial(
        loss, heads=heads, rate=rate, remat=remat))(p16, tokens, labels, key)
    g = jax.tree.map(lambda x: x.astype(jnp.float32), g16)
    m = jax.tree.map(lambda m_, g_: b1 * m_ + (1 - b1) * g_, m, g)
    v = jax.tree.map(lambda v_, g_: b2 * v_ + (1 - b2) * g_ * g_, v, g)
    decay = lambda w: wd if w.ndim == 2 else 0.0
    master = jax.tree.map(lambda w, m_, v_: w - lr * (m_ / (jnp.sqrt(v_) + eps) + decay(w) * w),
                          master, m, v)
    return value, master, m, v


def megatron(p, axis):
    """Megatron's tensor-parallel splits over mesh axis ``axis`` as layouts: the q/k/v and fc1
    weights and biases column-parallel, the output and fc2 weights row-parallel, the word
    embedding (and so the tied output layer) split over the vocabulary."""
    col, row, vec = f"[_,{axis}]", f"[{axis},_]", f"[{axis}]"
    split = dict(wqkv=col, bqkv=vec, wo=row, w1=col, b1=vec, w2=row)
    return {"wte": row, "wpe": None, "lnf_g": None, "lnf_b": None,
            "blocks": [{k: split.get(k) for k in b} for b in p["blocks"]]}
