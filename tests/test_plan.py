"""ap.plan: strategies without running, on abstract (ShapeDtypeStruct) arguments."""
import jax

import autopar as ap
import models as m


def test_plan_is_data_parallel_from_abstract_arguments():
    """Planned without running, data_parallel on 8 devices is what data parallelism is, by its
    definition: parameters replicated, each batch leaf split on its first dimension over all 8
    devices, and one all-reduce over them per gradient (the parameter's bytes) and for the
    scalar loss. Abstract arguments give the same plan as concrete ones."""
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=8)
    planned = ap.plan(m.mlp_sgd_step, p, b, config=cfg)
    (axis,) = planned.axis_names
    assert planned.mesh_shape == (8,)
    params = [i for i in planned.inputs if i.is_param]
    assert len(params) == len(jax.tree.leaves(p)) and all(i.layout.is_replicated() for i in params)
    assert [str(i.layout) for i in planned.inputs if not i.is_param] == [f"[{axis},_]"] * 2
    assert {(c.kind, c.axes) for c in planned.collectives} == {("all_reduce", (axis,))}
    assert sorted(c.bytes for c in planned.collectives) == sorted(
        [4] + [x.nbytes for x in jax.tree.leaves(p)])
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
