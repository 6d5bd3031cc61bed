"""The cost model at cluster scale: chips from their datasheets, real machines as presets,
XLA's fusion, and Megatron-LM's annotated plan computing no matmul twice (pure planning)."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import megatron_gpt as mg
import user_gpt as ug
from autopar.chip import CHIPS, Chip
from autopar.strategies.cost_model import compute_time, flops, fused
from autopar.strategies.candidates import candidates_of
from autopar.strategies.fusion import groups, touches
from autopar.trace import trace


def test_a_large_gemm_runs_at_the_chips_large_gemm_rate_and_a_small_one_below():
    a100 = CHIPS["a100-80gb"]
    n = 8192
    big = a100.matmul_seconds(n, n, n, 1, jnp.bfloat16, 3 * n * n * 2)
    assert big == pytest.approx(2 * n ** 3 / (312e12 * 0.8) + a100.launch, rel=0.01)
    # NVIDIA's guide: a 2048 x 4608 output is 288 tiles of 256 x 128, three waves of 108
    assert a100.fill(2048, 4608) == pytest.approx(288 / 324)
    # float32 runs on TF32 units there, at half the bf16 rate; V100 has neither bf16 nor TF32
    assert a100.peak(np.float32) == a100.peak(jnp.bfloat16) / 2
    assert CHIPS["v100-16gb"].peak(jnp.bfloat16) == CHIPS["v100-16gb"].vector_flops
    # attention's QK^T with a head dim of 64 is bound by its bytes, not its FLOPs
    b, s, hd = 16, 2048, 64
    moved = b * (2 * s * hd + s * s) * 2
    qk = a100.matmul_seconds(s, s, hd, b, jnp.bfloat16, moved)
    assert qk == pytest.approx(moved / a100.stream_rate + a100.launch)
    with pytest.raises(ap.ConfigError, match="unknown chip"):
        Chip.named("a200")


def test_machines_as_presets_with_their_links_and_shared_nics():
    dgx = ap.Topology.preset("dgx-a100:4", 32)
    assert dgx == ap.Topology.preset("cluster:4x8", 32) == ap.Topology.cluster(4, 8)
    assert dgx.chip.name == "a100-80gb" and "DGX A100" in dgx.source
    node, gpu = dgx.levels
    assert 1 / gpu.beta == pytest.approx(300e9 * 0.78) and node.share == 1
    cloud = ap.Topology.preset("v100-cloud:2", 16)
    # one 25 Gb/s NIC for eight GPUs: each device gets an eighth of it
    assert cloud.levels[0].share == 8
    assert cloud.levels[0].beta_for("all_reduce") == pytest.approx(8 * cloud.levels[0].beta)
    h100 = ap.Topology.preset("dgx-h100:2x8", 16)
    assert h100.chip.peak(jnp.bfloat16) == pytest.approx(989.4e12)
    for topo in (dgx, cloud, h100):
        assert ap.Topology.from_dict(topo.to_dict()) == topo
    with pytest.raises(ap.ConfigError, match="does not describe"):
        ap.Topology.preset("dgx-a100:3", 32)


def test_the_same_all_reduce_is_slower_over_a_shared_nic():
    from autopar.redistribution.planner import Planner
    times = []
    for name in ("dgx-a100:2", "v100-cloud:2"):
        topo = ap.Topology.preset(name, 16)
        mesh = ap.LogicalMesh.create((2, 8), ("dp", "tp"), topo)
        times.append(Planner(mesh).step_time("all_reduce", ("dp",), 64 << 20)[0])
    assert times[1] > 50 * times[0]


def _graph():
    p, b = ug.init(1, 64, 128), ug.batch(4, 16, 128)
    return trace(lambda p, b: ug.loss(p, b, 4), p, b)


def test_fusion_groups_a_layer_norm_as_one_kernel_and_restarts_at_the_residual():
    g = _graph()
    group, depth = groups(g, chip=True)
    t = touches(g, chip=True)
    by_source = lambda key: [n for n in g.nodes if key in n.source]
    norm = [n for n in by_source("layer_norm") if n.id in group]
    first = {group[n.id] for n in norm[:8]}
    assert len(first) == 1                       # the first layer norm's operators: one kernel
    kernel = [n for n in g.nodes if group.get(n.id) in first]
    reads = sum(r for n in kernel for r in t[n.id].reads)
    writes = sum(w for n in kernel for w in t[n.id].writes)
    assert sum(t[n.id].launch for n in kernel) == 1
    assert writes == 1                           # its output, once
    assert reads == 1                            # x (the embedding), once
    # its scale and shift: broadcasts of the parameters folded into it, reading the vectors
    folded = [u for n in kernel for x in n.inputs if getattr(x, "id", None) in g.producer
              for u in [g.producer[x.id]] if u.prim == "broadcast_in_dim"
              and group.get(u.id) not in first]
    assert len(folded) == 2
    assert all(t[u.id].reads == (True,) and t[u.id].writes == (False,)
               and not t[u.id].launch for u in folded)
    # the residual add after the output projection reads the projection: a new kernel, one
    # boundary deeper than the first layer norm's
    adds = [n for n in g.nodes if n.prim == "add" and any(
        getattr(x, "id", None) in g.producer and g.producer[x.id].prim == "dot_general"
        for x in n.inputs)]
    assert adds and all(group[a.id] not in first and depth[a.id] > depth[norm[0].id]
                        for a in adds)


def test_a_fused_chain_costs_one_read_and_one_write():
    x = jnp.ones((1024, 1024), jnp.bfloat16)
    g = trace(lambda x: jnp.exp(x * 2.0 + 1.0) - x, x)
    mesh = ap.LogicalMesh.create((1,), ("x",), ap.Topology.preset("dgx-a100:1x1", 1))
    cands, t = candidates_of(g, mesh), fused(g, mesh)
    total = sum(compute_time(n, cands[n.id][0], mesh, t.get(n.id)) for n in g.nodes)
    chip = mesh.topology.chip
    assert total == pytest.approx(2 * x.nbytes / chip.stream_rate + chip.launch, rel=1e-6)
    unfused = sum(compute_time(n, cands[n.id][0], mesh) for n in g.nodes)
    assert unfused > 3 * total


def test_megatrons_annotated_gpt_computes_no_matmul_flop_twice():
    """Megatron's column/row splits over tp and the batch over dp on a (2, 4) mesh: every
    matmul's FLOPs (forward, recomputed, backward) are divided by all 8 devices."""
    p, (m, v), b = mg.params(2, 64, 128, 16), mg.adam_state(mg.params(2, 64, 128, 16)), \
        mg.batch(8, 16, 128)
    key = jax.random.PRNGKey(0)
    step = functools.partial(mg.train_step, heads=4)
    split = mg.megatron(p, "tp")
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4),
                            mesh_axis_names=("dp", "tp"), topology="dgx-a100:1x8",
                            progress=False)
    s = ap.plan(step, p, m, v, b, key, config=cfg, batch_argnums=(3,),
                in_strategy=(split, split, split, ("[dp,_]", "[dp,_]"), None))
    g = trace(step, p, m, v, b, key)
    size = {"dp": 2, "tp": 4}
    dots = [(n, o) for n, o in zip(g.nodes, s.ops) if n.prim == "dot_general"]
    assert len(dots) > 20
    for n, o in dots:
        (lc, _), _ = n.params["dimension_numbers"]
        split_k = math.prod(size[a] for d in lc for a in o.in_layouts[0].dims[d])
        split_out = math.prod(size[a] for d in o.out_layouts[0].dims for a in d)
        assert split_k * split_out == 8, (o.name, o.source, o.in_layouts, o.out_layouts)
    assert {c.kind for c in s.collectives if c.axes == ("tp",)} >= {"all_reduce"}
    assert flops(dots[0][0]) > 0


def test_a_numpy_scalar_that_promotes_bf16_activations_is_warned_about_with_its_line():
    import numpy
    def scaled(x):
        return jnp.sum(x / numpy.sqrt(16.0))     # promotes: float32 from here on

    def kept(x):
        return jnp.sum(x / math.sqrt(16.0)) + jnp.sum(x.astype(jnp.float32) * 2.0)
    x = jnp.ones((4, 8), jnp.bfloat16)
    with pytest.warns(ap.AutoparWarning, match=r"test_cluster_costs.py:\d+.*math.sqrt"):
        trace(scaled, x)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.AutoparWarning)
        trace(kept, x)
        bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), ug.init(1, 64, 128))
        g = trace(lambda p, b: ug.loss(p, b, 4), bf16, ug.batch(4, 16, 128))
    dots = [n for n in g.nodes if n.prim == "dot_general"]
    assert {str(n.outputs[0].dtype) for n in dots} == {"bfloat16"}     # no float32 matmul
