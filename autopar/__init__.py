"""autopar: an auto-parallel compiler for JAX training steps."""
from .errors import (AutoparError, AutoparWarning, CollectiveError, ConfigError, InfeasibleError,
                     LayoutError, NativeArgumentError, PipelineError, RedistributionError,
                     RuleError, WorkerError)
from .layout import Layout
from .mesh import LogicalMesh
from .topology import Level, Topology
from .annotate import pipeline_stage, shard
from .config import (Backend, OptimizerLevel, ParallelConfig, ParallelMode, PipelineScheduler,
                     SearchMode)
from .context import (context_config, get_auto_parallel_context, reset_auto_parallel_context,
                      set_auto_parallel_context)
from .compiler.api import Compiled, compile, parallel, plan
from .runtime.jax_distributed import init_distributed
from . import comm
from .strategies.strategy import Strategy
from .program import Collective, Program
