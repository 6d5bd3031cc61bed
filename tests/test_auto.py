"""auto_parallel: the search picks every layout, under the per-device memory cap."""
import jax
import numpy as np
import pytest

import autopar as ap
import models as m
from test_api import assert_same

SIZES = (256, 1024, 256)


def mlp():
    return m.mlp_params(sizes=SIZES), m.mlp_batch(batch=32, sizes=SIZES)


def dp_peak(p, b):
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4)
    return ap.plan(m.mlp_sgd_step, p, b, config=cfg).peak_memory


@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming", "ilp"])
def test_auto_parallel_fits_a_cap_data_parallel_cannot(mode):
    p, b = mlp()
    cap = int(0.4 * dp_peak(p, b))            # replicated parameters and gradients do not fit
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, search_mode=mode,
                            max_device_memory=cap)
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    assert c.strategy.peak_memory <= cap
    assert c.strategy.memory_limit == cap and c.strategy.search == mode
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    assert any(not i.layout.is_replicated() for i in c.strategy.inputs if i.is_param)


def test_infeasible_cap_names_the_peak():
    p, b = mlp()
    cap = int(0.2 * dp_peak(p, b))
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, max_device_memory=cap)
    with pytest.raises(ap.InfeasibleError) as e:
        ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    msg = str(e.value)
    assert str(cap) in msg and "at step" in msg and "still need" in msg
    assert "argument w" in msg or "models.py" in msg          # the operator or parameter named


def test_auto_parallel_gpt_matches_single_device():
    p, b = m.gpt_params(d=64, vocab=128, seq=16), m.gpt_batch(batch=8, seq=16, vocab=128)
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4)
    c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
    assert_same(c(p, b), m.gpt_sgd_step(p, b))
    dp = ap.plan(m.gpt_sgd_step, p, b, config=ap.ParallelConfig(parallel_mode="data_parallel",
                                                                device_num=4))
    assert c.strategy.step_time <= dp.step_time * 1.05


def test_long_searches_report_progress(capsys):
    p, b = m.gpt_params(d=64, vocab=128, seq=16), m.gpt_batch(batch=8, seq=16, vocab=128)
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, search_mode="ilp",
                            search_time=4.0)
    ap.plan(m.gpt_sgd_step, p, b, config=cfg)
    err = capsys.readouterr().err
    assert "autopar [gpt_sgd_step, ilp," in err
    ap.plan(m.gpt_sgd_step, p, b, config=cfg.replace(progress=False))
    assert capsys.readouterr().err == ""
