"""Pipeline parallel and micro-batches: the plan (stages, transfers, accumulation), the
schedules, and the step run by both backends equal to the single-device step."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import models as m
import user_gpt as ug
from autopar.pipeline_program import Accumulate, Transfer, in_flight, schedule
from autopar.program import Collective
from test_stages import two_stage_mlp_step

RTOL, ATOL = 1e-5, 1e-6


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=RTOL, atol=ATOL), a, b)


def config(n=4, stages=2, micro=2, scheduler="1f1b", **kw):
    kw.setdefault("parallel_mode", "data_parallel")
    kw.setdefault("backend", "jax")
    return ap.ParallelConfig(device_num=n, pipeline_stages=stages, micro_batches=micro,
                             pipeline_scheduler=scheduler, progress=False, **kw)


def steps_of(stage, cls):
    return [i for _, body in stage.phases() for i in body if isinstance(i, cls)]


def test_schedules_order_and_in_flight_activations():
    gpipe = schedule("gpipe", 2, 3)
    assert gpipe[0] == (("forward", 0), ("forward", 1), ("forward", 2),
                        ("backward", 0), ("backward", 1), ("backward", 2))
    f1b = schedule("1f1b", 3, 4)
    assert f1b[0] == (("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0),
                      ("forward", 3), ("backward", 1), ("backward", 2), ("backward", 3))
    assert f1b[2] == tuple(x for m_ in range(4) for x in (("forward", m_), ("backward", m_)))
    for s, tasks in enumerate(f1b):           # live forwards never exceed in_flight
        live = peak = 0
        for phase, _ in tasks:
            live += 1 if phase == "forward" else -1
            peak = max(peak, live)
        assert peak == in_flight("1f1b", 3, 4, s) == 3 - s
    assert in_flight("gpipe", 3, 4, 1) == 4


def test_two_stage_plan_sends_activations_forward_and_cotangents_back():
    p, b = m.mlp_params(), m.mlp_batch()
    c = ap.compile(two_stage_mlp_step, p, b, config=config(micro=2))
    s0, s1 = c.program.stages
    assert s0.devices == (0, 1) and s1.devices == (2, 3)
    sent0 = [t for t in steps_of(s0, Transfer) if t.kind == "send"]
    sent1 = [t for t in steps_of(s1, Transfer) if t.kind == "send"]
    assert [(t.peer, t.micro, t.shape) for t in sent0] == [(1, True, (2, 32))]   # h, per micro-batch
    assert [(t.peer, t.micro, t.shape) for t in sent1] == [(0, True, (2, 32))]   # its cotangent
    assert sent0[0] in s0.forward and sent1[0] in s1.backward
    # gradients accumulate over micro-batches, then one all-reduce each over the data axis
    for st in (s0, s1):
        assert steps_of(st, Accumulate) and all(a.kind == "sum" for a in steps_of(st, Accumulate))
        reduces = [x for x in st.post if isinstance(x, Collective)]
        assert reduces and all(x.kind == "all_reduce" and x.axes == ("y",) for x in reduces)
        assert not any(isinstance(x, Collective) for x in st.forward + st.backward)
    kinds = {x.kind for x in c.collectives()}
    assert kinds == {"send", "recv", "all_reduce"}


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro,n", [(1, 4, 2), (2, 2, 2), (2, 4, 4)])
def test_mlp_pipeline_on_jax_equals_single_device(stages, micro, n, scheduler):
    p, b = m.mlp_params(), m.mlp_batch()
    c = ap.compile(two_stage_mlp_step, p, b,
                   config=config(n=n, stages=stages, micro=micro, scheduler=scheduler))
    assert_same(c(p, b), two_stage_mlp_step(p, b))


def test_pipeline_with_adam_and_sharded_optimizer_on_jax():
    sizes = (64, 256, 64)
    p, b = m.mlp_params(sizes), m.mlp_batch(batch=128, sizes=sizes)

    def step(params, opt, batch):
        def loss(q, bt):
            x, y = bt
            with ap.pipeline_stage(0):
                h = jax.nn.relu(x @ q["w1"] + q["b1"])
            with ap.pipeline_stage(1):
                out = h @ q["w2"] + q["b2"]
            return jnp.mean((out - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params, batch)
        new, opt = m.adam(params, grads, opt)
        return value, new, opt

    args = (p, m.adam_init(p), b)
    c = ap.compile(step, *args, config=config(micro=4, enable_parallel_optimizer=True,
                                              optimizer_level="level2",
                                              parallel_optimizer_threshold=0))
    assert_same(c(*args), step(*args))
    assert any(x.kind == "reduce_scatter" for x in c.collectives())


def test_gpt_four_blocks_gpipe_on_jax():
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    c = ap.compile(m.gpt_pipeline_step, p, b, config=config(micro=4, scheduler="gpipe"))
    assert_same(c(p, b), m.gpt_pipeline_step(p, b))


def runner_of(comm):
    """In a worker: how it runs its stage, and its last step's pipeline counters."""
    from autopar.runtime.native_backend import WORKER
    return type(WORKER.whole).__name__, WORKER.stats["pipeline"]


@pytest.mark.native
@pytest.mark.parametrize("scheduler,whole", [("gpipe", "1"), ("1f1b", "1"), ("1f1b", "0")])
def test_gpt_four_blocks_on_four_native_ranks(monkeypatch, scheduler, whole):
    """The issue's model: 4 decoder blocks, 2 stages x 2-way data parallel, 4 micro-batches;
    each rank's step one executable with its transfers inside (the default), or interpreted
    task by task (AUTOPAR_WHOLE_STEP=0)."""
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", whole)
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    c = ap.compile(m.gpt_pipeline_step, p, b,
                   config=config(micro=4, scheduler=scheduler, backend="native"))
    want = m.gpt_pipeline_step(p, b)
    assert_same(c(p, b), want)
    assert_same(c(p, b), want)               # workers stay loaded: a second step, same values
    ranks = c.on_workers(runner_of)
    assert {kind for kind, _ in ranks} == {"WholeStage" if whole == "1" else "NoneType"}
    assert all(0 <= s["wait_s"] < s["step_s"] for _, s in ranks)
    c.close()


def kept_args(comm):
    """In a worker: how many argument blocks its last step took from its kept results."""
    from autopar.runtime.native_backend import WORKER
    return WORKER.stats["kept_args"]


@pytest.mark.native
def test_pipeline_parameters_stay_in_the_workers_and_a_loop_matches_the_single_device_one(
        monkeypatch):
    """Results of 64 KiB or more stay in the stage's ranks (runtime.resident); the parameters
    passed back unchanged go as keys to the stage that made them, and a training loop gives
    the single-device loop's values. A new array in a kept one's place is sent whole."""
    monkeypatch.setenv("AUTOPAR_RESIDENT", "1")
    p, b = m.gpt_params(layers=4, d=128, vocab=64), m.gpt_batch(batch=8)
    c = ap.compile(m.gpt_pipeline_step, p, b, config=config(micro=4, backend="native"))
    got, want = p, p
    for _ in range(3):
        loss, got = c(got, b)
        want_loss, want = m.gpt_pipeline_step(want, b)
        assert_same((loss, got), (want_loss, want))
    big = [k for k, x in enumerate(jax.tree.leaves(got)) if x.nbytes >= 64 << 10]
    assert big and all(not jax.tree.leaves(got)[k].flags.writeable for k in big)
    assert all(n > 0 for n in c.on_workers(kept_args))
    leaves, tree = jax.tree.flatten(got)
    leaves[big[0]] = leaves[big[0]] + 1.0            # not a kept result: sent whole
    want_leaves = jax.tree.leaves(want)
    want_leaves[big[0]] = np.asarray(want_leaves[big[0]]) + 1.0
    want = jax.tree.unflatten(tree, want_leaves)
    assert_same(c(jax.tree.unflatten(tree, leaves), b), m.gpt_pipeline_step(want, b))
    c.close()


@pytest.mark.native
def test_a_stage_rank_stopped_fails_the_pipeline_step_and_the_next_one_works(monkeypatch):
    """A rank of the second stage stopped (SIGSTOP) while the first stage's ranks wait for its
    cotangents inside their executables: the call raises CollectiveError within the bound,
    every worker is gone, and the next call runs on new workers."""
    from test_native_failures import TIMEOUT, stop_rank_and_call
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", "1")
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    c = ap.compile(m.gpt_pipeline_step, p, b, config=config(
        micro=4, backend="native", collective_timeout=TIMEOUT))
    want = m.gpt_pipeline_step(p, b)
    assert_same(c(p, b), want)
    stop_rank_and_call(c, 3, p, b)
    assert_same(c(p, b), want)
    c.close()


@pytest.mark.parametrize("devices,backend", [
    ((1, 3), "jax"), pytest.param((3, 1), "native", marks=pytest.mark.native)])
def test_stages_on_meshes_of_different_sizes_match_single_device(devices, backend):
    """A stage of one device next to one of three: values cross between the meshes whole."""
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    c = ap.compile(m.gpt_sgd_step, p, b, config=config(
        micro=4, backend=backend, parallel_mode="auto_parallel", pipeline_stage_devices=devices))
    stages = c.program.stages
    assert [st.mesh.size for st in stages] == list(devices)
    assert [st.devices for st in stages] == [tuple(range(devices[0])),
                                              tuple(range(devices[0], 4))]
    routes = {t.route for st in stages for t in steps_of(st, Transfer)}
    assert routes == {"whole"}
    assert [st.mesh_shape for st in c.strategy.stages] == [(k,) for k in devices]
    want = m.gpt_sgd_step(p, b)
    assert_same(c(p, b), want)
    if backend == "native":
        assert_same(c(p, b), want)
        c.close()


def test_annotated_stages_on_given_device_counts():
    p, b = m.mlp_params(), m.mlp_batch(batch=12)      # data parallel over 3, then over 1
    c = ap.compile(two_stage_mlp_step, p, b, config=config(micro=2, pipeline_stage_devices=(3, 1)))
    assert [st.devices for st in c.program.stages] == [(0, 1, 2), (3,)]
    assert_same(c(p, b), two_stage_mlp_step(p, b))


def test_auto_stage_devices_plan_three_stages_on_four_devices():
    """Three stages cannot split four devices equally: the planner chooses who gets two."""
    p, b = m.gpt_params(layers=6), m.gpt_batch(batch=8)
    c = ap.compile(m.gpt_sgd_step, p, b, config=config(
        stages=3, micro=4, parallel_mode="auto_parallel", pipeline_stage_devices="auto"))
    sizes = [len(st.devices) for st in c.program.stages]
    assert sorted(sizes) == [1, 1, 2]
    assert [d for st in c.program.stages for d in st.devices] == [0, 1, 2, 3]
    assert_same(c(p, b), m.gpt_sgd_step(p, b))


def test_stage_device_choice_is_the_best_fixed_split(monkeypatch):
    """The DP over cuts and device counts finds the least estimate among every split of the
    devices into stage sizes, each with its own best cuts."""
    from autopar.compiler import pipeline_plan
    from itertools import product
    seen = []
    real = pipeline_plan.plan_stages

    def spy(*a, **k):
        seen.append((a, k))
        return real(*a, **k)
    monkeypatch.setattr(pipeline_plan, "plan_stages", spy)
    p, b = m.gpt_params(layers=6, abstract=True), m.gpt_batch(batch=8, abstract=True)
    ap.plan(m.gpt_sgd_step, p, b, config=config(
        n=6, stages=3, micro=4, parallel_mode="auto_parallel", pipeline_stage_devices="auto"))
    (req,), _ = seen[0]
    assert req.sizes is None and req.stages is None and set(req.options) == {1, 2, 3, 4}
    chosen = real(req)
    splits = [c for c in product(req.options, repeat=req.count) if sum(c) == req.devices]
    each = {c: real(dataclasses.replace(req, sizes=c)).step_time for c in splits}
    assert chosen.step_time == pytest.approx(min(each.values()), rel=1e-9)
    assert each[chosen.sizes] == pytest.approx(chosen.step_time, rel=1e-9)


def test_bad_pipeline_configs_say_how_to_fix():
    with pytest.raises(ap.ConfigError, match="first axis 2 divides"):
        ap.ParallelConfig(parallel_mode="data_parallel", device_num=6, mesh_shape=(3, 2),
                          pipeline_stages=2)
    with pytest.raises(ap.ConfigError, match="does not divide device_num=3"):
        ap.ParallelConfig(parallel_mode="data_parallel", device_num=3, pipeline_stages=2)
    with pytest.raises(ap.ConfigError, match="micro_batches"):
        ap.ParallelConfig(micro_batches=0)
    with pytest.raises(ap.ConfigError, match="summing to device_num=4"):
        ap.ParallelConfig(device_num=4, pipeline_stages=2, pipeline_stage_devices=(1, 2))
    with pytest.raises(ap.ConfigError, match="'equal', 'auto'"):
        ap.ParallelConfig(device_num=4, pipeline_stages=2, pipeline_stage_devices="even")
    with pytest.raises(ap.ConfigError, match="pipeline_scheduler"):
        ap.ParallelConfig(pipeline_scheduler="interleaved")
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    with pytest.raises(ap.ConfigError, match="multiple of 16"):
        ap.compile(two_stage_mlp_step, p, b, config=config(micro=8))


def test_whole_batch_statistics_cannot_be_micro_batched():
    p, b = m.mlp_params(), m.mlp_batch()

    def step(params, batch):
        def loss(q, bt):
            x, y = bt
            h = x @ q["w1"]
            h = (h - h.mean(0)) / (h.std(0) + 1e-5)          # batch normalisation
            return jnp.mean((jax.nn.relu(h) @ q["w2"] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, m.sgd(params, grads)

    with pytest.raises(ap.PipelineError, match="whole batch"):
        ap.compile(step, p, b, config=config(stages=1, n=2, micro=2))


def test_a_pipeline_no_stage_size_can_hold_says_why_each_size_was_left_out():
    """in_strategy splits the batch 4 ways, more than a stage of 2 (or 3) of the 4 devices
    has: the error names each size left out and its reason, not only the stage count."""
    p, b = m.mlp_params(), m.mlp_batch()

    def step(params, batch):
        value, grads = jax.value_and_grad(m.mlp_loss)(params, batch)
        return value, m.sgd(params, grads)

    with pytest.raises(ap.PipelineError) as e:
        ap.compile(step, p, b, config=config(parallel_mode="semi_auto_parallel"),
                   in_strategy=(None, ((4, 1), (4, 1))))
    assert "a stage of 2 devices: in_strategy" in str(e.value)
    assert "apply to each stage's devices" in str(e.value)
    c = ap.compile(step, p, b, config=config(parallel_mode="semi_auto_parallel"),
                   in_strategy=(None, ((2, 1), (2, 1))))
    assert_same(c(p, b), step(p, b))


def test_automatic_stages_cut_between_blocks_and_match_single_device():
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    c = ap.compile(m.gpt_sgd_step, p, b, config=config(micro=4))     # no annotations
    names = [i.name for i in c.strategy.inputs]
    reads = [{names[i].split(".")[0] for i in st.inputs} for st in c.program.stages]
    assert {"h0", "h1"} <= reads[0] and not {"h2", "h3"} & reads[0]
    assert {"h2", "h3", "lnf_g"} <= reads[1] and not {"h0", "h1"} & reads[1]
    secs = [st.seconds for st in c.program.stages]
    assert max(secs) < 1.3 * min(secs)                  # balanced: two blocks each
    assert_same(c(p, b), m.gpt_sgd_step(p, b))


@pytest.mark.slow
def test_wider_gpt_pipelines_its_loss_cotangent_and_embedding_gradient():
    """At these sizes the data-parallel layouts split the loss's cotangent and the scatter-adds
    of the cross-entropy and embedding backward over the batch: the micro-batch split has to
    reach them through values the same for every micro-batch (the zeros they start from), and
    a summed weight gradient must not be sliced over micro-batches to be all-reduced."""
    p, b = m.gpt_params(layers=4, d=64, seq=16, vocab=128), m.gpt_batch(batch=16, seq=16, vocab=128)
    want = m.gpt_sgd_step(p, b)
    for sched in ("gpipe", "1f1b"):
        c = ap.compile(m.gpt_sgd_step, p, b, config=config(micro=4, scheduler=sched))
        micro = [i for st in c.program.stages for _, body in st.phases() for i in body
                 if isinstance(i, Collective) and "mb" in i.axes]
        assert micro == []
        assert_same(c(p, b), want)


def test_strategy_dump_shows_stages_and_round_trips():
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=8)
    s = ap.plan(m.gpt_pipeline_step, p, b, config=config(micro=4, scheduler="gpipe"))
    table = s.table()
    assert "pipeline: 2 stages, 4 micro-batches, gpipe" in table
    assert "stage 0: devices [0, 1]" in table and "stage 1: devices [2, 3]" in table
    assert {o.stage for o in s.ops} == {0, 1}
    assert s.peak_memory == max(st.memory for st in s.stages) and s.peak_op.startswith("stage")
    again = ap.Strategy.from_json(s.to_json())
    assert again.stages == s.stages and [o.stage for o in again.ops] == [o.stage for o in s.ops]
    assert {v["stage"] for v in s.to_mindspore()["parallel_strategy_item"].values()} == {0, 1}


def test_memory_cap_forces_a_pipeline_that_data_parallel_cannot_fit():
    """4 GPT blocks on 4 devices: data parallelism holds every parameter on every device; two
    stages hold half each. 1F1B keeps fewer micro-batches' activations than GPipe."""
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    dp = ap.plan(m.gpt_sgd_step, p, b, config=config(stages=1, micro=1))
    f1b = ap.plan(m.gpt_sgd_step, p, b, config=config(micro=4, scheduler="1f1b"))
    gpipe = ap.plan(m.gpt_sgd_step, p, b, config=config(micro=4, scheduler="gpipe"))
    assert f1b.peak_memory < dp.peak_memory and f1b.peak_memory < gpipe.peak_memory
    cap = (f1b.peak_memory + min(dp.peak_memory, gpipe.peak_memory)) // 2
    with pytest.raises(ap.InfeasibleError):
        ap.plan(m.gpt_sgd_step, p, b, config=config(stages=1, micro=1, max_device_memory=cap))
    with pytest.raises(ap.InfeasibleError):
        ap.plan(m.gpt_sgd_step, p, b, config=config(micro=4, scheduler="gpipe",
                                                    max_device_memory=cap))
    c = ap.compile(m.gpt_sgd_step, p, b, config=config(micro=4, max_device_memory=cap))
    assert c.strategy.peak_memory <= cap
    assert_same(c(p, b), m.gpt_sgd_step(p, b))


@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
def test_two_stages_of_four_devices(mode, micro):
    """2 stages x 4 devices, the batch split 4 ways inside each stage and into 2 or 4
    micro-batches (one or two rows per device per micro-batch): every operator keeps the
    micro-batch split it is given (the attention's mask broadcast included), so nothing waits
    for the whole batch, and the step equals the single-device one."""
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=4 * micro * 2)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode=mode, device_num=8, pipeline_stages=2,
                            micro_batches=micro, pipeline_stage_devices="equal",
                            progress=False)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    assert [st.mesh.size for st in c.program.stages] == [4, 4]
    assert_same(c(p, b), m.gpt_sgd_step(p, b))


def test_stages_divide_the_first_mesh_axis():
    """pipeline_stages=2 on mesh (4, 2): each stage keeps both axes, the first halved (as
    Megatron's pipeline x data x tensor on a (hosts, GPUs) mesh), and the step equals the
    single-device one."""
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=8)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="auto_parallel", device_num=8,
                            mesh_shape=(4, 2), pipeline_stages=2, micro_batches=2,
                            pipeline_stage_devices="equal", progress=False)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    assert [st.mesh.shape for st in c.program.stages] == [(2, 2), (2, 2)]
    assert_same(c(p, b), m.gpt_sgd_step(p, b))


@pytest.mark.parametrize("model", ["tests", "user"])
def test_stage_layouts_leave_rows_for_every_micro_batch(model):
    """auto_parallel with 4 micro-batches of a 16-row batch on 8 devices: a layout splitting
    the batch 8 ways would leave 2 rows, which 4 micro-batches cannot share (the micro-batch
    plan would have to move the split to another dimension, which no pipeline runs); the
    stage search keeps only layouts whose batch dimensions split into the micro-batches, and
    the step equals the single-device one. On this suite's GPT and on one written as users
    write it (tests/user_gpt.py)."""
    if model == "tests":
        step, p, b = m.gpt_sgd_step, m.gpt_params(layers=1), m.gpt_batch(batch=16)
    else:
        step, p, b = ug.step, ug.init(layers=1, d=32, vocab=64), ug.batch(16, 8, 64)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="auto_parallel", device_num=8,
                            micro_batches=4, progress=False)
    c = ap.compile(step, p, b, config=cfg)
    size = dict(zip(c.strategy.axis_names, c.strategy.mesh_shape))
    for leaf in c.strategy.inputs:
        if not leaf.is_param:          # the batch: at most 16 / 4 = 4 ways
            assert math.prod(size[a] for a in leaf.layout.dims[0]) <= 4, leaf
    assert_same(c(p, b), step(p, b))


def test_blocks_recomputed_under_checkpoint_are_not_cut_inside():
    """Each block wrapped in jax.checkpoint (as large models are trained): its recomputation in
    the backward pass is anchored where the block's input is used, so a cut after the
    attention's residual add would send recomputed values forward in the backward pass (a
    PipelineError for 2, 3 and 4 stages before). Cuts fall between blocks; the 4-stage step
    equals the single-device one, and recomputing holds fewer activations than keeping them."""
    p, b = ug.init(layers=2, d=32, vocab=64), ug.batch(8, 8, 64)

    def step(remat):
        def sgd(params, batch):
            loss = lambda q, x: ug.loss(q, x, remat=remat)
            value, grads = jax.value_and_grad(loss)(params, batch)
            return value, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
        return sgd

    c = ap.compile(step(True), p, b, config=config(n=4, stages=4, micro=4))
    assert_same(c(p, b), ug.step(p, b))
    peak = {remat: max(st.memory for st in ap.plan(step(remat), p, b, config=config(
        n=2, stages=2, micro=4)).stages) for remat in (True, False)}
    assert peak[True] < 0.7 * peak[False]


def test_the_interleaved_schedule_is_megatrons():
    """Megatron-LM's interleaved 1F1B, 2 device groups x 2 parts, 4 micro-batches: each group
    runs every (part, micro-batch) forward and backward once, a part's forward before its
    backward, and its warm-up is 2 (groups - d - 1) + (v - 1) groups forwards; its step is
    (M v + groups - 1) parts' time, against (M + S - 1) stages' without interleaving."""
    from autopar.pipeline_program import device_schedule, pipeline_seconds
    for d in range(2):
        order = device_schedule(2, 2, 4, d)
        assert sorted(order) == sorted((j, ph, mb) for j in (d, d + 2) for mb in range(4)
                                       for ph in ("forward", "backward"))
        for j, ph, mb in order:
            if ph == "backward":
                assert order.index((j, "forward", mb)) < order.index((j, ph, mb))
        warm = next(i for i, t in enumerate(order) if t[1] == "backward") - 1
        assert warm == 2 * (2 - d - 1) + 2
    per_stage = schedule("1f1b", 4, 4, interleave=2)
    assert per_stage[0][:3] == (("forward", 0), ("forward", 1), ("forward", 2))
    assert pipeline_seconds([1.0] * 4, 4, interleave=2) == 4 * 2 + 1
    assert pipeline_seconds([2.0] * 2, 4) == 2 * (4 + 1)
    assert in_flight("1f1b", 4, 4, 0, interleave=2) == 5 / 2      # Megatron: warm-up + 1 parts


def test_an_interleaved_pipeline_runs_on_jax_devices_and_equals_the_single_device_step():
    """Two stages' devices holding two parts each (4 layers cut into 4 parts) on a 2 x 2 mesh:
    the parts alternate between the device groups, the step equals the single-device one, and
    the estimate is the interleaved schedule's; "auto" weighs it against the plain 1F1B; the
    native runtime refuses it (one stage per rank) before planning."""
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=8)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="auto_parallel", device_num=4,
                            mesh_shape=(2, 2), pipeline_stages=2, micro_batches=4,
                            pipeline_interleave=2, progress=False)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    assert [st.devices for st in c.program.stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    assert c.strategy.pipeline_interleave == 2 and len(c.strategy.stages) == 4
    from autopar.pipeline_program import pipeline_seconds
    secs = [st.seconds for st in c.strategy.stages]
    assert c.strategy.pipeline_time == pytest.approx(pipeline_seconds(secs, 4, 2)
                                                     + c.strategy.overhead_time)
    assert_same(c(p, b), m.gpt_sgd_step(p, b))
    back = ap.Strategy.from_json(c.strategy.to_json())
    assert back.pipeline_interleave == 2 and back.pipeline_time == c.strategy.pipeline_time
    auto = ap.plan(m.gpt_sgd_step, p, b, config=cfg.replace(pipeline_interleave="auto"))
    assert {ch.interleave for ch in auto.pipeline_choices} == {1, 2, 4}
    with pytest.raises(ap.ConfigError, match="one pipeline stage per rank"):
        ap.compile(m.gpt_sgd_step, p, b, config=cfg.replace(backend="native"))
    with pytest.raises(ap.ConfigError, match="1f1b"):
        cfg.replace(pipeline_scheduler="gpipe")


@pytest.mark.parametrize("backend", ["jax", pytest.param("native", marks=pytest.mark.native)])
@pytest.mark.parametrize("scheduler", ["1f1b", "gpipe"])
def test_a_two_stage_pipeline_of_one_micro_batch_runs(backend, scheduler):
    """micro_batches=1: each stage runs the whole batch in turn (no overlap, a bubble of the
    other stage's time), the single-device step's values."""
    p, b = m.mlp_params(), m.mlp_batch()
    c = ap.compile(two_stage_mlp_step, p, b, config=config(micro=1, scheduler=scheduler,
                                                          backend=backend))
    assert len(c.strategy.stages) == 2 and c.strategy.micro_batches == 1
    assert_same(c(p, b), two_stage_mlp_step(p, b))
    c.close()
