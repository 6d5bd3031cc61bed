import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import optax

BATCH, SEQ, D, H, E, CLASSES = 8, 64, 256, 1024, 4, 16
N = BATCH * SEQ
CAP = int(1.25 * N / E)

def init(key):
    k = jax.random.split(key, 6)
    s = lambda fan: 1.0 / np.sqrt(fan)
    return {
        "w_in": jax.random.normal(k[0], (D, D)) * s(D),
        "router": jax.random.normal(k[1], (D, E)) * s(D),
        "w1": jax.random.normal(k[2], (E, D, H)) * s(D),
        "b1": jnp.zeros((E, H)),
        "w2": jax.random.normal(k[3], (E, H, D)) * s(H),
        "w_out": jax.random.normal(k[4], (D, CLASSES)) * s(D),
    }

def moe_block(p, x):                      # x: (N, D)
    logits = x @ p["router"]              # (N, E)
    probs = jax.nn.softmax(logits, axis=-1)
    idx = jnp.argmax(probs, axis=-1)      # top-1 expert
    gate = jnp.take_along_axis(probs, idx[:, None], axis=-1)[:, 0]
    onehot = jax.nn.one_hot(idx, E, dtype=x.dtype)             # (N, E)
    pos = (jnp.cumsum(onehot, axis=0) - 1.0) * onehot          # position in its expert's buffer
    keep = onehot * (pos < CAP)
    dispatch = keep[:, :, None] * jax.nn.one_hot(pos, CAP, dtype=x.dtype)  # (N, E, C)
    combine = dispatch * gate[:, None, None]
    xe = jnp.einsum("nec,nd->ecd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("ecd,edh->ech", xe, p["w1"]) + p["b1"][:, None, :])
    ye = jnp.einsum("ech,ehd->ecd", h, p["w2"])
    y = jnp.einsum("nec,ecd->nd", combine, ye)
    # switch-transformer load balancing loss
    aux = E * jnp.sum(onehot.mean(0) * probs.mean(0))
    return y, aux

def loss_fn(p, batch):
    x, labels = batch                     # x: (B, T, D)
    h = jnp.tanh(x.reshape(N, D) @ p["w_in"])
    y, aux = moe_block(p, h)
    h = h + y
    logits = h @ p["w_out"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels.reshape(N)).mean()
    return ce + 0.01 * aux

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
    bench("m4_moe", step, params, opt_state, batch, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
