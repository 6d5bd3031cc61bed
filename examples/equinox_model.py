"""Equinox: a small sequence classifier (eqx.nn.Embedding, eqx.nn.MultiheadAttention,
eqx.nn.LayerNorm, eqx.nn.MLP) trained with optax's Adam, auto-parallelised over 4 devices.

Run: python examples/equinox_model.py (needs equinox and optax: pip install -e ".[test]").
The step splits the model with ``eqx.partition(model, eqx.is_array)`` into its arrays (the
parameters autopar shards) and the rest, and ``eqx.combine``s them inside the loss, so it is a
pure function of pytrees (parameters, optimizer state, batch). autopar picks every operator's
layout on its own (auto_parallel), runs the step on 4 worker processes of the default native
backend, and each step is checked against the plain single-device step.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx           # noqa: E402
import jax                      # noqa: E402
import jax.numpy as jnp         # noqa: E402
import numpy as np              # noqa: E402
import optax                    # noqa: E402

import autopar as ap            # noqa: E402

VOCAB, D, HEADS, CLASSES, BATCH, SEQ = 32, 32, 4, 4, 8, 8


class Classifier(eqx.Module):
    """Embeds one sequence of tokens, one self-attention block, mean-pools, classifies."""
    embed: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=k1)
        self.norm = eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k2)
        self.mlp = eqx.nn.MLP(D, CLASSES, width_size=2 * D, depth=2, key=k3)

    def __call__(self, tokens):                                # tokens: (SEQ,)
        x = jax.vmap(self.embed)(tokens)
        h = jax.vmap(self.norm)(x)
        x = x + self.attn(h, h, h)
        return self.mlp(x.mean(axis=0))


params, static = eqx.partition(Classifier(jax.random.PRNGKey(0)), eqx.is_array)
optimizer = optax.adam(1e-2)


def loss_fn(params, batch):
    tokens, labels = batch
    logits = jax.vmap(eqx.combine(params, static))(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, eqx.apply_updates(params, updates), opt_state


def main():
    r = np.random.default_rng(0)
    batch = (jnp.asarray(r.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32),
             jnp.asarray(r.integers(0, CLASSES, (BATCH,)), jnp.int32))
    opt_state = optimizer.init(params)

    # dynamic_programming: the graph-elimination search finds Megatron-style tensor parallelism
    # (attention heads and MLP columns/rows split over the 4 devices) with nothing annotated
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4,
                            search_mode="dynamic_programming")
    compiled = ap.compile(step, params, opt_state, batch, config=cfg,
                          batch_argnums=(2,))                  # args: params, optimizer state, batch
    single = jax.jit(step)

    par, ref = (params, opt_state), (params, opt_state)
    for i in range(3):
        loss, *par = compiled(*par, batch)
        ref_loss, *ref = single(*ref, batch)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), par, ref)
        print(f"step {i}: loss {float(loss):.5f} (single device {float(ref_loss):.5f})")
    print("parameters and optimizer state match the single-device step\n")

    # the strategy table's head (mesh, estimated time and memory) and the layouts chosen for
    # the parameters and the batch (the optimizer state, arg1.*, is left out here)
    table = compiled.strategy.table().splitlines()
    end = next(i for i, line in enumerate(table) if line.startswith("operator"))
    print("\n".join(line for line in table[:end] if not line.startswith("arg1.")).rstrip())
    kinds = sorted({c.kind for c in compiled.collectives()})
    print(f"\n{len(compiled.collectives())} collectives ({', '.join(kinds)}), "
          f"{len(compiled.strategy.ops)} operators")


if __name__ == "__main__":
    main()
