"""Repeated blocks folded (strategies/solvers/fold.py): which nodes are tied, that the folded
problem prices a tied choice exactly, and dynamic programming on it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopar.strategies.problem import SearchProblem
from autopar.strategies.solvers import dp, fold
from autopar.strategies.solvers.random_problems import random_problem


def layered(seed: int, blocks: int, block_nodes: int = 5, strategies: int = 3, limit=None):
    """A model of ``blocks`` identical layers between a distinct first and last node: one
    random block (a sparse graph) copied, each copy fed by the last node of the one before,
    as a traced stack of layers is; intervals as a forward pass holds its activations."""
    block = random_problem(
        seed,
        kind="sparse",
        nodes=block_nodes,
        max_strategies=strategies,
        limit="none",
        max_combinations=10**9,
    )
    rng = np.random.default_rng(seed + 1)
    k = block.num_nodes
    head = np.round(rng.uniform(0, 100, strategies), 2)
    tail = np.round(rng.uniform(0, 100, strategies), 2)
    costs = [head] + [c for _ in range(blocks) for c in block.node_costs] + [tail]
    usages = [np.ones(len(c), np.int64) * 7 for c in costs[:1]]
    usages += [u for _ in range(blocks) for u in block.node_usages]
    usages += [np.ones(len(tail), np.int64) * 7]
    link_in = np.round(rng.uniform(0, 50, (len(head), len(block.node_costs[0]))), 2)
    link = np.round(rng.uniform(0, 50, (len(block.node_costs[-1]), len(block.node_costs[0]))), 2)
    link_out = np.round(rng.uniform(0, 50, (len(block.node_costs[-1]), len(tail))), 2)
    edges, mats = [], []
    for b in range(blocks):
        base = 1 + b * k
        for (u, v), m in zip(block.edges.tolist(), block.edge_costs):
            edges.append((base + u, base + v))
            mats.append(m)
        if b == 0:
            edges.append((0, base))
            mats.append(link_in)
        else:
            edges.append((base - 1, base))
            mats.append(link)
    last = 1 + blocks * k
    edges.append((last - 1, last))
    mats.append(link_out)
    n = len(costs)
    intervals = np.array([[i, n + (n - i)] for i in range(n)], np.int64)
    return SearchProblem(
        tuple(costs),
        tuple(usages),
        intervals,
        np.array(edges, np.int64),
        tuple(mats),
        limit,
        f"layered-{seed}",
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_middle_layers_fold_into_one_and_a_tied_choice_is_priced_exactly(seed):
    blocks, k = 16, 5
    problem = layered(seed, blocks, k)
    f = fold.fold(problem)
    assert f is not None and f.shrink >= 2.0
    # the same position in two middle layers is one class; the first and last nodes their own
    middle = [1 + b * k for b in range(6, 10)]
    assert len({int(f.members[i]) for i in middle}) == 1
    assert f.members[0] not in f.members[1:] and f.members[-1] not in f.members[:-1]
    # members of a class are alike: equal cost and usage vectors
    for c in np.unique(f.members).tolist():
        idx = np.flatnonzero(f.members == c).tolist()
        for i in idx[1:]:
            assert np.array_equal(problem.node_costs[i], problem.node_costs[idx[0]])
            assert np.array_equal(problem.node_usages[i], problem.node_usages[idx[0]])
    rng = np.random.default_rng(seed)
    for _ in range(20):  # any choice of the folded problem is priced as its unfolding
        choice = [int(rng.integers(len(c))) for c in f.problem.node_costs]
        assert f.problem.cost(choice) == pytest.approx(problem.cost(f.unfold(choice)), rel=1e-12)
    # and the penalised costs a solver passes fold the same way
    doubled = 2 * problem.flat_costs
    assert all(np.allclose(a, 2 * b) for a, b in zip(f.costs(doubled), f.problem.node_costs))


@pytest.mark.parametrize("seed", range(4))
def test_a_graph_that_does_not_repeat_does_not_fold(seed):
    problem = random_problem(seed, kind="sparse", nodes=40, limit="none", max_combinations=10**30)
    assert fold.fold(problem) is None


def _best_tied(problem, f):
    """The cheapest choice that gives every class one strategy, by enumeration."""
    sizes = [len(c) for c in f.problem.node_costs]
    return min(problem.cost(f.unfold(c)) for c in itertools.product(*(range(s) for s in sizes)))


@pytest.mark.parametrize("seed", range(5))
def test_folded_dynamic_programming_is_no_worse_than_the_best_tied_choice(seed):
    problem = layered(seed, 12, block_nodes=2, strategies=2)
    f = fold.fold(problem)
    assert f is not None and np.prod([len(c) for c in f.problem.node_costs]) <= 1 << 16
    got = dp.solve(problem, fold=True)
    assert got.cost <= _best_tied(problem, f) + 1e-9
    assert not got.optimal  # optimal among tied choices only: nothing is claimed
    assert got.cost == pytest.approx(problem.cost(got.choice))


@pytest.mark.parametrize("seed", range(5))
def test_folded_dynamic_programming_keeps_to_a_binding_memory_limit(seed):
    loose = layered(seed, 16)
    smallest = [int(np.argmin(u)) for u in loose.node_usages]
    cheapest = dp.solve(loose, fold=True)
    low, high = loose.peak(smallest), cheapest.peak
    assert high > low  # the limit below binds
    limit = low + (high - low) // 3
    problem = layered(seed, 16, limit=limit)
    got = dp.solve(problem, fold=True)
    assert problem.peak(got.choice) <= limit
    assert got.cost >= cheapest.cost - 1e-9


def test_large_repeated_problems_fold_by_default_and_auto_parallel_keeps_the_folded_answer():
    """dp.solve folds a problem of at least FOLD_NODES nodes that repeats (and says so in its
    Solution), not a small one; auto_parallel's search does not polish a folded answer with
    local search (compiler.search._polished)."""
    import autopar as ap
    from autopar.compiler import search

    big = layered(3, 1 + dp.FOLD_NODES // 5)
    assert big.num_nodes >= dp.FOLD_NODES
    got = dp.solve(big)
    f = fold.fold(big)  # by default the cheaper first elimination decides
    folded_first = big.cost(f.unfold(dp.run(f.problem)[0]))
    assert got.folded == (folded_first < big.cost(dp.run(big)[0]))
    assert got.cost == pytest.approx(big.cost(got.choice))
    small = layered(3, 16)
    assert not dp.solve(small).folded and dp.solve(small, fold=True).folded
    folded = dp.solve(big, fold=True)
    assert search._polished(big, folded, 10.0, ap.ParallelConfig(), None) is folded
