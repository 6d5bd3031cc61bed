"""The layouts of a whole step on one mesh, as planning hands them between its phases.

In: what planning on one mesh decided (the mesh, its redistribution planner, every operator's
chosen candidate, the parallel optimizer's update layouts, the results' layouts, the priced
redistributions) and, without a pipeline, the lowered Program. Out: a frozen ``MeshPlan``
that the compiler's phases (``api``, ``pipeline_plan``, ``dump``) read.
"""

from __future__ import annotations

import dataclasses

from ..mesh import LogicalMesh
from ..program import Program
from ..redistribution.planner import Planner
from ..strategies.propagation import Assignment


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The layouts of the whole step on one mesh and what lowering them costs."""

    mesh: LogicalMesh
    planner: Planner
    assignment: Assignment
    updates: dict  # argument position -> layout its update runs in
    out_layouts: tuple  # per result: state keeps its argument's layout, else None
    comm: dict  # node id -> seconds of the redistributions feeding it
    program: Program | None = None  # the lowered Program (without a pipeline)
    out_comm: float = 0.0
    measured: float | None = None  # profile_plans: one rank's compute, measured
    alternatives: tuple = ()  # auto_parallel: the Alternative of each plan compared
