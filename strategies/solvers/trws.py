"""Sequential tree-reweighted message passing (TRW-S) over the pairwise cost of a problem.

In: node costs (one array per node, the ``unary`` passed to each ``sweep`` call) and edges
with cost matrices (``inf`` marks a forbidden pair). Out: from ``sweep``, a choice read off
the last forward pass; messages persist between calls, so a changed ``unary`` (a Lagrangian
memory price, say) starts from where the last call ended. From ``lower_bound``, the bound on
every choice's cost that the last backward pass proved.

Recurrence (Kolmogorov, "Convergent tree-reweighted message passing", 2006), nodes in index
order, ``gamma_i = 1 / max(#neighbours before i, #neighbours after i)``:
    h_i(s)          = unary_i(s) + sum_j m_{j->i}(s)
    m_{i->j}(t)     = min_s ( gamma_i h_i(s) - m_{j->i}(s) + M_ij(s, t) ),  then shifted to min 0,
for ``j`` after ``i`` in a forward pass and before it in a backward pass. The choice: in the
forward pass ``x_i = argmin_s unary_i(s) + sum_{j<i} M_ij(s, x_j) + sum_{j>i} m_{j->i}(s)``.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

FORBIDDEN = 1e17          # problem costs at or above this mark an impossible strategy or pair


class MessagePassing:
    def __init__(self, num_nodes: int, sizes, edges, edge_costs):
        finite = [m[np.isfinite(m)] for m in edge_costs]
        top = max([float(np.abs(f).max()) for f in finite if f.size] + [1.0])
        big = 1e4 * top                           # stands in for a forbidden pair
        self.big = big
        self.n = num_nodes
        self.before = [[] for _ in range(num_nodes)]   # (edge, j, M oriented (i, j)) with j < i
        self.after = [[] for _ in range(num_nodes)]
        self.into = []                                 # per edge: [message into u, into v]
        for e, ((u, v), m) in enumerate(zip(edges, edge_costs)):
            u, v = int(u), int(v)
            m = np.where(np.isfinite(m), m, big)
            self.into.append([np.zeros(m.shape[0]), np.zeros(m.shape[1])])
            # slot k: the message into the node itself; 1 - k: the one it sends
            if u < v:
                self.after[u].append((e, v, m, 0))
                self.before[v].append((e, u, m.T, 1))
            else:
                self.before[u].append((e, v, m, 0))
                self.after[v].append((e, u, m.T, 1))
        self.incoming = [np.zeros(int(k)) for k in sizes]
        self.gamma = np.array([1.0 / max(1, len(b), len(a))
                               for b, a in zip(self.before, self.after)])
        self.bound = -np.inf

    def _send(self, i, h, links) -> float:
        """Messages from ``i`` (node term ``h``) along ``links``; returns the sum of each new
        message's minimum before it is shifted to 0."""
        hg = self.gamma[i] * h
        shifted = 0.0
        for e, j, m, k in links:
            msg = (hg - self.into[e][k])[:, None] + m
            new = msg.min(0)
            low = float(new.min())
            shifted += low
            new -= low
            self.incoming[j] += new - self.into[e][1 - k]
            self.into[e][1 - k] = new
        return shifted

    def sweep(self, unary, sweeps: int = 1) -> np.ndarray:
        """``sweeps`` forward+backward passes; the choice of the last forward pass. Each
        backward pass also sets ``bound`` (see ``lower_bound``)."""
        x = np.zeros(self.n, np.int64)
        for _ in range(sweeps):
            for i in range(self.n):
                h = unary[i] + self.incoming[i]
                p = h.copy()
                for e, j, m, k in self.before[i]:
                    p += m[:, x[j]] - self.into[e][k]
                x[i] = int(np.argmin(p))
                self._send(i, h, self.after[i])
            bound = 0.0
            for i in range(self.n - 1, -1, -1):
                h = unary[i] + self.incoming[i]
                low = float(h.min())
                bound += low + self._send(i, h - low, self.before[i])
            self.bound = bound
        return x

    def beliefs(self, unary) -> list:
        """Per node, ``unary + incoming messages`` (min-marginals up to a shift)."""
        return [u + m for u, m in zip(unary, self.incoming)]

    def lower_bound(self) -> float:
        """A lower bound on ``sum_i unary_i(x_i) + sum_e M_e(x_u, x_v)`` over every choice that
        uses no forbidden pair, for the ``unary`` of the last ``sweep`` (its backward pass):
        TRW-S's own bound (Kolmogorov, 2006), the sum over the nodes, last to first, of the
        minimum of each node's term and of the messages it sends back before they are
        shifted. Forbidden pairs count as the finite cost that stands in for them, which only
        lowers the bound. ``-inf`` before any sweep."""
        return self.bound


def bound(problem, seconds: float, target: Optional[float] = None,
          tolerance: float = 1e-3) -> Optional[float]:
    """The best TRW-S lower bound on every choice's cost of ``problem`` (a SearchProblem; its
    memory limit relaxed, so the bound holds under it too) proved by sweeps within
    ``seconds``, stopping early once it is within ``tolerance`` (relative) of ``target`` (a
    known choice's cost). None when no sweep finished in time."""
    deadline = time.monotonic() + seconds
    unary = [np.where(c >= FORBIDDEN, np.inf, c).astype(np.float64) for c in problem.node_costs]
    edges, mats = [], []
    for (u, v), m in zip(problem.edges.tolist(), problem.edge_costs):
        m = np.where(m >= FORBIDDEN, np.inf, m)
        if u == v:                                     # a self-loop is a node cost
            unary[u] = unary[u] + np.diag(m)
        else:
            edges.append((u, v))
            mats.append(m)
    passing = MessagePassing(problem.num_nodes, [len(c) for c in unary],
                             np.asarray(edges, np.int64).reshape(-1, 2), mats)
    best, took = None, 0.0
    while time.monotonic() + took < deadline:       # a sweep that cannot finish is not begun
        t0 = time.monotonic()
        passing.sweep(unary, 1)
        took = time.monotonic() - t0
        got = passing.lower_bound()
        if np.isfinite(got) and (best is None or got > best):
            best = got
        if best is not None and target is not None and \
                target - best <= tolerance * abs(target):
            break
    return best
