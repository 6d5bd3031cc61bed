"""Brute force: the reference optimum of a tiny SearchProblem by exhaustive enumeration.

In: a ``SearchProblem`` whose product of strategy counts is at most ``max_combinations``
(default 1,000,000). Out: a ``Solution`` with ``optimal=True``: the cheapest choice that
respects ``usage_limit``; among equally cheap choices, the lexicographically smallest one
(node 0's index most significant). ``InfeasibleError`` when nothing fits (``check_fits``
first, naming the peak step and the limit), ``ConfigError`` when the problem is too big.

Method: every choice is a number in the mixed radix of the strategy counts (node 0 most
significant, so counting order is lexicographic order); chunks of consecutive numbers are
decoded to choices and priced with numpy; memory is checked at every step where some
interval starts (the live set only grows there, so those steps bound every other step).
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.errors import ConfigError, InfeasibleError
from autopar.strategies.problem import SearchProblem, Solution, check_fits

MAX_COMBINATIONS = 1_000_000
_CHUNK = 1 << 15


def _check_steps(problem: SearchProblem) -> np.ndarray:
    """Steps at which memory must be checked: every start of a non-empty interval."""
    live = problem.intervals[:, 1] > problem.intervals[:, 0]
    return np.unique(problem.intervals[live, 0])


def solve(
    problem: SearchProblem,
    *,
    time_limit=None,
    initial=None,
    progress=None,
    max_combinations: int = MAX_COMBINATIONS,
) -> Solution:
    """Enumerate every choice (``time_limit`` and ``initial`` are not needed: the work is
    bounded by ``max_combinations``)."""
    t0 = time.perf_counter()
    check_fits(problem)
    sizes = [len(c) for c in problem.node_costs]
    total = math.prod(sizes)
    if total > max_combinations:
        raise ConfigError(
            f"brute force on {problem.name!r} would enumerate {total:.3g} choices "
            f"({problem.num_nodes} nodes), more than max_combinations={max_combinations}; use "
            "the ilp or dp solver for problems this size."
        )
    n = problem.num_nodes
    if n == 0:
        return Solution.of(problem, (), "brute", time.perf_counter() - t0, True)

    steps = _check_steps(problem)
    iv = problem.intervals
    live = (iv[None, :, 0] <= steps[:, None]) & (steps[:, None] < iv[None, :, 1])  # (T, n)
    limited = problem.usage_limit is not None and len(steps) > 0
    radix = np.ones(n, np.int64)  # weight of each node's digit
    for i in range(n - 2, -1, -1):
        radix[i] = radix[i + 1] * sizes[i + 1]

    best_cost, best_index = math.inf, -1
    for lo in range(0, total, _CHUNK):
        index = np.arange(lo, min(total, lo + _CHUNK), dtype=np.int64)
        digits = (index[:, None] // radix[None, :]) % np.asarray(sizes, np.int64)[None, :]
        cost = np.zeros(len(index))
        for i in range(n):
            cost += problem.node_costs[i][digits[:, i]]
        for (u, v), m in zip(problem.edges, problem.edge_costs):
            cost += m[digits[:, u], digits[:, v]]
        if limited:
            assert problem.usage_limit is not None  # limited implies a limit
            use = np.zeros((len(index), n), np.int64)
            for i in range(n):
                use[:, i] = problem.node_usages[i][digits[:, i]]
            fits = (use @ live.T.astype(np.int64) <= problem.usage_limit).all(axis=1)
            cost = np.where(fits, cost, math.inf)
        k = int(np.argmin(cost))  # first minimum: lexicographic tie-break
        if cost[k] < best_cost:
            best_cost, best_index = float(cost[k]), int(index[k])
    if best_index < 0:
        raise InfeasibleError(
            f"no choice of {problem.name!r} fits the memory limit of {problem.usage_limit} "
            "bytes per device at every step (checked exhaustively)."
        )
    choice = [(best_index // int(radix[i])) % sizes[i] for i in range(n)]
    return Solution.of(problem, choice, "brute", time.perf_counter() - t0, True)
