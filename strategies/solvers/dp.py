"""Dynamic programming by graph elimination (MindSpore's ``dp_algo``), then replay.

In: a ``SearchProblem``; ``time_limit`` (seconds, default 60: bounds the residual CP-SAT
solves and the memory multiplier search), ``star`` (allow the approximate star rule),
``enumeration_limit`` (largest residual component solved by enumeration), ``fold`` (eliminate
with repeated blocks folded; None: by size, below). Out: a
``Solution`` respecting ``usage_limit`` (``InfeasibleError`` from ``check_fits`` otherwise);
``optimal=True`` only when every elimination was exact, the residual was solved exactly and
the memory limit did not bind.

The problem is a graph whose nodes carry cost vectors c_i[s] and whose edges carry matrices
M_ij[s, t] (edge direction only names the rule; costs are symmetric in use). Rules, each
recording a table to replay, applied until no edge is left or no rule applies:

- edge elimination (parallel edges i-j, either direction):  M_ij <- M_ij + M'_ij
- merge / contract elimination (v has one neighbour w; merge when v is w's successor,
  contract when v is its predecessor):
      c_w[t] <- c_w[t] + min_s (c_v[s] + M_vw[s, t]),          replay s_v = argmin_s(...)[s_w]
- node elimination (v has exactly two neighbours a, b, not adjacent): a new edge
      M_ab[p, q] = min_s (M_av[p, s] + c_v[s] + M_vb[s, q]),   replay s_v = argmin(...)[s_a, s_b]
- triangle elimination (the same, a and b already adjacent): M_ab <- M_ab + that minimum.
- star elimination (only when stuck, and only in residual components too big to solve
  exactly; approximate): centre v = the node of least degree (>= 3), then fewest
  strategies; n_1 = the neighbour whose edge constrains v most (largest mean column spread
  max_s M_v1[s, p] - min_s M_v1[s, p]); n_2..n_k the others. v's strategy becomes a
  function of n_1's alone,
      s*(p) = argmin_s (c_v[s] + M_v1[s, p] + sum_{k>=2} min_q (c_k[q] + M_vk[s, q])),
  c_1[p] += c_v[s*(p)] + M_v1[s*(p), p], and each M_vk becomes an edge n_1-n_k with
  M_1k[p, q] = M_vk[s*(p), q]. Exact costs are kept; only v's choice is restricted.

Nodes that end isolated take argmin c_i. A residual component with edges is enumerated when
the product of its strategy counts is at most ``enumeration_limit``, else solved by CP-SAT
(ilp.py) in the time left. Replay walks the records backwards, each table giving the
eliminated node's strategy from its anchors' strategies. The first four rules are exact, so
trees and series-parallel graphs are solved optimally.

Folding (fold.py): a problem of at least ``FOLD_NODES`` nodes whose repeated blocks (a stack
of identical layers) fold it to half its size or less is eliminated folded: one node per class
of alike nodes, every member taking its class's strategy, and the answer unfolded before the
memory search, the repair and the descent below, which all see the whole problem; the first
elimination runs both ways, and the memory search goes on folded only where folded was the
cheaper (a Flax GPT of 12 layers eliminates 9% dearer folded). On GPT
training steps of 8-40 layers this eliminates a tenth to a fortieth of the nodes and finds
cheaper plans than eliminating the whole problem (elimination is approximate on both, and
folded the layers cannot drift apart: 1.7B on 32 A100s, 0.72x the unfolded plan's step after
local search). The answer is then optimal only among tied choices, and never claimed optimal.

Memory: eliminations optimise cost only. If the cost-optimal choice breaks the limit, a
Lagrangian multiplier lambda is added to the node costs of the nodes live at violated steps,
c_i[s] + lambda * usage_i[s]. lambda is first 2^40 times a scale (the cost per byte at which a
penalised node is indifferent between its cheapest and its smallest strategy): when even that
choice breaks the limit, the nodes it violates join the penalised set (up to four rounds);
else lambda moves to the breakpoint of the two plans that bracket it (the infeasible one of
the largest lambda tried, at first the unpenalised plan, and the feasible one of the smallest,
at first the 2^40 one): the lambda at which their penalised costs are equal. The plan there
replaces the end it falls on; when it is no cheaper there than both ends, no plan lies
between them and the search stops (a geometric midpoint stands in when the breakpoint falls
outside the bracket, the heuristic eliminations not being exact on every graph).
Every candidate choice then goes through ``bfs_propagation.repair_memory`` (moves nodes live at
the peak to smaller strategies), the three cheapest through ``bfs_propagation.improve`` (1-opt
descent within the limit), and the cheapest is returned (or ``initial``, when given, feasible
and cheaper). Inexact runs (star rule, unproven residual) are polished the same way.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autopar.strategies.problem import SearchProblem, Solution, check_fits
from autopar.strategies.solvers import fold as folding
from autopar.strategies.solvers.bfs_propagation import Adjacency, improve, repair_memory

DEFAULT_TIME_LIMIT = 60.0
ENUMERATION_LIMIT = 20_000
_BLOCK = 1 << 22  # largest (p, s, q) array built at once in node elimination
_LAMBDA_STEPS = 16  # most steps of the memory multiplier search
_POLISHED = 3  # cheapest repaired candidates given to the descent
FOLD_NODES = 2000  # problems this large fold their repeated blocks by default
_CEILING = 2.0**40  # multiplier (times the scale) tried first: if even its choice
# breaks the limit, the penalised set widens instead


@dataclass(frozen=True, eq=False)
class Elimination:
    """One applied rule: ``node`` was removed; ``table`` gives its strategy from the
    strategies of ``anchors`` (one anchor: table[s_a]; two: table[s_a, s_b])."""

    kind: str
    node: int
    anchors: tuple
    table: np.ndarray


@dataclass(frozen=True, eq=False)
class Reduction:
    """What elimination leaves: the records in order, the final node costs, the residual
    edges ``{(i, j) i < j: matrix}`` between alive nodes, the alive nodes, and the count of
    each rule applied (edge eliminations included)."""

    records: tuple
    costs: tuple
    pairs: dict
    alive: tuple
    counts: dict

    @property
    def fully_reduced(self) -> bool:
        return not self.pairs

    @property
    def exact(self) -> bool:
        return self.counts.get("star", 0) == 0


class _Graph:
    """The mutable working graph of one elimination run (local to ``eliminate``): node costs,
    neighbours, edge matrices, which nodes are still alive and the count of each rule applied;
    ``memo``: each rule's arithmetic by the bytes of its operands (``_memo``)."""

    def __init__(self, problem: SearchProblem, costs):
        self.memo: dict[tuple, tuple] = {}  # (tag, shapes and bytes...) -> the rule's answer
        self.memo_bytes = 0
        self.cost = [np.array(c, np.float64) for c in costs]
        self.nbr: list = [{} for _ in self.cost]  # i -> {j: True if edge i->j first}
        self.mats: dict = {}
        self.alive = np.ones(len(self.cost), bool)  # not eliminated yet
        self.counts = dict.fromkeys(("edge", "merge", "contract", "node", "triangle", "star"), 0)
        for (u, v), m in zip(problem.edges.tolist(), problem.edge_costs):
            if u == v:
                self.cost[u] += np.diag(m)
            else:
                self.add(u, v, m)

    def mat(self, i: int, j: int) -> np.ndarray:
        return self.mats[i, j] if i < j else self.mats[j, i].T

    def add(self, i: int, j: int, m: np.ndarray) -> None:
        key, m = ((i, j), m) if i < j else ((j, i), m.T)
        if key in self.mats:
            self.mats[key] = self.mats[key] + m
            self.counts["edge"] += 1
        else:  # never written in place: the problem's own may stay
            self.mats[key] = np.asarray(m, np.float64)
            self.nbr[i][j] = True
            self.nbr[j][i] = False

    def drop(self, v: int) -> None:
        """Eliminate node ``v``: its edges go and it is no longer alive."""
        for w in self.nbr[v]:
            del self.nbr[w][v]
            self.mats.pop((min(v, w), max(v, w)))
        self.nbr[v] = {}
        self.alive[v] = False


@dataclass(eq=False)
class _Work:
    """What elimination still has to look at: ``queue``, nodes that may have one or two
    neighbours (for the exact rules), and ``heap``, star centres ``(degree, strategies,
    node)`` kept lazily (``_pop_centre`` drops or re-pushes stale entries)."""

    queue: deque
    heap: list = field(default_factory=list)

    def touched(self, g: _Graph, nodes, star: bool) -> None:
        """Nodes whose neighbours changed -> queued when they have at most two, else (with
        ``star``) pushed as star centres."""
        for w in nodes:
            if len(g.nbr[w]) <= 2:
                self.queue.append(w)
            elif star:
                heapq.heappush(self.heap, (len(g.nbr[w]), len(g.cost[w]), w))


def _node_table(a_v: np.ndarray, c_v: np.ndarray, v_b: np.ndarray):
    """min and argmin over s of a_v[p, s] + c_v[s] + v_b[s, q], in blocks of rows p."""
    p, s, q = a_v.shape[0], a_v.shape[1], v_b.shape[1]
    best = np.empty((p, q))
    arg = np.empty((p, q), np.int64)
    rows = max(1, _BLOCK // max(1, s * q))
    for lo in range(0, p, rows):
        t = (a_v[lo : lo + rows] + c_v[None, :])[:, :, None] + v_b[None, :, :]
        arg[lo : lo + rows] = t.argmin(axis=1)
        best[lo : lo + rows] = np.take_along_axis(t, arg[lo : lo + rows][:, None, :], 1)[:, 0]
    return best, arg


_MEMO_BYTES = 1 << 26  # operand bytes one elimination run keeps answers for


def _memo(g: _Graph, tag: str, operands, compute):
    """``compute()``, kept in ``g.memo`` by ``tag`` and the shapes and bytes of ``operands``:
    a model of repeated layers eliminates the same small tables once per layer, so the rules'
    arithmetic is done once per distinct table (answers are frozen: records share them)."""
    parts = [tag]
    for a in operands:
        parts += (a.shape, a.tobytes())
    key = tuple(parts)
    hit = g.memo.get(key)
    if hit is None:
        hit = compute()
        for a in hit:
            if isinstance(a, np.ndarray):
                a.setflags(write=False)
        size = sum(a.nbytes for a in operands)
        if g.memo_bytes + size <= _MEMO_BYTES:
            g.memo[key], g.memo_bytes = hit, g.memo_bytes + size
    return hit


def _coupling(m: np.ndarray) -> float:
    """How much a neighbour's strategy p constrains the centre's: the mean over p of the
    spread max_s m[s, p] - min_s m[s, p] (the star rule keys the centre on the neighbour
    with the largest)."""
    return float((m.max(axis=0) - m.min(axis=0)).mean())


def _components(roots, nbr) -> list:
    """Connected components (sorted node lists) reached from ``roots`` that have edges;
    ``nbr[x]`` iterates x's neighbours."""
    seen, out = set(), []
    for r in roots:
        if r in seen or not nbr[r]:
            continue
        comp, stack = [], [r]
        seen.add(r)
        while stack:
            x = stack.pop()
            comp.append(x)
            for w in nbr[x]:
                if w not in seen:
                    seen.add(w)
                    stack.append(w)
        out.append(sorted(comp))
    return out


def _freeze_small(g: _Graph, frozen: np.ndarray, enumeration_limit: int) -> list:
    """Alive, unfrozen components of ``g`` -> those whose strategy product is at most
    ``enumeration_limit`` marked in ``frozen`` (left for exact solving); returns the nodes of
    the others, in component order."""
    big = []
    for comp in _components(np.flatnonzero(g.alive & ~frozen).tolist(), g.nbr):
        product = 1  # stops past the limit: never a product of thousands
        for i in comp:
            product *= len(g.cost[i])
            if product > enumeration_limit:
                big += comp
                break
        else:
            frozen[comp] = True
    return big


def _pop_centre(heap: list, g: _Graph, frozen: np.ndarray):
    """The next star centre: least degree (>= 3), then fewest strategies, then lowest index;
    stale heap entries are dropped or re-pushed with the current degree."""
    while heap:
        d, s, i = heapq.heappop(heap)
        if not g.alive[i] or frozen[i] or len(g.nbr[i]) < 3:
            continue
        if len(g.nbr[i]) == d:
            return i
        heapq.heappush(heap, (len(g.nbr[i]), s, i))
    return None


def _star(g: _Graph, v: int, records: list) -> list:
    """Star elimination of centre v (module docstring); returns v's former neighbours."""
    nbrs = sorted(g.nbr[v])
    mats = [g.mat(v, j) for j in nbrs]
    costs = [g.cost[j] for j in nbrs]

    def compute():
        # n_1: the strongest coupling, then most strategies, then the lowest index
        first = max(range(len(nbrs)), key=lambda k: (_coupling(mats[k]), len(costs[k]), -k))
        est = g.cost[v].copy()
        for k in range(len(nbrs)):
            if k != first:
                est += (mats[k] + costs[k][None, :]).min(axis=1)
        m1 = mats[first]
        table = (est[:, None] + m1).argmin(axis=0)  # s*(p) for each p of n_1
        return (
            first,
            table,
            g.cost[v][table] + m1[table, np.arange(m1.shape[1])],
            *(mats[k][table, :] for k in range(len(nbrs)) if k != first),
        )

    first, table, add, *moved = _memo(g, "star", [g.cost[v], *mats, *costs], compute)
    n1 = nbrs[first]
    rest = [j for j in nbrs if j != n1]
    g.cost[n1] = g.cost[n1] + add
    moved = list(zip(rest, moved))
    records.append(Elimination("star", v, (n1,), table))
    g.counts["star"] += 1
    g.drop(v)
    for k, m in moved:
        g.add(n1, k, m)
    return nbrs


def _leaf(g: _Graph, v: int, records: list) -> tuple:
    """Merge or contract elimination of ``v``, which has one neighbour w (module docstring),
    recorded in ``records``; returns the anchors ``(w,)``."""
    ((w, first),) = g.nbr[v].items()

    def compute():
        t = g.cost[v][:, None] + g.mat(v, w)
        arg = t.argmin(axis=0)
        return arg, t[arg, np.arange(t.shape[1])]

    arg, add = _memo(g, "leaf", (g.cost[v], g.mat(v, w)), compute)
    g.cost[w] = g.cost[w] + add
    kind = "contract" if first else "merge"
    records.append(Elimination(kind, v, (w,), arg))
    g.drop(v)
    g.counts[kind] += 1
    return (w,)


def _series(g: _Graph, v: int, records: list) -> tuple:
    """Node or triangle elimination of ``v``, which has two neighbours a < b (module
    docstring), recorded in ``records``; returns the anchors ``(a, b)``."""
    a, b = sorted(g.nbr[v])
    operands = (g.mat(a, v), g.cost[v], g.mat(v, b))
    best, arg = _memo(g, "series", operands, lambda: _node_table(*operands))
    kind = "triangle" if b in g.nbr[a] else "node"
    records.append(Elimination(kind, v, (a, b), arg))
    g.drop(v)
    g.add(a, b, best)
    if kind == "triangle":
        g.counts["edge"] -= 1  # counted as the triangle, not an edge merge
    g.counts[kind] += 1
    return (a, b)


def _exact_rules(g: _Graph, work: _Work, records: list, star: bool) -> None:
    """Apply the exact rules (merge, contract, node, triangle) to queued nodes of ``g`` until
    the queue is empty, recording each in ``records`` and rescheduling its anchors."""
    while work.queue:
        v = work.queue.popleft()
        deg = len(g.nbr[v])
        if g.alive[v] and deg in (1, 2):
            anchors = (_leaf if deg == 1 else _series)(g, v, records)
            work.touched(g, anchors, star)


def eliminate(
    problem: SearchProblem,
    costs=None,
    *,
    star: bool = True,
    enumeration_limit: int = ENUMERATION_LIMIT,
) -> Reduction:
    """Apply the rules of the module docstring to ``problem`` with node costs ``costs``
    (default: the problem's) -> the ``Reduction``. The exact rules run until stuck; then, with
    ``star``, one star elimination in a component too big to enumerate, and so on. Which
    components are small enough to leave is rechecked after max(1, big nodes // 8) star
    eliminations, and before giving up when no centre is left."""
    g = _Graph(problem, problem.node_costs if costs is None else costs)
    frozen = np.zeros(len(g.cost), bool)  # in a residual component left for exact solving
    records: list = []
    work = _Work(deque(i for i in range(len(g.cost)) if len(g.nbr[i]) <= 2))
    since_check, check_every = 0, 0
    while True:
        _exact_rules(g, work, records, star)
        if not g.mats or not star:
            break
        if since_check >= check_every:  # freeze components small enough to solve
            big = _freeze_small(g, frozen, enumeration_limit)
            work.heap = [(len(g.nbr[i]), len(g.cost[i]), i) for i in big if len(g.nbr[i]) >= 3]
            heapq.heapify(work.heap)
            since_check, check_every = 0, max(1, len(big) // 8)
        v = _pop_centre(work.heap, g, frozen)
        if v is None:
            if since_check == 0:
                break
            since_check = check_every
            continue
        work.touched(g, _star(g, v, records), star)
        since_check += 1
    return Reduction(
        tuple(records),
        tuple(g.cost),
        dict(g.mats),
        tuple(np.flatnonzero(g.alive).tolist()),
        dict(g.counts),
    )


def _solve_residual(red: Reduction, enumeration_limit: int, deadline: float):
    """Choice of every alive node (dict) and whether it is exactly optimal."""
    from autopar.strategies.solvers import brute, ilp

    choice = {i: int(np.argmin(red.costs[i])) for i in red.alive}
    exact = True
    adjacent: dict = {}
    for i, j in red.pairs:
        adjacent.setdefault(i, []).append(j)
        adjacent.setdefault(j, []).append(i)
    for comp in _components(sorted(adjacent), adjacent):
        index = {x: k for k, x in enumerate(comp)}
        keys = sorted(k for k in red.pairs if k[0] in index)
        sub = SearchProblem(
            tuple(red.costs[i] for i in comp),
            tuple(np.zeros(len(red.costs[i]), np.int64) for i in comp),
            np.zeros((len(comp), 2), np.int64),
            np.array([(index[i], index[j]) for i, j in keys], np.int64).reshape(-1, 2),
            tuple(red.pairs[k] for k in keys),
            None,
            "dp-residual",
        )
        if math.prod(len(c) for c in sub.node_costs) <= enumeration_limit:
            sol = brute.solve(sub, max_combinations=enumeration_limit)
        else:
            sol = ilp.solve(sub, time_limit=max(0.1, deadline - time.perf_counter()))
            exact = exact and sol.optimal
        for x, s in zip(comp, sol.choice):
            choice[x] = s
    return choice, exact


def _replay(n: int, red: Reduction, residual: dict) -> np.ndarray:
    choice = np.full(n, -1, np.int64)
    for i, s in residual.items():
        choice[i] = s
    for rec in reversed(red.records):
        choice[rec.node] = int(rec.table[tuple(int(choice[a]) for a in rec.anchors)])
    return choice


def run(
    problem: SearchProblem,
    costs=None,
    *,
    star: bool = True,
    enumeration_limit: int = ENUMERATION_LIMIT,
    deadline: float = math.inf,
):
    """Eliminate, solve the residual, replay: (choice, exact) ignoring memory."""
    red = eliminate(problem, costs, star=star, enumeration_limit=enumeration_limit)
    residual, exact = _solve_residual(red, enumeration_limit, deadline)
    return _replay(problem.num_nodes, red, residual), exact and red.exact


def _violated_nodes(problem: SearchProblem, choice) -> np.ndarray:
    """Mask of nodes live at some step where ``choice`` breaks the limit."""
    prof = problem.usage_profile(choice)
    steps = np.flatnonzero(prof > problem.usage_limit)
    iv = problem.intervals
    if len(steps) == 0:
        return np.zeros(problem.num_nodes, bool)
    first = np.searchsorted(steps, iv[:, 0], side="left")
    return (first < len(steps)) & (steps[np.minimum(first, len(steps) - 1)] < iv[:, 1])


def _lambda_scale(problem: SearchProblem, hot: np.ndarray) -> float:
    """Cost per byte that makes a penalised node indifferent between its cheapest and its
    smallest strategy, summed over the penalised nodes."""
    d = u = 0.0
    for i in np.flatnonzero(hot).tolist():
        c, us = problem.node_costs[i], problem.node_usages[i]
        d += float(c[int(np.argmin(us))] - c.min())
        u += float(us[int(np.argmin(c))] - us.min())
    return max(d, 1e-9) / max(u, 1.0)


def solve(
    problem: SearchProblem,
    *,
    time_limit=None,
    initial=None,
    progress=None,
    star: bool = True,
    enumeration_limit: int = ENUMERATION_LIMIT,
    fold: bool | None = None,
) -> Solution:
    """Elimination DP with a Lagrangian memory multiplier and repair (module docstring).
    ``fold``: eliminate on the problem with its repeated blocks folded (``fold.py``); None:
    on problems of at least ``FOLD_NODES`` nodes that fold to half their size or less, both
    ways once, and folded on where that was cheaper."""
    t0 = time.perf_counter()
    check_fits(problem)
    deadline = t0 + (DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit))
    folded = None
    if fold or (fold is None and problem.num_nodes >= FOLD_NODES):
        folded = folding.fold(problem)

    def run_with(costs=None):
        """(choice, exact) of one elimination with ``costs`` in the flat layout (problem.py);
        None: the problem's own."""
        if folded is None:
            per_node = None if costs is None else np.split(costs, problem.offsets[1:])
            return run(
                problem,
                per_node,
                star=star,
                enumeration_limit=enumeration_limit,
                deadline=deadline,
            )
        got, _ = run(
            folded.problem,
            None if costs is None else folded.costs(costs),  # None: the fold's own sums
            star=star,
            enumeration_limit=enumeration_limit,
            deadline=deadline,
        )
        return folded.unfold(got), False  # optimal among the tied choices only

    choice, exact = run_with()
    if folded is not None and fold is None:  # by size: folded only where it eliminates better
        plain, plain_exact = run(
            problem, None, star=star, enumeration_limit=enumeration_limit, deadline=deadline
        )
        if problem.cost(plain) <= problem.cost(choice):
            folded, choice, exact = None, plain, plain_exact
    adj = Adjacency.of(problem)
    if problem.feasible(choice):
        if not exact:
            choice = improve(problem, choice, adj, deadline=deadline)
        return _finish(problem, choice, initial, t0, exact, progress, folded=folded)
    candidates = [choice]
    hot = _violated_nodes(problem, choice)

    def penalised(lam: float):
        hot_flat = np.repeat(hot, problem.sizes)
        return run_with(problem.flat_costs + lam * (problem.flat_usages * hot_flat))[0]

    for _ in range(4):  # widen the penalised set while violations move
        scale = _lambda_scale(problem, hot)
        high = scale * _CEILING  # usage all but alone decides
        fit = penalised(high)
        candidates.append(fit)
        if not problem.feasible(fit):  # no multiplier fits: widen the set
            extra = _violated_nodes(problem, fit) & ~hot
            if not extra.any() or time.perf_counter() > deadline:
                break
            hot |= extra
            continue
        low, below, above = 0.0, choice, fit  # lambdas and plans bracketing the least
        held = lambda c: float(problem.usages(c)[hot].sum())
        line = lambda c, lam: problem.cost(c) + lam * held(c)
        for _ in range(_LAMBDA_STEPS):
            if time.perf_counter() > deadline or high <= low * 1.001:
                break
            drop = held(below) - held(above)
            mid = (problem.cost(above) - problem.cost(below)) / drop if drop > 0 else -1.0
            breakpoint = low < mid < high
            if not breakpoint:
                mid = math.sqrt(low * high) if low > 0 else high / 4.0
            c = penalised(mid)
            candidates.append(c)
            if breakpoint and line(c, mid) >= line(below, mid) * (1 - 1e-9):
                break  # nothing between the bracketing plans
            if problem.feasible(c):
                high, above = mid, c
            else:
                low, below = mid, c
        break
    # repaired in order of their own cost, until the next cannot reach the cheapest few: a
    # repair moves nodes to smaller strategies, which after elimination by cost seldom cost
    # less (a heuristic cut: repairing every candidate was a quarter of dynamic programming's
    # time on GPT 18B's 33k-node problems)
    repaired: list = []
    for c in sorted(candidates, key=problem.cost):
        if len(repaired) >= _POLISHED and problem.cost(c) >= problem.cost(repaired[-1]):
            break
        repaired.append(c if problem.feasible(c) else repair_memory(problem, c, adj))
        repaired = sorted(repaired, key=problem.cost)[:_POLISHED]
    polished = [improve(problem, c, adj, deadline=deadline) for c in repaired[:_POLISHED]]
    choice = min(polished, key=problem.cost)
    return _finish(problem, choice, initial, t0, False, progress, len(candidates), folded)


def _finish(
    problem: SearchProblem,
    choice,
    initial,
    t0: float,
    exact: bool,
    progress,
    runs: int = 1,
    folded: folding.Fold | None = None,
) -> Solution:
    """The Solution, or ``initial`` when that is feasible and cheaper."""
    sol = Solution.of(problem, choice, "dynamic_programming", time.perf_counter() - t0, exact)
    if folded is not None:
        sol = dataclasses.replace(sol, folded=True)
    if (
        not exact
        and initial is not None
        and len(initial.choice) == problem.num_nodes
        and problem.feasible(initial.choice)
        and problem.cost(initial.choice) < sol.cost
    ):
        sol = Solution.of(problem, initial.choice, "dynamic_programming", time.perf_counter() - t0)
    if progress is not None:
        fold = "" if folded is None else f" on the problem folded {folded.shrink:.1f}x"
        progress(f"dynamic_programming: cost {sol.cost:.9g} after {runs} elimination runs{fold}")
    return sol
