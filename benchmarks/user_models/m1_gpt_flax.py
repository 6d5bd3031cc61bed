import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import flax.linen as nn
import optax

import os
VOCAB, D, HEADS, LAYERS, SEQ, BATCH = (1024, 256, 4, 4, 64, 8) if os.environ.get("GPT_BIG") else (512, 128, 4, 2, 64, 16)

class Block(nn.Module):
    d: int
    heads: int
    @nn.compact
    def __call__(self, x):
        T = x.shape[1]
        mask = nn.make_causal_mask(jnp.ones((x.shape[0], T)))
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.d)(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.d)(h)
        h = nn.gelu(h)
        h = nn.Dense(self.d)(h)
        return x + h

class GPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(VOCAB, D)
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        x = emb(tokens) + pos[None, : tokens.shape[1]]
        for _ in range(LAYERS):
            x = Block(D, HEADS)(x)
        x = nn.LayerNorm()(x)
        return emb.attend(x)  # tied embeddings

model = GPT()
rng = np.random.default_rng(0)
tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32)
batch = (tokens[:, :-1], tokens[:, 1:])
params = model.init(jax.random.PRNGKey(0), batch[0])["params"]
opt = optax.adamw(1e-3, weight_decay=0.01)
opt_state = opt.init(params)

def loss_fn(params, batch):
    x, y = batch
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state

if __name__ == "__main__":
    bench("m1_gpt_flax" + ("_big" if os.environ.get("GPT_BIG") else ""), step, params, opt_state, batch, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
