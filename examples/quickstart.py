"""Quick start: a 2-layer MLP training step on a 2 x 4 mesh of CPU devices: data parallel over
the mesh's x axis, Megatron-style tensor parallel over its y axis.

Run: python examples/quickstart.py. It compiles the plain single-device step with two
``ap.shard`` annotations and a batch split, checks the sharded result against the single-device
one, and prints the chosen strategy and the collectives autopar inserted.
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "device_count" not in _flags:              # 8 fake CPU devices for JAX, beside any flags set
    os.environ["XLA_FLAGS"] = _flags + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax                      # noqa: E402
import jax.numpy as jnp         # noqa: E402
import numpy as np              # noqa: E402

import autopar as ap            # noqa: E402


def loss_fn(params, batch):
    x, y = batch
    h = jax.nn.relu(x @ ap.shard(params["w1"], (1, 4)) + params["b1"])   # column parallel
    out = h @ ap.shard(params["w2"], (4, 1)) + params["b2"]               # row parallel
    return jnp.mean((out - y) ** 2)


def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def inputs():
    """Parameters and a batch of 16 rows."""
    r = np.random.default_rng(0)
    params = {"w1": r.normal(0, 0.2, (32, 64)), "b1": np.zeros(64),
              "w2": r.normal(0, 0.2, (64, 32)), "b2": np.zeros(32)}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    batch = (jnp.asarray(r.normal(size=(16, 32)), jnp.float32),
             jnp.asarray(r.normal(size=(16, 32)), jnp.float32))
    return params, batch


# the batch is split over x (data parallel), the weights over y (tensor parallel)
IN_STRATEGY = (None, ((2, 1), (2, 1)))


def main():
    params, batch = inputs()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4))
    compiled = ap.compile(step, params, batch, config=cfg, in_strategy=IN_STRATEGY)
    loss, new_params = compiled(params, batch)

    ref_loss, ref_params = jax.jit(step)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 new_params, ref_params)
    print(f"loss {float(loss):.6f} (single device {float(ref_loss):.6f}): parameters match\n")
    print(compiled.strategy.table())
    print("\ncollectives:")
    for c in compiled.collectives():
        print(" ", c)


if __name__ == "__main__":
    main()
