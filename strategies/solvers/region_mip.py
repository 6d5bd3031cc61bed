"""Exact MIP over a region of a ReducedProblem with every other node fixed (HiGHS, via scipy).

In: a ``ReducedProblem``, the current choice and its memory ``slack`` (capacity left per kept
step), the region's nodes and a time limit. Out: a ``RegionResult``: the region's new
strategies (None when HiGHS found nothing in time), whether HiGHS proved them optimal for the
region, and the model size. ``solve`` runs the MIP (``build`` then ``solve_model``). The
caller checks memory exactly and keeps the answer only if it is better; a region of every node
is the whole problem, whose LP and MIP lazy_memory.py solves from ``build``'s model.

Model (the local polytope of the pairwise cost, exact because ``x`` is binary):
    x[i, s] in {0, 1},              sum_s x[i, s] = 1                      (i in region)
    y[e, a, b] in [0, 1],           sum_b y[e, a, b] = x[u, a],  sum_a y[e, a, b] = x[v, b]
                                                                          (edges inside)
    minimise  sum_i sum_s unary_i[s] x[i, s] + sum_e sum_ab M_e[a, b] y[e, a, b]
where ``unary_i`` adds to the node cost the edges to fixed neighbours at their current strategy.
Memory, per piece ``p`` of the compressed time axis over which the region's usage is constant
(pieces that cannot overflow or that another piece implies are left out), as a running sum so
each term appears twice, not once per step:
    U_p = U_{p-1} + sum_{terms starting at p} usage . x - sum_{terms ending at p} usage . x
    U_p <= capacity_p = min over the piece of (slack + the region's current usage).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import scipy.sparse as sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from .graph_reduction import MemoryTerm, ReducedProblem, dominated_steps


@dataclass(frozen=True, eq=False)
class RegionResult:
    nodes: np.ndarray  # region nodes
    choice: np.ndarray | None  # their new strategies, None when none was found
    optimal: bool  # HiGHS proved it optimal for the region
    variables: int  # model columns
    unsure: tuple = ()  # nodes whose LP values were fractional (LP only)
    bound: float | None = None  # HiGHS's lower bound on the region's objective (cost units;
    # nodes outside the region held as they were): the MIP's
    # dual bound, or the optimum of the LP relaxation
    reduced: np.ndarray | None = None  # the LP's reduced costs per column (LP only;
    # objective units, see LazyMemoryModel.fix)
    prices: np.ndarray | None = None  # the LP's price of a byte at each memory piece's
    # step (``RegionModel.steps``; cost units, LP only)


@dataclass(frozen=True, eq=False)
class RegionModel:
    nodes: np.ndarray
    xoff: np.ndarray  # first column of each node's x
    cost: np.ndarray  # objective, scaled
    a: sparse.csr_matrix  # sparse equality rows (memory as equalities on U columns)
    rhs: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    nx: int  # number of x columns (the binaries)
    scale: float = 1.0  # cost units per objective unit
    pieces: int = 0  # memory pieces: the last rows and columns (U) are theirs
    steps: np.ndarray | None = None  # each piece's kept step where its capacity is least
    bytes: float = 1.0  # bytes per memory unit of the U rows

    def pick(self, values) -> np.ndarray:
        """Each node's strategy with the largest ``x``."""
        xs = values[: self.nx]
        return np.array(
            [int(np.argmax(xs[a:b])) for a, b in zip(self.xoff[:-1], self.xoff[1:])], np.int64
        )


@dataclass(frozen=True, eq=False)
class _Region:
    """A region's indexing: its sorted ``nodes``, ``local`` (problem node -> position in the
    region, -1 outside), their strategy counts (``sizes``), the first x column of each node
    (``xoff``, one past the end last) and the number of x columns ``nx``."""

    nodes: np.ndarray
    local: np.ndarray
    sizes: np.ndarray
    xoff: np.ndarray
    nx: int


class _Rows(NamedTuple):
    """Sparse constraint rows as coordinate triplets: arrays of row indices, column indices
    and values (entry k of each list goes together), and the number of rows."""

    rows: list
    cols: list
    vals: list
    nrows: int


class RegionMip:
    """Per-problem indexes (terms and edges by node) shared by every region solve."""

    def __init__(self, r: ReducedProblem):
        self.r = r
        n = r.num_nodes
        self.terms: list[list[MemoryTerm]] = [[] for _ in range(n)]
        for t in r.terms:
            self.terms[t.node].append(t)
        self.incident: list[list[int]] = [[] for _ in range(n)]
        for e, (u, v) in enumerate(r.edges):
            self.incident[u].append(e)
            self.incident[v].append(e)
        self.sizes = np.array([len(c) for c in r.node_costs], np.int64)

    def pair_count(self, nodes) -> int:
        inside = np.zeros(self.r.num_nodes, bool)
        inside[nodes] = True
        e = self.r.edges
        both = inside[e[:, 0]] & inside[e[:, 1]]
        return int((self.sizes[e[both, 0]] * self.sizes[e[both, 1]]).sum())

    def build(self, choice, slack, nodes, steps: bool = False) -> RegionModel:
        """The MIP of the module docstring for ``nodes`` (others fixed as in ``choice``): the
        x and y columns with their equality rows, then the memory's U columns and rows (with
        ``steps``, the model says at which kept step each piece's capacity is least)."""
        reg = self._region(nodes)
        unary, inner = self._split_edges(reg, choice)
        mats = [self.r.edge_costs[e] for e in inner]
        ysz = np.array([m.size for m in mats], np.int64)
        yoff = reg.nx + np.concatenate([[0], np.cumsum(ysz)])
        eq = self._polytope_rows(reg, inner, mats, yoff)
        rows, cols, vals, nrow = list(eq.rows), list(eq.cols), list(eq.vals), eq.nrows
        rhs = np.zeros(nrow)
        rhs[: len(reg.nodes)] = 1.0
        ncol = int(yoff[-1])
        mem = self._memory(choice, slack, reg.nodes, reg.xoff, reg.local, nrow, ncol, steps)
        cost = np.concatenate(unary + [m.ravel() for m in mats])
        lb, ub = np.zeros(ncol), np.ones(ncol)
        if mem is not None:
            mrows, mcols, mvals, cap, at, unit = mem
            k = len(cap)
            rows.append(mrows)
            cols.append(mcols)
            vals.append(mvals)
            rhs = np.concatenate([rhs, np.zeros(k)])
            cost = np.concatenate([cost, np.zeros(k)])
            lb = np.concatenate([lb, np.full(k, -np.inf)])
            ub = np.concatenate([ub, cap])
            nrow += k
            ncol += k
        forbidden = ~np.isfinite(cost)
        cost[forbidden] = 0.0
        ub[forbidden] = 0.0
        a = sparse.csr_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(nrow, ncol)
        )
        # HiGHS works best with objective coefficients of moderate size
        scale = float(np.abs(cost).max()) / 1e4 if ncol and np.abs(cost).max() > 1e4 else 1.0
        if mem is None:
            return RegionModel(reg.nodes, reg.xoff, cost / scale, a, rhs, lb, ub, reg.nx, scale)
        return RegionModel(
            reg.nodes, reg.xoff, cost / scale, a, rhs, lb, ub, reg.nx, scale, len(cap), at, unit
        )

    def _region(self, nodes) -> _Region:
        """Region node ids (any order, repeats allowed) -> its indexing (``_Region``)."""
        nodes = np.asarray(sorted({int(x) for x in nodes}), np.int64)
        local = np.full(self.r.num_nodes, -1, np.int64)
        local[nodes] = np.arange(len(nodes))
        sizes = self.sizes[nodes]
        xoff = np.concatenate([[0], np.cumsum(sizes)])
        return _Region(nodes, local, sizes, xoff, int(xoff[-1]))

    def _split_edges(self, reg: _Region, choice) -> tuple[list, list]:
        """A region and the current choice -> (per region node its ``unary`` costs, the edges
        to fixed neighbours folded in at their current strategy; the edges inside the region,
        each listed once)."""
        r = self.r
        unary = [r.node_costs[x].astype(np.float64).copy() for x in reg.nodes]
        inner = []
        for x in reg.nodes:
            for e in self.incident[x]:
                u, v = r.edges[e]
                if reg.local[u] >= 0 and reg.local[v] >= 0:
                    if u == x:
                        inner.append(e)
                elif u == x:
                    unary[reg.local[x]] += r.edge_costs[e][:, choice[v]]
                else:
                    unary[reg.local[x]] += r.edge_costs[e][choice[u], :]
        return unary, inner

    def _polytope_rows(self, reg: _Region, inner, mats, yoff) -> _Rows:
        """The equality rows of the local polytope: one strategy per region node, then per
        inside edge (matrix ``mats[k]``, y columns from ``yoff[k]``) its two marginals."""
        rows = [np.repeat(np.arange(len(reg.nodes)), reg.sizes)]
        cols = [np.arange(reg.nx)]
        vals = [np.ones(reg.nx)]
        nrow = len(reg.nodes)
        for e, m, y0 in zip(inner, mats, yoff[:-1]):
            u, v = reg.local[self.r.edges[e]]
            su, sv = m.shape
            ys = y0 + np.arange(su * sv)
            rows += [
                nrow + np.repeat(np.arange(su), sv),
                nrow + np.arange(su),
                nrow + su + np.tile(np.arange(sv), su),
                nrow + su + np.arange(sv),
            ]
            cols += [ys, reg.xoff[u] + np.arange(su), ys, reg.xoff[v] + np.arange(sv)]
            vals += [np.ones(su * sv), -np.ones(su), np.ones(su * sv), -np.ones(sv)]
            nrow += su + sv
        return _Rows(rows, cols, vals, nrow)

    def solve(self, choice, slack, nodes, time_limit: float, gap: float = 1e-6) -> RegionResult:
        """The region's MIP, built and solved by HiGHS within about ``time_limit`` seconds."""
        t0 = time.monotonic()
        m = self.build(choice, slack, nodes)
        return self.solve_model(m, time_limit - (time.monotonic() - t0), gap)

    @staticmethod
    def solve_model(m: RegionModel, time_limit: float, gap: float = 1e-6) -> RegionResult:
        """``solve`` on a model ``build`` made (HiGHS releases the GIL: a thread may run it)."""
        integrality = np.zeros(len(m.cost))
        integrality[: m.nx] = 1
        res = milp(
            m.cost,
            constraints=LinearConstraint(m.a, m.rhs, m.rhs),
            integrality=integrality,
            bounds=Bounds(m.lb, m.ub),
            options={"time_limit": max(0.05, float(time_limit)), "disp": False, "mip_rel_gap": gap},
        )
        dual = getattr(res, "mip_dual_bound", None)
        bound = float(dual) * m.scale if dual is not None and np.isfinite(dual) else None
        if res.x is None:
            return RegionResult(m.nodes, None, False, len(m.cost), bound=bound)
        return RegionResult(m.nodes, m.pick(res.x), res.status == 0, len(m.cost), bound=bound)

    def _memory(self, choice, slack, nodes, xoff, local, row0, col0, steps=False):
        """Rows of the running-sum memory model, or None when the region cannot overflow:
        (rows, columns, values, each piece's capacity in memory units, the kept step where it
        is least (None without ``steps``: a sort over the region's span), bytes per memory
        unit)."""
        terms = [(local[x], t) for x in nodes for t in self.terms[x]]
        if not terms:
            return None
        lo = np.array([t.lo for _, t in terms], np.int64)
        hi = np.array([t.hi for _, t in terms], np.int64)
        cur = np.array([t.usage[choice[t.node]] for _, t in terms], np.int64)
        top = np.array([t.usage.max() for _, t in terms], np.int64)
        cuts = np.unique(np.concatenate([lo, hi]))
        a, b = int(cuts[0]), int(cuts[-1])
        delta = np.zeros(b - a + 1, np.int64)
        np.add.at(delta, lo - a, cur)
        np.add.at(delta, hi - a, -cur)
        free = slack[a:b] + np.cumsum(delta)[:-1]  # capacity for the region
        cap = np.minimum.reduceat(free, cuts[:-1] - a)  # per piece
        at = np.zeros(len(cap), np.int64)
        if steps:
            piece = np.repeat(np.arange(len(cuts) - 1), np.diff(cuts))
            order = np.lexsort((free, piece))  # each piece's least step first
            at = a + order[np.searchsorted(piece[order], np.arange(len(cap)))]
        plo, phi = np.searchsorted(cuts, lo), np.searchsorted(cuts, hi)
        most = np.zeros(len(cuts), np.int64)
        np.add.at(most, plo, top)
        np.add.at(most, phi, -top)
        keep = np.flatnonzero(np.cumsum(most)[:-1] > cap)
        if len(keep) == 0:
            return None
        cap, at = cap[keep], at[keep]
        klo, khi = np.searchsorted(keep, plo), np.searchsorted(keep, phi)
        live = khi > klo
        klo, khi, terms = klo[live], khi[live], [t for t, ok in zip(terms, live) if ok]
        while True:
            drop = dominated_steps(cap, klo, khi)
            if not drop.any():
                break
            left = np.concatenate([[0], np.cumsum(~drop)])
            cap, at, klo, khi = cap[~drop], at[~drop], left[klo], left[khi]
            live = khi > klo
            klo, khi, terms = klo[live], khi[live], [t for t, ok in zip(terms, live) if ok]
        k = len(cap)
        # bytes scaled so the largest usage is ~1e5: one byte stays above HiGHS' 1e-7 tolerance
        scale = max(1.0, float(max(t.usage.max() for _, t in terms)) / 1e5)
        rows = [row0 + np.arange(k), row0 + np.arange(1, k)]
        cols = [col0 + np.arange(k), col0 + np.arange(k - 1)]
        vals = [np.ones(k), -np.ones(k - 1)]
        for (i, t), l, h in zip(terms, klo, khi):
            nz = np.flatnonzero(t.usage)
            u = t.usage[nz] / scale
            rows.append(np.full(len(nz), row0 + l))
            cols.append(xoff[i] + nz)
            vals.append(-u)
            if h < k:
                rows.append(np.full(len(nz), row0 + h))
                cols.append(xoff[i] + nz)
                vals.append(u)
        return (
            np.concatenate(rows),
            np.concatenate(cols),
            np.concatenate(vals),
            cap / scale,
            at if steps else None,
            scale,
        )
