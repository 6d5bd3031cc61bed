import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import equinox as eqx
import optax

IN, HID, OUT, DEPTH, BATCH = 784, 1024, 10, 4, 128

class DeepMLP(eqx.Module):
    layers: list
    def __init__(self, key):
        keys = jax.random.split(key, DEPTH + 1)
        dims = [IN] + [HID] * DEPTH + [OUT]
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(dims[:-1], dims[1:], keys)]
    def __call__(self, x):
        for l in self.layers[:-1]:
            x = jax.nn.gelu(l(x))
        return self.layers[-1](x)

model = DeepMLP(jax.random.PRNGKey(0))
params, static = eqx.partition(model, eqx.is_array)
opt = optax.adam(1e-3)
opt_state = opt.init(params)
rng = np.random.default_rng(0)
batch = (jnp.asarray(rng.normal(size=(BATCH, IN)), jnp.float32), jnp.asarray(rng.integers(0, OUT, (BATCH,)), jnp.int32))

def loss_fn(params, batch):
    x, y = batch
    logits = jax.vmap(eqx.combine(params, static))(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return loss, eqx.apply_updates(params, updates), opt_state

if __name__ == "__main__":
    bench("m2_mlp_eqx", step, params, opt_state, batch, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
