"""What compile refuses before planning: the config a call means (``config_of``: the given
one, or the context's), a backend that cannot run its devices (``check_backend``), and
combinations of config and loaded strategy autopar does not plan (``check_request``). In: a
ParallelConfig (and a loaded Strategy). Out: the config, or a ConfigError saying what and how
to fix it."""

from __future__ import annotations

import jax

from ..config import NATIVE_MAX_RANKS, Backend, ParallelConfig, ParallelMode
from ..context import context_config
from ..errors import ConfigError
from ..runtime.jax_distributed import multi_process


def config_of(config) -> ParallelConfig:
    """``config``, or the context's when None; ConfigError for anything else."""
    if config is None:
        return context_config()
    if not isinstance(config, ParallelConfig):
        raise ConfigError(
            f"config={config!r} must be an ap.ParallelConfig, e.g. "
            "ap.ParallelConfig(parallel_mode='data_parallel', device_num=2)."
        )
    return config


def check_backend(config) -> None:
    """ConfigError when the backend cannot run ``config``'s devices (checked before planning,
    not at the first call)."""
    n = config.devices.device_num
    if config.backend is Backend.NATIVE and multi_process():
        raise ConfigError(
            "backend='native' in a multi-process JAX runtime would start one "
            "native job per process; use backend='jax' (every process runs its "
            "devices' part of the plan), or start a single process."
        )
    if config.backend is Backend.NATIVE and n > NATIVE_MAX_RANKS:
        raise ConfigError(
            f"device_num={n}: the native backend runs at most {NATIVE_MAX_RANKS} "
            "ranks (one worker process each, on this host); use backend='jax' or "
            "fewer devices, or ap.plan to plan for more without running."
        )
    if config.backend is Backend.NATIVE and config.pipeline_interleave != 1:
        raise ConfigError(
            f"pipeline_interleave={config.pipeline_interleave!r}: the native "
            "runtime runs one pipeline stage per rank, and an interleaved "
            "pipeline puts several on each; run it with backend='jax', or plan "
            "it with ap.plan."
        )
    if config.backend is Backend.XLA and (pipelined(config) or config.pipeline.auto):
        raise ConfigError(
            "backend='xla' runs the plan as one jax.jit over the whole mesh, "
            "which has no pipeline stages; use backend='jax' for a pipeline "
            "(pipeline_stages=1 and micro_batches=1 with 'xla')."
        )
    if config.backend in (Backend.JAX, Backend.XLA) and n > len(jax.devices()):
        raise ConfigError(
            f"device_num={n} but JAX sees {len(jax.devices())} device(s) "
            f"({jax.devices()[0].platform}); on CPU set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} before importing jax, or "
            "lower device_num."
        )


def pipelined(config) -> bool:
    """Whether ``config`` asks for a pipeline (stages or micro-batches)."""
    return config.pipeline_stages != 1 or config.micro_batches != 1


def check_request(config, strategy, pipelined):
    """The combinations of config and loaded strategy autopar refuses, with how to fix them."""
    mode = config.parallel_mode
    if mode is ParallelMode.HYBRID_PARALLEL and strategy is not None:
        raise ConfigError(
            "hybrid_parallel runs the step's own collectives: there is no "
            "strategy to load; unset strategy / strategy_ckpt_config."
        )
    if (
        mode
        in (ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL)
        and not config.gradients_mean
    ):
        raise ConfigError(
            f"gradients_mean=False ({mode.value}) asks for MindSpore's sum of per-replica "
            "gradients, which is the data-parallel degree times the gradient of the step you "
            "wrote; autopar keeps the single-device mathematics in every mode "
            "(gradients_mean=True). To get the sum, multiply the loss by the degree."
        )
    if config.profile_plans and (pipelined or mode is ParallelMode.HYBRID_PARALLEL):
        raise ConfigError(
            "profile_plans measures one rank's step of a program without a "
            "pipeline; unset it, or set pipeline_stages=1 and micro_batches=1 "
            "(and a mode other than hybrid_parallel)."
        )
    if strategy is not None and pipelined and len({st.mesh_shape for st in strategy.stages}) > 1:
        raise ConfigError(
            "the strategy has pipeline stages on meshes of different sizes, which "
            "autopar does not load yet; plan again (pipeline_stage_devices) "
            "instead of loading it."
        )
