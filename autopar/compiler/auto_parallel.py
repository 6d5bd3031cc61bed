"""MindSpore 2.10's ``mindspore.parallel.auto_parallel.AutoParallel`` and its algorithm
parameters, for a JAX step.

In: ``AutoParallel(step, parallel_mode="semi_auto")`` (MindSpore's modes: "semi_auto",
"sharding_propagation", "recursive_programming"), then its configuration methods, each the
MindSpore method of that name (``hsdp``, ``pipeline``, ``dataset_strategy``, ``comm_fusion``,
``save_param_strategy_file``, ``load_param_strategy_file``, ``save_operator_strategy_file``,
``load_operator_strategy_file``, ...); ``set_algo_parameters(**kw)`` /
``get_algo_parameters(key)`` / ``reset_algo_parameters()`` with MindSpore's keys. Out: calling
the object compiles the step on its first call (``ap.compile`` with the ``ParallelConfig`` the
settings make, ``config()``) and runs it; ``compile(*args)`` / ``plan(*args)`` give the
``Compiled`` / ``Strategy``. Each method sets the MindSpore context key it stands for
(``context.mindspore_fields``), so what autopar does not do warns as the context does. Beyond
MindSpore's: ``device_num`` (MindSpore's is its communication group's size; default: JAX's
device count) and any ``ParallelConfig`` field as a keyword (``micro_batches``: MindSpore
sets it with ``nn.PipelineCell``; ``backend``, ``max_device_memory``, ...). Deliberate
differences: ``gradients_mean`` is True (the single-device step's mathematics; MindSpore's
wrapper defaults to False, which autopar refuses, ``enable_gradients_mean`` sets it).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from ..config import ParallelConfig
from ..context import mindspore_fields
from ..errors import AutoparWarning, ConfigError

if TYPE_CHECKING:
    from .compiled import Compiled  # imported with the compiler when a step is compiled

MODES = {
    "semi_auto": {"parallel_mode": "semi_auto_parallel"},
    "sharding_propagation": {
        "parallel_mode": "auto_parallel",
        "search_mode": "sharding_propagation",
    },
    "recursive_programming": {
        "parallel_mode": "auto_parallel",
        "search_mode": "recursive_programming",
    },
}


class AutoParallel:
    """``AutoParallel(step, parallel_mode="semi_auto", *, device_num=None, **config_fields)``:
    see the module docstring."""

    def __init__(
        self, network, parallel_mode: str = "semi_auto", *, device_num=None, **config_fields
    ):
        if not callable(network):
            raise ConfigError(f"AutoParallel({network!r}): give the step function to wrap.")
        if parallel_mode not in MODES:
            raise ConfigError(
                f"AutoParallel parallel_mode={parallel_mode!r}: MindSpore's are "
                f"{', '.join(map(repr, MODES))}."
            )
        if device_num is None:
            import jax

            device_num = jax.device_count()
        self.network, self.parallel_mode = network, parallel_mode
        self._kept: dict = {}
        self._fields = mindspore_fields(
            {**MODES[parallel_mode], "device_num": device_num, **config_fields}, self._kept
        )
        self._load_operator_file = self._save_operator_file = None
        self._compiled: dict[str, Compiled] = {}  # argument types -> the step compiled for them

    # ------------------------------------------------------------ MindSpore's methods
    def _set(self, keys: dict) -> None:
        """Apply MindSpore context ``keys`` to this wrapper's settings (a compiled step is
        planned again); their warnings point at the caller of the method that set them."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AutoparWarning)
            self._fields.update(mindspore_fields(keys, self._kept))
        for w in caught:
            warnings.warn(w.message, w.category, stacklevel=3)
        self._compiled.clear()

    def no_init_parameters_in_compile(self):
        self._set({"init_param_in_compile": False})

    def load_param_strategy_file(self, file_path):
        self._set({"strategy_ckpt_load_file": _path(file_path)})

    def save_param_strategy_file(self, file_path):
        self._set({"strategy_ckpt_save_file": _path(file_path)})

    def disable_strategy_file_only_for_trainable_params(self):
        self._set({"strategy_ckpt_config": {"only_trainable_params": False}})

    def save_operator_strategy_file(self, file_path):
        """The plan's operator strategies are written to ``file_path`` (autopar's JSON,
        which ``load_operator_strategy_file`` and ``ap.Strategy.load`` read) when it compiles;
        an absolute ``.json`` path, as MindSpore requires."""
        self._save_operator_file = _json_path(file_path)

    def load_operator_strategy_file(self, file_path):
        """Plan with the operator strategies of ``file_path`` (a file
        ``save_operator_strategy_file`` wrote)."""
        self._load_operator_file = _json_path(file_path)
        self._compiled.clear()

    def dataset_strategy(self, config):
        if config is None:
            raise ConfigError(
                "AutoParallel.dataset_strategy: give 'data_parallel', "
                "'full_batch' or a tuple of split tuples."
            )
        self._set({"dataset_strategy": config})

    def hsdp(self, shard_size=-1, threshold=64, optimizer_level="level1"):
        """MindSpore's optimizer parallel (ZeRO): ``enable_parallel_optimizer`` with its
        shard size, threshold (KB) and level."""
        if not isinstance(shard_size, int) or (shard_size <= 0 and shard_size != -1):
            raise ConfigError(f"hsdp shard_size={shard_size!r}: a positive integer or -1.")
        self._set(
            {
                "enable_parallel_optimizer": True,
                "parallel_optimizer_config": {
                    "optimizer_weight_shard_size": shard_size,
                    "parallel_optimizer_threshold": threshold,
                    "optimizer_level": optimizer_level,
                },
            }
        )

    def pipeline(self, stages=1, output_broadcast=False, interleave=False, scheduler="1f1b"):
        if isinstance(stages, bool) or not isinstance(stages, int) or stages <= 0:
            raise ConfigError(f"AutoParallel.pipeline stages={stages!r}: an int above 0.")
        self._set(
            {
                "pipeline_stages": stages,
                "pipeline_result_broadcast": output_broadcast,
                "pipeline_config": {
                    "pipeline_interleave": interleave,
                    "pipeline_scheduler": scheduler,
                },
            }
        )

    def comm_fusion(self, config):
        if config is not None and not isinstance(config, dict):
            raise ConfigError(f"AutoParallel.comm_fusion: a dict, not {config!r}.")
        self._set({"comm_fusion": config or {}})

    def enable_fp32_communication(self):
        self._set({"force_fp32_communication": True})

    def set_group_ckpt_save_file(self, file_path):
        self._set({"group_ckpt_save_file": _path(file_path)})

    def print_local_norm(self):
        self._set({"dump_local_norm": True})

    def dump_local_norm(self, file_path):
        self._set({"dump_local_norm": True, "dump_local_norm_path": _path(file_path)})

    def enable_device_local_norm(self):
        self._set({"dump_device_local_norm": True})

    def enable_gradients_mean(self):
        self._set({"gradients_mean": True})

    def disable_gradient_fp32_sync(self):
        self._set({"gradient_fp32_sync": False})

    def disable_loss_repeated_mean(self):
        self._set({"loss_repeated_mean": False})

    def get_pipeline_stages(self):
        return self.config().pipeline_stages

    def transformer_opt(self, file_path):
        if file_path:
            warnings.warn(
                f"AutoParallel.transformer_opt({file_path!r}): in MindSpore, Ascend's "
                "parallel speed-up switches (communication overlaps and fusions); "
                "autopar ignores them: its runtime fuses all-reduces into buckets "
                "itself.",
                AutoparWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------ what it makes
    def config(self) -> ParallelConfig:
        """The ParallelConfig these settings make."""
        return ParallelConfig(**self._fields)

    def plan(self, *args):
        from .api import plan

        return plan(self.network, *args, config=self.config())

    def compile(self, *args):
        """The step compiled for ``args`` (once per argument types)."""
        import jax

        from ..strategies.strategy import Strategy
        from .api import compile as compile_

        key = str(
            jax.tree.map(
                lambda x: (getattr(x, "shape", ()), str(getattr(x, "dtype", type(x).__name__))),
                args,
            )
        )
        if key not in self._compiled:
            strategy = Strategy.load(self._load_operator_file) if self._load_operator_file else None
            compiled = compile_(self.network, *args, config=self.config(), strategy=strategy)
            if self._save_operator_file:
                compiled.strategy.save(self._save_operator_file)
            self._compiled[key] = compiled
        return self._compiled[key]

    def __call__(self, *args):
        return self.compile(*args)(*args)

    def close(self):
        for c in self._compiled.values():
            c.close()
        self._compiled.clear()

    def __repr__(self) -> str:
        return (
            f"AutoParallel({getattr(self.network, '__name__', self.network)!r}, "
            f"parallel_mode={self.parallel_mode!r})"
        )


def _path(file_path) -> str:
    if not isinstance(file_path, str):
        raise ConfigError(f"the file path must be a str, not {type(file_path).__name__}.")
    return file_path


def _json_path(file_path) -> str:
    """MindSpore's rule for operator strategy files: an absolute path ending in .json."""
    _path(file_path)
    if not os.path.isabs(file_path):
        raise ConfigError(
            f"{file_path!r}: the operator strategy file must be an absolute path "
            "(MindSpore's rule)."
        )
    if not file_path.endswith(".json"):
        raise ConfigError(
            f"{file_path!r}: the operator strategy file must end in .json (MindSpore's rule)."
        )
    return file_path


# ---------------------------------------------------------------- algorithm parameters

# MindSpore's set_algo_parameters keys: (its default, what it means there, autopar: None when
# autopar already behaves as any value asks, else why a value other than the default is ignored)
ALGO = {
    "fully_use_devices": (True, "only consider strategies that use every device", None),
    "elementwise_op_strategy_follow": (
        False,
        "elementwise operators take their producer's strategy",
        "auto_parallel's search prices each elementwise operator's layouts like any other's",
    ),
    "enable_algo_approxi": (
        False,
        "prune the dynamic-programming search approximately",
        "autopar's searches are exact where they can be and bound their "
        "gap otherwise (search_time)",
    ),
    "algo_approxi_epsilon": (
        0.1,
        "the approximation's tolerance",
        "there is no approximate search to tune",
    ),
    "tensor_slice_align_enable": (
        False,
        "align MatMul slice shapes to tensor_slice_align_size",
        "autopar prices each slice's shape (matmul efficiency) instead",
    ),
    "tensor_slice_align_size": (16, "the alignment", "there is no alignment to tune"),
}
_algo: dict = {}


def set_algo_parameters(**kw) -> None:
    """MindSpore's ``set_algo_parameters``: every key accepted and kept; a value other than
    MindSpore's default that asks for what autopar does not do warns, saying why."""
    for key, value in kw.items():
        if key not in ALGO:
            raise ConfigError(
                f"unknown algorithm parameter {key!r}; MindSpore's are {', '.join(ALGO)}."
            )
        default, meaning, why = ALGO[key]
        if type(value) is not type(default) and not (
            isinstance(default, float) and isinstance(value, int)
        ):
            raise ConfigError(f"{key} takes a {type(default).__name__}, not {value!r}.")
        if why and value != default:
            warnings.warn(
                f"set_algo_parameters({key}={value!r}): in MindSpore, {meaning}; "
                f"autopar ignores it: {why}.",
                AutoparWarning,
                stacklevel=2,
            )
        _algo[key] = value


def get_algo_parameters(key: str):
    if key not in ALGO:
        raise ConfigError(
            f"unknown algorithm parameter {key!r}; MindSpore's are {', '.join(ALGO)}."
        )
    return _algo.get(key, ALGO[key][0])


def reset_algo_parameters() -> None:
    _algo.clear()
