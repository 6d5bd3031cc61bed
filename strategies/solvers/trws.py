"""Sequential tree-reweighted message passing (TRW-S) over the pairwise cost of a problem.

In: node costs (one array per node, the ``unary`` passed to each ``sweep`` call) and edges
with cost matrices (``inf`` marks a forbidden pair). Out: from ``sweep``, a choice read off
the last forward pass; messages persist between calls, so a changed ``unary`` (a Lagrangian
memory price, say) starts from where the last call ended. From ``lower_bound``, a bound on
every choice's cost valid for any messages.

Recurrence (Kolmogorov, "Convergent tree-reweighted message passing", 2006), nodes in index
order, ``gamma_i = 1 / max(#neighbours before i, #neighbours after i)``:
    h_i(s)          = unary_i(s) + sum_j m_{j->i}(s)
    m_{i->j}(t)     = min_s ( gamma_i h_i(s) - m_{j->i}(s) + M_ij(s, t) ),  then shifted to min 0,
for ``j`` after ``i`` in a forward pass and before it in a backward pass. The choice: in the
forward pass ``x_i = argmin_s unary_i(s) + sum_{j<i} M_ij(s, x_j) + sum_{j>i} m_{j->i}(s)``.
"""
from __future__ import annotations

import numpy as np


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
        self.pairs = []                                # per edge: (u, v, M with big for inf)
        for e, ((u, v), m) in enumerate(zip(edges, edge_costs)):
            u, v = int(u), int(v)
            m = np.where(np.isfinite(m), m, big)
            self.pairs.append((u, v, m))
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

    def _send(self, i, h, links):
        hg = self.gamma[i] * h
        for e, j, m, k in links:
            msg = (hg - self.into[e][k])[:, None] + m
            new = msg.min(0)
            new -= new.min()
            self.incoming[j] += new - self.into[e][1 - k]
            self.into[e][1 - k] = new

    def sweep(self, unary, sweeps: int = 1) -> np.ndarray:
        """``sweeps`` forward+backward passes; the choice of the last forward pass."""
        x = np.zeros(self.n, np.int64)
        for _ in range(sweeps):
            for i in range(self.n):
                h = unary[i] + self.incoming[i]
                p = h.copy()
                for e, j, m, k in self.before[i]:
                    p += m[:, x[j]] - self.into[e][k]
                x[i] = int(np.argmin(p))
                self._send(i, h, self.after[i])
            for i in range(self.n - 1, -1, -1):
                self._send(i, unary[i] + self.incoming[i], self.before[i])
        return x

    def beliefs(self, unary) -> list:
        """Per node, ``unary + incoming messages`` (min-marginals up to a shift)."""
        return [u + m for u, m in zip(unary, self.incoming)]

    def lower_bound(self, unary) -> float:
        """A lower bound on ``sum_i unary_i(x_i) + sum_e M_e(x_u, x_v)`` over every choice that
        uses no forbidden pair, for the messages as they are: the messages reparametrise the
        cost (node terms gain what they receive, edge terms lose what they send, so every
        choice's total is unchanged), and the total is at least the sum of each term's
        minimum. Forbidden pairs count as the large finite cost that stands in for them."""
        incoming = [np.zeros(len(u)) for u in unary]
        total = 0.0
        for e, (u, v, m) in enumerate(self.pairs):
            into_u, into_v = self.into[e]
            incoming[u] += into_u
            incoming[v] += into_v
            total += float((m - into_u[:, None] - into_v[None, :]).min())
        return total + sum(float((np.asarray(c) + i).min()) for c, i in zip(unary, incoming))
