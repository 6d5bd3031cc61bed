"""Random SearchProblems for solver tests and benchmarks.

In: a seed and optional shape knobs (graph kind, node count, strategies per node, memory-limit
mode). Out: a ``SearchProblem`` (strategies/problem.py) that is a pure function of the
arguments, so a failing seed reproduces exactly.

Graph kinds (edges always point from a lower to a higher node index, as a traced program's
dataflow does, except where stated):

- ``chain``: 0 -> 1 -> ... -> n-1.
- ``tree``: every node i > 0 hangs off a random earlier node (edge direction random).
- ``series_parallel``: a two-terminal series-parallel graph grown by random series
  (subdivide an edge) and parallel (add a two-edge path beside an edge) steps; sometimes a
  duplicate edge between the same pair (exercises edge elimination).
- ``diamond``: a chain of diamonds s -> a, s -> b, a -> t, b -> t.
- ``sparse``: a random sparse DAG, each node fed by one to three earlier nodes; usually not
  series-parallel.

The first four reduce fully under the elimination rules of dp.py (``REDUCIBLE``).

Costs: node costs uniform in [0, 100) rounded to cents, sometimes with exact ties; edge costs
look like resharding matrices (zero where the strategies agree, positive elsewhere, sometimes
a prohibitive 1e6 entry). Usages: integers in [1, 100). Intervals: random, overlapping,
occasionally empty (start == end: never live).

Memory-limit modes (``LIMIT_MODES``): ``none`` (no limit); ``loose`` (the peak of the largest
choice: never binds); ``tight`` (between the smallest possible peak and the largest: binds
often); ``exact`` (exactly the smallest possible peak: only minimum-usage choices at the peak
fit); ``infeasible`` (one byte under the smallest possible peak: InfeasibleError).
"""

from __future__ import annotations

import numpy as np

from autopar.errors import ConfigError
from autopar.strategies.problem import SearchProblem

KINDS = ("chain", "tree", "series_parallel", "diamond", "sparse")
REDUCIBLE = frozenset({"chain", "tree", "series_parallel", "diamond"})
LIMIT_MODES = ("none", "loose", "tight", "exact", "infeasible")


def _graph(kind: str, n: int, rng: np.random.Generator) -> tuple[int, list]:
    """(number of nodes, list of (u, v) edges) for ``kind`` with about ``n`` nodes."""
    if kind == "chain":
        return n, [(i, i + 1) for i in range(n - 1)]
    if kind == "tree":
        edges = []
        for i in range(1, n):
            p = int(rng.integers(0, i))
            edges.append((p, i) if rng.random() < 0.7 else (i, p))
        return n, edges
    if kind == "series_parallel":
        edges = [(0, 1)]
        count = 2
        while count < n:
            e = int(rng.integers(0, len(edges)))
            u, v = edges[e]
            w = count
            count += 1
            if rng.random() < 0.5:  # series: u -> w -> v replaces u -> v
                edges[e] = (u, w)
                edges.append((w, v))
            else:  # parallel: u -> w -> v beside u -> v
                edges += [(u, w), (w, v)]
        if rng.random() < 0.3:  # a duplicate edge between one pair
            edges.append(edges[int(rng.integers(0, len(edges)))])
        return count, edges
    if kind == "diamond":
        edges, s = [], 0
        count = 1
        while count + 3 <= max(n, 4):
            a, b, t = count, count + 1, count + 2
            edges += [(s, a), (s, b), (a, t), (b, t)]
            s, count = t, count + 3
        return count, edges
    if kind == "sparse":
        edge_set: set[tuple[int, int]] = set()
        for i in range(1, n):
            for p in rng.choice(i, size=min(i, int(rng.integers(1, 4))), replace=False):
                edge_set.add((int(p), i))
        return n, sorted(edge_set)
    raise ConfigError(f"unknown random graph kind {kind!r}; expected one of {KINDS}.")


def _edge_matrix(su: int, sv: int, rng: np.random.Generator) -> np.ndarray:
    """A resharding-like cost matrix: zero where the strategies agree, positive elsewhere."""
    m = np.round(rng.uniform(0.0, 60.0, (su, sv)), 2)
    if rng.random() < 0.6:
        k = min(su, sv)
        m[np.arange(k), np.arange(k)] = 0.0
    if rng.random() < 0.2:
        m[int(rng.integers(0, su)), int(rng.integers(0, sv))] = 1e6  # prohibitive pair
    if rng.random() < 0.15:
        m[:] = np.round(rng.uniform(0.0, 10.0), 2)  # separable: constant
    return m


def random_problem(
    seed: int,
    *,
    kind: str | None = None,
    nodes: int | None = None,
    max_strategies: int = 3,
    limit: str | None = None,
    max_combinations: int = 20_000,
) -> SearchProblem:
    """A random problem; arguments left None are drawn from ``seed`` as well.

    ``max_combinations`` caps the product of strategy counts (strategy counts are lowered
    until it holds) so brute force stays fast; pass a huge value for benchmark problems."""
    rng = np.random.default_rng(seed)
    kind = kind or KINDS[int(rng.integers(0, len(KINDS)))]
    n_want = nodes if nodes is not None else int(rng.integers(2, 9))
    limit = limit or LIMIT_MODES[int(rng.integers(0, len(LIMIT_MODES)))]
    if limit not in LIMIT_MODES:
        raise ConfigError(f"unknown limit mode {limit!r}; expected one of {LIMIT_MODES}.")
    n, edges = _graph(kind, max(n_want, 2), rng)

    sizes = rng.integers(1, max_strategies + 1, n)
    while np.prod(sizes.astype(float)) > max_combinations:
        sizes[int(np.argmax(sizes))] -= 1
    costs = []
    for s in sizes:
        c = np.round(rng.uniform(0.0, 100.0, s), 2)
        if s > 1 and rng.random() < 0.2:
            c[int(rng.integers(0, s))] = c[0]  # exact tie
        costs.append(c)
    usages = [rng.integers(1, 100, s).astype(np.int64) for s in sizes]
    horizon = 2 * n + 2
    starts = rng.integers(0, horizon, n)
    lengths = rng.integers(1, n + 2, n)
    lengths[rng.random(n) < 0.05] = 0  # never live
    intervals = np.stack([starts, starts + lengths], axis=1).astype(np.int64)
    ends = np.asarray(edges, np.int64).reshape(-1, 2)
    ecosts = tuple(_edge_matrix(int(sizes[u]), int(sizes[v]), rng) for u, v in ends)
    problem = SearchProblem(
        tuple(costs), tuple(usages), intervals, ends, ecosts, None, f"random-{kind}-{limit}-{seed}"
    )
    if limit == "none":
        return problem
    low = problem.peak([int(np.argmin(u)) for u in usages])
    high = problem.peak([int(np.argmax(u)) for u in usages])
    value = {
        "loose": high,
        "tight": low + int(rng.uniform(0.0, 0.6) * (high - low)),
        "exact": low,
        "infeasible": low - 1,
    }[limit]
    return SearchProblem(
        tuple(costs), tuple(usages), intervals, ends, ecosts, int(value), problem.name
    )


def random_medium_problem(
    seed: int,
    *,
    kind: str | None = None,
    nodes: int = 200,
    max_strategies: int = 8,
    limit: str = "tight",
) -> SearchProblem:
    """A benchmark-sized problem (hundreds of nodes): too big for brute force."""
    return random_problem(
        seed,
        kind=kind,
        nodes=nodes,
        max_strategies=max_strategies,
        limit=limit,
        max_combinations=10**300,
    )
