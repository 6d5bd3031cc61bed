"""MindSpore's auto-parallel context: process-wide settings that become a ``ParallelConfig``.

In: ``set_auto_parallel_context(**kw)`` with MindSpore 2.10's key names and values. Out:
``get_auto_parallel_context(key)`` (the value in MindSpore's form), ``context_config()`` (the
``ParallelConfig`` that ``ap.compile``, ``ap.plan`` and a bare ``@ap.parallel`` use when given
no config) and ``reset_auto_parallel_context()``.

Every key of MindSpore 2.10's ``set_auto_parallel_context`` is accepted. Honoured (MindSpore's
meaning; any ``ParallelConfig`` field, e.g. ``mesh_shape`` or ``backend``, is accepted by its
own name too):
- ``parallel_mode``, ``device_num``, ``search_mode`` (``auto_parallel_search_mode``, its old
  name), ``pipeline_stages``, ``enable_parallel_optimizer``, ``gradients_mean``,
  ``max_device_memory`` ("16GB" or bytes), ``strategy_ckpt_load_file``/``_save_file``: the
  ``ParallelConfig`` fields of those names;
- ``parallel_optimizer_config``: ``optimizer_level`` ("level1".."level3"),
  ``parallel_optimizer_threshold`` (KB), ``gradient_accumulation_shard`` (True: level2, as
  MindSpore says to write it now), ``optimizer_weight_shard_size`` (-1 only: autopar shards
  over the whole data-parallel group);
- ``pipeline_config``: ``pipeline_scheduler`` ("1f1b" or "gpipe"; MindSpore's "seqpipe",
  "seqvpp", "seqsmartvpp" and "zero_bubble_v" warn and run as 1f1b), ``pipeline_interleave``
  (False; True warns under 1f1b, and is what MindSpore 2.10 requires with gpipe); a dict
  without both keys warns (MindSpore 2.10 raises KeyError for it);
- ``strategy_ckpt_config``: ``load_file`` and ``save_file`` (``ParallelConfig``'s; a name
  ending in .json is JSON, any other MindSpore's protobuf, as MindSpore decides),
  ``only_trainable_params`` (every parameter of a JAX step is trainable);
- ``dataset_strategy``: "data_parallel", "full_batch" or a tuple of split tuples per batch
  leaf; ``full_batch`` (True: "full_batch", False: "data_parallel");
- ``comm_fusion``: ``{"allreduce": {"mode": "auto" | "size", "config": MB}}`` and
  ``{"openstate": False}`` set the native all-reduce bucket (``allreduce_fusion_bytes``; auto
  is MindSpore's 64 MB; its "index" mode warns and takes that size); ``auto_pipeline`` (True:
  ``pipeline_stages="auto"``); ``sharding_propagation`` (True: ``search_mode=
  "sharding_propagation"``).
The keys MindSpore's context accepts but does not document (``pipeline_segments``,
``communi_parallel_mode``, a top-level ``optimizer_weight_shard_size``,
``optimizer_weight_shard_aggregated_save``, ``auto_parallel_new_interface``,
``init_param_in_compile``) are accepted as the rest are.
The rest are accepted and kept for ``get_auto_parallel_context``; a value other than
MindSpore's default that asks for something autopar does not do is warned about
(``AutoparWarning``) with what the key means in MindSpore and why autopar does not need or do
it (``_MINDSPORE_ONLY``). Two MindSpore defaults are not what autopar does: gradients are
reduced in their own dtype (``gradient_fp32_sync``: MindSpore casts low-precision ones to
float32) and redistributions use AllToAll where it is cheapest (``enable_alltoall``).
Values are checked when set (an invalid one raises ``ConfigError`` listing the valid ones);
how they combine (``device_num`` against ``mesh_shape``, say) is checked when the config is
built. Deliberate differences from MindSpore: settings are per process, not per device
context; ``search_mode`` defaults to the best search autopar has for the graph's size (MindSpore:
recursive_programming), ``gradients_mean`` to True (the step then equals the single-device
one; MindSpore: False), ``dataset_strategy`` to None (the search chooses the batch layout
outside data_parallel; MindSpore: "data_parallel").
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from .config import ParallelConfig
from .errors import AutoparWarning, ConfigError

_FIELDS = [f.name for f in dataclasses.fields(ParallelConfig)]
# dict-valued MindSpore keys: {sub-key: ParallelConfig field, or None: MindSpore's only (kept,
# and in _IGNORED when autopar does not do what it asks)}
_DICTS: dict[str, dict[str, str | None]] = {
    "parallel_optimizer_config": {
        "optimizer_level": "optimizer_level",
        "parallel_optimizer_threshold": "parallel_optimizer_threshold",
        "gradient_accumulation_shard": None,
        "optimizer_weight_shard_size": None,
    },
    "pipeline_config": {"pipeline_scheduler": "pipeline_scheduler", "pipeline_interleave": None},
    "strategy_ckpt_config": {
        "load_file": "strategy_ckpt_load_file",
        "save_file": "strategy_ckpt_save_file",
        "only_trainable_params": None,
    },
    "comm_fusion": {"openstate": None, "allreduce": None, "allgather": None, "reducescatter": None},
}
# MindSpore's keys (and sub-keys) autopar keeps without a ParallelConfig field: their default
# in MindSpore, and (meaning in MindSpore, why autopar does without it, the values autopar's
# behaviour already is: no warning for those)
_MINDSPORE_ONLY: dict[str, tuple[object, str, str | None, tuple[object, ...] | str | None]] = {
    "global_rank": (
        0,
        "this process's rank",
        "autopar takes each process's rank from its launcher (autopar launch, ap.init_distributed)",
        "rank",
    ),
    "gradient_fp32_sync": (
        True,
        "all-reduce gradients in float32",
        "autopar reduces each "
        "gradient in its own dtype (float32 for float32 parameters: this "
        "differs only for low-precision gradients)",
        (False,),
    ),
    "force_fp32_communication": (
        False,
        "reduce collectives in float32",
        "autopar reduces each value in its own dtype",
        (False,),
    ),
    "loss_repeated_mean": (
        True,
        "divide a loss computed on several devices by the repeats",
        "autopar's steps compute the single-device loss exactly",
        (True,),
    ),
    "parameter_broadcast": (
        False,
        "broadcast device 0's parameters before training",
        "autopar places every parameter from the caller's one array",
        (False, True),
    ),
    "enable_alltoall": (
        False,
        "let redistributions use AllToAll (else AllGather, Split, Concat)",
        "autopar's redistribution planner uses AllToAll where it is cheapest",
        (True,),
    ),
    "pipeline_result_broadcast": (
        False,
        "broadcast the last stage's result in pipeline inference",
        "autopar returns a pipeline's results to the caller",
        (False, True),
    ),
    "group_ckpt_save_file": (
        "",
        "save the communication groups for checkpoint transforms",
        "autopar's strategy file holds the mesh its groups come from",
        ("",),
    ),
    "dump_local_norm": (False, "dump each device's gradient norm", "not built", (False,)),
    "dump_local_norm_path": ("", "where dump_local_norm writes", "not built", ("",)),
    "dump_device_local_norm": (False, "dump each device's local norm", "not built", (False,)),
    "grad_accumulation_step": (
        1,
        "accumulate gradients over this many micro-steps without a pipeline",
        "autopar accumulates over micro_batches inside a pipeline only; split the batch yourself",
        (1,),
    ),
    "full_batch": (False, "each device loads the whole batch", None, None),
    "auto_pipeline": (False, "choose the pipeline stage count", None, None),
    "all_reduce_fusion_config": (
        [],
        "fuse the gradient all-reduces at these parameter indices",
        "autopar fuses all-reduces by size (comm_fusion "
        "allreduce size mode, allreduce_fusion_bytes)",
        ([],),
    ),
    "auto_parallel_search_mode": (None, "search_mode's old name", None, None),
    "gradient_accumulation_shard": (False, "shard accumulated gradients (level2)", None, None),
    "optimizer_weight_shard_size": (
        -1,
        "the parallel optimizer's shard group size",
        "autopar shards each update over its whole data-parallel group",
        (-1,),
    ),
    "pipeline_interleave": (
        False,
        "interleaved pipeline stages (virtual stages)",
        "autopar's schedulers are gpipe and 1f1b",
        (False,),
    ),
    "only_trainable_params": (
        True,
        "save only trainable parameters' strategies",
        "every parameter of a JAX step is trainable",
        (True, False),
    ),
    "pipeline_segments": (
        1,
        "split each pipeline stage's layers into this many segments (a virtual pipeline)",
        "autopar interleaves stages with ParallelConfig(pipeline_interleave=N) under 1f1b",
        (1,),
    ),
    "communi_parallel_mode": (
        "all_group_parallel",
        "which communication groups run at the "
        "same time (all_group_parallel, same_server_group_parallel, "
        "no_group_parallel)",
        "a rank's collectives run one at a time, in program order",
        ("all_group_parallel", "no_group_parallel"),
    ),
    "optimizer_weight_shard_aggregated_save": (
        False,
        "save the parallel optimizer's weight slices merged into whole parameters",
        None,
        None,
    ),
    "sharding_propagation": (
        False,
        "search auto_parallel's strategies by propagating the annotated operators' ones",
        None,
        None,
    ),
    "auto_parallel_new_interface": (
        False,
        "set by MindSpore's AutoParallel cell for its own compile",
        None,
        None,
    ),
    "init_param_in_compile": (
        True,
        "initialise the parameters while compiling "
        "(AutoParallel.no_init_parameters_in_compile turns it off)",
        None,
        None,
    ),
    "openstate": (True, "communication fusion on", None, None),
    "allreduce": ({"mode": "auto", "config": None}, "all-reduce fusion", None, None),
    "allgather": (
        {"mode": "auto", "config": None},
        "all-gather fusion",
        "autopar fuses all-reduces only",
        None,
    ),
    "reducescatter": (
        {"mode": "auto", "config": None},
        "reduce-scatter fusion",
        "autopar fuses all-reduces only",
        None,
    ),
}
MINDSPORE_FUSION_MB = 64  # comm_fusion's "auto" all-reduce threshold in MindSpore
# MindSpore keys that are both a top-level key and a dict's sub-key
_BOTH = {"optimizer_weight_shard_size"}
KEYS = tuple(
    sorted(
        set(_FIELDS)
        | set(_DICTS)
        | {k for k in _MINDSPORE_ONLY if not any(k in d for d in _DICTS.values())}
        | _BOTH
        | {"strategy_ckpt_load_file", "strategy_ckpt_save_file"}
    )
)
# MindSpore 2.10's pipeline schedulers autopar does not run (1f1b runs instead), and what each is
_OTHER_SCHEDULERS = {
    "seqpipe": "1F1B over slices of each micro-batch's sequence (Seq1F1B)",
    "seqvpp": "seqpipe with virtual (interleaved) stages",
    "seqsmartvpp": "seqvpp with a memory-aware order of the slices",
    "zero_bubble_v": "ZB-V, a V-shaped schedule splitting each backward into its input and "
    "weight gradients to fill the bubble",
}

_settings: dict = {}  # ParallelConfig field -> value, as set
_kept: dict = {}  # MindSpore-only key -> value, as set


def _ignored(key, value) -> None:
    """Warn unless autopar already does what ``key=value`` asks, or it is MindSpore's default
    (what every MindSpore script gets, set or not; the module docstring's differences)."""
    default, meaning, why, fine = _MINDSPORE_ONLY[key]
    if value == default:
        return
    if fine == "rank":  # the launcher's, read without starting JAX's runtime
        fine = (int(os.environ.get("AUTOPAR_PROCESS_ID", "0")),)
    if why and (fine is None or value not in fine):
        warnings.warn(
            f"auto-parallel context {key}={value!r}: in MindSpore, {meaning}; autopar "
            f"ignores it: {why}.",
            AutoparWarning,
            stacklevel=6,
        )


def _bool(key, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} takes True or False, not {value!r}.")
    return value


def _converted(key, value) -> dict:
    """The ParallelConfig fields a MindSpore-only key sets (most set none)."""
    if key == "full_batch":
        return {"dataset_strategy": "full_batch" if _bool(key, value) else "data_parallel"}
    if key == "auto_pipeline":
        return {"pipeline_stages": "auto"} if _bool(key, value) else {}
    if key == "auto_parallel_search_mode":
        return {"search_mode": value}
    if key == "gradient_accumulation_shard":
        return {"optimizer_level": "level2"} if _bool(key, value) else {}
    if key == "sharding_propagation":
        return {"search_mode": "sharding_propagation"} if _bool(key, value) else {}
    if key == "communi_parallel_mode" and value not in (
        "all_group_parallel",
        "same_server_group_parallel",
        "no_group_parallel",
    ):
        raise ConfigError(
            f"communi_parallel_mode takes 'all_group_parallel', "
            f"'same_server_group_parallel' or 'no_group_parallel', not {value!r}."
        )
    if key in ("openstate", "allreduce"):
        return {"allreduce_fusion_bytes": _fusion_bytes(key, value)}
    if key in ("allgather", "reducescatter"):
        _fusion_bytes(key, value)
    return {}


def _fusion_bytes(key, value) -> int:
    """comm_fusion's openstate / allreduce value -> the all-reduce bucket in bytes."""
    if key == "openstate":
        return MINDSPORE_FUSION_MB << 20 if _bool(key, value) else 0
    if not isinstance(value, dict) or set(value) - {"mode", "config"}:
        raise ConfigError(
            f"comm_fusion {key} takes {{'mode': 'auto' | 'size', 'config': MB}}, not {value!r}."
        )
    mode, mb = value.get("mode", "auto"), value.get("config")
    if mode == "auto":
        return MINDSPORE_FUSION_MB << 20
    if mode == "size" and isinstance(mb, (int, float)) and not isinstance(mb, bool) and mb > 0:
        return int(mb * (1 << 20))
    if mode == "index" and isinstance(mb, (list, tuple)):
        warnings.warn(
            f"auto-parallel context comm_fusion {key} mode 'index': in MindSpore, "
            "fuse the gradient all-reduces split at these parameter indices; autopar "
            f"fuses all-reduces by size and uses MindSpore's auto threshold "
            f"({MINDSPORE_FUSION_MB} MB) instead.",
            AutoparWarning,
            stacklevel=7,
        )
        return MINDSPORE_FUSION_MB << 20
    raise ConfigError(
        f"comm_fusion {key}: mode {mode!r} with config {mb!r}; give mode 'auto', "
        "'size' with a threshold in MB above 0, or 'index' with a list of "
        "parameter indices."
    )


def _fields_of(key, value, kept) -> dict:
    """The ParallelConfig fields one context key sets (MindSpore-only keys are kept in
    ``_kept`` and, where autopar does not do what they ask, warned about)."""
    if key not in KEYS:
        raise ConfigError(
            f"unknown auto-parallel context key {key!r}; valid keys: {', '.join(KEYS)}."
        )
    if key in ("strategy_ckpt_load_file", "strategy_ckpt_save_file"):
        return {key: value or None}
    if key in _MINDSPORE_ONLY:
        return _mindspore_only(key, value, kept)
    if key not in _DICTS:
        return {key: value}
    if not isinstance(value, dict):
        raise ConfigError(f"{key} takes a dict with keys {', '.join(_DICTS[key])}; got {value!r}.")
    bad = [k for k in value if k not in _DICTS[key]]
    if bad:
        raise ConfigError(
            f"{key} has unknown key(s) {', '.join(map(repr, bad))}; valid keys: "
            f"{', '.join(_DICTS[key])}."
        )
    if key == "pipeline_config":
        value = _pipeline_config(value, kept)
    out: dict[str, Any] = {}
    for k, v in value.items():
        field = _DICTS[key][k]
        out.update(_mindspore_only(k, v, kept) if field is None else {field: v})
    return out


def _pipeline_config(value, kept) -> dict:
    """pipeline_config as autopar runs it: MindSpore 2.10's schedulers autopar does not run
    warned about and run as 1f1b; a dict without both keys warned about (MindSpore 2.10 raises
    KeyError for it); gpipe's pipeline_interleave=True not warned about (MindSpore runs gpipe
    only with it)."""
    if set(value) != {"pipeline_scheduler", "pipeline_interleave"}:
        warnings.warn(
            "auto-parallel context pipeline_config without both pipeline_scheduler "
            "and pipeline_interleave: MindSpore 2.10 raises KeyError for it (autopar "
            "takes the missing one's default).",
            AutoparWarning,
            stacklevel=5,
        )
    value = dict(value)
    scheduler = value.get("pipeline_scheduler")
    if scheduler in _OTHER_SCHEDULERS:
        warnings.warn(
            f"auto-parallel context pipeline_scheduler={scheduler!r}: in MindSpore, "
            f"{_OTHER_SCHEDULERS[scheduler]}; autopar runs gpipe and 1f1b and runs "
            "1f1b instead.",
            AutoparWarning,
            stacklevel=5,
        )
        value["pipeline_scheduler"] = "1f1b"
    if scheduler == "gpipe" and value.get("pipeline_interleave") is True:
        value.pop("pipeline_interleave")
        kept["pipeline_interleave"] = True
    return value


def _mindspore_only(key, value, kept) -> dict:
    """A MindSpore-only key (or sub-key): what it converts to, warned about where autopar does
    not do what it asks, and kept for ``get_auto_parallel_context``."""
    out = _converted(key, value)
    _ignored(key, value)
    kept[key] = value
    return out


def _checked(fields: dict) -> dict:
    """The values normalised ("2GB" -> bytes), checked one by one: each on its own, on top of
    a config that admits it."""
    out = {}
    for name, value in fields.items():
        base: dict[str, Any] = {"parallel_mode": "auto_parallel"} if name != "parallel_mode" else {}
        if name == "pipeline_stages" and isinstance(value, int) and value >= 1:
            base["device_num"] = value
        if name == "pipeline_stage_devices" and isinstance(value, (list, tuple)):
            base.update(
                device_num=sum(v for v in value if isinstance(v, int)) or 1,
                pipeline_stages=len(value) or 1,
            )
        if name == "topology":
            base["device_num"] = getattr(value, "num_devices", None)
        try:
            probe = ParallelConfig(**base, **{name: value})
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{name}={value!r} is not valid: {e}") from None
        out[name] = value if name in ("device_num", "mesh_shape") else getattr(probe, name)
    return out


def mindspore_fields(kw: dict, kept: dict) -> dict:
    """The ParallelConfig fields MindSpore context keys ``kw`` set, checked; the values of
    MindSpore-only keys go to ``kept`` (and are warned about where autopar does not do what
    they ask). What ``set_auto_parallel_context`` and ``ap.AutoParallel``'s methods apply."""
    fields = {}
    for key, value in kw.items():
        fields.update(_fields_of(key, value, kept))
    return _checked(fields)


def set_auto_parallel_context(**kw) -> None:
    """Set context keys (see the module docstring); unset keys keep their values."""
    _settings.update(mindspore_fields(kw, _kept))


def get_auto_parallel_context(key: str):
    """The value of one key, in MindSpore's form (enums as their strings, dicts for the dict
    keys, "" for an unset file); the default when it was never set."""
    if key not in KEYS:
        raise ConfigError(
            f"unknown auto-parallel context key {key!r}; valid keys: {', '.join(KEYS)}."
        )
    default = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    plain = lambda v: v.value if hasattr(v, "value") else v

    def value(name):
        if name in _MINDSPORE_ONLY:
            return _kept.get(name, _MINDSPORE_ONLY[name][0])
        got = plain(_settings.get(name, default[name]))
        return "" if got is None and name.startswith("strategy_ckpt") else got

    if key == "auto_parallel_search_mode":
        key = "search_mode"
    if key == "comm_fusion":
        return {sub: value(sub) for sub in _DICTS[key]}
    if key in _DICTS:
        return {sub: value(f or sub) for sub, f in _DICTS[key].items()}
    if key == "device_num" and key not in _settings:
        return context_config().device_num
    return value(key)


def reset_auto_parallel_context() -> None:
    """Every key back to its default."""
    _settings.clear()
    _kept.clear()


def context_config() -> ParallelConfig:
    """The ``ParallelConfig`` of the current context (raises ``ConfigError`` when its keys do
    not agree with each other)."""
    return ParallelConfig(**_settings)
