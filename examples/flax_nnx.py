"""Flax NNX: a small causal transformer (nnx.Embed, nnx.MultiHeadAttention, nnx.LayerNorm,
nnx.Linear) trained with optax, auto-parallelised over 4 devices.

Run: python examples/flax_nnx.py (needs flax and optax: pip install -e ".[test]"). The training
step is written the functional NNX way: ``graphdef, state = nnx.split(model)`` once, and the
step merges ``state`` back into a module, so it is a pure function of pytrees (parameters,
optimizer state, batch) that autopar can trace. autopar picks every operator's layout on its
own (auto_parallel), runs the step on 4 worker processes of the default native backend, and
each step is checked against the plain single-device step.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax                      # noqa: E402
import jax.numpy as jnp         # noqa: E402
import numpy as np              # noqa: E402
import optax                    # noqa: E402
from flax import nnx            # noqa: E402

import autopar as ap            # noqa: E402

VOCAB, D, HEADS, BATCH, SEQ = 32, 32, 4, 8, 8


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, 4 * D, rngs=rngs)
        self.fc2 = nnx.Linear(4 * D, D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(tokens))
        x = x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


graphdef, state = nnx.split(Transformer(nnx.Rngs(0)))
optimizer = optax.sgd(0.1, momentum=0.9)


def loss_fn(state, batch):
    tokens, labels = batch
    logits = nnx.merge(graphdef, state)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def step(state, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state, batch)
    updates, opt_state = optimizer.update(grads, opt_state, state)
    return loss, optax.apply_updates(state, updates), opt_state


def main():
    r = np.random.default_rng(0)
    tokens = jnp.asarray(r.integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])                  # predict the next token
    opt_state = optimizer.init(state)

    # dynamic_programming: the graph-elimination search finds Megatron-style tensor parallelism
    # (attention heads and MLP columns/rows split over the 4 devices) with nothing annotated
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4,
                            search_mode="dynamic_programming")
    compiled = ap.compile(step, state, opt_state, batch, config=cfg,
                          batch_argnums=(2,))                  # args: params, optimizer state, batch
    single = jax.jit(step)

    par, ref = (state, opt_state), (state, opt_state)
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
