"""Pipelines of steps written the way users write them: stages that exchange values in
their update (a parameter both read, a global gradient norm), and an unannotated lax.scan
between annotated stages."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
from test_pipeline import assert_same, config


def shared_weight_clipped_step(params, batch):
    """Stage 0 and stage 1 each read a slice of one stacked weight, and the update is clipped
    by the global norm of every gradient: each stage's post phase receives what the other
    computes from what it sent first."""
    def loss_fn(p):
        x, y = batch
        with ap.pipeline_stage(0):
            h = jnp.tanh(jnp.tanh(x @ p["a"]) @ p["w"][0])
        with ap.pipeline_stage(1):
            h = jnp.tanh(h @ p["w"][1]) @ p["c"]
        return jnp.mean((h - y) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(params)
    norm = jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(g)))
    scale = jnp.minimum(1.0, 0.5 / norm)
    return (loss, norm), jax.tree.map(lambda a, b: a - 0.1 * scale * b, params, g)


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
def test_stages_exchanging_values_in_their_update_match_single_device(backend):
    r = np.random.default_rng(0)
    p = {k: jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
         for k, s in (("a", (8, 8)), ("w", (2, 8, 8)), ("c", (8, 8)))}
    b = tuple(jnp.asarray(r.normal(size=(8, 8)), jnp.float32) for _ in range(2))
    with ap.compile(shared_weight_clipped_step, p, b, config=config(n=2, backend=backend)) as c:
        got, want = c(p, b), shared_weight_clipped_step(p, b)
        assert_same(got, want)
        assert_same(c(got[1], b), shared_weight_clipped_step(want[1], b))


def scan_between_stages_step(params, batch):
    """An unannotated lax.scan over stacked layers between the two annotated stages: its
    transpose slices the stacked residuals in the backward pass, reading forward values only."""
    def loss_fn(p):
        x, y = batch
        with ap.pipeline_stage(0):
            h = jnp.tanh(x @ p["a"])
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["w"])
        with ap.pipeline_stage(1):
            h = h @ p["c"]
        return jnp.mean((h - y) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(params)
    return loss, jax.tree.map(lambda a, b: a - 0.1 * b, params, g)


def test_an_unannotated_scan_between_stages_matches_single_device():
    r = np.random.default_rng(1)
    p = {k: jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
         for k, s in (("a", (8, 8)), ("w", (3, 8, 8)), ("c", (8, 8)))}
    b = tuple(jnp.asarray(r.normal(size=(8, 8)), jnp.float32) for _ in range(2))
    c = ap.compile(scan_between_stages_step, p, b, config=config(n=2))
    assert_same(c(p, b), scan_between_stages_step(p, b))
