import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import flax.linen as nn
import optax

BATCH, CLASSES = 64, 10

class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for ch in (32, 64, 128):
            x = nn.Conv(ch, (3, 3), padding="SAME")(x)
            x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(CLASSES)(x)

model = CNN()
rng = np.random.default_rng(0)
batch = (jnp.asarray(rng.normal(size=(BATCH, 32, 32, 3)), jnp.float32), jnp.asarray(rng.integers(0, CLASSES, (BATCH,)), jnp.int32))
params = model.init(jax.random.PRNGKey(0), batch[0])["params"]
opt = optax.sgd(0.05, momentum=0.9)
opt_state = opt.init(params)

def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), y).mean()

def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state

if __name__ == "__main__":
    bench("m3_cnn_flax", step, params, opt_state, batch, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
