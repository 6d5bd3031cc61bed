"""MindSpore's auto-parallel context API: set/get/reset, the bare decorator, strategy files and
dataset_strategy, on fake CPU devices."""
import re
import warnings

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
                                 pipeline_config={"pipeline_scheduler": "gpipe",
                                                  "pipeline_interleave": True},   # as 2.10 asks
                                 strategy_ckpt_config={"save_file": "/tmp/s.json"},
                                 dataset_strategy="full_batch", gradients_mean=True)
    get = ap.get_auto_parallel_context
    assert get("parallel_mode") == "auto_parallel" and get("device_num") == 8
    assert get("search_mode") == "dynamic_programming" and get("max_device_memory") == 2 << 30
    assert get("parallel_optimizer_config") == {
        "optimizer_level": "level2", "parallel_optimizer_threshold": 64,
        "gradient_accumulation_shard": False, "optimizer_weight_shard_size": -1}
    assert get("pipeline_config") == {"pipeline_scheduler": "gpipe", "pipeline_interleave": True}
    assert get("strategy_ckpt_config") == {"load_file": "", "save_file": "/tmp/s.json",
                                           "only_trainable_params": True}
    assert get("dataset_strategy") == "full_batch" and get("enable_parallel_optimizer") is True
    cfg = ap.context_config()
    assert cfg.mesh_shape == (8,) and cfg.optimizer_level is ap.OptimizerLevel.LEVEL2
    assert cfg.strategy_ckpt_save_file == "/tmp/s.json"
    ap.set_auto_parallel_context(device_num=4)             # other keys keep their values
    assert get("device_num") == 4 and get("parallel_mode") == "auto_parallel"
    ap.reset_auto_parallel_context()
    assert get("parallel_mode") == "stand_alone" and get("max_device_memory") is None


# MindSpore 2.10's set_auto_parallel_context keys (its docstring's Args)
MINDSPORE_KEYS = (
    "device_num", "global_rank", "gradients_mean", "gradient_fp32_sync", "loss_repeated_mean",
    "parallel_mode", "search_mode", "auto_parallel_search_mode", "parameter_broadcast",
    "strategy_ckpt_load_file", "strategy_ckpt_save_file", "full_batch", "dataset_strategy",
    "enable_parallel_optimizer", "force_fp32_communication", "enable_alltoall",
    "all_reduce_fusion_config", "pipeline_stages", "pipeline_result_broadcast",
    "pipeline_config", "parallel_optimizer_config", "comm_fusion", "strategy_ckpt_config",
    "group_ckpt_save_file", "auto_pipeline", "dump_local_norm", "dump_local_norm_path",
    "dump_device_local_norm",
    # not in its documentation, accepted by its context all the same (older scripts set them)
    "pipeline_segments", "communi_parallel_mode", "optimizer_weight_shard_size",
    "optimizer_weight_shard_aggregated_save", "sharding_propagation",
    "auto_parallel_new_interface", "init_param_in_compile", "grad_accumulation_step")


def test_every_mindspore_key_is_accepted_with_its_default():
    get = ap.get_auto_parallel_context
    defaults = {k: get(k) for k in MINDSPORE_KEYS}
    assert defaults["global_rank"] == 0 and defaults["gradient_fp32_sync"] is True
    assert defaults["full_batch"] is False and defaults["enable_alltoall"] is False
    assert defaults["strategy_ckpt_load_file"] == "" and defaults["all_reduce_fusion_config"] == []
    assert defaults["comm_fusion"]["openstate"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # MindSpore's defaults never warn
        ap.set_auto_parallel_context(**{k: v for k, v in defaults.items()
                                        if k not in ("search_mode", "auto_parallel_search_mode",
                                                     "dataset_strategy")})
    assert {k: get(k) for k in MINDSPORE_KEYS if k != "dataset_strategy"} == {
        k: v for k, v in defaults.items() if k != "dataset_strategy"}
    assert get("dataset_strategy") == "data_parallel"            # what full_batch=False means



def test_mindspore_keys_autopar_honours_become_config_fields():
    ap.set_auto_parallel_context(parallel_mode="auto_parallel", sharding_propagation=True)
    assert ap.context_config().search_mode is ap.SearchMode.SHARDING_PROPAGATION
    ap.set_auto_parallel_context(
        parallel_mode="auto_parallel", device_num=4, full_batch=True,
        auto_parallel_search_mode="dynamic_programming", strategy_ckpt_save_file="/tmp/a.ckpt",
        comm_fusion={"allreduce": {"mode": "size", "config": 32}},
        parallel_optimizer_config={"gradient_accumulation_shard": True})
    cfg = ap.context_config()
    assert cfg.dataset_strategy == "full_batch" and cfg.search_mode is ap.SearchMode.DYNAMIC_PROGRAMMING
    assert cfg.strategy_ckpt_save_file == "/tmp/a.ckpt" and cfg.allreduce_fusion_bytes == 32 << 20
    assert cfg.optimizer_level is ap.OptimizerLevel.LEVEL2
    assert ap.get_auto_parallel_context("strategy_ckpt_config")["save_file"] == "/tmp/a.ckpt"
    ap.set_auto_parallel_context(comm_fusion={"openstate": False}, auto_pipeline=True)
    cfg = ap.context_config()
    assert cfg.allreduce_fusion_bytes == 0 and cfg.pipeline_stages == "auto"
    ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "auto", "config": None}})
    assert ap.context_config().allreduce_fusion_bytes == 64 << 20      # MindSpore's auto


def test_every_config_field_is_a_key_by_its_own_name_too():
    """Fields that MindSpore sets inside a dict key (parallel_optimizer_config,
    pipeline_config) are keys by their ParallelConfig names as well, both ways."""
    ap.set_auto_parallel_context(optimizer_level="level3", parallel_optimizer_threshold=0,
                                 pipeline_scheduler="gpipe")
    cfg = ap.context_config()
    assert cfg.optimizer_level is ap.OptimizerLevel.LEVEL3 and cfg.parallel_optimizer_threshold == 0
    assert ap.get_auto_parallel_context("pipeline_scheduler") == "gpipe"
    assert ap.get_auto_parallel_context("parallel_optimizer_config")["optimizer_level"] == "level3"


@pytest.mark.parametrize("kw, says", [
    ({"global_rank": 3}, "global_rank=3: in MindSpore, this process's rank; autopar ignores "
                         "it: autopar takes each process's rank from its launcher"),
    ({"enable_alltoall": True}, None),                       # autopar does: no warning
    ({"force_fp32_communication": True}, "in its own dtype"),
    ({"pipeline_config": {"pipeline_scheduler": "1f1b", "pipeline_interleave": True}},
     "schedulers are gpipe and 1f1b"),
    ({"pipeline_config": {"pipeline_scheduler": "gpipe", "pipeline_interleave": True}}, None),
    ({"pipeline_config": {"pipeline_scheduler": "1f1b"}}, "MindSpore 2.10 raises KeyError"),
    ({"pipeline_config": {"pipeline_scheduler": "zero_bubble_v", "pipeline_interleave": False}},
     "ZB-V.*runs 1f1b instead"),
    ({"pipeline_config": {"pipeline_scheduler": "seqpipe", "pipeline_interleave": False}},
     "Seq1F1B.*runs 1f1b instead"),
    ({"comm_fusion": {"allreduce": {"mode": "index", "config": [2, 5]}}}, "parameter indices; "
     "autopar fuses all-reduces by size"),
    ({"pipeline_segments": 2}, "virtual pipeline.*pipeline_interleave=N"),
    ({"communi_parallel_mode": "same_server_group_parallel"}, "one at a time"),
    ({"communi_parallel_mode": "no_group_parallel"}, None),
    ({"optimizer_weight_shard_size": 2}, "whole data-parallel group"),   # top-level, as 1.x
    ({"optimizer_weight_shard_aggregated_save": True}, None),
    ({"auto_parallel_new_interface": True}, None),
    ({"init_param_in_compile": False}, None),
    ({"grad_accumulation_step": 4}, "inside a pipeline only"),
    ({"comm_fusion": {"allgather": {"mode": "size", "config": 8}}}, "fuses all-reduces only"),
    ({"dump_local_norm": True}, "not built"),
])
def test_mindspore_keys_autopar_does_not_do_warn_what_they_mean(kw, says):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ap.set_auto_parallel_context(**kw)
    got = [str(w.message) for w in caught if issubclass(w.category, ap.AutoparWarning)]
    assert (len(got) == 1 and re.search(says, got[0])) if says else not got, got
    key = next(iter(kw))
    assert ap.get_auto_parallel_context(key) == (kw[key] if key not in (
        "pipeline_config", "comm_fusion") else ap.get_auto_parallel_context(key))


@pytest.mark.parametrize("kw, says", [
    ({"parallel_mod": "auto_parallel"}, "valid keys: .*parallel_mode"),
    ({"parallel_mode": "auto"}, "'semi_auto_parallel', 'auto_parallel'"),
    ({"search_mode": "greedy"}, "'recursive_programming', 'ilp'"),
    ({"parallel_optimizer_config": {"optimizer_level": "level4"}}, "'level1', 'level2'"),
    ({"parallel_optimizer_config": {"shard_everything": True}},
     "valid keys: optimizer_level, parallel_optimizer_threshold"),
    ({"strategy_ckpt_config": "a.json"}, "takes a dict with keys load_file, save_file"),
    ({"full_batch": "yes"}, "full_batch takes True or False"),
    ({"comm_fusion": {"allreduce": {"mode": "index", "config": 2}}}, "list of parameter "
     "indices"),
    ({"communi_parallel_mode": "some_groups"}, "'all_group_parallel'"),
    ({"sharding_propagation": 1}, "sharding_propagation takes True or False"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": 0}}}, "threshold in MB above 0"),
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
                                       (((4, 1), (4, 1)), True), (((1, 1), (1, 1)), False),
                                       (((2, 1), (2, 1)), True)])   # mesh (2, 2), as MindSpore's
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


def test_mindspores_autoparallel_wrapper_configures_and_runs_the_step(tmp_path):
    """ap.AutoParallel(step, parallel_mode=...) with MindSpore 2.10's methods: its modes as
    autopar's, hsdp as the parallel optimizer, the operator strategy file saved when it
    compiles and loaded by another wrapper, MindSpore-only choices warned about at the
    caller's line, and the step's values."""
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    net = ap.AutoParallel(m.mlp_sgd_step, parallel_mode="sharding_propagation", device_num=4,
                          backend="jax")
    net.hsdp(threshold=0, optimizer_level="level2")
    net.dataset_strategy("data_parallel")
    path = str(tmp_path / "ops.json")
    net.save_operator_strategy_file(path)
    cfg = net.config()
    assert cfg.parallel_mode is ap.ParallelMode.AUTO_PARALLEL
    assert cfg.search_mode is ap.SearchMode.SHARDING_PROPAGATION
    assert cfg.enable_parallel_optimizer and cfg.optimizer_level is ap.OptimizerLevel.LEVEL2
    assert_same(net(p, b), m.mlp_sgd_step(p, b))
    again = ap.AutoParallel(m.mlp_sgd_step, device_num=4, backend="jax")
    again.load_operator_strategy_file(path)
    assert again.config().parallel_mode is ap.ParallelMode.SEMI_AUTO_PARALLEL
    assert again.compile(p, b).strategy.search == "loaded"
    with pytest.warns(ap.AutoparWarning, match="zero_bubble_v.*runs 1f1b") as caught:
        again.pipeline(stages=2, scheduler="zero_bubble_v")
    assert caught[0].filename == __file__
    assert again.get_pipeline_stages() == 2
    with pytest.raises(ap.ConfigError, match="'semi_auto', 'sharding_propagation'"):
        ap.AutoParallel(m.mlp_sgd_step, parallel_mode="auto_parallel")
    with pytest.raises(ap.ConfigError, match="absolute path"):
        net.load_operator_strategy_file("ops.json")
    net.close()


def test_algo_parameters_are_mindspores_keys_warned_about_where_autopar_differs():
    try:
        assert ap.get_algo_parameters("fully_use_devices") is True
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ap.set_algo_parameters(fully_use_devices=False, tensor_slice_align_size=16)
        with pytest.warns(ap.AutoparWarning, match=r"enable_algo_approxi=True\): in MindSpore"):
            ap.set_algo_parameters(enable_algo_approxi=True)
        assert ap.get_algo_parameters("enable_algo_approxi") is True
        with pytest.raises(ap.ConfigError, match="MindSpore's are fully_use_devices"):
            ap.set_algo_parameters(fully_use_device=True)
        with pytest.raises(ap.ConfigError, match="takes a bool"):
            ap.set_algo_parameters(fully_use_devices="yes")
    finally:
        ap.reset_algo_parameters()
    assert ap.get_algo_parameters("enable_algo_approxi") is False
