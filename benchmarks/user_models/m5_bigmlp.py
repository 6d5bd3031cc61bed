import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import optax

IN, HID, OUT, BATCH = 512, 4096, 10, 8
dims = [IN, HID, HID, HID, OUT]

def init(key):
    ks = jax.random.split(key, len(dims) - 1)
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
            for k, a, b in zip(ks, dims[:-1], dims[1:])]

def loss_fn(params, batch):
    x, y = batch
    for l in params[:-1]:
        x = jax.nn.relu(x @ l["w"] + l["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

OPT = sys.argv[2] if len(sys.argv) > 2 else "adam"
opt = optax.adam(1e-4) if OPT == "adam" else optax.sgd(1e-2)
params = init(jax.random.PRNGKey(0))
opt_state = opt.init(params)
rng = np.random.default_rng(0)
batch = (jnp.asarray(rng.normal(size=(BATCH, IN)), jnp.float32), jnp.asarray(rng.integers(0, OUT, (BATCH,)), jnp.int32))

def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state

if __name__ == "__main__":
    bench(f"m5_bigmlp_{OPT}", step, params, opt_state, batch, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
