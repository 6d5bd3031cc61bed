"""A whole model's LP relaxation and MIP with its memory rows added only where an answer
overflows (HiGHS through highspy, the LP warm-started from the last basis after each addition).

In: a ``RegionModel`` that ``RegionMip.build`` made (its last ``pieces`` rows and columns are the
memory's running sums). Out, as ``RegionMip`` gives them: ``relax`` a ``RegionResult`` with the
LP's optimum (a proven bound), its rounding, reduced costs and the price of a byte at each
memory piece (its row's dual; 0 for a row left out); ``fix`` reduced-cost fixing against a
ceiling; ``solve`` the MIP's ``RegionResult``. One object does the three in that order (the MIP
is the LP's model with integrality added), on one thread (HiGHS releases the GIL).
``WholeModel`` runs one so on a thread of its own beside local_search's search: the LP, then
the MIP under a ceiling widened until an answer is found or proven.

Why lazily: on IOPDDL D's reduced problem (203 nodes) the memory is 15,001 of the model's 26,387
rows, and HiGHS' dual simplex did not solve the LP in 150 s (interior point: 36-50 s). Without
them the LP solves in 1 s; each round then adds, as one row of the usages live there, the pieces
where the answer overflows most (local maxima of the overflow along the pieces, at most
``per_round``), and 22 rows give the whole LP's optimum in 5 s. A row left out has dual 0: once
no piece overflows, the LP's optimum and reduced costs are the whole model's. The MIP is solved
over the rows found so far, then checked and solved again with the rows its answer breaks; its
dual bound is always a bound on the whole model (it relaxes it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import scipy.sparse as sparse

try:  # the core class: highspy's ``Highs`` prints HiGHS' banner on stdout when the first
    from highspy._core import _Highs as _Highs  # one is made, into `autopar solve`'s answer
except ImportError:  # pragma: no cover - another highspy layout
    from highspy import Highs as _Highs
from highspy import HighsModelStatus, HighsVarType, kHighsInf

from .region_mip import RegionMip, RegionModel, RegionResult


class LazyMemoryModel:
    """``m`` in HiGHS without its memory rows; see the module docstring."""

    per_round = 10  # rows added per round at most
    tolerance = 1e-7  # overflow ignored, relative to the piece's capacity (HiGHS' own)

    def __init__(self, m: RegionModel):
        self.m = m
        k = m.pieces
        rows, cols = m.a.shape[0] - k, m.a.shape[1] - k
        a = sparse.csr_matrix(m.a)
        self.ncol = cols
        # a piece's usage is the running sum of these rows' x terms, negated
        self.steps = sparse.csr_matrix(a[rows:, :cols])
        self.cap = m.ub[cols:]
        self.added = np.zeros(k, bool)
        self.order: list[int] = []  # the pieces whose rows were added, in the model's row order
        self.rows = rows
        self.integer = False  # the MIP (solve) has begun: no more LP duals
        # the memory prices of the last LP solved (``_prices``)
        self.prices: np.ndarray | None = None
        self.top = np.inf  # fix's ceiling, objective units
        h = self.h = _Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", 0)
        poly = sparse.csr_matrix(a[:rows, :cols])
        h.addVars(cols, m.lb[:cols], m.ub[:cols])
        h.changeColsCost(cols, np.arange(cols, dtype=np.int32), m.cost[:cols])
        h.addRows(
            rows,
            m.rhs[:rows],
            m.rhs[:rows],
            poly.nnz,
            poly.indptr[:-1].astype(np.int32),
            poly.indices.astype(np.int32),
            poly.data,
        )

    def usage(self, x) -> np.ndarray:
        """Each piece's usage under column values ``x`` (scaled bytes, as ``cap``)."""
        return -np.cumsum(self.steps @ x[: self.ncol])

    def overflowing(self, x) -> np.ndarray:
        """The pieces whose rows to add for ``x``: where the overflow is a local maximum along
        the pieces and not yet in the model, most overflowing first, ``per_round`` at most."""
        over = self.usage(x) - self.cap
        bad = over > self.tolerance * np.maximum(1.0, np.abs(self.cap))
        if not bad.any():
            return np.zeros(0, np.int64)
        pad = np.concatenate([[-np.inf], over, [-np.inf]])
        peak = bad & ~self.added & (over >= pad[:-2]) & (over >= pad[2:])
        if not peak.any():  # a plateau of added rows HiGHS breaks within its tolerance
            peak = bad & ~self.added
        idx = np.flatnonzero(peak)
        return idx[np.argsort(-over[idx], kind="stable")][: self.per_round]

    def _add(self, pieces):
        self.added[pieces] = True
        self.order.extend(int(p) for p in pieces)
        rows = sparse.csr_matrix(
            np.stack([-np.asarray(self.steps[: p + 1].sum(axis=0)).ravel() for p in pieces])
        )
        rows.data[np.abs(rows.data) < 1e-9] = 0.0  # a term's end and start at one piece
        rows.eliminate_zeros()
        self.h.addRows(
            len(pieces),
            np.full(len(pieces), -kHighsInf),
            self.cap[pieces],
            rows.nnz,
            rows.indptr[:-1].astype(np.int32),
            rows.indices.astype(np.int32),
            rows.data,
        )

    def _rounds(self, end: float) -> tuple[np.ndarray | None, bool]:
        """Solve, add the rows the answer breaks, again, until it breaks none or time runs out:
        (the last answer's column values or None, whether it broke none)."""
        while True:
            self.h.setOptionValue("time_limit", max(0.05, end - time.monotonic()))
            self.h.run()
            if self.h.getInfo().primal_solution_status != 2:  # no feasible point
                return None, False
            if not self.integer and self.h.getModelStatus() == HighsModelStatus.kOptimal:
                self.prices = self._prices()
            x = np.asarray(self.h.getSolution().col_value)
            pieces = self.overflowing(x)
            if len(pieces) == 0:
                return x, True
            if time.monotonic() >= end:
                return x, False
            self._add(pieces)

    def _prices(self) -> np.ndarray:
        """Each piece's price of a byte (cost units) from the last LP's row duals: a binding
        upper row's dual is the objective's change per unit of its bound (<= 0); 0 for a row
        not added."""
        prices = np.zeros(self.m.pieces)
        prices[self.order] = np.maximum(
            -np.asarray(self.h.getSolution().row_dual)[self.rows :], 0.0
        )
        return prices * self.m.scale / self.m.bytes

    def relax(self, time_limit: float) -> RegionResult:
        """The LP relaxation (see ``RegionMip``'s): its optimum, rounding, reduced costs and
        memory prices, or no choice when it was not solved within ``time_limit`` seconds (then
        the prices of the last round solved, over the rows it had, if any: prices >= 0 of any
        rows are a Lagrangian's, whose bound holds)."""
        m = self.m
        x, whole = self._rounds(time.monotonic() + time_limit)
        if x is None or not whole or self.h.getModelStatus() != HighsModelStatus.kOptimal:
            return RegionResult(m.nodes, None, False, len(m.cost), prices=self.prices)
        top = np.maximum.reduceat(x[: m.nx], m.xoff[:-1])
        unsure = tuple(int(v) for v in m.nodes[top < 1 - 1e-6])
        fun = self.h.getInfo().objective_function_value
        reduced = np.asarray(self.h.getSolution().col_dual)
        return RegionResult(
            m.nodes, m.pick(x), False, len(m.cost), unsure, fun * m.scale, reduced, self.prices
        )

    def fix(self, lp: RegionResult, ceiling: float) -> int:
        """Keep in the MIP only answers costing at most ``ceiling`` (cost units, like
        ``lp.bound``; ``lp`` the solved ``relax``): every column those cannot set to 1 is fixed
        at 0 (reduced-cost fixing; a later call sets every column anew) and HiGHS prunes above
        it. Any point of the model costs the LP's optimum plus, for each column, its reduced
        cost times its distance from the bound the LP left it at (all terms >= 0), so a column
        at 0 whose reduced cost exceeds ``ceiling`` less the LP's optimum is below 1 in every
        point costing at most ``ceiling``: 0 in every answer, since x is binary and each y is
        then 0 or 1. So the fixed MIP's optimum is the whole model's when it is at most
        ``ceiling``, and its dual bound capped at ``ceiling`` (which it is when no answer is
        left) is a bound on the whole model. Returns how many columns were fixed."""
        assert lp.bound is not None, "fix takes a solved relax (it has a bound)"
        room = max((ceiling - lp.bound) / self.m.scale, 0.0)
        ub = self.m.ub[: self.ncol].copy()
        self.top = np.inf
        if lp.reduced is not None and not np.isnan(room):
            # HiGHS' dual tolerance is 1e-7 per column: keep a margin beyond it
            ub[lp.reduced > room * (1 + 1e-6) + 1e-6] = 0.0
            top = ceiling / self.m.scale
            self.top = top + 1e-9 * abs(top) + 1e-9
        self.h.setOptionValue("objective_bound", float(self.top))
        self.h.changeColsBounds(
            self.ncol, np.arange(self.ncol, dtype=np.int32), self.m.lb[: self.ncol], ub
        )
        return int((ub < self.m.ub[: self.ncol]).sum())

    def solve(self, time_limit: float, gap: float = 1e-6) -> RegionResult:
        """The MIP (x binary) within ``time_limit`` seconds and relative gap ``gap``: its
        answer (None when none was found), whether it is proven the whole model's optimum (the
        fixed model's, at most ``fix``'s ceiling: HiGHS may return an answer above its cutoff),
        its dual bound (inf when it has no answer: none below the ceiling)."""
        m = self.m
        self.integer = True
        self.h.changeColsIntegrality(
            m.nx, np.arange(m.nx, dtype=np.int32), np.full(m.nx, HighsVarType.kInteger)
        )
        self.h.setOptionValue("mip_rel_gap", float(gap))
        x, whole = self._rounds(time.monotonic() + time_limit)
        dual = self.h.getInfo().mip_dual_bound
        if self.h.getModelStatus() == HighsModelStatus.kInfeasible:
            dual = np.inf
        bound = float(dual) * m.scale if not np.isnan(dual) and dual > -np.inf else None
        if x is None:
            return RegionResult(m.nodes, None, False, len(m.cost), bound=bound)
        optimal = (
            whole
            and self.h.getModelStatus() == HighsModelStatus.kOptimal
            and self.h.getInfo().objective_function_value <= self.top
        )
        return RegionResult(m.nodes, m.pick(x), optimal, len(m.cost), bound=bound)


class WholeModel:
    """A problem's whole model on a thread of its own (HiGHS releases the GIL, so the search
    goes on beside it on the second core): its LP relaxation (``relax``), then, when ``gap``
    is given, its MIP (``mip``, relative gap ``gap``), each a RegionResult once solved, all
    within ``time_limit`` seconds, the LP within ``lp_limit``. ``mip`` is the RegionMip of the
    problem (the reduced one, or one ``restrict``ed), ``choice`` its current strategies,
    ``slack`` the free memory. Both are solved with the memory rows added as answers break
    them (``LazyMemoryModel``). The MIP is not tried when the LP was not solved: HiGHS' MIP
    starts with it. ``ceiling()`` is the best answer's cost so far less the reduction's offset
    (inf when none). The MIP keeps only the answers that cost at most ``top``, the least of
    that and the LP's optimum plus ``reach`` of it, by fixing at 0 every column the LP's
    reduced costs rule out of them (``LazyMemoryModel.fix``: on IOPDDL D at 1% over the LP,
    half the columns), so it proves ``top`` a bound when it finds no answer (then it runs again
    with ``reach`` four times wider) and the optimum when it finds one. ``fixed`` is how many
    columns the last MIP fixed, ``rounds`` how many MIPs ran; ``mip`` the last one's result,
    with the best bound proven so far."""

    reach = 0.01

    def __init__(
        self,
        mip: RegionMip,
        choice,
        slack,
        time_limit: float,
        gap: float | None = None,
        lp_limit: float | None = None,
        ceiling: Callable[[], float] = lambda: np.inf,
    ):
        model = mip.build(choice, slack, np.arange(len(choice)), steps=True)  # now: they change
        self.model = model
        self.relax = self.mip = None
        self.fixed = self.rounds = 0
        self.relaxed = threading.Event()
        lp_limit = time_limit if lp_limit is None else min(lp_limit, time_limit)
        self.thread = threading.Thread(
            target=self._solve, args=(model, time_limit, gap, lp_limit, ceiling), daemon=False
        )  # joined at exit: HiGHS stopped
        # in native code by the interpreter ending aborts the process ("terminate called")
        self.thread.start()

    def _solve(self, model, time_limit, gap, lp_limit, ceiling):
        start = time.monotonic()
        end = start + time_limit
        try:
            lazy = LazyMemoryModel(model)
            self.relax = lazy.relax(start + lp_limit - time.monotonic())
        finally:
            self.relaxed.set()
        if gap is None or self.relax.choice is None:
            return
        lp = self.relax
        reach = self.reach * max(abs(lp.bound), 1.0)
        proven = -np.inf
        while True:
            self.rounds += 1
            best = ceiling()
            top = min(best, lp.bound + reach)
            self.fixed = lazy.fix(lp, top)
            res = lazy.solve(end - time.monotonic(), gap)
            if res.bound is not None:
                proven = max(proven, min(res.bound, top))
            if res.choice is None and self.mip is not None:  # keep an earlier answer
                res = dataclasses.replace(res, choice=self.mip.choice)
            self.mip = dataclasses.replace(res, bound=proven if proven > -np.inf else None)
            # nothing below ``top`` that was left out: widen it while the search's best is above
            if res.optimal or top >= best or proven < top or end - time.monotonic() < 1.0:
                return
            reach *= 4

    def done(self) -> bool:
        return not self.thread.is_alive()
