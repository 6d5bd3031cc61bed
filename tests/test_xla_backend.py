"""backend='xla': the plan run by XLA's own SPMD partitioner (jax.jit with the plan's shardings
and constraints), on 8 fake CPU devices: the single-device step's numbers, and the collectives
XLA inserted against the plan's, each difference said."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar as ap
import models
from autopar.runtime.xla_backend import collectives, differences

MEGATRON_MLP = ({"w1": P(None, "y"), "b1": P("y"), "w2": P("y", None), "b2": P()}, P("x"))


def cfg(mode, **kw):
    return ap.ParallelConfig(parallel_mode=mode, mesh_shape=(2, 4), mesh_axis_names=("x", "y"),
                             backend="xla", **kw)


def close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, want)


CASES = {
    "mlp data_parallel": (models.mlp_sgd_step, lambda: (models.mlp_params(),
                                                        models.mlp_batch()),
                          "data_parallel", None),
    "mlp megatron": (models.mlp_sgd_step, lambda: (models.mlp_params(), models.mlp_batch()),
                     "semi_auto_parallel", MEGATRON_MLP),
    "mlp adam auto": (models.mlp_adam_step, lambda: (
        models.mlp_params(), models.adam_init(models.mlp_params()), models.mlp_batch()),
        "auto_parallel", None),
    "gpt auto": (models.gpt_sgd_step, lambda: (models.gpt_params(), models.gpt_batch(batch=8)),
                 "auto_parallel", None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_xla_runs_the_plan_with_the_single_device_numbers(name):
    step, make, mode, ins = CASES[name]
    args = make()
    c = ap.compile(step, *args, config=cfg(mode), in_strategy=ins)
    close(c(*args), step(*args))
    got = c.xla_collectives()
    diff = differences(c.strategy.collectives, got)
    for line in diff:                                   # each difference says what and why
        assert line.split(":")[0] in {"all_reduce", "all_gather", "reduce_scatter",
                                      "all_to_all", "collective_permute"}
        assert "XLA" in line
    if mode == "data_parallel":        # the gradients' all-reduces, combined by XLA
        assert {k for k, _ in got} == {"all_reduce"}
        assert sum(s * n for (_, s), n in got.items()) == \
            sum(x.bytes * x.count for x in c.strategy.collectives)
        assert all("combined" in line for line in diff)
    # the plan's layouts reach XLA: its arguments as the plan laid them out
    assert [str(i.layout) for i in c.strategy.inputs] == [
        str(ap.Layout.from_partition_spec(s.spec, len(i.shape)))
        for s, i in zip(jax.tree.leaves(c.in_shardings), c.strategy.inputs)]


def test_collectives_reads_a_compiled_modules_text():
    text = """
  %all-reduce.1 = f32[16,8]{1,0} all-reduce(f32[16,8]{1,0} %p), replica_groups={{0,1}}
  %ag = (f32[4]{0}, f32[8]{0}) all-gather-start(f32[4]{0} %q), dimensions={0}
  %ag.done = f32[8]{0} all-gather-done((f32[4]{0}, f32[8]{0}) %ag)
  %rs = bf16[2,4]{1,0} reduce-scatter(bf16[4,4]{1,0} %r), dimensions={0}
"""
    got = collectives(text)
    assert got == {("all_reduce", 512): 1, ("all_gather", 48): 1, ("reduce_scatter", 16): 1}


def test_a_pipeline_is_refused_on_xla_with_what_to_use():
    with pytest.raises(ap.ConfigError, match="backend='jax' for a pipeline"):
        ap.compile(models.mlp_sgd_step, models.mlp_params(), models.mlp_batch(),
                   config=cfg("semi_auto_parallel", pipeline_stages=2, micro_batches=2))
