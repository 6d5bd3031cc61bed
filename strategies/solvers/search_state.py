"""The state local_search (local_search.py) moves through: a choice per node of a
ReducedProblem, the memory it leaves free, and the strategies arc consistency leaves each node.

In: a ``ReducedProblem``. Out: ``State`` -- the choice, the free memory ``slack`` at every kept
time step, and per-node queries (cost of each strategy with the neighbours as now, which
strategies fit) and updates; ``Domains`` -- per node the strategies still possible without a
forbidden pair, kept arc consistent as nodes are fixed.
"""
from __future__ import annotations

import numpy as np

from .graph_reduction import ReducedProblem


class State:
    """Choice, slack and per-node views of a ReducedProblem."""

    def __init__(self, r: ReducedProblem):
        n = r.num_nodes
        self.r = r
        self.n = n
        self.cost = [c.astype(np.float64) for c in r.node_costs]
        self.sizes = np.array([len(c) for c in self.cost], np.int64)
        self.nbrs = [[] for _ in range(n)]       # (w, M oriented (x, w))
        for (u, v), m in zip(r.edges, r.edge_costs):
            self.nbrs[u].append((int(v), m))
            self.nbrs[v].append((int(u), m.T))
        self.nbr_ids = [np.array([w for w, _ in nb], np.int64) for nb in self.nbrs]
        self._flat(r)
        self._memory_tables(r)
        self.choice = np.zeros(n, np.int64)
        self.slack = r.capacity.astype(np.int64).copy()

    def _flat(self, r: ReducedProblem):
        self.node_off = np.concatenate([[0], np.cumsum(self.sizes)])[:-1]
        self.node_flat = np.concatenate(self.cost) if self.n else np.zeros(0)
        esz = np.array([m.size for m in r.edge_costs], np.int64)
        self.edge_off = np.concatenate([[0], np.cumsum(esz)])[:-1]
        self.edge_flat = (np.concatenate([m.ravel() for m in r.edge_costs]) if len(esz)
                          else np.zeros(0))
        self.eu, self.ev = r.edges[:, 0], r.edges[:, 1]
        self.esv = self.sizes[self.ev] if len(esz) else np.zeros(0, np.int64)

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
        self.has_memory = np.array([d is not None for d in self.table], bool)

    # ------------------------------------------------------------------ queries
    def local(self, x) -> np.ndarray:
        """Cost of each strategy of ``x`` with its neighbours as now."""
        out = self.cost[x].copy()
        ch = self.choice
        for w, m in self.nbrs[x]:
            out += m[:, ch[w]]
        return out

    def avail(self, x) -> np.ndarray:
        """Memory ``x`` may use per piece with every other node as now."""
        lo, hi = self.span[x]
        return np.minimum.reduceat(self.slack[lo:hi], self.starts[x]) + \
            self.table[x][self.choice[x]]

    def fits(self, x) -> np.ndarray:
        """Strategies of ``x`` that fit with every other node as now."""
        if self.table[x] is None:
            return np.ones(len(self.cost[x]), bool)
        return (self.table[x] <= self.avail(x)).all(1)

    def total(self, choice=None, forbidden=np.inf) -> float:
        """The cost of ``choice`` (the current one by default), each forbidden pair it uses
        counted as ``forbidden``."""
        ch = self.choice if choice is None else choice
        if self.n == 0:
            return self.r.offset
        out = self.r.offset + float(self.node_flat[self.node_off + ch].sum())
        if len(self.eu):
            pairs = self.edge_flat[self.edge_off + ch[self.eu] * self.esv + ch[self.ev]]
            out += float(np.where(np.isfinite(pairs), pairs, forbidden).sum())
        return out

    def price(self, lam) -> list:
        """Node costs plus memory priced at ``lam`` per byte and kept step."""
        out = []
        for x in range(self.n):
            d = self.table[x]
            if d is None:
                out.append(self.cost[x])
            else:
                lo, hi = self.span[x]
                out.append(self.cost[x] + d @ np.add.reduceat(lam[lo:hi], self.starts[x]))
        return out

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
        delta = np.zeros(len(self.slack) + 1, np.int64)
        for x in np.flatnonzero(self.has_memory):
            lo, hi = self.span[x]
            d = self.table[x][self.choice[x]]
            cuts = self.starts[x] + lo
            np.add.at(delta, cuts, d)
            np.add.at(delta, np.append(cuts[1:], hi), -d)
        self.slack = self.r.capacity.astype(np.int64) - np.cumsum(delta)[:-1]

    def overflow(self) -> bool:
        return bool(self.slack.size) and int(self.slack.min()) < 0


class Domains:
    """The strategies each node may still take without a forbidden pair (infinite edge cost),
    kept arc consistent as nodes are fixed: fixing a node narrows its neighbours to the
    strategies with a finite pair with it, and each narrowing spreads the same way. A node
    left with nothing keeps what it had (a conflict a later repair or descent must mend)."""

    def __init__(self, st: State):
        self.st = st
        self.finite = [np.isfinite(c) for c in st.cost]
        self.allowed = [[(w, np.isfinite(m)) for w, m in nb] for nb in st.nbrs]
        self.reset()

    def reset(self):
        self.left = [f.copy() for f in self.finite]

    def fix(self, x, s):
        self.left[x] = np.zeros(len(self.left[x]), bool)
        self.left[x][s] = True
        todo = [x]
        while todo:
            y = todo.pop()
            for w, ok in self.allowed[y]:
                new = self.left[w] & ok[self.left[y]].any(0)
                if new.any() and (new != self.left[w]).any():
                    self.left[w] = new
                    todo.append(w)
