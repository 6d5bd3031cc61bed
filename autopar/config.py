"""ParallelConfig: every setting of one compilation, in one frozen value.

In: keyword fields (MindSpore's names where MindSpore has one). Out: a validated, frozen
``ParallelConfig``; ``config.mesh()`` builds the ``LogicalMesh`` it describes. Enums list the
valid choices; an invalid value raises ``ConfigError`` listing them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional

from .errors import ConfigError
from .mesh import LogicalMesh
from .topology import Topology


class ParallelMode(str, Enum):
    STAND_ALONE = "stand_alone"              # one device, no communication
    DATA_PARALLEL = "data_parallel"          # batch split over all devices, gradients all-reduced
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"  # user annotations + propagation
    AUTO_PARALLEL = "auto_parallel"          # full strategy search
    HYBRID_PARALLEL = "hybrid_parallel"      # the step calls collectives itself


class SearchMode(str, Enum):
    SHARDING_PROPAGATION = "sharding_propagation"
    DYNAMIC_PROGRAMMING = "dynamic_programming"
    RECURSIVE_PROGRAMMING = "recursive_programming"
    ILP = "ilp"


class OptimizerLevel(str, Enum):
    LEVEL1 = "level1"    # optimizer state and update sharded; gradients all-reduced, then sliced
    LEVEL2 = "level2"    # ... and gradients reduce-scattered (only a shard is ever reduced)
    LEVEL3 = "level3"    # ... and parameters kept sharded, all-gathered where they are read


class PipelineScheduler(str, Enum):
    GPIPE = "gpipe"      # every micro-batch's forward, then every backward
    ONE_F_ONE_B = "1f1b"  # after a warm-up, one forward then one backward: fewer live activations


class Backend(str, Enum):
    JAX = "jax"          # jax.shard_map over a jax.sharding.Mesh
    NATIVE = "native"    # autopar's multi-process runtime (the default)


def _enum(cls, value, field):
    try:
        return cls(value.value if isinstance(value, Enum) else value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"{field}={value!r} is not valid; choose one of {valid}.") from None


_UNITS = {"": 1, "B": 1, "KB": 2 ** 10, "MB": 2 ** 20, "GB": 2 ** 30, "TB": 2 ** 40}


def parse_bytes(value, field: str = "max_device_memory") -> Optional[int]:
    """``16GB`` / ``"512 MB"`` / ``1024`` -> bytes (binary units, as MindSpore's max_device_memory)."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?B?)\s*", str(value).upper())
    if not m:
        raise ConfigError(f"{field}={value!r} is not a size; write e.g. 16GB or 512MB.")
    return int(float(m.group(1)) * _UNITS[m.group(2) if m.group(2) != "" else ""])


@dataclass(frozen=True)
class ParallelConfig:
    parallel_mode: ParallelMode = ParallelMode.STAND_ALONE   # how the step is parallelised
    device_num: Optional[int] = None          # devices used; default: product of mesh_shape, else 1
    mesh_shape: Optional[tuple] = None        # logical mesh; default: (device_num,)
    mesh_axis_names: Optional[tuple] = None   # default: x / x,y / x,y,z
    topology: Optional[Topology] = None       # default: Topology.local(device_num)
    search_mode: SearchMode = SearchMode.SHARDING_PROPAGATION  # solver for auto_parallel
    max_device_memory: Optional[int] = None   # bytes per device ("16GB" accepted); None: no cap
    gradients_mean: bool = True               # data_parallel: replica gradients are averaged, so
                                              # the step equals the single-device one (False: see README)
    backend: Backend = Backend.NATIVE         # where compiled steps run: "native" (one worker
                                              # process per device, C++ collectives) or "jax"
                                              # (shard_map over jax.devices(): GPU, TPU, fake CPUs);
                                              # one device runs in this process either way
    search_time: Optional[float] = None       # seconds auto_parallel's solver may take (None: its default)
    progress: bool = True                     # report searches that run past a second on stderr
    collective_timeout: float = 10.0          # native backend: seconds a collective may wait for a
                                              # peer before every rank raises CollectiveError
    allreduce_fusion_bytes: int = 25 << 20    # native backend: all-reduce bucket size
                                              # ("25MB" accepted; 0: one call per all-reduce)
    enable_parallel_optimizer: bool = False   # shard the parameter update over the devices that
                                              # hold a parameter replicated (ZeRO; see optimizer_level)
    optimizer_level: OptimizerLevel = OptimizerLevel.LEVEL1   # what is sharded, as MindSpore's
                                              # parallel_optimizer_config["optimizer_level"]
    parallel_optimizer_threshold: int = 64    # KB: smaller parameters keep a replicated update
                                              # (MindSpore's default, also in KB)
    pipeline_stages: int = 1                  # stages the devices are split into (the first mesh
                                              # axis; each stage runs its layers on the rest)
    pipeline_stage_devices: object = None     # devices per stage: "equal" (the first mesh
                                              # axis), "auto" (the stage planner chooses them
                                              # with the cuts), a tuple (one count per stage,
                                              # summing to device_num; a stage mesh of another
                                              # size is one axis), or None: "auto" where the
                                              # planner cuts the stages, else "equal"
    micro_batches: int = 1                    # pipeline: the batch is split into this many
                                              # micro-batches; gradients accumulate over them
    pipeline_scheduler: PipelineScheduler = PipelineScheduler.ONE_F_ONE_B   # "gpipe" or "1f1b"
    dataset_strategy: object = None           # layouts of the batch arguments: "data_parallel"
                                              # (dim 0 split over every device), "full_batch"
                                              # (replicated), or MindSpore's tuple of split tuples,
                                              # one per batch leaf; None: split in data_parallel
                                              # mode, chosen by the search or propagation otherwise
    strategy_ckpt_load_file: Optional[str] = None   # compile reuses the strategy saved there
    strategy_ckpt_save_file: Optional[str] = None   # compile saves its strategy there (autopar JSON)

    def __post_init__(self):
        """Every field validated and normalised (names to enums, "25MB" to bytes). Long
        because it is a table, one check per field in the fields' order, so a new field's
        check goes beside it."""
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("parallel_mode", _enum(ParallelMode, self.parallel_mode, "parallel_mode"))
        set_("search_mode", _enum(SearchMode, self.search_mode, "search_mode"))
        set_("backend", _enum(Backend, self.backend, "backend"))
        set_("optimizer_level", _enum(OptimizerLevel, self.optimizer_level, "optimizer_level"))
        set_("pipeline_scheduler", _enum(PipelineScheduler, self.pipeline_scheduler,
                                         "pipeline_scheduler"))
        for key in ("pipeline_stages", "micro_batches"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{key}={v!r} must be an integer >= 1.")
        if not (isinstance(self.parallel_optimizer_threshold, (int, float))
                and self.parallel_optimizer_threshold >= 0):
            raise ConfigError(f"parallel_optimizer_threshold={self.parallel_optimizer_threshold!r} "
                              "must be a number of KB >= 0 (0 shards every parameter's update).")
        ds = self.dataset_strategy
        if isinstance(ds, (list, tuple)):
            ds = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in ds)
            if not all(isinstance(s, tuple) and all(isinstance(c, int) and not isinstance(c, bool)
                                                   and c >= 1 for c in s) for s in ds):
                raise ConfigError(f"dataset_strategy={self.dataset_strategy!r}: give one tuple of "
                                  "split counts per batch argument leaf, e.g. ((4, 1), (4, 1)).")
            set_("dataset_strategy", ds)
        elif ds not in (None, "data_parallel", "full_batch"):
            raise ConfigError(f"dataset_strategy={ds!r} is not valid; choose 'data_parallel', "
                              "'full_batch' or a tuple of split-count tuples, one per batch leaf.")
        set_("max_device_memory", parse_bytes(self.max_device_memory))
        set_("allreduce_fusion_bytes", parse_bytes(self.allreduce_fusion_bytes or 0,
                                                   "allreduce_fusion_bytes"))
        try:
            timeout = float(self.collective_timeout)
        except (TypeError, ValueError):
            timeout = -1.0
        if not timeout > 0:
            raise ConfigError(f"collective_timeout={self.collective_timeout!r} must be a positive "
                              "number of seconds.")
        set_("collective_timeout", timeout)
        n = self.device_num
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"device_num={n!r} must be an integer >= 1.")
        shape = tuple(int(s) for s in self.mesh_shape) if self.mesh_shape is not None else None
        if shape is None:
            n = 1 if n is None else int(n)
            shape = (n,)
        elif n is None:
            n = math.prod(shape)
        stages, given = self.pipeline_stages, self.pipeline_stage_devices
        if self.mesh_shape is None and stages > 1 and n % stages == 0:
            shape = (stages, n // stages)          # default: the stage axis, then one axis
        if n < 1 or math.prod(shape) != n:
            raise ConfigError(f"device_num={n} but mesh_shape={shape} holds {math.prod(shape)} "
                              "devices; make them agree.")
        if isinstance(given, (list, tuple)):
            given = tuple(given)
            if len(given) != stages or sum(given) != n or not all(
                    isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in given):
                raise ConfigError(f"pipeline_stage_devices={self.pipeline_stage_devices!r} must "
                                  f"give {stages} device counts >= 1 (one per stage) summing to "
                                  f"device_num={n}, e.g. {(1,) * (stages - 1) + (n - stages + 1,)}.")
            set_("pipeline_stage_devices", given)
        elif given not in (None, "auto", "equal"):
            raise ConfigError(f"pipeline_stage_devices={given!r} is not valid; give 'equal', "
                              "'auto', None or a tuple of device counts, one per stage.")
        elif given == "auto" and n < stages:
            raise ConfigError(f"pipeline_stages={stages} needs at least that many devices; "
                              f"device_num is {n}.")
        if given in (None, "equal") and stages > 1 and shape[0] != stages:
            raise ConfigError(f"pipeline_stages={stages} splits the devices along the first mesh "
                              f"axis, but mesh_shape={shape} starts with {shape[0]}; use a "
                              f"mesh_shape that starts with {stages}, e.g. {(stages, n // stages)}"
                              if n % stages == 0 else
                              f"pipeline_stages={stages} does not divide device_num={n}; use a "
                              "stage count that divides the devices, or give "
                              "pipeline_stage_devices (a count per stage, or 'auto').")
        if self.parallel_mode is ParallelMode.STAND_ALONE and n != 1:
            raise ConfigError(f"parallel_mode='stand_alone' runs on one device but device_num={n}; "
                              "use data_parallel or semi_auto_parallel for several devices.")
        set_("device_num", n)
        set_("mesh_shape", shape)
        if self.mesh_axis_names is not None:
            set_("mesh_axis_names", tuple(self.mesh_axis_names))
        if self.topology is not None and self.topology.num_devices != n:
            raise ConfigError(f"topology {self.topology} has {self.topology.num_devices} devices, "
                              f"device_num is {n}.")

    def mesh(self) -> LogicalMesh:
        return LogicalMesh.create(self.mesh_shape, self.mesh_axis_names,
                                  self.topology or Topology.local(self.device_num))

    def replace(self, **changes) -> "ParallelConfig":
        return replace(self, **changes)
