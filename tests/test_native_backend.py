"""backend="native": the compiler-core training steps on 4 worker processes give the
single-device values, and a compiled object keeps its workers between calls."""
import numpy as np
import pytest

import autopar as ap
import models as m
from test_api import assert_same

MEGATRON = {"w1": (1, 2), "b1": (2,), "w2": (2, 1), "b2": (1,)}


@pytest.mark.parametrize("mode,mesh,strategy", [
    ("data_parallel", (4,), None),
    ("semi_auto_parallel", (2, 2), (MEGATRON, None)),
    ("auto_parallel", (2, 2), None),
])
def test_mlp_step_on_four_ranks(mode, mesh, strategy):
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    cfg = ap.ParallelConfig(parallel_mode=mode, device_num=4, mesh_shape=mesh, backend="native",
                            progress=False, collective_timeout=5)
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg, in_strategy=strategy)
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    job = c._runner.job
    assert job.timeout == 5.0
    b2 = m.mlp_batch(batch=16, seed=5)
    assert_same(c(p, b2), m.mlp_sgd_step(p, b2))       # same workers, new values
    assert c._runner.job is job and all(pr.poll() is None for pr in job.procs)
    c._runner.close()
    assert all(pr.poll() is not None for pr in job.procs)


def test_gpt_block_on_four_ranks():
    p, b = m.gpt_params(), m.gpt_batch(batch=4)
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, mesh_shape=(2, 2),
                            search_mode="dynamic_programming", backend="native", progress=False)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    kinds = {x.kind for x in c.collectives()}
    assert kinds                                  # the plan communicates
    assert_same(c(p, b), m.gpt_sgd_step(p, b))
    c._runner.close()


@pytest.mark.parametrize("bad", [0, -1, "soon"])
def test_collective_timeout_must_be_positive(bad):
    with pytest.raises(ap.ConfigError, match="collective_timeout"):
        ap.ParallelConfig(collective_timeout=bad)


def worker_stats(comm):
    from autopar.runtime.native_backend import stats
    return stats(comm)


def test_gradient_all_reduces_are_fused_into_buckets():
    """data_parallel's loss and gradient all-reduces of a GPT block: one call per all-reduce
    without fusion, fewer with the default buckets; the values are the same."""
    p, b = m.gpt_params(), m.gpt_batch(batch=4)
    calls = {}
    for fusion in (0, "25MB"):
        cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="native",
                                allreduce_fusion_bytes=fusion)
        c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
        assert_same(c(p, b), m.gpt_sgd_step(p, b))
        calls[fusion] = c._runner.job.call(worker_stats, [()] * 2)[0]["all_reduce_calls"]
        c._runner.close()
    n = sum(x.kind == "all_reduce" for x in c.collectives())
    assert calls[0] == n and calls["25MB"] < n
