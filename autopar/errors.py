"""autopar's one error hierarchy.

In: nothing. Out: exception classes rooted at ``AutoparError``. Messages say what went wrong,
where (operator, value, shapes, mesh) and how to fix it.
"""
from __future__ import annotations


class AutoparError(Exception):
    """Root of every error autopar raises on purpose."""


class ConfigError(AutoparError, ValueError):
    """A ParallelConfig field or context key has an invalid value."""


class LayoutError(AutoparError, ValueError):
    """A layout or sharding annotation does not fit its tensor or mesh."""


class RuleError(AutoparError):
    """No sharding rule exists for a primitive, or a rule cannot handle its parameters."""


class InfeasibleError(AutoparError):
    """No strategy satisfies the constraints (e.g. the per-device memory cap)."""


class RedistributionError(AutoparError):
    """No sequence of collectives turns one layout into another."""


class CollectiveError(AutoparError, RuntimeError):
    """A collective failed while running (rank, operation, cause)."""
