"""The pipeline search (``pipeline_stages`` / ``micro_batches`` "auto"): which (stages,
micro-batches) pairs it plans, in what order, what it skips and why, and that the pair it
chooses is the least estimate within the cap."""
import dataclasses

import jax
import numpy as np
import pytest

import autopar as ap
import models as m
from test_pipeline import assert_same


def test_auto_stages_and_micro_batches_take_the_least_estimate():
    """pipeline_stages and micro_batches "auto": every pair tried is listed with its estimate
    (or why it could not be planned), the chosen one has the least estimate of them and is
    the plan compiled, the same as planning that pair directly, and the step equals the
    single-device one."""
    p, b = m.gpt_params(layers=4), m.gpt_batch(batch=16)
    cfg = ap.ParallelConfig(backend="jax", parallel_mode="data_parallel", device_num=8,
                            pipeline_stages="auto", micro_batches="auto", progress=False)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    tried = c.strategy.pipeline_choices
    assert {(t.stages, t.micro_batches) for t in tried} >= {(1, 1), (2, 2), (4, 4)}
    chosen = [t for t in tried if t.note == "chosen"]
    assert len(chosen) == 1
    planned = [t.seconds for t in tried if t.seconds is not None]
    assert chosen[0].seconds == min(planned)
    assert all(t.note for t in tried if t.seconds is None)          # why it was refused
    assert (len(c.strategy.stages) or 1, c.strategy.micro_batches) == \
        (chosen[0].stages, chosen[0].micro_batches)
    again = ap.plan(m.gpt_sgd_step, p, b, config=cfg.replace(
        pipeline_stages=chosen[0].stages, micro_batches=chosen[0].micro_batches,
        pipeline_stage_devices=None if chosen[0].stages == 1 else "equal",
        mesh_shape=None if chosen[0].stages == 1 else (chosen[0].stages, 8 // chosen[0].stages)))
    estimate = again.pipeline_time if again.stages else again.step_time
    assert estimate == pytest.approx(chosen[0].seconds)
    assert "pipelines considered" in c.strategy.table()
    assert_same(c(p, b), m.gpt_sgd_step(p, b))


@dataclasses.dataclass(frozen=True)
class _Estimate:
    stages: tuple
    pipeline_time: float
    step_time: float
    peak_memory: int = 0
    pipeline_choices: tuple = ()


def test_auto_pipeline_skips_fewer_micro_batches_once_the_stages_overflow():
    """A stage count's pairs are planned from the most micro-batches down; once its stages
    exceed the cap, fewer (larger) micro-batches are not planned, and say why. One stage and
    one micro-batch is planned whole (other layouts), so it is still planned."""
    from types import SimpleNamespace
    from autopar.compiler.api import CompileRequest
    from autopar.compiler.pipeline_plan import auto_pipeline, pipeline_options
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4,
                            pipeline_stages="auto", micro_batches="auto", progress=False)
    graph = SimpleNamespace(inputs=[SimpleNamespace(shape=(64, 8))])
    req = CompileRequest(config=cfg, graph=graph, args=(np.zeros((64, 8)),), batch_argnums=(0,),
                         in_strategy=None, strategy=None, names=(("b", False),), name="step",
                         pairs=(), pipelined=True)
    staged, whole = [], []

    def stage_one(r, cache):
        S, M = r.config.pipeline_stages, r.config.micro_batches
        staged.append((S, M))
        if S < 4:
            raise ap.InfeasibleError(f"no split into {S} stages fits")
        return SimpleNamespace(bound=lambda m: 1.0 / m, stage_plan=SimpleNamespace(memory=(S,)))

    def plan_one(r, cache):
        S, M = r.config.pipeline_stages, r.config.micro_batches
        (whole if (S, M) == (1, 1) else staged).append((S, M))
        t = 1.0 / M + 0.5
        return None, _Estimate((0,) * S if S > 1 else (), t, t), None

    pairs = [(S, M) for S, M, v in pipeline_options(cfg, cfg.logical_mesh(), 64)]   # interleave 1
    most = {S: max(M for s, M in pairs if s == S) for S, _ in pairs}
    _, strat, _ = auto_pipeline(req, cfg.logical_mesh(), plan_one, stage_one)
    assert whole == [(1, 1)]
    assert [p for p in staged if p[0] < 4] == [(1, most[1]), (2, most[2])]
    assert [c.micro_batches for c in strat.pipeline_choices if c.stages == 4] == \
        sorted(M for S, M in pairs if S == 4)
    notes = {(c.stages, c.micro_batches): c.note for c in strat.pipeline_choices}
    assert list(notes) == pairs
    for S in (1, 2):
        assert "InfeasibleError" in notes[S, most[S]]
        assert all(f"no split into {S} stage(s) fits the cap with {most[S]} micro-batches" in
                   notes[S, M] for s, M in pairs if s == S and 1 < M < most[S])
    assert notes[4, most[4]] == "chosen"


def test_auto_pipeline_stops_two_stage_counts_past_the_best():
    """Stage counts are planned up to their stages in ascending order and stop once two counts
    past the best were slower (counts that could not be planned do not count); pairs are cut
    into programs in order of their stages' bound only while the bound can still beat the best
    whole estimate. Every pair not planned or not cut is listed with why, and when no pair
    plans, the error names each pair's reason."""
    from types import SimpleNamespace
    from autopar.compiler.api import CompileRequest
    from autopar.compiler.pipeline_plan import auto_pipeline
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=64,
                            pipeline_stages="auto", micro_batches=4, progress=False)
    graph = SimpleNamespace(inputs=[SimpleNamespace(shape=(64, 8))])
    req = CompileRequest(config=cfg, graph=graph, args=(np.zeros((64, 8)),), batch_argnums=(0,),
                         in_strategy=None, strategy=None, names=(("b", False),), name="step",
                         pairs=(), pipelined=True)
    seconds = {1: 9.0, 2: 5.0, 4: 4.0, 8: 6.0, 16: None, 32: 7.0, 64: 1.0}   # None: fails
    overhead = {1: 0.5, 2: 0.5, 4: 1.5, 8: 0.5, 32: 0.5, 64: 0.5}   # on top of the bound
    staged, cut = [], []

    def stage_one(r, cache):
        S = r.config.pipeline_stages
        staged.append(S)
        if seconds[S] is None:
            raise ap.InfeasibleError(f"{S} stages do not fit")
        return SimpleNamespace(bound=lambda M: seconds[S], stage_plan=SimpleNamespace(memory=(S,)))

    def plan_one(r, cache):
        S = r.config.pipeline_stages
        cut.append(S)
        t = seconds[S] + overhead[S]
        return None, _Estimate((0,) * S if S > 1 else (), t, t), None

    _, strat, _ = auto_pipeline(req, cfg.logical_mesh(), plan_one, stage_one)
    assert staged == [1, 2, 4, 8, 16, 32]          # 64 is past 8 and 32, both slower than 4
    assert cut == [4, 2]          # 4 (bound 4) takes 5.5 s whole, so 2 (bound 5) may beat it
    notes = {c.stages: c.note for c in strat.pipeline_choices}
    assert notes[2] == "chosen" and "InfeasibleError" in notes[16]
    assert "not planned" in notes[64] and all("not cut" in notes[S] for S in (1, 8, 32))
    seconds.update({S: None for S in seconds})
    with pytest.raises(ap.InfeasibleError, match="Every .* pair tried failed: 1 stage.*64 stage"):
        auto_pipeline(req, cfg.logical_mesh(), plan_one, stage_one)


def test_auto_stage_counts_are_whole_hosts():
    """On 3 DGX A100 nodes (mesh (3, 8)), 2 stages of 12 GPUs or 4 of 6 would span two hosts:
    auto's pipeline search tries, near each power of two, the stage counts whose stages
    ``Topology.inner`` accepts (1, 3, 8 of one GPU per host, 12 of two GPUs), and plans one (it
    aborted the plan); a count given that splits hosts is refused naming why."""
    from autopar.compiler.pipeline_plan import stage_counts
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=48)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (p, b))
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=24, mesh_shape=(3, 8),
                            mesh_axis_names=("node", "gpu"),
                            topology=ap.Topology.machine("dgx-a100", 3, 8),
                            pipeline_stages="auto", micro_batches="auto", progress=False)
    assert stage_counts(cfg.logical_mesh()) == [1, 3, 8, 12]
    s = ap.plan(m.gpt_sgd_step, *args, config=cfg, batch_argnums=(1,))
    assert {c.stages for c in s.pipeline_choices} <= {1, 3, 8, 12}
    assert any(c.note == "chosen" for c in s.pipeline_choices)
    with pytest.raises(ap.ConfigError, match="12 devices per pipeline stage do not fill whole"):
        ap.plan(m.gpt_sgd_step, *args, config=cfg.replace(pipeline_stages=2),
                batch_argnums=(1,))
    assert ap.Topology.machine("dgx-a100", 3, 8).inner(4).num_devices == 4   # half a host


def test_a_stages_devices_print_as_runs():
    from autopar.strategies.strategy import device_ranges
    assert device_ranges(range(256, 512)) == "[256-511]"
    assert device_ranges((2, 3)) == "[2, 3]" and device_ranges((0, 1, 2, 8, 9, 10)) == "[0-2, 8-10]"
