"""A Mixture-of-Experts layer (GShard-style top-1 routing) whose auto_parallel plan is expert
parallel: the experts' weights are split over the devices and the tokens travel to their
expert and back by all-to-all.

Run: python examples/moe.py. The batch is split over the devices (MindSpore's default
``dataset_strategy="data_parallel"``); the search weighs replicating the experts (an all-reduce
of their gradients) against splitting them (all-to-alls of the routed tokens).
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "device_count" not in _flags:              # 4 fake CPU devices for JAX, beside any flags set
    os.environ["XLA_FLAGS"] = _flags + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax                      # noqa: E402
import jax.numpy as jnp         # noqa: E402
import numpy as np              # noqa: E402

import autopar as ap            # noqa: E402

G, S, D, H, E, C = 4, 32, 64, 512, 4, 16   # token groups, tokens per group, model width,
                                           # expert hidden width, experts, expert capacity


def init(seed=0):
    r = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(r.normal(0, s[-2] ** -0.5, s), jnp.float32)
    return {"router": w(D, E), "w_in": w(E, D, H), "w_out": w(E, H, D)}


def moe(params, x):
    """x [G, S, D] -> [G, S, D]: each token goes to its top expert (up to C per group)."""
    probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, params["router"]), axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(probs, axis=-1), E, dtype=x.dtype)      # [G, S, E]
    slot = jnp.cumsum(onehot, axis=1) * onehot - 1.0        # the token's place in its expert
    dispatch = onehot[..., None] * jax.nn.one_hot(slot, C, dtype=x.dtype)     # [G, S, E, C]
    combine = dispatch * jnp.max(probs, axis=-1)[..., None, None]
    xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)          # tokens to their experts
    h = jax.nn.gelu(jnp.einsum("egcd,edh->egch", xe, params["w_in"]))
    ye = jnp.einsum("egch,ehd->egcd", h, params["w_out"])
    return jnp.einsum("gsec,egcd->gsd", combine, ye)        # and back to their places


def step(params, batch):
    x, y = batch
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((moe(p, x) - y) ** 2))(params)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def main():
    r = np.random.default_rng(1)
    params = init()
    batch = tuple(jnp.asarray(r.normal(size=(G, S, D)), jnp.float32) for _ in range(2))
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, search_mode="ilp",
                            dataset_strategy="data_parallel", search_time=20)
    compiled = ap.compile(step, params, batch, config=cfg)
    loss, new = compiled(params, batch)
    ref_loss, ref = jax.jit(step)(params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 (loss, new), (ref_loss, ref))
    print(f"loss {float(loss):.6f}, the same as the single-device step\n")
    s = compiled.strategy
    for i in s.inputs:
        expert_parallel = i.name.startswith("w_") and i.layout.dims[0]
        print(f"{i.name:8} {str(i.layout):10} {'experts split: expert parallel' * bool(expert_parallel)}")
    a2a = [c for c in compiled.collectives() if c.kind == "all_to_all"]
    print(f"\n{len(a2a)} all-to-alls move the routed tokens:")
    for c in a2a:
        print(" ", c)
    dp = ap.plan(step, params, batch,
                 config=ap.ParallelConfig(parallel_mode="data_parallel", device_num=4))
    print(f"\nestimated step {s.step_time * 1e6:.0f} us; data parallel (experts replicated): "
          f"{dp.step_time * 1e6:.0f} us")
    assert a2a and all(i.layout.dims[0] for i in s.inputs if i.name.startswith("w_"))


if __name__ == "__main__":
    main()
