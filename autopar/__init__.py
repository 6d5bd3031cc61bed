"""autopar: an auto-parallel compiler for JAX training steps.

The public names below load on first use (PEP 562), so `import autopar` and the
`autopar` command line do not import JAX until a name that needs it is touched;
`autopar solve` and `autopar COMMAND --help` stay numpy-only.
"""

import importlib
import importlib.util

_EXPORTS = {
    ".errors": (
        "AutoparError",
        "AutoparWarning",
        "CollectiveError",
        "ConfigError",
        "InfeasibleError",
        "LayoutError",
        "NativeArgumentError",
        "PipelineError",
        "RedistributionError",
        "RuleError",
        "WorkerError",
    ),
    ".layout": ("Layout",),
    ".mesh": ("LogicalMesh",),
    ".topology": ("Level", "Topology"),
    ".annotate": ("pipeline_stage", "shard"),
    ".config": (
        "Backend",
        "OptimizerLevel",
        "ParallelConfig",
        "ParallelMode",
        "PipelineScheduler",
        "SearchMode",
    ),
    ".context": (
        "context_config",
        "get_auto_parallel_context",
        "reset_auto_parallel_context",
        "set_auto_parallel_context",
    ),
    ".compiler.api": ("Compiled", "compile", "plan"),
    ".compiler.decorator": ("parallel",),
    ".compiler.auto_parallel": (
        "AutoParallel",
        "get_algo_parameters",
        "reset_algo_parameters",
        "set_algo_parameters",
    ),
    ".runtime.jax_distributed": ("init_distributed",),
    ".strategies.strategy": ("Strategy",),
    ".program": ("Collective", "Program"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE) + ["comm"]


def __getattr__(name):
    """A public name, or a submodule, imported the first time it is asked for."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    elif name == "__version__":  # the installed distribution's (pyproject.toml)
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version(__name__)
        except PackageNotFoundError:
            raise AttributeError(
                "autopar.__version__: autopar is not installed (run `pip install "
                ".` from the repository root)"
            ) from None
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
