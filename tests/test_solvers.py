"""Solvers over SearchProblem, cross-checked against brute force on random tiny problems.

Tier: pure planning (no JAX, no devices). Several hundred random problems (every graph kind
of ``random_problems``, every memory-limit mode) go through brute force, ilp, dp and
sharding propagation; the IOPDDL example must give its known optimum 445.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from autopar.errors import ConfigError, InfeasibleError
from autopar.strategies.problem import SearchProblem, Solution
from autopar.strategies.solvers import bfs_propagation, brute, dp, ilp
from reference import cheapest
from autopar.strategies.solvers.random_problems import (KINDS, LIMIT_MODES, REDUCIBLE,
                                                        random_medium_problem, random_problem)

EXAMPLE = os.path.join(os.path.dirname(__file__), "data", "iopddl", "example.json")
SOLVERS = {"brute": brute.solve, "ilp": ilp.solve, "dp": dp.solve,
           "propagation": bfs_propagation.solve}


def same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-7 * max(1.0, abs(a), abs(b))


def check_valid(problem: SearchProblem, sol) -> None:
    assert len(sol.choice) == problem.num_nodes
    assert all(0 <= s < len(c) for s, c in zip(sol.choice, problem.node_costs))
    assert problem.feasible(sol.choice), (problem.name, sol.solver, sol.peak)
    assert same(sol.cost, problem.cost(sol.choice))


def check_infeasible(problem: SearchProblem) -> None:
    for name, solve in SOLVERS.items():
        with pytest.raises(InfeasibleError, match=rf"limit of {problem.usage_limit} bytes"
                                                  rf".*at step \d+"):
            solve(problem)


def limit_binds(problem: SearchProblem, choice) -> bool:
    return problem.usage_limit is not None and not problem.feasible(choice)


# ---------------------------------------------------------------------- the IOPDDL example
@pytest.mark.parametrize("name", ["brute", "ilp", "dp"])
def test_example_optimum_445(name):
    problem = SearchProblem.load(EXAMPLE)
    sol = SOLVERS[name](problem)
    check_valid(problem, sol)
    assert sol.cost == 445
    # the limit binds on the example, so dp's multiplier search cannot claim a proof
    assert sol.optimal == (name != "dp")


def test_example_propagation_feasible():
    problem = SearchProblem.load(EXAMPLE)
    sol = bfs_propagation.solve(problem)
    check_valid(problem, sol)
    assert sol.cost >= 445 and not sol.optimal


# ---------------------------------------------------------------------- random cross-checks
@pytest.mark.parametrize("seed", range(40))
def test_brute_force_is_the_plain_enumeration(seed):
    """brute.solve (mixed-radix chunks priced with numpy, memory checked at interval starts)
    is the reference of every other solver test: it must agree with plain enumeration."""
    kind = KINDS[seed % len(KINDS)]
    problem = random_problem(seed, kind=kind, nodes=3 + seed % 5,
                             limit=LIMIT_MODES[seed % len(LIMIT_MODES)])
    want = cheapest(problem)
    if want is None:
        with pytest.raises(InfeasibleError):
            brute.solve(problem)
    else:
        assert brute.solve(problem).cost == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(110))
def test_random_tiny_problems_against_brute_force(seed):
    """Five problems per seed (one per graph kind), limit mode drawn from the seed."""
    for k, kind in enumerate(KINDS):
        problem = random_problem(1000 * seed + k, kind=kind)
        try:
            best = brute.solve(problem)
        except InfeasibleError:
            check_infeasible(problem)
            continue
        check_valid(problem, best)
        assert best.optimal

        exact = ilp.solve(problem, time_limit=20)
        check_valid(problem, exact)
        assert exact.optimal and same(exact.cost, best.cost), (problem.name, exact, best)

        sol = dp.solve(problem)
        check_valid(problem, sol)
        assert sol.cost >= best.cost - 1e-7 * max(1.0, best.cost)
        if sol.optimal:
            assert same(sol.cost, best.cost), problem.name
        unconstrained, _ = dp.run(problem)
        if kind in REDUCIBLE and not limit_binds(problem, unconstrained):
            assert sol.optimal and same(sol.cost, best.cost), (problem.name, sol, best)
        if limit_binds(problem, unconstrained):
            assert not sol.optimal

        prop = bfs_propagation.solve(problem)
        check_valid(problem, prop)
        assert prop.cost >= best.cost - 1e-7 * max(1.0, best.cost)


@pytest.mark.parametrize("seed", range(40))
def test_dp_non_reducible_and_star(seed):
    """Sparse DAGs: exact residual solving matches brute force without a limit; the star rule
    (forced by a tiny enumeration limit) stays feasible and never beats the optimum."""
    for limit in ("none", "tight"):
        problem = random_problem(seed, kind="sparse", nodes=7 + seed % 3, limit=limit)
        best = brute.solve(problem)
        sol = dp.solve(problem, star=False)
        check_valid(problem, sol)
        if limit == "none":
            assert sol.optimal and same(sol.cost, best.cost), problem.name
        starred = dp.solve(problem, enumeration_limit=1)
        check_valid(problem, starred)
        assert starred.cost >= best.cost - 1e-7 * max(1.0, best.cost)
        red = dp.eliminate(problem, enumeration_limit=1)
        left = {i for pair in red.pairs for i in pair}
        assert red.fully_reduced or math.prod(len(red.costs[i]) for i in left) == 1
        if red.counts["star"]:
            assert not red.exact


@pytest.mark.parametrize("seed", range(30))
def test_reducible_graphs_reduce_fully(seed):
    for kind in sorted(REDUCIBLE):
        problem = random_problem(seed, kind=kind, nodes=6 + seed % 10, limit="none",
                                 max_combinations=10 ** 9)
        red = dp.eliminate(problem, star=False)
        assert red.fully_reduced and red.exact, (problem.name, red.counts)


@pytest.mark.parametrize("seed", range(25))
def test_infeasible_limits_raise(seed):
    problem = random_problem(seed, kind=KINDS[seed % len(KINDS)], limit="infeasible")
    check_infeasible(problem)


@pytest.mark.parametrize("seed", range(25))
def test_exact_limit_fits_only_smallest_at_peak(seed):
    problem = random_problem(seed, kind=KINDS[seed % len(KINDS)], limit="exact")
    best = brute.solve(problem)
    for name, solve in SOLVERS.items():
        sol = solve(problem)
        check_valid(problem, sol)
        if name in ("brute", "ilp"):
            assert same(sol.cost, best.cost)


@pytest.mark.parametrize("seed", range(20))
def test_large_costs_scale_exactly(seed):
    """Costs around 1e10 with fractional parts: CP-SAT's integer scaling keeps the optimum."""
    base = random_problem(seed, nodes=6, max_strategies=4)
    scaled = SearchProblem(tuple(c * 1e8 + 0.37 for c in base.node_costs), base.node_usages,
                           base.intervals, base.edges, tuple(m * 3e8 for m in base.edge_costs),
                           base.usage_limit, base.name + "-scaled")
    try:
        best = brute.solve(scaled)
    except InfeasibleError:
        check_infeasible(scaled)
        return
    sol = ilp.solve(scaled)
    check_valid(scaled, sol)
    assert sol.optimal and same(sol.cost, best.cost)


# ---------------------------------------------------------------------- solver specifics
def _problem(costs, usages, intervals, edges, matrices, limit=None):
    return SearchProblem(tuple(np.asarray(c, float) for c in costs),
                         tuple(np.asarray(u, np.int64) for u in usages),
                         np.asarray(intervals, np.int64).reshape(-1, 2),
                         np.asarray(edges, np.int64).reshape(-1, 2),
                         tuple(np.asarray(m, float) for m in matrices), limit)


def test_brute_ties_pick_lexicographically_smallest():
    problem = _problem([[1, 1, 1], [2, 2]], [[1, 1, 1], [1, 1]], [[0, 1], [0, 1]],
                       [[0, 1]], [[[0, 0], [0, 0], [0, 0]]])
    assert brute.solve(problem).choice == (0, 0)


def test_brute_refuses_huge_problems():
    problem = random_problem(1, kind="chain", nodes=30, max_strategies=4, limit="none",
                             max_combinations=10 ** 30)
    with pytest.raises(ConfigError, match="max_combinations"):
        brute.solve(problem)


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_empty_problem(name):
    problem = _problem([], [], np.zeros((0, 2)), np.zeros((0, 2)), [], limit=10)
    sol = SOLVERS[name](problem)
    assert sol.choice == () and sol.cost == 0


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_self_loops_and_parallel_edges(name):
    costs = [[3, 1, 2], [0, 5], [4, 4, 1]]
    problem = _problem(costs, [[5, 9, 1], [2, 3], [7, 1, 1]], [[0, 4], [1, 3], [2, 6]],
                       [[0, 0], [0, 1], [1, 0], [1, 2], [2, 1]],
                       [np.diag([10, 0, 7]) + 1, [[0, 3], [2, 2], [9, 0]], [[1, 0, 2], [0, 4, 1]],
                        [[0, 1, 6], [5, 0, 2]], [[2, 0], [0, 3], [1, 1]]], limit=14)
    best = brute.solve(problem)
    sol = SOLVERS[name](problem)
    check_valid(problem, sol)
    if name != "propagation":
        assert same(sol.cost, best.cost)


def test_ilp_uses_initial_and_reports_optimality():
    problem = random_problem(7, kind="sparse", nodes=8, limit="tight")
    best = brute.solve(problem)
    start = bfs_propagation.solve(problem)
    sol = ilp.solve(problem, initial=start, time_limit=10)
    assert sol.optimal and same(sol.cost, best.cost) and sol.solver == "ilp"
    with pytest.raises(ConfigError, match="initial"):
        ilp.solve(problem, initial=brute.solve(random_problem(8, nodes=3, limit="none")))


def test_ilp_lower_bound_holds_for_every_feasible_cost():
    """Stopped before proving optimality, CP-SAT still bounds the cost: the bound of a short run
    lies below the cost of a longer one and the other way round; proven optima are their own
    bound (gap 0)."""
    problem = random_medium_problem(1, nodes=150, max_strategies=10)
    short, longer = ilp.solve(problem, time_limit=1.5), ilp.solve(problem, time_limit=4)
    for a, b in ((short, longer), (longer, short)):
        assert a.lower_bound is not None and a.lower_bound <= b.cost + 1e-9
        assert 0 <= a.gap < 1
    tiny = random_problem(7, kind="sparse", nodes=8, limit="tight")
    sol = ilp.solve(tiny, time_limit=10)
    assert sol.optimal and sol.lower_bound == sol.cost and sol.gap == 0


def test_ilp_reduction_keeps_optimum_with_forbidden_pairs():
    """1e18 entries (IOPDDL's 'impossible') are pruned by the bound of a known solution."""
    big = 1e18
    problem = _problem([[0, 1, big], [1, 0], [0, 0, 3]], [[1, 1, 1], [1, 2], [3, 1, 1]],
                       [[0, 3], [1, 4], [2, 5]], [[0, 1], [1, 2], [0, 2]],
                       [[[0, big], [big, 0], [0, 0]], [[big, 0, 2], [0, big, big]],
                        [[1, 1, 0], [0, 5, 5], [big, big, big]]], limit=4)
    best = brute.solve(problem)
    red = ilp.reduce_problem(problem, best.cost)
    assert not red.allowed[0][2]
    sol = ilp.solve(problem)
    assert sol.optimal and same(sol.cost, best.cost) and sol.cost < big


def test_ilp_improves_a_dominated_initial_when_nothing_is_left_to_search():
    """Dominance leaves one strategy per node, so CP-SAT gets an empty model; the answer must
    still be the reduced choice, not the (worse) initial one."""
    problem = _problem([[5, 1], [3, 0]], [[2, 1], [1, 1]], [[0, 2], [1, 3]], [[0, 1]],
                       [[[0, 0], [0, 0]]], limit=10)
    sol = ilp.solve(problem, initial=Solution.of(problem, (0, 0), "given"))
    assert sol.choice == (1, 1) and sol.optimal


def test_ilp_memory_steps_cover_every_maximal_live_set():
    problem = _problem([[0]] * 4, [[1]] * 4, [[0, 5], [1, 3], [2, 6], [4, 6]], [], [])
    # live sets: t=0 {0}, 1 {0,1}, 2 {0,1,2}, 4 {0,2,3}: maximal ones start at 2 and 4
    assert ilp._memory_steps(problem).tolist() == [2, 4]


def test_propagation_anchors_and_determinism():
    problem = random_problem(3, kind="tree", nodes=8, max_strategies=3, limit="none")
    node = max(range(problem.num_nodes), key=lambda i: len(problem.node_costs[i]))
    strategy = len(problem.node_costs[node]) - 1
    a = bfs_propagation.solve(problem, anchors={node: strategy})
    b = bfs_propagation.solve(problem, anchors={node: strategy})
    assert a.choice == b.choice and a.choice[node] == strategy
    adj = bfs_propagation.Adjacency.of(problem)
    assert bfs_propagation.propagate(problem, adj, {node: strategy})[node] == strategy
    with pytest.raises(ConfigError, match="anchor"):
        bfs_propagation.solve(problem, anchors={problem.num_nodes: 0})


def test_repair_reaches_the_limit():
    problem = random_problem(11, kind="sparse", nodes=8, limit="exact")
    largest = [int(np.argmax(u)) for u in problem.node_usages]
    assert not problem.feasible(largest)
    fixed = bfs_propagation.repair_memory(problem, largest)
    assert problem.feasible(fixed)
    polished = bfs_propagation.improve(problem, fixed)
    assert problem.feasible(polished) and problem.cost(polished) <= problem.cost(fixed)


@pytest.mark.parametrize("kind", ["series_parallel", "sparse"])
def test_medium_problems(kind):
    """Benchmark-sized problems: every solver feasible; CP-SAT no worse than the heuristics
    it starts from."""
    problem = random_medium_problem(5, kind=kind, nodes=60, max_strategies=5)
    heuristic = [dp.solve(problem), bfs_propagation.solve(problem)]
    for sol in heuristic:
        check_valid(problem, sol)
    sol = ilp.solve(problem, time_limit=3, initial=min(heuristic, key=lambda h: h.cost))
    check_valid(problem, sol)
    assert sol.cost <= min(h.cost for h in heuristic) + 1e-6 * abs(sol.cost)
    assert not math.isnan(sol.cost)


def test_random_problem_is_a_function_of_its_arguments():
    a = random_problem(42)
    b = random_problem(42)
    assert a.to_json() == b.to_json()
    assert {random_problem(s).name.split("-")[2] for s in range(60)} == set(LIMIT_MODES)


def test_dynamic_programming_polished_by_local_search_in_auto_parallels_search():
    """auto_parallel's search polishes dynamic programming's answer with local search
    (``compiler.search._polished``): never dearer, a proven bound never above it, and cheaper
    on graphs that are not series-parallel (where elimination is only approximate)."""
    import autopar as ap
    from autopar.compiler import search
    from autopar.compiler.search import _polished
    from autopar.strategies import solvers
    from autopar.strategies.solvers.random_problems import random_medium_problem
    better = 0
    for seed in range(4):
        p = random_medium_problem(seed, kind="sparse", nodes=200)
        dp = solvers.get("dynamic_programming")(p, time_limit=10)
        assert p.num_nodes < search.POLISH_NODES        # small: kept as it is
        assert _polished(p, dp, 0.0, ap.ParallelConfig(), None) is dp
        search.POLISH_NODES, keep = 0, search.POLISH_NODES
        try:
            got = _polished(p, dp, 0.0, ap.ParallelConfig(), None)
        finally:
            search.POLISH_NODES = keep
        assert p.feasible(got.choice) and got.cost == pytest.approx(p.cost(got.choice))
        assert got.cost <= dp.cost
        assert got.lower_bound is None or got.lower_bound <= got.cost + 1e-9
        better += got.cost < dp.cost
    assert better >= 1
