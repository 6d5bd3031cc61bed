"""ap.plan: strategies without running, on abstract (ShapeDtypeStruct) arguments."""
import jax

import autopar as ap
import models as m


def test_plan_equals_compile_strategy():
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=8)
    planned = ap.plan(m.mlp_sgd_step, p, b, config=cfg)
    assert planned.to_json() == ap.compile(m.mlp_sgd_step, p, b, config=cfg).strategy.to_json()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (p, b))
    assert ap.plan(m.mlp_sgd_step, *abstract, config=cfg).to_json() == planned.to_json()


def test_plan_gpt3_width_without_allocating():
    # two GPT-3 blocks (d=12288, vocab 50304): ~4.2e9 parameters, 17 GB of float32 that this
    # 24 GB machine could not hold alongside gradients; planning allocates none of it
    p = m.gpt_params(vocab=50304, seq=2048, d=12288, heads=96, layers=2, abstract=True)
    b = m.gpt_batch(batch=8, seq=2048, vocab=50304, abstract=True)
    n_params = sum(x.size for x in jax.tree.leaves(p))
    assert n_params > 4e9
    s = ap.plan(m.gpt_sgd_step, p, b, config=ap.ParallelConfig(parallel_mode="data_parallel",
                                                               device_num=8))
    assert s.peak_memory > 4 * n_params          # parameters alone, replicated per device
    assert s.step_time > 0 and s.comm_time > 0
    assert all(i.layout.is_replicated() for i in s.inputs if i.is_param)
    assert "peak memory" in s.table()
