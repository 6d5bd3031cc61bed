"""The state local_search (local_search.py) moves through: a choice per node of a
ReducedProblem and the memory it leaves free.

In: a ``ReducedProblem``. Out: ``State`` -- the choice, the free memory ``slack`` at every kept
time step, per-node queries (cost of each strategy with the neighbours as now) and updates, and
a choice kept clear of forbidden pairs by arc consistency (``consistent``). The loops over every
node (``load``, ``price``, ``consistent``, the 1-opt ``descend``, the memory ``repair``) run in
C++ (``autopar._native.SearchState``, native/src/search_state.cc) on the same tables, writing
``choice`` and ``slack`` in place.
"""

from __future__ import annotations

import copy

import numpy as np

from autopar import _native

from .graph_reduction import MemoryTerm, ReducedProblem


class State:
    """Choice, slack and per-node views of a ReducedProblem."""

    def __init__(self, r: ReducedProblem):
        n = r.num_nodes
        self.r = r
        self.n = n
        self.cost = [c.astype(np.float64) for c in r.node_costs]
        self.sizes = np.array([len(c) for c in self.cost], np.int64)
        # per node: (w, M oriented (x, w))
        self.nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        for (u, v), m in zip(r.edges, r.edge_costs):
            self.nbrs[u].append((int(v), m))
            self.nbrs[v].append((int(u), m.T))
        self.nbr_ids = [np.array([w for w, _ in nb], np.int64) for nb in self.nbrs]
        self._flat(r)
        self._memory_tables(r)
        self._kernel = self._native(r)
        self.choice = np.zeros(n, np.int64)
        self.slack = r.capacity.astype(np.int64).copy()

    def _flat(self, r: ReducedProblem):
        self.node_off = np.concatenate([[0], np.cumsum(self.sizes)])[:-1]
        self.node_flat = np.concatenate(self.cost) if self.n else np.zeros(0)
        esz = np.array([m.size for m in r.edge_costs], np.int64)
        self.edge_off = np.concatenate([[0], np.cumsum(esz)])[:-1]
        self.edge_flat = (
            np.concatenate([m.ravel() for m in r.edge_costs]) if len(esz) else np.zeros(0)
        )
        self.eu, self.ev = r.edges[:, 0], r.edges[:, 1]
        self.esv = self.sizes[self.ev] if len(esz) else np.zeros(0, np.int64)
        self._regret_tables()

    def _memory_tables(self, r: ReducedProblem):
        by_node: list[list[MemoryTerm]] = [[] for _ in range(self.n)]
        for t in r.terms:
            by_node[t.node].append(t)
        self.span = np.zeros((self.n, 2), np.int64)
        # per node (None where its memory does not depend on its strategy): the compressed
        # steps its pieces start at, their lengths, and the usage per (strategy, piece)
        self.starts: list[np.ndarray | None] = []
        self.lens: list[np.ndarray | None] = []
        self.table: list[np.ndarray | None] = []
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

    def _native(self, r: ReducedProblem):
        """The loops of ``load``, ``price``, ``descend`` and ``repair`` in C++ (native/src/search_state.cc)
        over the same tables, flat."""
        flat = lambda parts, t: np.concatenate(parts).astype(t) if parts else np.zeros(0, t)
        offsets = lambda counts: np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        pieces = [0 if a is None else len(a) for a in self.starts]
        mats = list(r.edge_costs)
        return _native.SearchState(
            self.sizes,
            self.node_flat,
            np.asarray(r.edges, np.int64).reshape(-1, 2),
            flat([m.ravel() for m in mats], np.float64),
            flat([m.T.ravel() for m in mats], np.float64),
            offsets([m.size for m in mats]),
            offsets(pieces),
            flat([a + lo for a, (lo, _) in zip(self.starts, self.span) if a is not None], np.int64),
            flat([ln for ln in self.lens if ln is not None], np.int64),
            flat([d.ravel() for d in self.table if d is not None], np.int64),
            offsets([len(c) * p for c, p in zip(self.cost, pieces)]),
            r.capacity.astype(np.int64),
        )

    def fork(self) -> State:
        """A State over the same problem, tables and C++ kernel (use one of the two at a
        time) with a copy of this one's choice and slack."""
        other = copy.copy(self)
        other.choice, other.slack = self.choice.copy(), self.slack.copy()
        return other

    # ------------------------------------------------------------------ queries
    def local(self, x) -> np.ndarray:
        """Cost of each strategy of ``x`` with its neighbours as now."""
        out = self.cost[x].copy()
        ch = self.choice
        for w, m in self.nbrs[x]:
            out += m[:, ch[w]]
        return out

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

    def regret(self, unary) -> np.ndarray:
        """Per node, how much more its strategy costs than its cheapest one with its
        neighbours as now, node costs taken from ``unary`` (flat, as ``price`` gives them)."""
        ch = self.choice
        local = np.array(unary, np.float64)
        if len(self._pair_at):
            e = self._pair_edge
            other = np.where(self._pair_side, ch[self.eu[e]], ch[self.ev[e]])
            stride = np.where(self._pair_side, self.esv[e], 1)
            local += np.bincount(
                self._pair_to, self.edge_flat[self._pair_at + other * stride], minlength=len(local)
            )
        here = local[self.node_off + ch]
        return here - np.minimum.reduceat(local, self.node_off)

    def _regret_tables(self):
        """For every (edge, strategy of one end): the flat entry of the edge's matrix at that
        strategy and the other end's strategy 0 (``_pair_at``), which end (``_pair_side``:
        True for v), the edge and the flat strategy it adds to."""
        su, sv = self.sizes[self.eu], self.sizes[self.ev]
        edge = np.repeat(np.arange(len(self.eu)), su + sv)
        first = np.concatenate([[0], np.cumsum(su + sv)])[:-1]
        k = np.arange(len(edge)) - first[edge]
        side = k >= su[edge]
        j = np.where(side, k - su[edge], k)  # the strategy of that end
        self._pair_edge, self._pair_side = edge, side
        self._pair_at = self.edge_off[edge] + np.where(side, j, j * sv[edge])
        self._pair_to = (
            np.where(side, self.node_off[self.ev[edge]], self.node_off[self.eu[edge]]) + j
        )

    def price(self, lam) -> np.ndarray:
        """Node costs plus memory priced at ``lam`` per byte and kept step, flat in node order
        (node ``x``'s at ``node_off[x]``)."""
        return self._kernel.price(np.asarray(lam, np.float64))

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
        self.choice = np.array(choice, np.int64)
        self._kernel.load(self.choice, self.slack)

    def descend(self, order, seconds: float) -> int:
        """1-opt from the nodes of ``order``: each to its cheapest strategy that fits (the
        first among equals), revisiting neighbours of moved nodes, until no move helps or
        ``seconds`` pass. Returns the moves made."""
        return self._kernel.descend(
            self.choice, self.slack, np.asarray(order, np.int64), float(seconds)
        )

    def repair(self, order, seconds: float) -> int:
        """While memory overflows, rounds over the nodes of ``order`` live at an overflowing
        step: each over what the others leave it moves to the strategy with the least
        (extra cost + 1) per byte of excess removed, never into a forbidden pair. Stops when
        everything fits, a round moves nothing or ``seconds`` pass. Returns the moves made."""
        return self._kernel.repair(
            self.choice, self.slack, np.asarray(order, np.int64), float(seconds)
        )

    def consistent(self, score) -> np.ndarray:
        """A choice using no forbidden pair where arc consistency can keep it so: nodes in
        breadth-first order (roots in node order), each taking its strategy of least ``score``
        (flat in node order; the first among equals) among those the nodes fixed before it
        leave it -- fixing a node narrows its neighbours to the strategies with a finite pair
        with it, and each narrowing spreads -- or among all when none is left (a conflict a
        later repair or descent must mend). In C++ (``SearchState.consistent``)."""
        return self._kernel.consistent(np.asarray(score, np.float64))

    def overflow(self) -> bool:
        return bool(self.slack.size) and int(self.slack.min()) < 0
