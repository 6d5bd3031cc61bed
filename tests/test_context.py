"""MindSpore's auto-parallel context API: set/get/reset, the bare decorator, strategy files and
dataset_strategy, on fake CPU devices."""
import jax
import numpy as np
import pytest

import autopar as ap
import models as m


@pytest.fixture(autouse=True)
def clean_context():
    ap.reset_auto_parallel_context()
    yield
    ap.reset_auto_parallel_context()


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=1e-5, atol=1e-6), a, b)


def test_set_get_reset_in_mindspore_form():
    assert ap.get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert ap.get_auto_parallel_context("device_num") == 1
    ap.set_auto_parallel_context(parallel_mode=ap.ParallelMode.AUTO_PARALLEL, device_num=8,
                                 search_mode="dynamic_programming", max_device_memory="2GB",
                                 enable_parallel_optimizer=True,
                                 parallel_optimizer_config={"optimizer_level": "level2"},
                                 pipeline_config={"pipeline_scheduler": "gpipe"},
                                 strategy_ckpt_config={"save_file": "/tmp/s.json"},
                                 dataset_strategy="full_batch", gradients_mean=True)
    get = ap.get_auto_parallel_context
    assert get("parallel_mode") == "auto_parallel" and get("device_num") == 8
    assert get("search_mode") == "dynamic_programming" and get("max_device_memory") == 2 << 30
    assert get("parallel_optimizer_config") == {"optimizer_level": "level2",
                                                "parallel_optimizer_threshold": 64}
    assert get("pipeline_config") == {"pipeline_scheduler": "gpipe"}
    assert get("strategy_ckpt_config") == {"load_file": None, "save_file": "/tmp/s.json"}
    assert get("dataset_strategy") == "full_batch" and get("enable_parallel_optimizer") is True
    cfg = ap.context_config()
    assert cfg.mesh_shape == (8,) and cfg.optimizer_level is ap.OptimizerLevel.LEVEL2
    assert cfg.strategy_ckpt_save_file == "/tmp/s.json"
    ap.set_auto_parallel_context(device_num=4)             # other keys keep their values
    assert get("device_num") == 4 and get("parallel_mode") == "auto_parallel"
    ap.reset_auto_parallel_context()
    assert get("parallel_mode") == "stand_alone" and get("max_device_memory") is None


@pytest.mark.parametrize("kw, says", [
    ({"parallel_mod": "auto_parallel"}, "valid keys: .*parallel_mode"),
    ({"parallel_mode": "auto"}, "'semi_auto_parallel', 'auto_parallel'"),
    ({"search_mode": "greedy"}, "'recursive_programming', 'ilp'"),
    ({"parallel_optimizer_config": {"optimizer_level": "level4"}}, "'level1', 'level2'"),
    ({"parallel_optimizer_config": {"gradient_accumulation_shard": True}},
     "valid keys: optimizer_level, parallel_optimizer_threshold"),
    ({"strategy_ckpt_config": "a.json"}, "takes a dict with keys load_file, save_file"),
    ({"device_num": 0}, "integer >= 1"),
    ({"max_device_memory": "lots"}, "write e.g. 16GB"),
    ({"dataset_strategy": "half_batch"}, "'data_parallel', 'full_batch'"),
])
def test_invalid_keys_and_values_list_the_valid_ones(kw, says):
    with pytest.raises(ap.ConfigError, match=says):
        ap.set_auto_parallel_context(**kw)
    assert ap.get_auto_parallel_context("parallel_mode") == "stand_alone"   # nothing was set
    with pytest.raises(ap.ConfigError, match="valid keys"):
        ap.get_auto_parallel_context("no_such_key")


def test_bare_decorator_follows_the_context():
    @ap.parallel
    def step(params, batch):
        return m.mlp_sgd_step(params, batch)

    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    ap.set_auto_parallel_context(parallel_mode="data_parallel", device_num=4, backend="jax")
    assert_same(step(p, b), m.mlp_sgd_step(p, b))
    c = step.compile(p, b)
    assert c.strategy.mode == "data_parallel" and c.config.device_num == 4
    ap.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2)
    c2 = step.compile(p, b)                  # a new context: compiled again
    assert c2 is not c and c2.strategy.mode == "semi_auto_parallel" and c2.config.device_num == 2
    assert_same(step(p, b), m.mlp_sgd_step(p, b))
    # ap.compile with no config takes the context too
    assert ap.compile(m.mlp_sgd_step, p, b).strategy.mode == "semi_auto_parallel"


def test_strategy_ckpt_config_saves_and_loads(tmp_path):
    path = str(tmp_path / "strategy.json")
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    ap.set_auto_parallel_context(parallel_mode="auto_parallel", device_num=4, backend="jax",
                                 strategy_ckpt_config={"save_file": path})
    first = ap.compile(m.mlp_sgd_step, p, b)
    saved = ap.Strategy.load(path)
    assert [o.out_layouts for o in saved.ops] == [o.out_layouts for o in first.strategy.ops]
    ap.set_auto_parallel_context(strategy_ckpt_config={"load_file": path, "save_file": None})
    again = ap.compile(m.mlp_sgd_step, p, b)
    assert again.strategy.search == "loaded"
    assert [i.layout for i in again.strategy.inputs] == [i.layout for i in saved.inputs]
    assert_same(again(p, b), m.mlp_sgd_step(p, b))


@pytest.mark.parametrize("ds, split", [("full_batch", False), ("data_parallel", True),
                                       (((4, 1), (4, 1)), True), (((1, 1), (1, 1)), False)])
def test_dataset_strategy_lays_out_the_batch(ds, split):
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=4, backend="jax",
                            dataset_strategy=ds)
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    batch = [i.layout for i in c.strategy.inputs if not i.is_param]
    assert all(bool(lay.dims[0]) == split for lay in batch), batch
    assert_same(c(p, b), m.mlp_sgd_step(p, b))


def test_dataset_strategy_errors():
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=4,
                            dataset_strategy=((4, 1),))
    with pytest.raises(ap.ConfigError, match="2 batch leaves"):
        ap.plan(m.mlp_sgd_step, p, b, config=cfg)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, dataset_strategy="full_batch")
    with pytest.raises(ap.ConfigError, match="use semi_auto_parallel"):
        ap.plan(m.mlp_sgd_step, p, b, config=cfg)
