"""Sharded checkpoints with orbax: a compiled step's state saved in its layouts and restored
into the same plan and into other plans' layouts (8-way data parallel, 2x4 Megatron-LM, ZeRO
level 3), equal to the saved values."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar as ap
import models

MEGATRON = ({"w1": P(None, "y"), "b1": P("y"), "w2": P("y", None), "b2": P()}, P("x"))


def plans():
    mesh = dict(mesh_shape=(2, 4), mesh_axis_names=("x", "y"), backend="jax")
    return {
        "data_parallel": (ap.ParallelConfig(parallel_mode="data_parallel", **mesh), None),
        "megatron": (ap.ParallelConfig(parallel_mode="semi_auto_parallel", **mesh), MEGATRON),
        "zero3": (ap.ParallelConfig(parallel_mode="data_parallel", enable_parallel_optimizer=True,
                                    optimizer_level="level3", parallel_optimizer_threshold=0,
                                    **mesh), None),
    }


def compiled(name):
    config, ins = plans()[name]
    p = models.mlp_params(sizes=(16, 64, 16))
    return ap.compile(models.mlp_adam_step, p, models.adam_init(p), models.mlp_batch(16),
                      config=config, in_strategy=None if ins is None else
                      (ins[0], None, ins[1]))


@pytest.mark.parametrize("saver, reader", [("megatron", "megatron"), ("megatron", "data_parallel"),
                                           ("data_parallel", "zero3"), ("zero3", "megatron")])
def test_state_saved_in_one_plan_is_restored_into_another(tmp_path, saver, reader):
    a, b = compiled(saver), compiled(reader)
    p = models.mlp_params(sizes=(16, 64, 16))
    batch = models.mlp_batch(16)
    state = jax.device_put((p, models.adam_init(p)), a.in_shardings[:2])
    _, p1, s1 = a(*state, batch)                         # one trained step, then saved
    path = a.save(tmp_path / "step1", (p1, s1))
    assert json.load(open(os.path.join(path, "autopar_strategy.json")))["mode"] == \
        a.strategy.mode
    got = b.restore(path, argnums=(0, 1))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 got, (p1, s1))
    for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(b.in_shardings[:2])):
        assert x.sharding.is_equivalent_to(s, x.ndim)   # in the reader's layouts
    loss, _, _ = b(*got, batch)                           # and it trains on from there
    np.testing.assert_allclose(loss, a(p1, s1, batch)[0], rtol=1e-5)


def test_saving_names_what_is_wrong(tmp_path):
    c = compiled("megatron")
    p = models.mlp_params(sizes=(16, 64, 16))
    with pytest.raises(ap.ConfigError, match="matches none of the step's arguments"):
        c.save(tmp_path / "x", {"w": jnp.zeros(3)})
    c.save(tmp_path / "y", p)                              # the parameters alone: argument 0
    with pytest.raises(ap.ConfigError, match="exists; give a new directory"):
        c.save(tmp_path / "y", p)
    with pytest.raises(ap.ConfigError, match="no checkpoint"):
        c.restore(tmp_path / "missing")
    got = c.restore(tmp_path / "y")
    np.testing.assert_array_equal(np.asarray(got["w1"]), p["w1"])


@pytest.mark.native
def test_the_native_backend_saves_and_restores_host_arrays(tmp_path):
    p = models.mlp_params(sizes=(16, 64, 16))
    c = ap.compile(models.mlp_sgd_step, p, models.mlp_batch(16),
                   config=ap.ParallelConfig(parallel_mode="data_parallel", device_num=2))
    with c:
        _, p1 = c(p, models.mlp_batch(16))
        c.save(tmp_path / "n", p1)
        got = c.restore(tmp_path / "n")
        assert isinstance(got["w1"], np.ndarray)
        jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, p1))
