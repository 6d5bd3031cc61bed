"""profile_plans (tools/profile.py): one rank's step measured with its collectives replaced by
local stand-ins of the same shapes, and the Strategy's estimate built on the measurement."""
import subprocess

import jax
import numpy as np
import pytest

import autopar as ap
import models as m
from autopar.program import Collective, Slice, StepKind
from autopar.tools import profile


@pytest.mark.parametrize("step, out_shape", [
    (Collective(StepKind.ALL_REDUCE, ("x",), (3, 4), "float32", 48), (3, 4)),
    (Collective(StepKind.ALL_GATHER, ("x",), (3, 4), "float32", 96, dim=0), (6, 4)),
    (Collective(StepKind.REDUCE_SCATTER, ("x",), (3, 4), "float32", 48, dim=1), (3, 2)),
    (Collective(StepKind.ALL_TO_ALL, ("x",), (3, 4), "float32", 48, dim=0, dst_dim=1), (6, 2)),
    (Slice(("x",), 1, (3, 4)), (3, 2)),
    (Slice(("x",), None, (3, 4), kind=StepKind.PARTIAL_ZERO), (3, 4)),
])
def test_stand_ins_have_the_collectives_shapes(step, out_shape):
    """Each stand-in gives a rank's block the shape the collective would (2 ranks)."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert profile._STANDIN[step.kind](x, step, 2).shape == out_shape


@pytest.mark.parametrize("backend,mesh", [("native", (2,)), ("jax", (2,)), ("jax", (2, 2))])
def test_profiled_plan_estimates_with_its_measured_compute(backend, mesh):
    """With profile_plans, the Strategy's compute is its step as measured in a child process
    (native: one rank on one core; jax: every device's at once, as the jax backend runs them)
    and its estimate is that plus the priced communication and overhead; the plan's layouts
    are the same as without it."""
    params, batch = m.mlp_params((64, 256, 64)), m.mlp_batch(64, (64, 256, 64))
    cfg = dict(parallel_mode="semi_auto_parallel", mesh_shape=mesh, backend=backend,
               progress=False)
    shard = ({"w1": "[_,x]", "b1": "[x]", "w2": "[x,_]", "b2": None}, None)
    priced = ap.plan(m.mlp_sgd_step, params, batch, config=ap.ParallelConfig(**cfg),
                     in_strategy=shard)
    measured = ap.plan(m.mlp_sgd_step, params, batch, in_strategy=shard,
                       config=ap.ParallelConfig(**cfg, profile_plans=True))
    assert priced.measured_compute is None
    c = measured.measured_compute
    assert c is not None and 0 < c < 1.0
    assert measured.compute_time == c
    assert measured.step_time == pytest.approx(c + measured.comm_time + measured.overhead_time)
    assert [o.out_layouts for o in measured.ops] == [o.out_layouts for o in priced.ops]
    assert "(measured)" in measured.table()
    again = ap.Strategy.from_json(measured.to_json())
    assert again.measured_compute == c and again.step_time == measured.step_time


def test_profile_plans_refuses_a_pipeline():
    params, batch = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=2, micro_batches=2,
                            profile_plans=True, progress=False)
    with pytest.raises(ap.ConfigError, match="profile_plans.*without a pipeline"):
        ap.plan(m.mlp_sgd_step, params, batch, config=cfg)


def test_plans_are_timed_in_turn_in_one_child_and_the_same_program_once():
    """compute_seconds of several programs: one median each, in order; a program lowered
    twice to the same exported step is timed once (the same median); a step with twice the
    batch rows per rank takes longer than the same plan with half of them."""
    sizes = (64, 512, 64)
    params, big, small = m.mlp_params(sizes), m.mlp_batch(512, sizes), m.mlp_batch(64, sizes)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, progress=False)
    a = ap.compile(m.mlp_sgd_step, params, big, config=cfg).program
    again = ap.compile(m.mlp_sgd_step, params, big, config=cfg).program
    less = ap.compile(m.mlp_sgd_step, params, small, config=cfg).program
    t = profile.compute_seconds([a, less, again], seconds=0.3)
    assert len(t) == 3 and t[0] == t[2] and all(x > 0 for x in t)
    assert t[0] > t[1]


def test_native_ranks_sharing_cores_take_turns(monkeypatch):
    """A native mesh with more ranks than this process's cores: one rank's profiled step is
    stretched by the ranks per core (its workers take turns on the cores); the jax backend's
    profile runs every device at once and is not."""
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, progress=False)
    prog = ap.compile(m.mlp_sgd_step, m.mlp_params(), m.mlp_batch(batch=16), config=cfg).program
    done = subprocess.CompletedProcess([], 0, stdout=b'{"seconds": [0.01]}\n', stderr=b"")
    monkeypatch.setattr(profile.subprocess, "run", lambda *a, **k: done)
    monkeypatch.setattr(profile.os, "sched_getaffinity", lambda pid: {0})
    assert profile.compute_seconds([prog], "native") == [pytest.approx(0.04)]
    assert profile.compute_seconds([prog], "jax") == [pytest.approx(0.01)]
    monkeypatch.setattr(profile.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert profile.compute_seconds([prog], "native") == [pytest.approx(0.01)]


def test_profiles_are_scaled_to_the_machines_speed_at_calibration(monkeypatch):
    """With ``Topology.reference_compute`` (the calibration's reference step as profiled then),
    a profile times that step too, last, and scales the plans' figures by its calibrated over
    its measured time; without it, or on a stage or a stretched topology (profiled on other
    devices), the figures stay as measured."""
    from dataclasses import replace

    from autopar.compiler import api
    from autopar.tools.calibrate import stretch
    got = []

    def fake(programs, backend):
        got.append([p.mesh.size for p in programs])
        return [0.010, 0.040][:len(programs)]       # the reference at half its calibrated speed
    monkeypatch.setattr(api, "compute_seconds", fake)
    params, batch = m.mlp_params((64, 256, 64)), m.mlp_batch(64, (64, 256, 64))
    topo = replace(ap.Topology.local(2), reference_compute=0.020)
    cfg = dict(parallel_mode="data_parallel", device_num=2, progress=False,
               profile_plans=True)
    s = ap.plan(m.mlp_sgd_step, params, batch, config=ap.ParallelConfig(**cfg, topology=topo))
    assert got == [[2, 2]] and s.measured_compute == pytest.approx(0.005)
    got.clear()
    s = ap.plan(m.mlp_sgd_step, params, batch,
                config=ap.ParallelConfig(**cfg, topology=ap.Topology.local(2)))
    assert got == [[2]] and s.measured_compute == pytest.approx(0.010)
    assert stretch(topo, 4).reference_compute == 0 and topo.inner(1).reference_compute == 0
    assert topo.inner(2).reference_compute == 0.020
    assert ap.Topology.from_dict(topo.to_dict()) == topo
    assert "reference_compute" not in ap.Topology.local(2).to_dict()


def test_each_argument_and_result_costs_the_topologys_arg_overhead():
    """``Topology.arg_overhead`` (calibrated: 16 arrays of 64 KB against one of 1 MB) is
    paid per argument and result of a call: a plan's overhead grows by it times their number;
    a stretched topology's per call grows as its step overhead does."""
    from dataclasses import replace

    from autopar.tools.calibrate import stretch
    params, batch = m.mlp_params((64, 256, 64)), m.mlp_batch(64, (64, 256, 64))
    base = ap.Topology.local(2)
    cfg = dict(parallel_mode="data_parallel", device_num=2, progress=False)
    plain = ap.plan(m.mlp_sgd_step, params, batch, config=ap.ParallelConfig(**cfg, topology=base))
    costly = ap.plan(m.mlp_sgd_step, params, batch, config=ap.ParallelConfig(
        **cfg, topology=replace(base, arg_overhead=1e-4)))
    arrays = 4 + 2 + 1 + 4               # w1 b1 w2 b2 and the batch's x, y in; loss, params out
    assert costly.overhead_time - plain.overhead_time == pytest.approx(arrays * 1e-4)
    t = replace(base, arg_overhead=1e-4, step_overhead=1e-3)
    assert stretch(t, 4).arg_overhead == pytest.approx(2e-4)
    assert ap.Topology.from_dict(t.to_dict()) == t
    with pytest.raises(ap.ConfigError, match="arg_overhead"):
        replace(base, arg_overhead=-1.0)


def test_state_passed_back_is_not_priced_as_moved_again():
    """A training loop passes back the parameters the last call returned, which stay on the
    devices (the native runtime's resident blocks, the jax backend's arrays): a call moves the
    batch in and the results out, whatever the state's layout (data parallelism's replicated
    parameters were priced as sent to every device each call)."""
    from dataclasses import replace
    params, batch = m.mlp_params((64, 256, 64)), m.mlp_batch(64, (64, 256, 64))
    base = ap.Topology.local(2)
    cfg = dict(parallel_mode="data_parallel", device_num=2, progress=False)
    plain = ap.plan(m.mlp_sgd_step, params, batch, config=ap.ParallelConfig(**cfg, topology=base))
    costly = ap.plan(m.mlp_sgd_step, params, batch, config=ap.ParallelConfig(
        **cfg, topology=replace(base, host_beta=1e-9)))
    nbytes = lambda tree: sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
    moved = nbytes(batch) + nbytes(params) + 4        # the batch in, the new params and loss out
    assert (costly.overhead_time - plain.overhead_time) == pytest.approx(
        moved * (1e-9 - base.host_beta))
