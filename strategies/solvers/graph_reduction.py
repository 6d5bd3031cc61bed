"""Exact reductions of a SearchProblem, and the mapping of a reduced answer back.

In: a ``SearchProblem``. Out: a ``ReducedProblem`` -- fewer nodes, fewer strategies, the same
optimum -- whose ``expand(choice)`` gives a choice for every original node. Costs at or above
``FORBIDDEN`` (IOPDDL marks impossible strategies and pairs with 1e18) become ``inf``: a
strategy or pair that no finite answer can use.

Reductions, applied from a work queue until none applies (each keeps the optimum and keeps the
memory constraint exact):
- forbidden strategies: a node strategy of infinite cost, or one whose row of some edge matrix is
  all infinite (arc consistency), is removed.
- dominated strategies: ``t`` dominates ``s`` when its cost, every edge row and the memory it
  uses in every interval are all <= those of ``s``; ``s`` is removed (ties keep the lower index).
- functional merge: when every strategy of ``u`` leaves exactly one finite pair on edge
  ``(u, v)``, ``v``'s choice is a function ``f`` of ``u``'s; ``v`` merges into ``u`` (cost
  ``c_u + c_v[f] + M[s, f(s)]``, ``v``'s other edges become ``u``'s through ``f``).
- leaf fold: a node ``v`` with one neighbour ``u`` takes, for each strategy of ``u``, its
  cheapest strategy ``f(s_u)``, when that strategy also uses no more memory in any interval than
  any alternative allowed there; then ``v`` merges into ``u`` as above.
- single strategy: a node with one strategy adds its edge rows to its neighbours' costs and
  drops out (fixed); an isolated node whose memory does not depend on its strategy is fixed at
  its cheapest strategy.
- parallel edges are summed; a separable edge (``M[a, b] = r[a] + c[b]``) becomes node costs.

Memory stays exact because a reduced node keeps its *members*: for every original node it
stands for, the original strategy per reduced strategy. Its memory is the sum over members of
their usage over their own interval. ``ReducedProblem`` carries that as ``terms`` on a
compressed time axis: only time steps where the limit could bind are kept, one per run of equal
live sets (the one with the most fixed usage), and each term covers a contiguous index range.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from autopar.errors import InfeasibleError

from ..problem import SearchProblem

FORBIDDEN = 1e17  # costs at or above this mark an impossible strategy or pair
_DOMINANCE_BUDGET = 4e6  # skip the pairwise dominance test above S*S*width element compares


@dataclass(frozen=True, eq=False)
class MemoryTerm:
    """Usage of one reduced node over compressed steps ``[lo, hi)``, one value per strategy."""

    node: int
    lo: int
    hi: int
    usage: np.ndarray  # int64 (strategies,), >= 0 (the constant part lives in ``capacity``)


@dataclass(frozen=True, eq=False)
class ReducedProblem:
    original: SearchProblem
    node_costs: tuple  # float64 per reduced node
    edges: np.ndarray  # (edges, 2) int64 into reduced nodes, u < v
    edge_costs: tuple  # float64 (S_u, S_v); inf = forbidden pair
    member_ids: tuple  # per reduced node: int64 original node ids
    member_maps: tuple  # per reduced node: int64 (members, strategies) original strategy
    fixed: np.ndarray  # original choice of nodes decided without search, -1 elsewhere
    offset: float  # cost of the fixed part not carried by any reduced node
    capacity: np.ndarray  # int64 per kept step: limit minus fixed usage there
    terms: tuple  # MemoryTerm, sorted by node

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_edges(self) -> int:
        return len(self.edge_costs)

    def expand(self, choice) -> np.ndarray:
        """The original choice for a choice of one strategy per reduced node."""
        out = self.fixed.copy()
        for ids, maps, s in zip(self.member_ids, self.member_maps, choice):
            out[ids] = maps[:, int(s)]
        return out

    def encode(self, choice) -> np.ndarray | None:
        """The reduced choice that expands to the original ``choice`` (None when none does)."""
        choice = np.asarray(choice, np.int64)
        if ((self.fixed >= 0) & (self.fixed != choice)).any():
            return None
        out = np.zeros(self.num_nodes, np.int64)
        for x, (ids, maps) in enumerate(zip(self.member_ids, self.member_maps)):
            hit = np.flatnonzero((maps == choice[ids][:, None]).all(0))
            if len(hit) == 0:
                return None
            out[x] = hit[0]
        return out

    def cost(self, choice) -> float:
        c = np.asarray(choice)
        total = self.offset + sum(float(nc[s]) for nc, s in zip(self.node_costs, c))
        return total + sum(float(m[c[u], c[v]]) for (u, v), m in zip(self.edges, self.edge_costs))

    def slack(self, choice) -> np.ndarray:
        """Capacity left at every kept step (negative where the limit is broken)."""
        delta = np.zeros(len(self.capacity) + 1, np.int64)
        for t in self.terms:
            u = t.usage[int(choice[t.node])]
            delta[t.lo] += u
            delta[t.hi] -= u
        return self.capacity - np.cumsum(delta)[:-1]

    def feasible(self, choice) -> bool:
        return bool(np.all(self.slack(choice) >= 0))


class _Work:
    """Mutable graph the reductions rewrite; lives only inside ``reduce``."""

    def __init__(self, p: SearchProblem):
        n = p.num_nodes
        self.p = p
        self.n = n
        self.live = p.intervals[:, 1] > p.intervals[:, 0]
        self.fixed = np.full(n, -1, np.int64)
        self.offset = 0.0
        self.cost = [np.where(c >= FORBIDDEN, np.inf, c.astype(np.float64)) for c in p.node_costs]
        self.ids = [np.array([i], np.int64) for i in range(n)]
        self.maps = [np.arange(len(c), dtype=np.int64)[None, :] for c in p.node_costs]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        self.alive = np.ones(n, bool)
        self.var_ids, self.var_use = [], []
        for i, u in enumerate(p.node_usages):
            varies = bool(self.live[i] and u.min() != u.max())
            self.var_ids.append(np.array([i] if varies else [], np.int64))
            self.var_use.append(
                u[None, :].astype(np.int64) if varies else np.zeros((0, len(u)), np.int64)
            )
        for (u, v), m in zip(p.edges, p.edge_costs):
            u, v = int(u), int(v)
            m = np.where(m >= FORBIDDEN, np.inf, m)
            if u == v:
                self.cost[u] = self.cost[u] + np.diag(m)
            else:
                self.add_edge(u, v, m)

    # ------------------------------------------------------------------ primitives
    def add_edge(self, u, v, m):
        old = self.adj[u].get(v)
        if old is not None:
            m = old + m
        self.adj[u][v] = m
        self.adj[v][u] = m.T

    def drop_edge(self, u, v):
        del self.adj[u][v]
        del self.adj[v][u]

    def keep(self, x, mask):
        """Keep only the strategies of ``x`` where ``mask`` holds."""
        if not mask.any():
            raise InfeasibleError(
                f"problem {self.p.name!r}: original node(s) {self.ids[x][:5].tolist()} have no "
                "strategy of finite cost compatible with their neighbours."
            )
        self.cost[x] = self.cost[x][mask]
        self.maps[x] = self.maps[x][:, mask]
        self.var_use[x] = self.var_use[x][:, mask]
        for w, m in self.adj[x].items():
            m = m[mask]
            self.adj[x][w] = m
            self.adj[w][x] = m.T

    def merge(self, v, u, f) -> tuple[int, list[int]]:
        """Merge ``v`` into ``u`` where ``v``'s strategy is ``f[s_u]``; the merged node takes
        ``u``'s strategies and the container (id) of the one with more edges, which it
        returns with the neighbours whose edges moved to it."""
        m = self.adj[u][v]
        cost = self.cost[u] + self.cost[v][f] + m[np.arange(len(f)), f]
        ids = np.concatenate([self.ids[u], self.ids[v]])
        maps = np.vstack([self.maps[u], self.maps[v][:, f]])
        var_ids, var_use = self.var_ids[u], self.var_use[u]
        if len(self.var_ids[v]):
            vu = self.var_use[v][:, f]
            varies = vu.min(1) != vu.max(1)
            var_ids = np.concatenate([var_ids, self.var_ids[v][varies]])
            var_use = np.vstack([var_use, vu[varies]])
        self.drop_edge(u, v)
        if len(self.adj[v]) > len(self.adj[u]):
            for w, mw in self.adj[v].items():  # v's container, u's strategies
                mw = mw[f]
                self.adj[v][w] = mw
                self.adj[w][v] = mw.T
            keep, gone = v, u
            moved = [(w, mu) for w, mu in self.adj[u].items()]
        else:
            keep, gone = u, v
            moved = [(w, mw[f]) for w, mw in self.adj[v].items()]
        for w, mw in moved:
            self.drop_edge(gone, w)
            self.add_edge(keep, w, mw)
        self.cost[keep], self.ids[keep], self.maps[keep] = cost, ids, maps
        self.var_ids[keep], self.var_use[keep] = var_ids, var_use
        self.alive[gone] = False
        return keep, [w for w, _ in moved]

    def fix(self, x, s):
        """Decide ``x`` at strategy ``s``; its edges become costs of its neighbours."""
        self.offset += float(self.cost[x][s])
        for w, m in list(self.adj[x].items()):
            self.cost[w] = self.cost[w] + m[s]
            self.drop_edge(x, w)
        self.fixed[self.ids[x]] = self.maps[x][:, s]
        self.alive[x] = False

    # ------------------------------------------------------------------ reductions
    def arc_prune(self, x) -> bool:
        ok = np.isfinite(self.cost[x])
        for m in self.adj[x].values():
            ok &= np.isfinite(m).any(1)
        if ok.all():
            return False
        self.keep(x, ok)
        return True

    def dominance(self, x) -> bool:
        s = len(self.cost[x])
        parts = [self.cost[x][:, None], self.var_use[x].T.astype(np.float64)]
        parts += list(self.adj[x].values())
        width = sum(p.shape[1] for p in parts)
        if s < 2 or s * s * width > _DOMINANCE_BUDGET:
            return False
        sig = np.hstack(parts)
        le = np.ones((s, s), bool)  # le[t, s]: t <= s everywhere
        step = max(1, int(_DOMINANCE_BUDGET // (s * s)))
        for a in range(0, width, step):
            blk = sig[:, a : a + step]
            le &= (blk[:, None, :] <= blk[None, :, :]).all(2)
        eq = le & le.T
        idx = np.arange(s)
        beats = le & (~eq | (idx[:, None] < idx[None, :]))
        np.fill_diagonal(beats, False)
        dominated = beats.any(0)
        if not dominated.any():
            return False
        self.keep(x, ~dominated)
        return True

    @staticmethod
    def separable(m) -> bool:
        """``m[a, b] == r[a] + c[b]`` for all pairs (all finite)."""
        if not np.isfinite(m).all():
            return False
        return bool((m - m[:, :1] - m[:1, :] + m[0, 0] == 0).all())

    def memory_constant(self, x) -> bool:
        return len(self.var_ids[x]) == 0

    def leaf_choice(self, v, u):
        """``f[s_u]``: ``v``'s best strategy per strategy of its only neighbour ``u``, or None
        when taking it could use more memory than an alternative."""
        tot = self.adj[u][v] + self.cost[v][None, :]
        f = np.argmin(tot, 1)
        if self.memory_constant(v):
            return f
        use = self.var_use[v]  # (k, S_v)
        allowed = np.isfinite(tot)  # (S_u, S_v)
        worse = (use[:, f][:, :, None] > use[:, None, :]).any(0)  # (S_u, S_v)
        return None if (worse & allowed).any() else f

    def visit(self, x, queue):
        if not self.alive[x]:
            return
        if self.arc_prune(x):
            queue.extend(self.adj[x])
        if len(self.cost[x]) == 1:
            nbrs = list(self.adj[x])
            self.fix(x, 0)
            queue.extend(nbrs)
            return
        for w, m in list(self.adj[x].items()):  # separable edges become node costs
            if self.separable(m):
                self.cost[x] = self.cost[x] + m[:, 0]
                self.cost[w] = self.cost[w] + (m[0] - m[0, 0])
                self.drop_edge(x, w)
                queue.append(w)
        for w, m in self.adj[x].items():  # x is a function of a neighbour
            if (np.isfinite(m).sum(0) == 1).all():
                self._merged(*self.merge(x, w, np.argmax(np.isfinite(m), 0)), queue)
                return
        if len(self.adj[x]) == 1:
            (u,) = self.adj[x]
            f = self.leaf_choice(x, u)
            if f is not None:
                self._merged(*self.merge(x, u, f), queue)
                return
        for w, m in self.adj[x].items():  # a neighbour is a function of x
            if (np.isfinite(m).sum(1) == 1).all():
                self._merged(*self.merge(w, x, np.argmax(np.isfinite(m), 1)), queue)
                return
        if not self.adj[x] and self.memory_constant(x):
            self.fix(x, int(np.argmin(self.cost[x])))
            return
        if self.dominance(x):
            queue.append(x)
            queue.extend(self.adj[x])

    @staticmethod
    def _merged(keep, moved, queue):
        queue.append(keep)
        queue.extend(moved)


def reduce(problem: SearchProblem) -> ReducedProblem:
    """Apply the reductions of the module docstring until none applies."""
    w = _Work(problem)
    queue = deque(range(w.n))
    queued = np.ones(w.n, bool)
    pending: deque[int] = deque()
    while queue:
        x = queue.popleft()
        queued[x] = False
        pending.clear()
        w.visit(x, pending)
        for y in pending:
            if w.alive[y] and not queued[y]:
                queued[y] = True
                queue.append(y)
    return _finish(w)


def restrict(r: ReducedProblem, keep) -> ReducedProblem:
    """``r`` with node ``x`` limited to the strategies ``keep[x]`` (sorted index arrays). Not
    exact -- a restriction -- but its answers are answers of ``r``'s original problem."""
    return ReducedProblem(
        r.original,
        tuple(c[k] for c, k in zip(r.node_costs, keep)),
        r.edges,
        tuple(m[np.ix_(keep[u], keep[v])] for (u, v), m in zip(r.edges, r.edge_costs)),
        r.member_ids,
        tuple(m[:, k] for m, k in zip(r.member_maps, keep)),
        r.fixed,
        r.offset,
        r.capacity,
        tuple(MemoryTerm(t.node, t.lo, t.hi, t.usage[keep[t.node]]) for t in r.terms),
    )


def _finish(w: _Work) -> ReducedProblem:
    p = w.p
    keep = np.flatnonzero(w.alive)
    index = np.full(w.n, -1, np.int64)
    index[keep] = np.arange(len(keep))
    pairs: list[tuple[int, int]] = []
    ecosts = []
    for x in keep:
        for y, m in w.adj[x].items():
            if x < y:
                pairs.append((int(index[x]), int(index[y])))
                ecosts.append(m)
    edges = np.asarray(pairs, np.int64).reshape(-1, 2)
    capacity, terms = _memory(p, w, keep, index)
    return ReducedProblem(
        p,
        tuple(w.cost[x] for x in keep),
        edges,
        tuple(ecosts),
        tuple(w.ids[x] for x in keep),
        tuple(w.maps[x] for x in keep),
        w.fixed,
        w.offset,
        capacity,
        terms,
    )


def _memory(p: SearchProblem, w: _Work, keep, index):
    """Fixed usage per time step, the variable terms, and the compressed time axis."""
    horizon = int(p.intervals[:, 1].max()) if p.num_nodes else 0
    base = np.zeros(horizon + 1, np.int64)
    raw = []  # (node, start, end, usage over strategies)
    fixed_ids = np.flatnonzero(w.fixed >= 0)
    fixed_ids = fixed_ids[w.live[fixed_ids]]
    use = np.array([p.node_usages[i][w.fixed[i]] for i in fixed_ids], np.int64)
    np.add.at(base, p.intervals[fixed_ids, 0], use)
    np.add.at(base, p.intervals[fixed_ids, 1], -use)
    for x in keep:
        for o, mp in zip(w.ids[x], w.maps[x]):
            if not w.live[o]:
                continue
            u = p.node_usages[o][mp]
            floor = int(u.min())
            s, e = int(p.intervals[o, 0]), int(p.intervals[o, 1])
            base[s] += floor
            base[e] -= floor
            if u.max() > floor:
                raw.append((int(index[x]), s, e, u - floor))
    base = np.cumsum(base)[:horizon]
    limit = p.usage_limit
    if limit is None or not raw:
        return np.zeros(0, np.int64), ()
    extra = np.zeros(horizon + 1, np.int64)
    for _, s, e, u in raw:
        extra[s] += u.max()
        extra[e] -= u.max()
    extra = np.cumsum(extra)[:horizon]
    bind = np.flatnonzero(base + extra > limit)
    if len(bind) == 0:
        return np.zeros(0, np.int64), ()
    cuts = np.unique(np.array([t for _, s, e, _ in raw for t in (s, e)], np.int64))
    run = np.searchsorted(cuts, bind, side="right")
    # one step per run of equal live sets: the one with the most fixed usage
    order = np.lexsort((-base[bind], run))
    first = np.ones(len(order), bool)
    first[1:] = run[order][1:] != run[order][:-1]
    kept = np.sort(bind[order][first])
    capacity = (limit - base[kept]).astype(np.int64)
    node = np.array([x for x, _, _, _ in raw], np.int64)
    lo = np.searchsorted(kept, np.array([s for _, s, _, _ in raw], np.int64))
    hi = np.searchsorted(kept, np.array([e for _, _, e, _ in raw], np.int64))
    while True:
        drop = dominated_steps(capacity, lo, hi)
        if not drop.any():
            break
        left = np.concatenate([[0], np.cumsum(~drop)])
        capacity, lo, hi = capacity[~drop], left[lo], left[hi]
    merged: dict[tuple[int, int, int], np.ndarray] = {}
    for x, a, b, (_, _, _, u) in zip(node, lo, hi, raw):
        if b > a:
            key = (int(x), int(a), int(b))
            merged[key] = merged[key] + u if key in merged else u
    terms = tuple(
        MemoryTerm(x, a, b, u) for (x, a, b), u in sorted(merged.items(), key=lambda kv: kv[0])
    )
    return capacity, terms


def dominated_steps(capacity, lo, hi) -> np.ndarray:
    """Steps whose constraint another step implies: one live over a superset of the terms with
    no more capacity. Between consecutive steps with no term ending, live sets only grow, so a
    step is implied by a later one of the same such run with capacity <= its own; mirrored for
    runs with no term starting (strictly less there, so two equal steps never drop each other).
    """
    k = len(capacity)
    ends = np.zeros(k + 1, bool)
    ends[hi] = True
    starts = np.zeros(k + 1, bool)
    starts[lo] = True
    fwd = _later_min(capacity, np.cumsum(ends[:k]))
    back = _later_min(capacity[::-1], np.cumsum(starts[1 : k + 1][::-1]))[::-1]
    return (fwd <= capacity) | (back < capacity)


def _later_min(values, group) -> np.ndarray:
    """For each i, the minimum of ``values[j]`` over ``j > i`` with ``group[j] == group[i]``
    (``group`` nondecreasing); a value above every ``values`` where there is none."""
    k = len(values)
    vals = values[::-1].astype(np.int64)
    span = int(vals.max() - vals.min()) + 1 if k else 1
    newgrp = np.ones(k, bool)
    newgrp[1:] = group[::-1][1:] != group[::-1][:-1]
    shift = span * (np.cumsum(newgrp) - 1)  # later groups sit strictly lower
    run = np.minimum.accumulate(vals - shift) + shift
    prev = np.full(k, int(vals.max()) + 1 if k else 0, np.int64)
    prev[1:] = np.where(newgrp[1:], prev[1:], run[:-1])
    return prev[::-1]
