"""A top-1 MoE layer written the way small public MoE ports write it: every expert runs on every
token and each token's own expert output is picked out by fancy indexing,
``eo[idx, arange(B)[:, None], arange(T)]`` (a batch-aligned gather, and a scatter-add in the
backward pass), scaled by the router's probability; an embedding MLP before it and a classifier
after. ``python benchmarks/user_models/m6_nano_moe.py [ROUNDS]``."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import optax

BATCH, SEQ, D, H, E, CLASSES = 8, 64, 256, 512, 4, 16


def init(key):
    k = jax.random.split(key, 5)
    s = lambda fan: 1.0 / np.sqrt(fan)
    return {"w_in": jax.random.normal(k[0], (D, D)) * s(D),
            "router": jax.random.normal(k[1], (D, E)) * s(D),
            "w1": jax.random.normal(k[2], (E, D, H)) * s(D),
            "w2": jax.random.normal(k[3], (E, H, D)) * s(H),
            "w_out": jax.random.normal(k[4], (D, CLASSES)) * s(D)}


def moe(p, x):                                   # x: (B, T, D)
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    idx = jnp.argmax(probs, axis=-1)             # (B, T)
    h = jax.nn.gelu(jnp.einsum("btd,edh->ebth", x, p["w1"]))
    eo = jnp.einsum("ebth,ehd->ebtd", h, p["w2"])
    b, t = jnp.arange(BATCH)[:, None], jnp.arange(SEQ)[None, :]
    return eo[idx, b, t] * jnp.max(probs, axis=-1, keepdims=True)


def loss_fn(p, batch):
    x, labels = batch
    h = jnp.tanh(x @ p["w_in"])
    h = h + moe(p, h)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w_out"], labels).mean()


params = init(jax.random.PRNGKey(0))
opt = optax.adam(1e-3)
opt_state = opt.init(params)
rng = np.random.default_rng(0)
batch = (jnp.asarray(rng.normal(size=(BATCH, SEQ, D)), jnp.float32),
         jnp.asarray(rng.integers(0, CLASSES, (BATCH, SEQ)), jnp.int32))


def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


if __name__ == "__main__":
    bench("m6_nano_moe", step, params, opt_state, batch,
          rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
