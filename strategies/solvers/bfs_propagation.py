"""Sharding propagation over a SearchProblem (MindSpore's BFS), and the memory repair that
dp.py shares.

In: a ``SearchProblem``; optional ``anchors`` (``{node: strategy}``, e.g. user-annotated
operators). Out: a ``Solution`` that respects ``usage_limit`` (``InfeasibleError`` from
``check_fits`` when nothing can). Never proven optimal.

Method:
1. Anchors are fixed first. Every connected component without an anchor gets one: the node
   whose cheapest strategy, priced with its node cost plus the cheapest entry of each incident
   edge row, is the most expensive of the component (the node that costs most to get wrong
   goes first; ties: lowest index). It takes that cheapest strategy.
2. Breadth-first from the anchors (neighbours visited in index order): a node is decided when
   it leaves the queue, taking ``argmin_s node_cost[s] + sum_{decided nbr w} edge(s, c_w)``
   (ties: lowest strategy index). Each node and edge is looked at a constant number of times.
3. Memory repair (``repair_memory``): while the usage profile peaks over the limit at step t,
   move one node live at t to a smaller strategy, the move with the least
   ``extra cost / min(bytes saved, bytes over the limit)`` (cost priced against the current
   neighbours; ties: smaller extra cost, lower node, lower strategy). Every move lowers one
   node's usage, so the loop ends; it ends feasible because ``check_fits`` passed. Anchors
   move only when no other node live at the peak can shrink.
4. Descent (``improve``): sweeps moving single nodes to cheaper strategies that keep every
   step within the limit, until a sweep moves nothing (at most 8 sweeps; after the first,
   only neighbours of moved nodes are revisited). Anchors never move here.

``initial``: when given and feasible, the cheaper of it and the propagated choice is returned.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from autopar.errors import ConfigError
from autopar.strategies.problem import SearchProblem, Solution, check_fits


@dataclass(frozen=True, eq=False)
class Adjacency:
    """Incident edges of every node in CSR form: for node i, entries ``ptr[i]:ptr[i+1]`` of
    ``edge`` (edge index), ``other`` (the neighbour) and ``first`` (True when i is the edge's
    u, so the matrix is indexed ``[c_i, c_other]``; else ``[c_other, c_i]``); ``rows[i]`` is
    the same as a tuple of ``(edge, other, first)``."""

    ptr: np.ndarray
    edge: np.ndarray
    other: np.ndarray
    first: np.ndarray
    rows: tuple

    @staticmethod
    def of(problem: SearchProblem) -> Adjacency:
        n, e = problem.num_nodes, problem.num_edges
        ends = problem.edges.reshape(-1, 2)
        node = np.concatenate([ends[:, 0], ends[:, 1]])
        edge = np.concatenate([np.arange(e), np.arange(e)])
        other = np.concatenate([ends[:, 1], ends[:, 0]])
        first = np.concatenate([np.ones(e, bool), np.zeros(e, bool)])
        order = np.lexsort((edge, other, node))
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(node, minlength=n), out=ptr[1:])
        edge, other, first = edge[order], other[order], first[order]
        flat = list(zip(edge.tolist(), other.tolist(), first.tolist()))
        bounds = ptr.tolist()
        rows = tuple(tuple(flat[bounds[i] : bounds[i + 1]]) for i in range(n))
        return Adjacency(ptr, edge, other, first, rows)

    def neighbours(self, i: int) -> list:
        return self.other[self.ptr[i] : self.ptr[i + 1]].tolist()


def local_costs(
    problem: SearchProblem,
    adj: Adjacency,
    i: int,
    choice: np.ndarray,
    decided: np.ndarray | None = None,
) -> np.ndarray:
    """Node i's cost per strategy plus its edges to (decided) neighbours at their choices
    (a self-loop prices the pair (s, s))."""
    total = problem.node_costs[i].copy()
    for e, w, first in adj.rows[i]:
        m = problem.edge_costs[e]
        if w == i:
            if first:
                total += np.diag(m)
        elif decided is None or decided[w]:
            total += m[:, choice[w]] if first else m[choice[w], :]
    return total


def _anchor_scores(problem: SearchProblem, adj: Adjacency) -> np.ndarray:
    """Per node: node cost plus the cheapest entry of each incident edge row, minimised over
    the node's strategies (the node's cheapest strategy choice, priced optimistically)."""
    scores = np.empty(problem.num_nodes)
    for i in range(problem.num_nodes):
        total = problem.node_costs[i].copy()
        for e, _w, first in adj.rows[i]:
            m = problem.edge_costs[e]
            total += m.min(axis=1) if first else m.min(axis=0)
        scores[i] = total.min()
    return scores


def _components(n: int, adj: Adjacency) -> np.ndarray:
    """Component label per node (labels in order of each component's lowest node)."""
    label = np.full(n, -1, np.int64)
    count = 0
    for root in range(n):
        if label[root] >= 0:
            continue
        label[root] = count
        stack = [root]
        while stack:
            x = stack.pop()
            for w in adj.neighbours(x):
                if label[w] < 0:
                    label[w] = count
                    stack.append(w)
        count += 1
    return label


def propagate(problem: SearchProblem, adj: Adjacency, anchors: dict) -> np.ndarray:
    """Steps 1-2 of the module docstring: the BFS choice, ignoring memory."""
    n = problem.num_nodes
    choice = np.zeros(n, np.int64)
    decided = np.zeros(n, bool)
    queued = np.zeros(n, bool)
    queue: deque = deque()
    for a, s in sorted(anchors.items()):
        a, s = int(a), int(s)
        if not (0 <= a < n and 0 <= s < len(problem.node_costs[a])):
            raise ConfigError(
                f"propagation anchor {a} -> strategy {s} does not exist in "
                f"{problem.name!r} ({n} nodes)."
            )
        choice[a], decided[a], queued[a] = s, True, True
        queue.append(a)
    label = _components(n, adj)
    anchored = np.zeros(int(label.max()) + 1 if n else 0, bool)
    anchored[label[decided]] = True
    scores = _anchor_scores(problem, adj)
    order = np.lexsort((np.arange(n), -scores))  # most expensive first, then lowest index
    for i in order.tolist():
        if anchored[label[i]]:
            continue
        anchored[label[i]] = True
        queued[i] = True
        queue.append(i)
    while queue:
        x = queue.popleft()
        if not decided[x]:
            choice[x] = int(np.argmin(local_costs(problem, adj, x, choice, decided)))
            decided[x] = True
        for w in adj.neighbours(x):
            if not queued[w]:
                queued[w] = True
                queue.append(w)
    return choice


def repair_memory(
    problem: SearchProblem, choice, adj: Adjacency | None = None, pinned=()
) -> np.ndarray:
    """Step 3 of the module docstring: a feasible choice close to ``choice``. Nodes in
    ``pinned`` move only when no other node live at the peak can shrink. Assumes
    ``check_fits(problem)`` passed."""
    choice = np.array(choice, np.int64)
    limit = problem.usage_limit
    if limit is None or problem.num_nodes == 0:
        return choice
    adj = adj or Adjacency.of(problem)
    iv = problem.intervals
    use = problem.usages(choice)
    horizon = int(iv[:, 1].max())
    delta = np.zeros(horizon + 1, np.int64)
    np.add.at(delta, iv[:, 0], use)
    np.add.at(delta, iv[:, 1], -use)
    prof = np.cumsum(delta)[:horizon]
    min_use = np.array([int(u.min()) for u in problem.node_usages], np.int64)
    pin = np.zeros(problem.num_nodes, bool)
    pin[list(pinned)] = True
    # every move (node, strategy) in the problem's flat layout: its extra cost and the bytes
    # it saves, brought up to date for a live node whose neighbourhood changed (``fresh``)
    sizes, offsets, flat_use = problem.sizes, problem.offsets, problem.flat_usages
    owner = np.repeat(np.arange(problem.num_nodes), sizes)
    strategy = np.arange(len(owner)) - offsets[owner]
    extra, saved = np.zeros(len(owner)), np.zeros(len(owner), np.int64)
    fresh = np.zeros(problem.num_nodes, bool)

    def refresh(i: int) -> None:
        local = local_costs(problem, adj, i, choice)
        at = slice(offsets[i], offsets[i] + sizes[i])
        extra[at] = local - local[choice[i]]
        saved[at] = use[i] - flat_use[at]
        fresh[i] = True

    while len(prof):
        t = int(np.argmax(prof))
        excess = int(prof[t]) - limit
        if excess <= 0:
            break
        shrinkable = (iv[:, 0] <= t) & (t < iv[:, 1]) & (use > min_use)
        live = np.flatnonzero(shrinkable & ~pin)
        if len(live) == 0:
            live = np.flatnonzero(shrinkable)
        assert len(live), "check_fits passed, so some live node can shrink"
        for i in live[~fresh[live]].tolist():
            refresh(i)
        mask = np.zeros(problem.num_nodes, bool)
        mask[live] = True
        cand = np.flatnonzero(mask[owner] & (saved > 0))
        node, strat, cost = owner[cand], strategy[cand], extra[cand]
        score = cost / np.minimum(saved[cand], excess)
        k = int(np.lexsort((strat, node, cost, score))[0])
        i, s = int(node[k]), int(strat[k])
        new = int(problem.node_usages[i][s])
        prof[iv[i, 0] : iv[i, 1]] += new - use[i]
        use[i], choice[i] = new, s
        fresh[i] = False
        fresh[adj.neighbours(i)] = False
    return choice


def improve(
    problem: SearchProblem,
    choice,
    adj: Adjacency | None = None,
    *,
    max_sweeps: int = 8,
    deadline: float = math.inf,
    pinned=(),
) -> np.ndarray:
    """Step 4 of the module docstring: 1-opt descent that keeps the choice within the limit.
    The first sweep visits every node in index order, later sweeps the neighbours of nodes
    that moved; a node moves to its cheapest strategy (given its neighbours) among those
    that fit the memory headroom of its live steps, when that is cheaper than its current
    one by more than a relative 1e-12. Nodes in ``pinned`` never move."""
    choice = np.array(choice, np.int64)
    n = problem.num_nodes
    if n == 0:
        return choice
    adj = adj or Adjacency.of(problem)
    iv = problem.intervals
    limit = problem.usage_limit
    use = problem.usages(choice)
    prof = problem.usage_profile(choice)
    frozen = set(pinned)
    todo = [i for i in range(n) if len(problem.node_costs[i]) > 1 and i not in frozen]
    for _ in range(max_sweeps):
        dirty = set()
        for i in todo:
            local = local_costs(problem, adj, i, choice)
            cur = int(choice[i])
            better = local < local[cur] - 1e-12 * max(1.0, abs(float(local[cur])))
            if not better.any():
                continue
            s0, s1 = int(iv[i, 0]), int(iv[i, 1])
            if limit is not None and s1 > s0:
                room = limit - int(prof[s0:s1].max())
                better &= problem.node_usages[i] - use[i] <= room
                if not better.any():
                    continue
            s = int(np.flatnonzero(better)[np.argmin(local[better])])
            new = int(problem.node_usages[i][s])
            prof[s0:s1] += new - use[i]
            use[i], choice[i] = new, s
            dirty.update(adj.neighbours(i))
        todo = sorted(w for w in dirty if len(problem.node_costs[w]) > 1 and w not in frozen)
        if not todo or time.perf_counter() > deadline:
            break
    return choice


def solve(
    problem: SearchProblem,
    *,
    time_limit=None,
    initial=None,
    progress=None,
    anchors: dict | None = None,
) -> Solution:
    """Propagate from ``anchors`` (or one automatic anchor per component), then repair memory."""
    t0 = time.perf_counter()
    check_fits(problem)
    adj = Adjacency.of(problem)
    anchors = {int(a): int(s) for a, s in (anchors or {}).items()}
    choice = repair_memory(problem, propagate(problem, adj, anchors), adj, pinned=anchors)
    choice = improve(problem, choice, adj, pinned=anchors)
    best = Solution.of(problem, choice, "sharding_propagation", time.perf_counter() - t0)
    if (
        initial is not None
        and len(initial.choice) == problem.num_nodes
        and problem.feasible(initial.choice)
    ):
        other = Solution.of(
            problem, initial.choice, "sharding_propagation", time.perf_counter() - t0
        )
        if other.cost < best.cost:
            best = other
    if progress is not None:
        progress(f"sharding_propagation: cost {best.cost:.6g}, peak {best.peak}")
    return best
