"""ParallelConfig's option groups: each validates its own fields, together they hold every
field once, and a config hands out its groups normalised."""
import dataclasses

import pytest

import autopar as ap
from autopar.config import (DeviceOptions, ExecutionOptions, ModeOptions, OptimizerOptions,
                            PipelineOptions, SearchOptions)

GROUPS = (ModeOptions, SearchOptions, ExecutionOptions, OptimizerOptions, PipelineOptions,
          DeviceOptions)


def names(cls):
    return [f.name for f in dataclasses.fields(cls)]


def test_the_groups_hold_every_field_once_with_its_default():
    grouped = [n for g in GROUPS for n in names(g)]
    assert sorted(grouped) == sorted(names(ap.ParallelConfig))
    defaults = {f.name: f.default for f in dataclasses.fields(ap.ParallelConfig)}
    for g in GROUPS:
        assert all(f.default == defaults[f.name] for f in dataclasses.fields(g)), g


@pytest.mark.parametrize("group, field, bad", [
    (ModeOptions, "parallel_mode", "auto"),
    (ModeOptions, "dataset_strategy", "half"),
    (ModeOptions, "dataset_strategy", ((0, 1),)),
    (SearchOptions, "search_mode", "greedy"),
    (SearchOptions, "max_device_memory", "lots"),
    (ExecutionOptions, "backend", "gpu"),
    (ExecutionOptions, "collective_timeout", 0),
    (ExecutionOptions, "allreduce_fusion_bytes", "big"),
    (OptimizerOptions, "optimizer_level", "level4"),
    (OptimizerOptions, "parallel_optimizer_threshold", -1),
    (PipelineOptions, "pipeline_stages", 0),
    (PipelineOptions, "micro_batches", True),
    (PipelineOptions, "pipeline_scheduler", "zb"),
    (PipelineOptions, "pipeline_stage_devices", "half"),
    (DeviceOptions, "device_num", 0),
    (DeviceOptions, "mesh_shape", (3,)),           # device_num=2 below: they disagree
])
def test_each_group_rejects_a_bad_value_naming_the_field(group, field, bad):
    kw = {"device_num": 2} if group is DeviceOptions and field != "device_num" else {}
    with pytest.raises(ap.ConfigError, match=f"{field}="):
        group(**kw, **{field: bad})
    with pytest.raises(ap.ConfigError, match=f"{field}="):     # the same through the flat config
        ap.ParallelConfig(**kw, **{field: bad})


def test_groups_normalise_their_fields():
    assert ModeOptions("data_parallel", dataset_strategy=[[4, 1]]) == ModeOptions(
        ap.ParallelMode.DATA_PARALLEL, dataset_strategy=((4, 1),))
    assert SearchOptions(max_device_memory="2GB").max_device_memory == 2 << 30
    assert ExecutionOptions(collective_timeout="5", allreduce_fusion_bytes=None) == \
        ExecutionOptions(collective_timeout=5.0, allreduce_fusion_bytes=0)
    assert OptimizerOptions(optimizer_level="level2").optimizer_level is ap.OptimizerLevel.LEVEL2
    assert PipelineOptions(pipeline_scheduler="gpipe").pipeline_scheduler is \
        ap.PipelineScheduler.GPIPE


def test_devices_resolve_their_defaults():
    assert DeviceOptions() == DeviceOptions(device_num=1, mesh_shape=(1,))
    assert DeviceOptions(mesh_shape=[2, 2]).device_num == 4
    assert DeviceOptions(device_num=8).mesh_shape == (8,)
    assert DeviceOptions(device_num=8, pipeline_stages=2).mesh_shape == (2, 4)
    assert DeviceOptions(device_num=6, pipeline_stages=4).mesh_shape == (6,)
    assert DeviceOptions(device_num=4, mesh_shape=(2, 2)).logical_mesh().shape == (2, 2)
    topo = ap.Topology.local(2)
    with pytest.raises(ap.ConfigError, match="topology .* has 2 devices, device_num is 4"):
        DeviceOptions(device_num=4, topology=topo)


def test_pipeline_is_checked_against_the_devices():
    six = DeviceOptions(device_num=6)
    assert PipelineOptions(2, [2, 4]).for_devices(six).pipeline_stage_devices == (2, 4)
    with pytest.raises(ap.ConfigError, match=r"pipeline_stage_devices=\[2, 3\] must give 2 "
                                             "device counts >= 1 .* summing to device_num=6"):
        PipelineOptions(2, [2, 3]).for_devices(six)
    with pytest.raises(ap.ConfigError, match="pipeline_stages=4 does not divide device_num=6"):
        PipelineOptions(4).for_devices(six)
    with pytest.raises(ap.ConfigError, match="pipeline_stages=8 needs at least that many"):
        PipelineOptions(8, "auto").for_devices(six)
    with pytest.raises(ap.ConfigError, match=r"mesh_shape=\(3, 2\) starts with 3"):
        PipelineOptions(2).for_devices(DeviceOptions(mesh_shape=(3, 2)))
    with pytest.raises(ap.ConfigError, match="stand_alone"):
        ModeOptions().check_devices(six)


def test_a_config_hands_out_its_groups():
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=8, pipeline_stages=2,
                            pipeline_stage_devices=[4, 4], micro_batches=4, backend="jax",
                            max_device_memory="1GB", optimizer_level="level3",
                            collective_timeout=3)
    assert cfg.pipeline == PipelineOptions(2, (4, 4), 4)
    assert cfg.devices == DeviceOptions(device_num=8, mesh_shape=(2, 4))
    assert cfg.mode == ModeOptions(ap.ParallelMode.AUTO_PARALLEL)
    assert cfg.search == SearchOptions(max_device_memory=1 << 30)
    assert cfg.execution == ExecutionOptions(ap.Backend.JAX, 3.0)
    assert cfg.optimizer == OptimizerOptions(optimizer_level=ap.OptimizerLevel.LEVEL3)
    # the flat fields keep the normalised values, as before
    assert cfg.mesh_shape == (2, 4) and cfg.pipeline_stage_devices == (4, 4)
    assert cfg.collective_timeout == 3.0 and cfg.max_device_memory == 1 << 30
    assert cfg.logical_mesh().shape == (2, 4)
    with pytest.raises(AttributeError):
        cfg.pipeline = PipelineOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pipeline.micro_batches = 2
