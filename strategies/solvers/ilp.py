"""Exact search with OR-tools CP-SAT: the reference solver and fall-back polisher.

In: a ``SearchProblem``; ``time_limit`` (seconds, default 60), ``initial`` (a Solution used
as the search hint and as the pruning bound), ``progress`` (called on each improvement).
Out: a ``Solution`` respecting ``usage_limit``; ``optimal=True`` only when CP-SAT proves
optimality (of the integer-scaled model, see Rounding); ``bound``, CP-SAT's objective bound
in cost units less the rounding of every term (when CP-SAT stopped before any solution: the
separable bound, each node's and edge's cheapest entry). ``InfeasibleError`` (``check_fits``)
when nothing fits.

Formulation (after the reduction below), over free nodes i (two or more strategies left):

    x[i,a] in {0,1},  sum_a x[i,a] = 1
    edge (u,v) between free nodes, cost split as M[a,b] = r[a] + c[b] + R[a,b] with R >= 0
    (row minima r, then column minima c, moved into the node costs); P = the compatible
    (not forbidden) pairs:
      - separable (R = 0 on P, nothing forbidden): no edge term at all;
      - functional (every a has exactly one compatible f(a), or the same for every b):
            x[v,b] = sum_{a: f(a)=b} x[u,a],  cost R[a,f(a)] on x[u,a]   (no pair variables)
      - otherwise the marginal (local-polytope) formulation over the compatible pairs:
            y[a,b] in {0,1} for (a,b) in P,  sum_b y[a,b] = x[u,a],  sum_a y[a,b] = x[v,b],
            cost R[a,b] on y[a,b]   (forbidden pairs simply have no variable)
    memory, at every step t that starts a maximal live set (a start with no end before the
    next start: the live set only grows at starts, so these steps dominate all others):
      sum_{i live at t} sum_a (usage[i,a] - min_a usage[i,a]) x[i,a]
          <= limit - sum_{i live at t} min_a usage[i,a]           (skipped when it cannot bind)
    minimise sum_i sum_a cost'[i,a] x[i,a] + the edge terms.

Reduction (before the model): node costs and edge matrices are shifted to minimum zero (a
constant); with a known feasible solution of shifted cost H, any node strategy or edge pair
whose own shifted cost exceeds H is forbidden (every other term is >= 0); arc consistency
drops strategies with no compatible partner on some edge; a strategy is dropped when another
of the same node is no worse in cost, usage and every incident edge row (ties keep the lower
index); nodes left with one strategy fold into their neighbours' node costs (edges to them
become unary terms). Parallel edges merge; self-loops fold into node costs.

Rounding: CP-SAT needs integers. Coefficients are ``round(cost * scale)`` with
``scale = 2**48 / objective_max`` (``objective_max`` = the largest objective the reduced
model can express), so each term is off by at most half a unit and the whole objective by
at most ``terms / (2 * scale)``: about 1e-12 of any solution within the pruning bound on the
IOPDDL problems. The reported cost is always the true float cost (``Solution.of``). When
CP-SAT finds a solution below a thousandth of the bound the model is rebuilt with the new
bound (finer scale, harder pruning) and solved again with the time left.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from autopar.errors import ConfigError, InfeasibleError
from autopar.strategies.problem import SearchProblem, Solution, check_fits
from autopar.strategies.solvers import anytime

DEFAULT_TIME_LIMIT = 60.0
NUM_WORKERS = 2
_SCALE_UNITS = 2.0**48
_REBUILD_RATIO = 1e-3
_HINT_SHARE = 0.2  # share of the time limit the default hint (dp) may take


@dataclass(frozen=True, eq=False)
class Reduced:
    """The reduced problem: per node the allowed strategy mask and shifted unary cost; per
    merged edge (u < v) the shifted matrix with forbidden pairs as +inf; dominator[i][a] is a
    strategy at least as good as a (a itself when a is allowed)."""

    allowed: tuple  # bool array per node
    unary: tuple  # float array per node (shifted node cost + self-loops)
    pairs: tuple  # ((u, v), matrix) with u < v
    dominator: tuple  # int array per node


def _merge_edges(problem: SearchProblem) -> tuple[list, dict]:
    """Node costs with self-loops folded in, and {(u, v) u < v: summed matrix}."""
    unary = [c.astype(np.float64).copy() for c in problem.node_costs]
    merged: dict = {}
    for (u, v), m in zip(problem.edges.tolist(), problem.edge_costs):
        if u == v:
            unary[u] += np.diag(m)
            continue
        key, mat = ((u, v), m) if u < v else ((v, u), m.T)
        merged[key] = merged[key] + mat if key in merged else np.array(mat, np.float64)
    return unary, merged


def reduce_problem(problem: SearchProblem, bound: float) -> Reduced:
    """The reduction of the module docstring; ``bound`` is the true cost of a feasible
    solution (``math.inf`` for none)."""
    unary, merged = _merge_edges(problem)
    offset = sum(float(c.min()) for c in unary) + sum(float(m.min()) for m in merged.values())
    unary = [c - c.min() for c in unary]
    keys = sorted(merged)
    mats = [merged[k] - merged[k].min() for k in keys]
    shifted = bound - offset
    slack = abs(shifted) * 1e-9 + 1e-9 if math.isfinite(shifted) else math.inf
    limit = shifted + slack
    allowed = [c <= limit for c in unary]
    mats = [np.where(m <= limit, m, np.inf) for m in mats]
    usages = problem.node_usages
    dominator = [np.arange(len(c)) for c in unary]
    incident: list = [[] for _ in unary]
    for k, (u, v) in enumerate(keys):
        incident[u].append((k, True))
        incident[v].append((k, False))

    changed = True
    while changed:
        changed = False
        for k, (u, v) in enumerate(keys):  # arc consistency
            ok = np.isfinite(mats[k]) & allowed[u][:, None] & allowed[v][None, :]
            au, av = allowed[u] & ok.any(axis=1), allowed[v] & ok.any(axis=0)
            if (au != allowed[u]).any() or (av != allowed[v]).any():
                allowed[u], allowed[v], changed = au, av, True
        for i in range(len(unary)):  # dominance
            idx = np.flatnonzero(allowed[i])
            if len(idx) < 2:
                continue
            cols = [unary[i][idx, None], usages[i][idx, None].astype(np.float64)]
            for k, first in incident[i]:
                u, v = keys[k]
                m = mats[k] if first else mats[k].T
                other = allowed[v] if first else allowed[u]
                cols.append(m[np.ix_(idx, np.flatnonzero(other))])
            f = np.concatenate(cols, axis=1)  # (k, features)
            le = np.ones((len(idx), len(idx)), bool)  # le[a, b]: f[a] <= f[b]
            for j in range(f.shape[1]):
                le &= f[:, j][:, None] <= f[:, j][None, :]
            strict = ~le.T  # b not <= a somewhere
            lower = np.arange(len(idx))[:, None] < np.arange(len(idx))[None, :]
            dom = le & (strict | lower)  # a dominates b
            np.fill_diagonal(dom, False)
            for b in range(len(idx)):
                winners = np.flatnonzero(dom[:, b] & allowed[i][idx])
                if len(winners) and allowed[i][idx[b]]:
                    a = idx[int(winners[0])]
                    allowed[i] = allowed[i].copy()
                    allowed[i][idx[b]] = False
                    dominator[i][dominator[i] == idx[b]] = a
                    changed = True
    return Reduced(tuple(allowed), tuple(unary), tuple(zip(keys, mats)), tuple(dominator))


def _memory_steps(problem: SearchProblem) -> np.ndarray:
    """Starts of maximal live sets: starts s_k with no interval ending in (s_k, s_{k+1}]."""
    iv = problem.intervals
    live = iv[:, 1] > iv[:, 0]
    starts = np.unique(iv[live, 0])
    if len(starts) == 0:
        return starts
    ends = np.sort(iv[live, 1])
    nxt = np.append(starts[1:], np.iinfo(np.int64).max)
    # an end e with s_k < e <= next start ends a live set that the next start does not cover
    first_after = np.searchsorted(ends, starts, side="right")
    has_end = (first_after < len(ends)) & (ends[np.minimum(first_after, len(ends) - 1)] <= nxt)
    return starts[has_end | (nxt == np.iinfo(np.int64).max)]


@dataclass(frozen=True, eq=False)
class _Model:
    model: cp_model.CpModel
    x: dict  # node -> (allowed strategy indices, list of BoolVar)
    fixed: np.ndarray  # strategy of every node (meaningful where not in x)
    scale: float
    terms: int = 0  # objective terms, each rounded by at most half a unit


def _functional(model, ok, sub, xu, xv, obj_vars, obj_coefs, scale) -> None:
    """An edge on which one end's strategy fixes the other's (every row, or every column,
    has one compatible pair): the determined end is tied to the other by equalities and the
    edge cost moves onto the determining end's literals; no pair variables."""
    if not (ok.sum(axis=1) == 1).all():
        ok, sub, xu, xv = ok.T, sub.T, xv, xu
    f = ok.argmax(axis=1)  # v's strategy for each of u's
    for b in range(ok.shape[1]):
        model.add(sum(xu[a] for a in np.flatnonzero(f == b).tolist()) == xv[b])
    cost = np.rint(sub[np.arange(len(f)), f] * scale).astype(np.int64)
    for a in np.flatnonzero(cost > 0).tolist():
        obj_vars.append(xu[a])
        obj_coefs.append(int(cost[a]))


def _build(problem: SearchProblem, red: Reduced, hint) -> _Model:
    """The CP-SAT model of the module docstring; ``hint`` (allowed strategies) or None:
    ``_objective_terms`` normalizes the costs, then one exactly-one group per free node,
    ``_pair_terms`` per remaining edge, ``_memory_constraints`` per memory step, the hints."""
    allowed = [np.flatnonzero(a) for a in red.allowed]
    free = np.array([len(a) > 1 for a in allowed], bool)
    fixed = np.array([int(a[0]) for a in allowed], np.int64)
    unary, edge_terms = _objective_terms(red, allowed, free)
    objective_max = sum(float(unary[i].max()) for i in np.flatnonzero(free))
    objective_max += sum(float(s.max()) for _, _, s, _ in edge_terms)
    scale = _SCALE_UNITS / objective_max if objective_max > 0 else 1.0

    model = cp_model.CpModel()
    x = {}
    for i in np.flatnonzero(free).tolist():
        lits = [model.new_bool_var(f"x{i}_{a}") for a in allowed[i]]
        model.add_exactly_one(lits)
        x[i] = (allowed[i], lits)
    obj_vars, obj_coefs = [], []
    for i, (_, lits) in x.items():
        obj_vars += lits
        obj_coefs += np.rint(unary[i] * scale).astype(np.int64).tolist()
    hint_y = []
    for term in edge_terms:
        hint_y += _pair_terms(model, term, x, allowed, hint, obj_vars, obj_coefs, scale)
    model.minimize(cp_model.LinearExpr.weighted_sum(obj_vars, obj_coefs))
    if problem.usage_limit is not None:
        _memory_constraints(model, problem, allowed, x)
    if hint is not None:
        for y, value in hint_y:
            model.add_hint(y, value)
        for i, (idx, lits) in x.items():
            for a, lit in zip(idx.tolist(), lits):
                model.add_hint(lit, int(a == hint[i]))
    return _Model(model, x, fixed, scale, len(obj_coefs))


def _objective_terms(red: Reduced, allowed, free):
    """Per node its allowed strategies' costs, and the edges between free nodes as
    ``(u, v, R, compatible)``: an edge to a fixed node folds into the other's costs; each
    matrix's row and column minima move into the nodes' costs (so R >= 0 with zeros), and an
    edge left all zero and compatible everywhere is dropped; each free node's costs are then
    shifted to a minimum of 0."""
    unary = [u[a].copy() for u, a in zip(red.unary, allowed)]
    edge_terms = []
    for (u, v), m in red.pairs:
        sub = m[np.ix_(allowed[u], allowed[v])]
        if not free[u] and not free[v]:
            continue
        if not free[v]:
            unary[u] += sub[:, 0]
            continue
        if not free[u]:
            unary[v] += sub[0, :]
            continue
        ok = np.isfinite(sub)
        r = np.where(ok, sub, np.inf).min(axis=1)
        sub = sub - r[:, None]
        c = np.where(ok, sub, np.inf).min(axis=0)
        sub = np.where(ok, sub - c[None, :], 0.0)
        unary[u] += r
        unary[v] += c
        if ok.all() and not (sub > 0).any():
            continue
        edge_terms.append((u, v, sub, ok))
    for i in np.flatnonzero(free):
        unary[i] = unary[i] - unary[i].min()
    return unary, edge_terms


def _pair_terms(model, term, x, allowed, hint, obj_vars, obj_coefs, scale) -> list:
    """One edge's variables: a functional edge (each row or each column has one compatible
    entry) through ``_functional``; otherwise a boolean per compatible pair, linked to both
    nodes' literals, priced in the objective. The pair booleans' hints (empty without one)."""
    u, v, sub, ok = term
    xu, xv = x[u][1], x[v][1]
    if (ok.sum(axis=1) == 1).all() or (ok.sum(axis=0) == 1).all():
        _functional(model, ok, sub, xu, xv, obj_vars, obj_coefs, scale)
        return []
    ys = {}
    for a, b in zip(*np.nonzero(ok)):
        ys[int(a), int(b)] = y = model.new_bool_var(f"y{u}_{v}_{a}_{b}")
        if sub[a, b] > 0:
            obj_vars.append(y)
            obj_coefs.append(int(np.rint(sub[a, b] * scale)))
    for a in range(ok.shape[0]):
        model.add(sum(ys[a, b] for b in np.flatnonzero(ok[a]).tolist()) == xu[a])
    for b in range(ok.shape[1]):
        model.add(sum(ys[a, b] for a in np.flatnonzero(ok[:, b]).tolist()) == xv[b])
    if hint is None:
        return []
    hu = int(np.searchsorted(allowed[u], hint[u]))
    hv = int(np.searchsorted(allowed[v], hint[v]))
    return [(y, int(a == hu and b == hv)) for (a, b), y in ys.items()]


def _memory_constraints(model, problem, allowed, x):
    """Per memory step that could exceed the limit: the usage above each live node's smallest
    allowed one, summed over the free nodes, within what the limit leaves."""
    iv = problem.intervals
    lo = np.array([int(u[a].min()) for u, a in zip(problem.node_usages, allowed)])
    extra_max = np.array([int(u[a].max()) for u, a in zip(problem.node_usages, allowed)]) - lo
    for t in _memory_steps(problem).tolist():
        live = np.flatnonzero((iv[:, 0] <= t) & (t < iv[:, 1]))
        rhs = problem.usage_limit - int(lo[live].sum())
        if int(extra_max[live].sum()) <= rhs:
            continue
        lits, coefs = [], []
        for i in live.tolist():
            if i in x:
                extra = problem.node_usages[i][allowed[i]] - lo[i]
                keep = extra > 0
                lits += [lit for lit, k in zip(x[i][1], keep) if k]
                coefs += extra[keep].tolist()
        model.add(cp_model.LinearExpr.weighted_sum(lits, coefs) <= rhs)


def _extract(built: _Model, value) -> np.ndarray:
    """The choice of every node from a CP-SAT assignment (``value(literal) -> bool``)."""
    choice = built.fixed.copy()
    for i, (idx, lits) in built.x.items():
        choice[i] = next(int(a) for a, lit in zip(idx, lits) if value(lit))
    return choice


class _Watcher(cp_model.CpSolverSolutionCallback):
    """Reports improvements; stops the search when a solution is far below the bound the
    model was scaled for (the model is then rebuilt finer)."""

    def __init__(self, built: _Model, problem: SearchProblem, bound: float, progress, t0):
        super().__init__()
        self.built, self.problem, self.bound = built, problem, bound
        self.progress, self.t0 = progress, t0
        self.best: tuple[float, np.ndarray] | None = None

    def on_solution_callback(self):
        cost = self.offer(_extract(self.built, self.boolean_value))
        if math.isfinite(self.bound) and cost < self.bound * _REBUILD_RATIO:
            self.stop_search()

    def offer(self, choice: np.ndarray) -> float:
        """Keep ``choice`` when it is the cheapest so far; returns its cost."""
        cost = self.problem.cost(choice)
        if self.best is None or cost < self.best[0]:
            self.best = (cost, choice)
            anytime.offer(cost, choice)
            if self.progress is not None:
                self.progress(f"ilp: cost {cost:.9g} at {time.perf_counter() - self.t0:.1f} s")
        return cost


def solve(
    problem: SearchProblem,
    *,
    time_limit=None,
    initial=None,
    progress=None,
    num_workers: int = NUM_WORKERS,
) -> Solution:
    """CP-SAT on the reduced model; see the module docstring."""
    t0 = time.perf_counter()
    check_fits(problem)
    budget = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    if problem.num_nodes == 0:
        return Solution.of(problem, (), "ilp", 0.0, True)
    best: tuple[float, np.ndarray] | None = None
    if initial is not None:
        if len(initial.choice) != problem.num_nodes:
            raise ConfigError(
                f"ilp: the initial solution has {len(initial.choice)} entries, "
                f"the problem {problem.name!r} has {problem.num_nodes} nodes."
            )
        if problem.feasible(initial.choice):
            best = (problem.cost(initial.choice), np.asarray(initial.choice, np.int64))
    if best is None:
        from autopar.strategies.solvers import bfs_propagation, dp

        hints = [
            bfs_propagation.solve(problem),
            dp.solve(problem, time_limit=_HINT_SHARE * budget, star=True),
        ]
        hint = min(hints, key=lambda s: s.cost)
        best = (hint.cost, np.asarray(hint.choice, np.int64))
    anytime.offer(best[0], best[1])
    if progress is not None:  # reported also when CP-SAT improves on nothing
        progress(f"ilp: from cost {best[0]:.9g} (the hint) at {time.perf_counter() - t0:.1f} s")
    optimal, lower = False, -math.inf
    while True:
        bound, hint_choice = best
        red = reduce_problem(problem, bound)
        mapped = np.array([int(d[h]) for d, h in zip(red.dominator, hint_choice)], np.int64)
        hinted = all(a[s] for a, s in zip(red.allowed, mapped))
        built = _build(problem, red, mapped if hinted else None)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.01, budget - (time.perf_counter() - t0))
        solver.parameters.num_workers = num_workers
        solver.parameters.random_seed = 0
        watcher = _Watcher(built, problem, bound, progress, t0)
        status = solver.solve(built.model, watcher)
        if status == cp_model.MODEL_INVALID:
            raise ConfigError(
                f"ilp: CP-SAT rejected the model of {problem.name!r}: {built.model.validate()}"
            )
        if status == cp_model.INFEASIBLE:
            raise InfeasibleError(
                f"ilp: CP-SAT proved that no choice of {problem.name!r} fits the memory limit "
                f"of {problem.usage_limit} bytes per device."
            )
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            last = _extract(built, solver.boolean_value)
            watcher.offer(last)  # also when no callback ran
            lower = max(lower, _lower_bound(problem, built, solver, last))
        found = watcher.best
        if found is not None and found[0] < best[0]:
            best = found
        rebuild = found is not None and found[0] < bound * _REBUILD_RATIO
        if not rebuild or time.perf_counter() - t0 >= budget:
            optimal = status == cp_model.OPTIMAL and not rebuild
            break
    # without CP-SAT's bound (stopped before its first solution), the separable one: every
    # node's and edge's cheapest entry, memory ignored
    lower = max(
        lower,
        sum(float(c.min()) for c in problem.node_costs)
        + sum(float(m.min()) for m in problem.edge_costs if m.size),
    )
    return Solution.of(problem, best[1], "ilp", time.perf_counter() - t0, optimal, lower)


def _lower_bound(problem: SearchProblem, built: _Model, solver, choice) -> float:
    """A lower bound on every feasible cost from CP-SAT's objective bound: the true cost of
    the model's last solution ``choice`` less the model's gap to its bound, in cost units,
    less the rounding of every term for both (the reduction keeps every solution cheaper than
    the one it was built from, so the bound holds for the whole problem)."""
    gap = max(0.0, solver.objective_value - solver.best_objective_bound) / built.scale
    return problem.cost(choice) - gap - built.terms / built.scale
