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

import numpy as np

from autopar import _native

FORBIDDEN = 1e17  # problem costs at or above this mark an impossible strategy or pair
STALL_SWEEPS = 50  # bound() stops once this many sweeps raised its bound by less than
STALL_SHARE = 1e-4  # ... this share of the target cost


class MessagePassing:
    """The recurrence above; the sweeps run in C++ (``autopar._native.MessagePassing``,
    native/src/trws.cc), which releases the GIL."""

    def __init__(self, num_nodes: int, sizes, edges, edge_costs):
        finite = [m[np.isfinite(m)] for m in edge_costs]
        top = max([float(np.abs(f).max()) for f in finite if f.size] + [1.0])
        big = 1e4 * top  # stands in for a forbidden pair
        self.big = big
        self.n = num_nodes
        self.sizes = np.asarray(sizes, np.int64).reshape(num_nodes)
        mats = [np.where(np.isfinite(m), m, big).astype(np.float64) for m in edge_costs]
        offsets = np.concatenate([[0], np.cumsum([m.size for m in mats], dtype=np.int64)])
        flat = lambda parts: np.concatenate(parts) if parts else np.zeros(0)
        self._kernel = _native.MessagePassing(
            self.sizes,
            np.asarray(edges, np.int64).reshape(-1, 2),
            flat([m.ravel() for m in mats]),
            flat([m.T.ravel() for m in mats]),
            offsets,
        )
        self.bound = -np.inf

    def sweep(self, unary, sweeps: int = 1) -> np.ndarray:
        """``sweeps`` forward+backward passes over ``unary`` (one array per node, or all flat
        in node order); the choice of the last forward pass. Each backward pass also sets
        ``bound`` (see ``lower_bound``)."""
        flat = np.concatenate(unary) if isinstance(unary, list) and unary else unary
        flat = np.asarray(flat, np.float64).reshape(-1)
        x, self.bound = self._kernel.sweep(flat, sweeps)
        return x

    def lower_bound(self) -> float:
        """A lower bound on ``sum_i unary_i(x_i) + sum_e M_e(x_u, x_v)`` over every choice that
        uses no forbidden pair, for the ``unary`` of the last ``sweep`` (its backward pass):
        TRW-S's own bound (Kolmogorov, 2006), the sum over the nodes, last to first, of the
        minimum of each node's term and of the messages it sends back before they are
        shifted. Forbidden pairs count as the finite cost that stands in for them, which only
        lowers the bound. ``-inf`` before any sweep."""
        return self.bound


def bound(
    problem, seconds: float, target: float | None = None, tolerance: float = 1e-3
) -> float | None:
    """The best TRW-S lower bound on every choice's cost of ``problem`` (a SearchProblem; its
    memory limit relaxed, so the bound holds under it too) proved by sweeps within
    ``seconds``, stopping early once it is within ``tolerance`` (relative) of ``target`` (a
    known choice's cost), or once the last ``STALL_SWEEPS`` sweeps raised it by less than
    ``STALL_SHARE`` of ``target`` (of the bound without one). None when no sweep finished in
    time."""
    deadline = time.monotonic() + seconds
    unary = [np.where(c >= FORBIDDEN, np.inf, c).astype(np.float64) for c in problem.node_costs]
    edges, mats = [], []
    for (u, v), m in zip(problem.edges.tolist(), problem.edge_costs):
        m = np.where(m >= FORBIDDEN, np.inf, m)
        if u == v:  # a self-loop is a node cost
            unary[u] = unary[u] + np.diag(m)
        else:
            edges.append((u, v))
            mats.append(m)
    passing = MessagePassing(
        problem.num_nodes, [len(c) for c in unary], np.asarray(edges, np.int64).reshape(-1, 2), mats
    )
    best, took, history = None, 0.0, []
    while time.monotonic() + took < deadline:  # a sweep that cannot finish is not begun
        t0 = time.monotonic()
        passing.sweep(unary, 1)
        took = time.monotonic() - t0
        got = passing.lower_bound()
        if np.isfinite(got) and (best is None or got > best):
            best = got
        if best is None:
            continue
        if target is not None and target - best <= tolerance * abs(target):
            break
        history.append(best)
        if len(history) > STALL_SWEEPS and best - history[-1 - STALL_SWEEPS] <= STALL_SHARE * abs(
            best if target is None else target
        ):
            break
    return best
