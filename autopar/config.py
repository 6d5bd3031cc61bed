"""ParallelConfig: every setting of one compilation, in one frozen value.

In: keyword fields (MindSpore's names where MindSpore has one). Out: a validated, frozen
``ParallelConfig``; ``config.logical_mesh()`` builds the ``LogicalMesh`` it describes. Enums list the
valid choices; an invalid value raises ``ConfigError`` listing them.

The fields fall into option groups, one per component, each a frozen dataclass that validates
its own fields (``ModeOptions``, ``SearchOptions``, ``ExecutionOptions``, ``OptimizerOptions``,
``PipelineOptions``, ``DeviceOptions``); ``ParallelConfig`` builds them from its flat fields and
returns them as ``config.mode``, ``.search``, ``.execution``, ``.optimizer``, ``.pipeline`` and
``.devices``.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import re
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Literal

import numpy as np

from .errors import ConfigError
from .mesh import LogicalMesh
from .topology import Topology

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh, PartitionSpec

    from .layout import Layout

    # a count, or "auto": the planner chooses it
    CountOrAuto = int | Literal["auto"]
    # pipeline_stage_devices: a device count per stage, "auto", "equal" or None
    StageDevices = Sequence[int] | Literal["auto", "equal"] | None
    # dataset_strategy: a name, or one layout per batch leaf (split counts, a PartitionSpec,
    # an ap.Layout or its text)
    DatasetStrategy = (
        Literal["data_parallel", "full_batch"]
        | Sequence[Sequence[int] | PartitionSpec | Layout | str]
        | None
    )


class ParallelMode(str, Enum):
    STAND_ALONE = "stand_alone"  # one device, no communication
    DATA_PARALLEL = "data_parallel"  # batch split over all devices, gradients all-reduced
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"  # user annotations + propagation
    AUTO_PARALLEL = "auto_parallel"  # full strategy search
    HYBRID_PARALLEL = "hybrid_parallel"  # the step calls collectives itself


class SearchMode(str, Enum):
    SHARDING_PROPAGATION = "sharding_propagation"
    DYNAMIC_PROGRAMMING = "dynamic_programming"
    RECURSIVE_PROGRAMMING = "recursive_programming"
    ILP = "ilp"


class OptimizerLevel(str, Enum):
    LEVEL1 = "level1"  # optimizer state and update sharded; gradients all-reduced, then sliced
    LEVEL2 = "level2"  # ... and gradients reduce-scattered (only a shard is ever reduced)
    LEVEL3 = "level3"  # ... and parameters kept sharded, all-gathered where they are read


class PipelineScheduler(str, Enum):
    GPIPE = "gpipe"  # every micro-batch's forward, then every backward
    ONE_F_ONE_B = "1f1b"  # after a warm-up, one forward then one backward: fewer live activations


NATIVE_MAX_RANKS = 256  # ranks of one native job (native/src/shm.cc: kMaxRanks)


class Backend(str, Enum):
    JAX = "jax"  # jax.shard_map over a jax.sharding.Mesh
    NATIVE = "native"  # autopar's multi-process runtime (the default)
    XLA = "xla"  # jax.jit with the plan's shardings: XLA's SPMD partitioner inserts
    # the collectives (runtime.xla_backend)


def _enum(cls, value, field):
    try:
        return cls(value.value if isinstance(value, Enum) else value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"{field}={value!r} is not valid; choose one of {valid}.") from None


_UNITS = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def parse_bytes(value, field: str = "max_device_memory") -> int | None:
    """``16GB`` / ``"512 MB"`` / ``1024`` -> bytes (binary units, as MindSpore's max_device_memory)."""
    if isinstance(value, bool) or isinstance(value, int) and value < 0:
        raise ConfigError(
            f"{field}={value!r} is not a size; write e.g. 16GB, 512MB or a number of bytes >= 0."
        )
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?B?)\s*", str(value).upper())
    if not m or not isinstance(value, (str, float)):
        raise ConfigError(f"{field}={value!r} is not a size; write e.g. 16GB or 512MB.")
    return int(float(m.group(1)) * _UNITS[m.group(2) if m.group(2) != "" else ""])


def _set(obj, **values):
    """Normalise fields of a frozen dataclass in its __post_init__."""
    for k, v in values.items():
        object.__setattr__(obj, k, v)


def _flag(obj, *names) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be True or False.")


def _path(obj, *names) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"{name}={value!r} must be a file path (a str) or None.")


def _count(value, field: str, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{field}={value!r} must be an integer >= 1"
            + (f" {alternative}." if alternative else ".")
        )


# --- option groups --------------------------------------------------------------------------
# ParallelConfig's fields, one group per component; each group's fields have ParallelConfig's
# names (their meaning is documented there), and each group validates and normalises its own.
# ParallelConfig builds them from its flat fields; ``config.pipeline`` etc. return them.


@dataclass(frozen=True)
class ModeOptions:
    """How the step is parallelised, and how the batch and the gradients are treated.
    ``check_devices`` checks the mode against the devices."""

    parallel_mode: ParallelMode = ParallelMode.STAND_ALONE
    gradients_mean: bool = True
    dataset_strategy: DatasetStrategy = None
    unannotated: str = "propagate"

    def __post_init__(self):
        _set(self, parallel_mode=_enum(ParallelMode, self.parallel_mode, "parallel_mode"))
        if self.unannotated not in ("propagate", "batch"):
            raise ConfigError(
                f"unannotated={self.unannotated!r}: choose 'propagate' (operators "
                "without a strategy follow the annotated ones) or 'batch' "
                "(MindSpore's semi_auto default: their batch dimension split)."
            )
        if (
            self.unannotated == "batch"
            and self.parallel_mode is not ParallelMode.SEMI_AUTO_PARALLEL
        ):
            raise ConfigError(
                f"unannotated='batch' is semi_auto_parallel's choice; "
                f"parallel_mode is {self.parallel_mode.value}."
            )
        _flag(self, "gradients_mean")
        ds = self.dataset_strategy
        if isinstance(ds, (list, tuple)):
            from jax.sharding import PartitionSpec

            from .layout import Layout

            named = lambda s: isinstance(s, (PartitionSpec, Layout, str))
            ds = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in ds)
            if not all(
                named(s)
                or isinstance(s, tuple)
                and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in s)
                for s in ds
            ):
                raise ConfigError(
                    f"dataset_strategy={self.dataset_strategy!r}: give one layout "
                    "per batch argument leaf: a tuple of split counts, e.g. "
                    "((4, 1), (4, 1)), a jax.sharding.PartitionSpec, e.g. "
                    "(P('dp'), P('dp')), or an ap.Layout or its text."
                )
            _set(self, dataset_strategy=ds)
        elif ds not in (None, "data_parallel", "full_batch"):
            raise ConfigError(
                f"dataset_strategy={ds!r} is not valid; choose 'data_parallel', "
                "'full_batch' or a tuple of layouts (split-count tuples, "
                "PartitionSpecs or ap.Layouts), one per batch leaf."
            )

    def check_devices(self, devices: DeviceOptions) -> None:
        n = devices.device_num
        if self.parallel_mode is ParallelMode.STAND_ALONE and n != 1:
            raise ConfigError(
                f"parallel_mode='stand_alone' runs on one device but device_num={n}; "
                "use data_parallel or semi_auto_parallel for several devices."
            )


RECOMPUTE = ("as_written", "selective", "none", "auto")  # ParallelConfig.recompute's values


@dataclass(frozen=True)
class SearchOptions:
    """Where a strategy comes from: the solver, its time and memory limits, its progress
    report, and the strategy files compile loads or saves."""

    search_mode: SearchMode | None = None
    search_time: float | None = None
    max_device_memory: int | None = None
    progress: bool = True
    strategy_ckpt_load_file: str | None = None
    strategy_ckpt_save_file: str | None = None
    profile_plans: bool = False
    recompute: str = "as_written"

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ConfigError(
                f"recompute={self.recompute!r}: choose 'as_written' (the step's "
                "jax.checkpoint blocks recomputed as written), 'selective' (only "
                "their large, cheap values: the attention's scores), 'none' (no "
                "recomputation: the backward pass reads the forward's values) or "
                "'auto' (auto_parallel plans each and keeps the faster plan that "
                "fits)."
            )
        _set(
            self,
            search_mode=None
            if self.search_mode is None
            else _enum(SearchMode, self.search_mode, "search_mode"),
            max_device_memory=parse_bytes(self.max_device_memory),
        )
        t = self.search_time
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0
        ):
            raise ConfigError(
                f"search_time={t!r} must be a finite number of seconds > 0, or "
                "None for the solver's default."
            )
        _flag(self, "progress", "profile_plans")
        _path(self, "strategy_ckpt_load_file", "strategy_ckpt_save_file")


@dataclass(frozen=True)
class ExecutionOptions:
    """Where and how compiled steps run: the backend, and the native runtime's collective
    timeout and all-reduce bucket size."""

    backend: Backend = Backend.NATIVE
    collective_timeout: float = 10.0
    allreduce_fusion_bytes: int = 25 << 20

    def __post_init__(self):
        _set(self, backend=_enum(Backend, self.backend, "backend"))
        _set(
            self,
            allreduce_fusion_bytes=parse_bytes(
                self.allreduce_fusion_bytes or 0, "allreduce_fusion_bytes"
            ),
        )
        t = self.collective_timeout
        try:  # a number, or its text ("5", as from a file)
            timeout = -1.0 if isinstance(t, bool) else float(t)
        except (TypeError, ValueError):
            timeout = -1.0
        if not 0 < timeout < math.inf:
            raise ConfigError(f"collective_timeout={t!r} must be a finite number of seconds > 0.")
        _set(self, collective_timeout=timeout)


@dataclass(frozen=True)
class OptimizerOptions:
    """The sharded parameter update (ZeRO): on or off, its level and its size threshold."""

    enable_parallel_optimizer: bool = False
    optimizer_level: OptimizerLevel = OptimizerLevel.LEVEL1
    parallel_optimizer_threshold: int = 64

    def __post_init__(self):
        _set(self, optimizer_level=_enum(OptimizerLevel, self.optimizer_level, "optimizer_level"))
        _flag(self, "enable_parallel_optimizer")
        if not (
            isinstance(self.parallel_optimizer_threshold, (int, float))
            and not isinstance(self.parallel_optimizer_threshold, bool)
            and self.parallel_optimizer_threshold >= 0
        ):
            raise ConfigError(
                f"parallel_optimizer_threshold={self.parallel_optimizer_threshold!r} "
                "must be a number of KB >= 0 (0 shards every parameter's update)."
            )


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline: stages, their devices, micro-batches and schedule. A device-count tuple
    is checked against the devices by ``for_devices``, which returns it as a tuple. Stages and
    micro-batches may be ``"auto"``: the planner chooses them (``auto``)."""

    pipeline_stages: CountOrAuto = 1
    pipeline_stage_devices: StageDevices = None
    micro_batches: CountOrAuto = 1
    pipeline_scheduler: PipelineScheduler = PipelineScheduler.ONE_F_ONE_B
    pipeline_interleave: CountOrAuto = 1

    def __post_init__(self):
        _set(
            self,
            pipeline_scheduler=_enum(
                PipelineScheduler, self.pipeline_scheduler, "pipeline_scheduler"
            ),
        )
        for field_ in ("pipeline_stages", "micro_batches", "pipeline_interleave"):
            if getattr(self, field_) != "auto":
                _count(getattr(self, field_), field_, "or 'auto'")
        v = self.pipeline_interleave
        if v != 1 and self.pipeline_scheduler != PipelineScheduler.ONE_F_ONE_B:
            raise ConfigError(
                f"pipeline_interleave={v!r} interleaves 1F1B (Megatron-LM's "
                "virtual pipeline); set pipeline_scheduler='1f1b' or leave "
                "pipeline_interleave at 1."
            )
        given = self.pipeline_stage_devices
        if (
            v != 1
            and given not in (None, "equal")
            and not (isinstance(given, (list, tuple)) and len(set(given)) == 1)
        ):
            raise ConfigError(
                f"pipeline_interleave={v!r}: each device holds {v!r} stages of "
                "equal size; leave pipeline_stage_devices unset or 'equal'."
            )
        if isinstance(v, int) and v > 1 and self.pipeline_stages == 1:
            raise ConfigError(
                f"pipeline_interleave={v} needs pipeline_stages > 1 (each of "
                "the stages' devices then holds that many of the model's parts)."
            )
        given = self.pipeline_stage_devices
        if not isinstance(given, (list, tuple)) and given not in (None, "auto", "equal"):
            raise ConfigError(
                f"pipeline_stage_devices={given!r} is not valid; give 'equal', "
                "'auto', None or a tuple of device counts, one per stage."
            )
        if self.auto and given not in (None, "equal"):
            raise ConfigError(
                f"pipeline_stage_devices={given!r} with pipeline_stages or "
                "micro_batches 'auto': the planner gives every stage an equal "
                "share; leave pipeline_stage_devices unset."
            )

    @property
    def auto(self) -> bool:
        """The planner chooses the stages, the micro-batches or the interleaving."""
        return "auto" in (self.pipeline_stages, self.micro_batches, self.pipeline_interleave)

    def for_devices(self, devices: DeviceOptions) -> PipelineOptions:
        """These options checked against the devices and their mesh (the stage devices add up,
        the stages divide the first mesh axis), with the stage device counts as a tuple."""
        n, shape = devices.device_num, devices.mesh_shape
        stages, given = self.pipeline_stages, self.pipeline_stage_devices
        if self.auto:
            return self
        # not auto: __post_init__ checked the stages are a count; DeviceOptions resolved the rest
        assert isinstance(stages, int) and n is not None and shape is not None
        if isinstance(given, (list, tuple)):
            given = tuple(given)
            if (
                not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in given)
                or len(given) != stages
                or sum(given) != n
            ):
                raise ConfigError(
                    f"pipeline_stage_devices={self.pipeline_stage_devices!r} must "
                    f"give {stages} device counts >= 1 (one per stage) summing to "
                    f"device_num={n}, e.g. {(1,) * (stages - 1) + (n - stages + 1,)}."
                )
        elif given == "auto" and n < stages:
            raise ConfigError(
                f"pipeline_stages={stages} needs at least that many devices; device_num is {n}."
            )
        if given in (None, "equal") and stages > 1 and shape[0] % stages:
            raise ConfigError(
                f"pipeline_stages={stages} splits the devices along the first mesh "
                f"axis, but mesh_shape={shape} starts with {shape[0]}, which "
                f"{stages} does not divide; use a mesh_shape whose first axis "
                f"{stages} divides, e.g. {(stages, n // stages)}"
                if n % stages == 0
                else f"pipeline_stages={stages} does not divide device_num={n}; use a "
                "stage count that divides the devices, or give "
                "pipeline_stage_devices (a count per stage, or 'auto')."
            )
        return (
            self
            if given is self.pipeline_stage_devices
            else replace(self, pipeline_stage_devices=given)
        )


@dataclass(frozen=True)
class DeviceOptions:
    """The devices and their logical mesh, defaults resolved: ``device_num``,
    ``mesh_shape`` and ``mesh_axis_names`` from ``mesh`` (a ``jax.sharding.Mesh`` or
    ``AbstractMesh``) when given, ``device_num`` from ``mesh_shape`` (else 1), ``mesh_shape``
    from ``device_num`` -- (stages, rest) when ``pipeline_stages`` (given to the constructor,
    not kept) divides it, else one axis. ``logical_mesh()`` builds the ``LogicalMesh``."""

    device_num: int | None = None
    mesh_shape: tuple[int, ...] | None = None
    mesh_axis_names: tuple[str, ...] | None = None
    topology: Topology | None = None
    mesh: Mesh | AbstractMesh | None = None
    pipeline_stages: InitVar[CountOrAuto] = 1

    def __post_init__(self, pipeline_stages):
        if self.mesh is not None:
            self._from_jax_mesh()
        n = self.device_num
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"device_num={n!r} must be an integer >= 1.")
        shape = self.mesh_shape
        if shape is not None:
            if (
                not isinstance(shape, (list, tuple))
                or not shape
                or not all(
                    isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 1
                    for k in shape
                )
            ):
                raise ConfigError(
                    f"mesh_shape={shape!r} must be a tuple of axis sizes, integers "
                    ">= 1, e.g. (8,) or (2, 4)."
                )
            shape = tuple(int(k) for k in shape)
        if shape is None:
            n = 1 if n is None else int(n)
            shape = (n,)
            if pipeline_stages != "auto" and pipeline_stages > 1 and n % pipeline_stages == 0:
                shape = (pipeline_stages, n // pipeline_stages)  # the stage axis, then one axis
        elif n is None:
            n = math.prod(shape)
        if n < 1 or math.prod(shape) != n:
            raise ConfigError(
                f"device_num={n} but mesh_shape={shape} holds {math.prod(shape)} "
                "devices; make them agree."
            )
        _set(self, device_num=n, mesh_shape=shape)
        names = self.mesh_axis_names
        if names is not None:
            if (
                not isinstance(names, (list, tuple))
                or len(names) != len(shape)
                or not all(isinstance(a, str) and a.isidentifier() for a in names)
                or len(set(names)) != len(names)
            ):
                raise ConfigError(
                    f"mesh_axis_names={names!r} must name each of the "
                    f"{len(shape)} axes of mesh_shape={shape} once, with "
                    "identifiers such as ('dp', 'mp')."
                )
            _set(self, mesh_axis_names=tuple(names))
        if isinstance(self.topology, str):
            _set(self, topology=Topology.preset(self.topology, n))
        elif self.topology is not None and not isinstance(self.topology, Topology):
            raise ConfigError(
                f"topology={self.topology!r} must be an ap.Topology, a preset "
                "name ('local', 'cluster:HOSTSxPER_HOST') or a topology file path."
            )
        if self.topology is not None and self.topology.num_devices != n:
            raise ConfigError(
                f"topology {self.topology} has {self.topology.num_devices} devices, "
                f"device_num is {n}."
            )

    def _from_jax_mesh(self) -> None:
        """``device_num``, ``mesh_shape``, ``mesh_axis_names`` from ``mesh``; a ConfigError
        where they are given too and differ."""
        from jax.sharding import AbstractMesh, Mesh

        m = self.mesh
        if not isinstance(m, (Mesh, AbstractMesh)):
            raise ConfigError(
                f"mesh={m!r} must be a jax.sharding.Mesh or AbstractMesh (or None: "
                "give mesh_shape and mesh_axis_names instead)."
            )
        got = {
            "device_num": int(m.size),
            "mesh_shape": tuple(int(k) for k in m.axis_sizes),
            "mesh_axis_names": tuple(m.axis_names),
        }
        for k, v in got.items():
            given = getattr(self, k)
            if given is not None and (tuple(given) if k != "device_num" else given) != v:
                raise ConfigError(
                    f"{k}={given!r} differs from the mesh's {v!r} ({m}); give "
                    "the mesh alone, or make them agree."
                )
        _set(self, **got)

    def logical_mesh(self) -> LogicalMesh:
        assert self.device_num is not None  # __post_init__ resolved it
        return LogicalMesh.create(
            self.mesh_shape, self.mesh_axis_names, self.topology or Topology.local(self.device_num)
        )


@dataclass(frozen=True)
class ParallelConfig:
    parallel_mode: ParallelMode = ParallelMode.STAND_ALONE  # how the step is parallelised
    device_num: int | None = None  # devices used; default: product of mesh_shape, else 1
    mesh_shape: tuple[int, ...] | None = None  # logical mesh; default: (device_num,)
    mesh_axis_names: tuple[str, ...] | None = None  # default: x / x,y / x,y,z
    mesh: Mesh | AbstractMesh | None = None  # a jax.sharding.Mesh (or AbstractMesh): the
    # three fields above from it; on the jax backend
    # the step runs on its devices
    topology: Topology | None = None  # default: this machine as measured for the
    # backend (tools.calibrate.machine_topology)
    search_mode: SearchMode | None = None  # auto_parallel's solver; None: autopar picks by
    # the mesh (compiler.search.default_search_mode)
    max_device_memory: int | None = None  # bytes per device ("16GB" accepted); None: no cap
    gradients_mean: bool = True  # data_parallel: replica gradients are averaged, so
    # the step equals the single-device one (False: see README)
    backend: Backend = Backend.NATIVE  # where compiled steps run: "native" (one worker
    # process per device, C++ collectives) or "jax"
    # (shard_map over jax.devices(): GPU, TPU, fake CPUs);
    # one device runs in this process either way
    search_time: float | None = None  # seconds auto_parallel's solver may take (None: its default)
    profile_plans: bool = False  # each lowered plan's compute is measured (one rank
    # alone on one core, tools/profile.py), not priced:
    # auto_parallel ranks its plans by it and the
    # Strategy's estimate uses it (no pipeline)
    progress: bool = True  # report searches that run past a second on stderr
    collective_timeout: float = 10.0  # native backend: seconds a collective may wait for a
    # peer before every rank raises CollectiveError
    allreduce_fusion_bytes: int = 25 << 20  # native backend: all-reduce bucket size
    # ("25MB" accepted; 0: one call per all-reduce)
    enable_parallel_optimizer: bool = False  # shard the parameter update over the devices that
    # hold a parameter replicated (ZeRO; see optimizer_level)
    optimizer_level: OptimizerLevel = OptimizerLevel.LEVEL1  # what is sharded, as MindSpore's
    # parallel_optimizer_config["optimizer_level"]
    parallel_optimizer_threshold: int = 64  # KB: smaller parameters keep a replicated update
    # (MindSpore's default, also in KB)
    pipeline_stages: CountOrAuto = 1  # stages the devices are split into (the first mesh
    # axis; each stage runs its layers on the rest);
    # "auto": the planner chooses (with micro_batches)
    pipeline_stage_devices: StageDevices = None  # devices per stage: "equal" (the first mesh
    # axis), "auto" (the stage planner chooses them
    # with the cuts), a tuple (one count per stage,
    # summing to device_num; a stage mesh of another
    # size is one axis), or None: "auto" where the
    # planner cuts the stages, else "equal"
    micro_batches: CountOrAuto = 1  # pipeline: the batch is split into this many
    # micro-batches; gradients accumulate over them
    # ("auto": the planner chooses)
    pipeline_scheduler: PipelineScheduler = PipelineScheduler.ONE_F_ONE_B  # "gpipe" or "1f1b"
    pipeline_interleave: CountOrAuto = 1  # 1f1b: model parts per stage's devices (Megatron-LM's
    # virtual pipeline size: the layers cut into
    # pipeline_stages x this many parts, part j on stage
    # j mod pipeline_stages's devices, a bubble this
    # many times shorter); "auto": the planner chooses
    dataset_strategy: DatasetStrategy = None  # layouts of the batch arguments: "data_parallel"
    # (dim 0 split over every device), "full_batch"
    # (replicated), or MindSpore's tuple of split tuples,
    # one per batch leaf; None: split in data_parallel
    # mode, chosen by the search or propagation otherwise
    unannotated: str = "propagate"  # semi_auto_parallel: operators without a strategy
    # follow the annotated ones ("propagate") or get
    # MindSpore's default, their batch dimension
    # split over every device ("batch")
    recompute: str = "as_written"  # activation recomputation: "as_written" (the
    # step's jax.checkpoint blocks recomputed),
    # "selective" (only their large values that
    # are cheap to recompute: the attention's
    # scores, Megatron-LM's selective
    # recomputation), "none" (the backward pass
    # reads the forward's values: autopar.recompute)
    # or "auto" (each planned, the faster plan that
    # fits kept)
    strategy_ckpt_load_file: str | None = None  # compile reuses the strategy saved there
    # compile saves its strategy there: autopar's JSON for a *.json name (loadable), else
    # MindSpore's protobuf strategy checkpoint
    strategy_ckpt_save_file: str | None = None

    def __post_init__(self):
        """Every field validated and normalised (names to enums, "25MB" to bytes, defaults
        resolved) by its group (``ModeOptions`` ... ``DeviceOptions`` above, each checking its
        own fields), then the groups against each other; the flat fields take the groups'
        values."""
        mode, search, execution, optimizer, pipeline = (
            self._group(cls)
            for cls in (
                ModeOptions,
                SearchOptions,
                ExecutionOptions,
                OptimizerOptions,
                PipelineOptions,
            )
        )
        devices = self._group(DeviceOptions, pipeline_stages=pipeline.pipeline_stages)
        pipeline = pipeline.for_devices(devices)
        mode.check_devices(devices)
        for group in (mode, search, execution, optimizer, pipeline, devices):
            _set(self, **{f.name: getattr(group, f.name) for f in fields(group)})

    def _group(self, cls, **extra):
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)}, **extra)

    # the option groups, for the components that take one (validated already: these rebuild
    # them from the normalised fields)
    @property
    def mode(self) -> ModeOptions:
        return self._group(ModeOptions)

    @property
    def search(self) -> SearchOptions:
        return self._group(SearchOptions)

    @property
    def execution(self) -> ExecutionOptions:
        return self._group(ExecutionOptions)

    @property
    def optimizer(self) -> OptimizerOptions:
        return self._group(OptimizerOptions)

    @property
    def pipeline(self) -> PipelineOptions:
        return self._group(PipelineOptions)

    @property
    def devices(self) -> DeviceOptions:
        return self._group(DeviceOptions)

    def logical_mesh(self) -> LogicalMesh:
        return self.devices.logical_mesh()

    def replace(self, **changes) -> ParallelConfig:
        return replace(self, **changes)


def _checked_init(init):
    """ParallelConfig's dataclass __init__, raising ConfigError (with the nearest valid names)
    for a keyword it has no field for, instead of TypeError."""
    names = [f.name for f in fields(ParallelConfig)]

    def __init__(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(names))
        if unknown or len(args) > len(names):
            near = {k: difflib.get_close_matches(k, names, 1) for k in unknown}
            raise ConfigError(
                "ParallelConfig takes keyword fields; "
                + (
                    "; ".join(
                        f"it has no field {k!r}" + (f" (did you mean {v[0]!r}?)" if v else "")
                        for k, v in near.items()
                    )
                    if unknown
                    else f"{len(args)} positional values given"
                )
                + f". Valid fields: {', '.join(names)}."
            )
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # the fields, for help() and IDEs
    return __init__


ParallelConfig.__init__ = _checked_init(ParallelConfig.__init__)  # type: ignore[method-assign]  # deliberately wrapped
