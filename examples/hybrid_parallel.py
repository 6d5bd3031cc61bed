"""hybrid_parallel: the step is written per device and calls autopar's collectives itself
(Megatron's tensor-parallel MLP over y, data parallel over x), and autopar runs it as written.

Run: python examples/hybrid_parallel.py. The arguments are given whole; ``in_strategy`` says
how each is split, and the new parameters come back whole.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax                  # noqa: E402
import jax.numpy as jnp     # noqa: E402
import numpy as np          # noqa: E402

import autopar as ap        # noqa: E402


def per_device_step(params, batch):
    x, y = batch                                    # this device's rows

    def loss_fn(p):                                 # p["w1"]: columns, p["w2"]: rows of this y
        h = jax.nn.relu(x @ p["w1"])
        out = ap.comm.all_reduce(h @ p["w2"], "y")  # sum the row-parallel partial products
        return ap.comm.all_reduce(jnp.mean((out - y) ** 2), "x") / 2   # mean over the 2 x rows
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def single_device_step(params, batch):
    x, y = batch
    loss_fn = lambda p: jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def main():
    r = np.random.default_rng(0)
    params = {"w1": jnp.asarray(r.normal(0, 0.2, (32, 64)), jnp.float32),
              "w2": jnp.asarray(r.normal(0, 0.2, (64, 32)), jnp.float32)}
    batch = tuple(jnp.asarray(r.normal(size=(16, 32)), jnp.float32) for _ in range(2))
    cfg = ap.ParallelConfig(parallel_mode="hybrid_parallel", device_num=4, mesh_shape=(2, 2))
    compiled = ap.compile(per_device_step, params, batch, config=cfg,
                          in_strategy=({"w1": "[_,y]", "w2": "[y,_]"}, "[x,_]"))
    loss, new = compiled(params, batch)
    ref_loss, ref = jax.jit(single_device_step)(params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 (loss, new), (ref_loss, ref))
    print(f"loss {float(loss):.6f} on 4 native ranks, the same as the single-device step")
    print("the step's collectives, as written (the gradient all-reduces come from JAX's "
          "differentiation of the per-device step):")
    for c in compiled.collectives():
        print(" ", c)


if __name__ == "__main__":
    main()
