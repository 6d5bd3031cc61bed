"""Independent references for the solver tests: plain enumeration, no numpy tricks, no pruning.

In: any problem with ``node_costs``, ``cost(choice)`` and ``feasible(choice)`` (a
``SearchProblem`` or a reduced one). Out: ``cheapest(problem)``, the least finite cost over
every memory-feasible choice (None when nothing fits). Costs of 1e17 or more count as
forbidden, as the IOPDDL format's "infinite" entries do.
"""
import itertools

import numpy as np


def cheapest(problem):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in problem.node_costs]):
        c = problem.cost(choice)
        if np.isfinite(c) and c < 1e17 and problem.feasible(choice) and (best is None or c < best):
            best = c
    return best
