"""autopar: an auto-parallel compiler for JAX training steps."""
from .errors import (AutoparError, CollectiveError, ConfigError, InfeasibleError, LayoutError,
                     RedistributionError, RuleError)
from .layout import Layout
from .mesh import LogicalMesh
from .topology import Level, Topology
from .annotate import shard
