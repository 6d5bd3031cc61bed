"""MindSpore's auto-parallel context: process-wide settings that become a ``ParallelConfig``.

In: ``set_auto_parallel_context(**kw)`` with MindSpore's key names and values. Out:
``get_auto_parallel_context(key)`` (the value in MindSpore's form), ``context_config()`` (the
``ParallelConfig`` that ``ap.compile``, ``ap.plan`` and a bare ``@ap.parallel`` use when given
no config) and ``reset_auto_parallel_context()``.

Keys (MindSpore's meaning; any other ``ParallelConfig`` field, e.g. ``mesh_shape``, ``backend``
or ``micro_batches``, is accepted by its own name):
- ``parallel_mode``, ``device_num``, ``search_mode``, ``pipeline_stages``,
  ``enable_parallel_optimizer``, ``gradients_mean``, ``max_device_memory`` ("16GB" or bytes):
  the ``ParallelConfig`` fields of the same name;
- ``parallel_optimizer_config``: a dict with ``optimizer_level`` ("level1".."level3") and
  ``parallel_optimizer_threshold`` (KB);
- ``pipeline_config``: a dict with ``pipeline_scheduler`` ("1f1b" or "gpipe");
- ``strategy_ckpt_config``: a dict with ``load_file`` (compile reuses the strategy saved there)
  and ``save_file`` (compile saves its strategy there, in autopar's JSON);
- ``dataset_strategy``: "data_parallel", "full_batch" or a tuple of split tuples per batch leaf.
Values are checked when set (an invalid one raises ``ConfigError`` listing the valid ones);
how they combine (``device_num`` against ``mesh_shape``, say) is checked when the config is
built. Differences from MindSpore: settings are per process, not per device context; the
default ``dataset_strategy`` (None) lets the search choose the batch layout outside
data_parallel.
"""
from __future__ import annotations

import dataclasses

from .config import ParallelConfig
from .errors import ConfigError

_FIELDS = [f.name for f in dataclasses.fields(ParallelConfig)]
# dict-valued MindSpore keys: {sub-key: ParallelConfig field}
_DICTS = {
    "parallel_optimizer_config": {"optimizer_level": "optimizer_level",
                                  "parallel_optimizer_threshold": "parallel_optimizer_threshold"},
    "pipeline_config": {"pipeline_scheduler": "pipeline_scheduler"},
    "strategy_ckpt_config": {"load_file": "strategy_ckpt_load_file",
                             "save_file": "strategy_ckpt_save_file"},
}
KEYS = tuple(sorted(set(_FIELDS) - {v for d in _DICTS.values() for v in d.values()}
                    | set(_DICTS)))

_settings: dict = {}          # ParallelConfig field -> value, as set


def _fields_of(key, value) -> dict:
    """The ParallelConfig fields one context key sets."""
    if key not in KEYS:
        raise ConfigError(f"unknown auto-parallel context key {key!r}; valid keys: "
                          f"{', '.join(KEYS)}.")
    if key not in _DICTS:
        return {key: value}
    if not isinstance(value, dict):
        raise ConfigError(f"{key} takes a dict with keys {', '.join(_DICTS[key])}; got {value!r}.")
    bad = [k for k in value if k not in _DICTS[key]]
    if bad:
        raise ConfigError(f"{key} has unknown key(s) {', '.join(map(repr, bad))}; valid keys: "
                          f"{', '.join(_DICTS[key])}.")
    return {_DICTS[key][k]: v for k, v in value.items()}


def _checked(fields: dict) -> dict:
    """The values normalised ("2GB" -> bytes), checked one by one: each on its own, on top of
    a config that admits it."""
    out = {}
    for name, value in fields.items():
        base = {"parallel_mode": "auto_parallel"} if name != "parallel_mode" else {}
        if name == "pipeline_stages" and isinstance(value, int) and value >= 1:
            base["device_num"] = value
        if name == "pipeline_stage_devices" and isinstance(value, (list, tuple)):
            base.update(device_num=sum(v for v in value if isinstance(v, int)) or 1,
                        pipeline_stages=len(value) or 1)
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


def set_auto_parallel_context(**kw) -> None:
    """Set context keys (see the module docstring); unset keys keep their values."""
    fields = {}
    for key, value in kw.items():
        fields.update(_fields_of(key, value))
    _settings.update(_checked(fields))


def get_auto_parallel_context(key: str):
    """The value of one key, in MindSpore's form (enums as their strings, dicts for the dict
    keys); the default when it was never set."""
    if key not in KEYS:
        raise ConfigError(f"unknown auto-parallel context key {key!r}; valid keys: "
                          f"{', '.join(KEYS)}.")
    default = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    plain = lambda v: v.value if hasattr(v, "value") else v
    if key in _DICTS:
        return {sub: plain(_settings.get(f, default[f])) for sub, f in _DICTS[key].items()}
    if key == "device_num" and key not in _settings:
        return context_config().device_num
    return plain(_settings.get(key, default[key]))


def reset_auto_parallel_context() -> None:
    """Every key back to its default."""
    _settings.clear()


def context_config() -> ParallelConfig:
    """The ``ParallelConfig`` of the current context (raises ``ConfigError`` when its keys do
    not agree with each other)."""
    return ParallelConfig(**_settings)
