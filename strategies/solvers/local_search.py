"""Local search for large SearchProblems (the IOPDDL contest instances) under a time limit.

In: a ``SearchProblem``, a time limit in seconds (default 60), optionally an initial Solution and
a ``progress(str)`` callback. Out: a feasible ``Solution`` (``InfeasibleError`` when even the
smallest strategies break the memory limit).

Algorithm:
1. ``reduce`` (reduce.py) shrinks the problem exactly: forbidden strategies and dominated ones
   go, nodes whose choice is a function of a neighbour's merge into it, leaves fold.
2. ``_State`` (state.py-like section below) keeps the choice, every node's local cost vector on
   demand, and the free memory ``slack`` at every kept time step; a node's memory is piecewise
   constant over its own pieces, so "which strategies fit" is one ``minimum.reduceat`` over the
   node's span and one comparison of a (strategies, pieces) table.
3. Start: the least-memory strategy per node, repaired at the worst step until it fits, then
   descent.
4. Moves, all exact in memory (a move that breaks the limit is undone):
   - 1-opt: each node to its cheapest strategy that fits;
   - tree blocks: grow a random induced tree of the graph, fix every other node, and choose
     the whole tree's strategies at once by min-sum dynamic programming (leaves to root:
     ``h_x = unary_x + sum of child messages``, ``msg_x(s_p) = min_s h_x(s) + M_xp(s, s_p)``);
     each node is restricted to strategies that fit alone, and to ones using no more memory
     than now wherever the joint answer overflows;
   - kicks: the same tree DP on noisy costs, followed by descent, kept when it beats the best.
The search stops a margin before the time limit, measured from the start of ``solve``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..problem import SearchProblem, Solution, check_fits
from .reduce import ReducedProblem, reduce
from .region_mip import RegionMip


@dataclass(frozen=True)
class LocalSearchOptions:
    seed: int = 0                 # random seed (block growth, kicks)
    default_time: float = 60.0    # seconds when solve() is given no time limit
    margin: float = 0.3           # seconds kept back before the time limit (plus expansion time)
    block_size: int = 200         # most nodes in one tree block
    kick_noise: float = 0.3       # relative noise on unary costs in a kick
    whole_mip_columns: int = 400_000   # solve the whole reduced problem as one MIP up to this
    region_columns: int = 30_000  # starting MIP size of a region (grows/shrinks with success)
    region_seconds: float = 10.0  # time limit of one region MIP
    progress_every: float = 1.0   # seconds between progress messages


class _State:
    """Choice, slack and per-node views of a ReducedProblem."""

    def __init__(self, r: ReducedProblem):
        n = r.num_nodes
        self.r = r
        self.n = n
        self.cost = [c.astype(np.float64) for c in r.node_costs]
        self.nbrs = [[] for _ in range(n)]       # (w, M oriented (x, w))
        for (u, v), m in zip(r.edges, r.edge_costs):
            self.nbrs[u].append((int(v), m))
            self.nbrs[v].append((int(u), m.T))
        self.nbr_ids = [np.array([w for w, _ in nb], np.int64) for nb in self.nbrs]
        self._memory_tables(r)
        self.choice = np.zeros(n, np.int64)
        self.slack = r.capacity.astype(np.int64).copy()

    def _memory_tables(self, r: ReducedProblem):
        by_node = [[] for _ in range(self.n)]
        for t in r.terms:
            by_node[t.node].append(t)
        self.span = np.zeros((self.n, 2), np.int64)
        self.starts, self.lens, self.table = [], [], []
        for x, ts in enumerate(by_node):
            if not ts:
                self.starts.append(None)
                self.lens.append(None)
                self.table.append(None)
                continue
            cuts = np.unique([b for t in ts for b in (t.lo, t.hi)])
            d = np.zeros((len(self.cost[x]), len(cuts)), np.int64)
            for t in ts:
                a, b = np.searchsorted(cuts, [t.lo, t.hi])
                d[:, a] += t.usage
                d[:, b] -= t.usage
            self.span[x] = cuts[0], cuts[-1]
            self.starts.append((cuts[:-1] - cuts[0]).astype(np.intp))
            self.lens.append(np.diff(cuts))
            self.table.append(np.cumsum(d, 1)[:, :-1])

    # ------------------------------------------------------------------ queries
    def local(self, x, choice=None) -> np.ndarray:
        """Cost of each strategy of ``x`` with its neighbours as in ``choice``."""
        ch = self.choice if choice is None else choice
        out = self.cost[x].copy()
        for w, m in self.nbrs[x]:
            out += m[:, ch[w]]
        return out

    def fits(self, x) -> np.ndarray:
        """Strategies of ``x`` that fit with every other node as now."""
        d = self.table[x]
        if d is None:
            return np.ones(len(self.cost[x]), bool)
        lo, hi = self.span[x]
        avail = np.minimum.reduceat(self.slack[lo:hi], self.starts[x]) + d[self.choice[x]]
        return (d <= avail).all(1)

    def usage_use(self, x) -> np.ndarray:
        """Memory-time of each strategy of ``x`` (for ranking, not for feasibility)."""
        d = self.table[x]
        if d is None:
            return np.zeros(len(self.cost[x]))
        return (d * self.lens[x]).sum(1).astype(np.float64)

    def total(self, choice=None) -> float:
        ch = self.choice if choice is None else choice
        return self.r.cost(ch)

    # ------------------------------------------------------------------ updates
    def set(self, x, s):
        old = self.choice[x]
        if old == s:
            return
        d = self.table[x]
        if d is not None:
            lo, hi = self.span[x]
            self.slack[lo:hi] -= np.repeat(d[s] - d[old], self.lens[x])
        self.choice[x] = s

    def min_slack(self, nodes) -> int:
        best = 0
        for x in nodes:
            if self.table[x] is not None:
                lo, hi = self.span[x]
                best = min(best, int(self.slack[lo:hi].min()))
        return best

    def load(self, choice):
        self.choice = np.asarray(choice, np.int64).copy()
        self.slack = self.r.capacity.astype(np.int64).copy()
        for x in range(self.n):
            d = self.table[x]
            if d is not None:
                lo, hi = self.span[x]
                self.slack[lo:hi] -= np.repeat(d[self.choice[x]], self.lens[x])


class _Search:
    def __init__(self, st: _State, opts: LocalSearchOptions, deadline: float,
                 progress: Optional[Callable[[str], None]], started: float):
        self.st = st
        self.opts = opts
        self.rng = np.random.default_rng(opts.seed)
        self.deadline = deadline
        self.progress = progress
        self.started = started
        self.last_report = started
        self.best = None
        self.best_cost = np.inf
        self.moves = 0
        self.optimal = False
        self.mip = RegionMip(st.r)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def report(self, what: str):
        now = time.monotonic()
        if self.progress is not None and now - self.last_report >= self.opts.progress_every:
            self.last_report = now
            self.progress(f"local_search {now - self.started:6.1f}s {what}: best "
                          f"{self.best_cost:.6g}, {self.moves} moves")

    def remember(self):
        if self.st.slack.size and self.st.slack.min() < 0:
            return
        c = self.st.total()
        if c < self.best_cost:
            self.best_cost = c
            self.best = self.st.choice.copy()

    # ------------------------------------------------------------------ start
    def initial(self):
        st = self.st
        for x in range(st.n):
            use = st.usage_use(x)
            st.choice[x] = int(np.lexsort((st.cost[x], use))[0])
        st.load(st.choice)
        self.repair()

    def repair(self):
        """Move nodes live at the worst step to less memory there until everything fits."""
        st = self.st
        while st.slack.size and st.slack.min() < 0 and self.time_left() > 0:
            t = int(np.argmin(st.slack))
            best = None
            for x in np.flatnonzero((st.span[:, 0] <= t) & (st.span[:, 1] > t)):
                d = st.table[x]
                p = int(np.searchsorted(st.starts[x], t - st.span[x, 0], side="right")) - 1
                gain = d[st.choice[x], p] - d[:, p]
                if gain.max() <= 0:
                    continue
                loc = st.local(x)
                extra = loc - loc[st.choice[x]]
                score = np.where(gain > 0, (np.maximum(extra, 0) + 1) / np.maximum(gain, 1),
                                 np.inf)
                s = int(np.argmin(score))
                if best is None or score[s] < best[0]:
                    best = (score[s], x, s)
            if best is None:
                break
            st.set(best[1], best[2])

    # ------------------------------------------------------------------ 1-opt
    def descend(self, nodes=None):
        """Best-improvement 1-opt over ``nodes`` (all by default) until no move helps."""
        st = self.st
        todo = list(range(st.n)) if nodes is None else list(nodes)
        queued = np.zeros(st.n, bool)
        queued[todo] = True
        self.rng.shuffle(todo)
        head = 0
        while head < len(todo):
            if head % 256 == 0 and self.time_left() <= 0:
                return
            x = todo[head]
            head += 1
            queued[x] = False
            loc = st.local(x)
            cur = st.choice[x]
            loc[~st.fits(x)] = np.inf
            s = int(np.argmin(loc))
            if loc[s] < loc[cur]:
                st.set(x, s)
                self.moves += 1
                for w in st.nbr_ids[x]:
                    if not queued[w]:
                        queued[w] = True
                        todo.append(int(w))

    # ------------------------------------------------------------------ tree blocks
    def grow_tree(self, root, size):
        """A random induced tree from ``root``: (nodes in order, parent of each)."""
        st = self.st
        inside = {root: -1}
        touch = {}
        frontier = []
        order = [root]
        for w in st.nbr_ids[root]:
            touch[int(w)] = root
            frontier.append(int(w))
        while frontier and len(order) < size:
            i = int(self.rng.integers(len(frontier)))
            frontier[i], frontier[-1] = frontier[-1], frontier[i]
            y = frontier.pop()
            if y in inside or touch.get(y, -2) == -2:
                continue
            inside[y] = touch[y]
            order.append(y)
            for w in st.nbr_ids[y]:
                w = int(w)
                if w in inside:
                    continue
                if w in touch:
                    touch[w] = -2            # a second neighbour inside: would close a cycle
                else:
                    touch[w] = y
                    frontier.append(w)
        return order, [inside[x] for x in order]

    def tree_dp(self, order, parent, noise=0.0, monotone=()):
        """Choose strategies for the tree ``order`` (others fixed) by min-sum DP; returns the
        new strategies and the change in true cost (negative: better)."""
        st = self.st
        pos = {x: i for i, x in enumerate(order)}
        unary, true_unary = [], []
        for x, p in zip(order, parent):
            u = st.cost[x].copy()
            for w, m in st.nbrs[x]:
                if w not in pos:
                    u += m[:, st.choice[w]]
            true_unary.append(u.copy())
            if noise:
                u = u * (1 + noise * self.rng.random(len(u)))
            ok = st.fits(x)
            if x in monotone and st.table[x] is not None:
                d = st.table[x]
                ok &= (d <= d[st.choice[x]]).all(1)
            ok[st.choice[x]] = True
            u[~ok] = np.inf
            unary.append(u)
        edge = {}
        for x, p in zip(order, parent):
            if p >= 0:
                for w, m in st.nbrs[x]:
                    if w == p:
                        edge[x] = m
                        break
        h = [u.copy() for u in unary]
        arg = {}
        for i in range(len(order) - 1, 0, -1):
            x, p = order[i], parent[i]
            tot = h[i][:, None] + edge[x]
            a = np.argmin(tot, 0)
            arg[x] = a
            h[pos[p]] += tot[a, np.arange(tot.shape[1])]
        new = {order[0]: int(np.argmin(h[0]))}
        for i in range(1, len(order)):
            x = order[i]
            new[x] = int(arg[x][new[parent[i]]])
        delta = 0.0
        for i, x in enumerate(order):
            delta += true_unary[i][new[x]] - true_unary[i][st.choice[x]]
            if parent[i] >= 0:
                m, p = edge[x], parent[i]
                delta += m[new[x], new[p]] - m[st.choice[x], st.choice[p]]
        return new, delta

    def apply(self, new):
        """Set the strategies ``new``; undo them and return False if memory overflows."""
        st = self.st
        old = {x: int(st.choice[x]) for x in new}
        for x, s in new.items():
            st.set(x, s)
        if st.min_slack(new) >= 0:
            return True
        for x, s in old.items():
            st.set(x, s)
        return False

    def block_move(self, root, size, noise=0.0):
        order, parent = self.grow_tree(root, size)
        new, delta = self.tree_dp(order, parent, noise)
        if noise == 0.0 and delta >= 0:
            return False, order
        if self.apply(new):
            self.moves += 1
            return True, order
        new, delta = self.tree_dp(order, parent, noise, monotone=set(order))
        if (noise == 0.0 and delta >= 0) or not self.apply(new):
            return False, order
        self.moves += 1
        return True, order

    # ------------------------------------------------------------------ region MIP
    def grow_region(self, root, budget):
        """A BFS ball from ``root`` whose MIP has about ``budget`` columns."""
        st, sizes = self.st, self.mip.sizes
        inside = np.zeros(st.n, bool)
        inside[root] = True
        order, cols, head = [root], int(sizes[root]), 0
        while head < len(order):
            x = order[head]
            head += 1
            nb = st.nbr_ids[x]
            for w in nb[self.rng.permutation(len(nb))]:
                if inside[w]:
                    continue
                add = int(sizes[w]) * (1 + int(sizes[st.nbr_ids[w][inside[st.nbr_ids[w]]]].sum()))
                if cols + add > budget:
                    continue
                inside[w] = True
                order.append(int(w))
                cols += add
        return order

    def region_move(self, nodes, time_limit):
        """Solve the region exactly; keep the answer when it fits and is cheaper."""
        st = self.st
        res = self.mip.solve(st.choice, st.slack, nodes, time_limit)
        if res.choice is None:
            return res, False
        before = st.total()
        old = st.choice[res.nodes].copy()
        for x, s in zip(res.nodes, res.choice):
            st.set(int(x), int(s))
        if st.min_slack(res.nodes) >= 0 and st.total() < before:
            self.moves += 1
            return res, True
        for x, s in zip(res.nodes, old):
            st.set(int(x), int(s))
        return res, False

    # ------------------------------------------------------------------ driver
    def run(self):
        st = self.st
        if st.n == 0:
            self.best = st.choice.copy()
            self.best_cost = st.total()
            return
        self.initial()
        self.descend()
        self.remember()
        self.report("start")
        everything = int(self.mip.sizes.sum()) + self.mip.pair_count(np.arange(st.n))
        if everything <= self.opts.whole_mip_columns:
            res, _ = self.region_move(np.arange(st.n), self.time_left())
            self.remember()
            self.report("whole MIP")
            if res.optimal:
                self.optimal = True
                return
        budget = float(self.opts.region_columns)
        while self.time_left() > 0.5:
            root = int(self.rng.integers(st.n))
            nodes = self.grow_region(root, budget)
            limit = min(self.time_left() - 0.2, self.opts.region_seconds)
            t0 = time.monotonic()
            res, better = self.region_move(nodes, limit)
            took = time.monotonic() - t0
            if res.optimal and took < 0.3 * limit:
                budget *= 1.3
            elif not res.optimal:
                budget *= 0.7
            self.remember()
            self.report(f"regions of ~{int(budget)} columns")

def solve(problem: SearchProblem, *, time_limit=None, initial=None, progress=None,
          options: LocalSearchOptions = LocalSearchOptions()) -> Solution:
    started = time.monotonic()
    check_fits(problem)
    limit = options.default_time if time_limit is None else float(time_limit)
    red = reduce(problem)
    st = _State(red)
    expand_time = 0.02 + 2e-6 * problem.num_nodes
    deadline = started + limit - options.margin - expand_time
    search = _Search(st, options, deadline, progress, started)
    search.run()
    best = search.best
    if initial is not None and problem.feasible(initial.choice):
        if best is None or problem.cost(initial.choice) < search.best_cost:
            return Solution.of(problem, initial.choice, "local_search",
                               time.monotonic() - started)
    choice = red.expand(best if best is not None else st.choice)
    return Solution.of(problem, choice, "local_search", time.monotonic() - started,
                       optimal=search.optimal)
