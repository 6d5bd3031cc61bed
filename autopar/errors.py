"""autopar's one error hierarchy.

In: nothing. Out: exception classes rooted at ``AutoparError``. Messages say what went wrong,
where (operator, value, shapes, mesh) and how to fix it.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Root of every error autopar raises on purpose."""


class AutoparWarning(UserWarning):
    """Something autopar accepted but does not do (e.g. a MindSpore context key it ignores)."""


class ConfigError(AutoparError, ValueError):
    """A ParallelConfig field or context key has an invalid value."""


class LayoutError(AutoparError, ValueError):
    """A layout or sharding annotation does not fit its tensor or mesh."""


class RuleError(AutoparError):
    """No sharding rule exists for a primitive, or a rule cannot handle its parameters."""


class InfeasibleError(AutoparError):
    """No strategy satisfies the constraints (e.g. the per-device memory cap)."""


class PipelineError(AutoparError, ValueError):
    """Pipeline stages that cannot run: bad ``ap.pipeline_stage`` numbers or order."""


class RedistributionError(AutoparError):
    """No sequence of collectives turns one layout into another."""


class CollectiveError(AutoparError, RuntimeError):
    """A collective failed while running (rank, operation, cause)."""


class NativeArgumentError(AutoparError, ValueError, TypeError):
    """An argument of the native runtime's binding (``autopar._native``: Segment, Comm, a
    collective) is out of range or of the wrong kind: a rank, size, descriptor, host list,
    timeout, group, root, peer, array (dtype, size, layout) or address. Raised before the C++
    code uses the argument, with its name and the valid range; nothing has moved. A ValueError,
    and a TypeError too (an array of the wrong dtype)."""


class WorkerError(AutoparError, RuntimeError):
    """A Python exception raised inside a native worker process: ``rank`` is the worker's rank,
    ``kind`` the exception's type name and ``traceback`` the worker's formatted traceback (also
    at the end of the message)."""

    def __init__(
        self, message: str, rank: int | None = None, kind: str | None = None, traceback: str = ""
    ):
        super().__init__(message)
        self.rank, self.kind, self.traceback = rank, kind, traceback

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.kind, self.traceback)
