"""The best solver combination for a SearchProblem under a time limit (``autopar solve``).

In: a SearchProblem, a time limit in seconds, an optional progress callback. Out: the best
feasible Solution found, with the best lower bound proved (``Solution.lower_bound``). Small
problems (after the cheap start) go to CP-SAT (``ilp``) seeded with the dynamic-programming
answer, which is exact when it finishes and bounds the cost when it does not; large ones (the
IOPDDL production graphs) go to ``local_search`` (exact reductions, tree-block DP moves, region
MIPs).
"""
from __future__ import annotations

import dataclasses
import time

from ..problem import SearchProblem, Solution, check_fits
from . import anytime, get

# an ILP is tried when the pair variables of all edges stay below this many and the nodes
# below ILP_NODES: CP-SAT's model is built node by node in Python and held whole in memory (a
# 65,335-node problem with 7 strategies, IOPDDL P, took 9 minutes and 5.8 GB to build and solve
# past its 240 s); larger problems go to local_search, which reduces them first
ILP_PAIRS = 2_000_000
ILP_NODES = 5_000


def solve(problem: SearchProblem, *, time_limit=None, initial=None, progress=None) -> Solution:
    start = time.monotonic()
    limit = 60.0 if time_limit is None else float(time_limit)
    check_fits(problem)
    pairs = sum(m.size for m in problem.edge_costs)
    if pairs > ILP_PAIRS or problem.num_nodes > ILP_NODES:
        return get("local_search")(problem, time_limit=limit, initial=initial, progress=progress)
    first = initial or get("dynamic_programming")(problem, time_limit=0.2 * limit)
    if problem.feasible(first.choice):
        anytime.offer(first.cost, first.choice)
    if progress:
        progress(f"dynamic programming: cost {first.cost:.6g}; polishing with CP-SAT")
    left = limit - (time.monotonic() - start) - 0.5
    if left <= 1.0:
        return first
    polished = get("ilp")(problem, time_limit=left, initial=first, progress=progress)
    if polished.cost <= first.cost:
        return polished
    return dataclasses.replace(first, bound=polished.lower_bound)     # CP-SAT's bound holds
