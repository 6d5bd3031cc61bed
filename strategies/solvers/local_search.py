"""Search for large SearchProblems (the IOPDDL contest instances) under a time limit.

In: a ``SearchProblem``, a time limit in seconds (default 60), optionally an initial Solution and
a ``progress(str)`` callback (about once a second). Out: a feasible ``Solution``
(``InfeasibleError`` when even the smallest strategies break the memory limit, or when no
strategy combination has a finite cost).

Algorithm:
1. ``reduce`` (graph_reduction.py) shrinks the problem exactly: forbidden and dominated
   strategies go, nodes whose choice is a function of a neighbour's merge into it, leaves fold.
2. ``State`` (search_state.py) keeps the choice and the free memory ``slack`` at every kept
   time step; a node's memory is piecewise constant over its own pieces, so "which strategies
   fit" is one ``minimum.reduceat`` over the node's span and one comparison of a (strategies,
   pieces) table.
3. Start: the least-memory strategy per node among those arc consistency leaves it with the
   nodes fixed before it (no forbidden pair), repaired until it fits, then 1-opt descent;
   repairs never move a node into a forbidden pair.
4. Lagrangian phase: memory prices ``lam_t >= 0`` per kept step turn the limit into node costs
   (``usage . sum of lam over each piece``); TRW-S message passing (trws.py) minimises the priced
   cost, its answer is made to use no forbidden pair where it does (its own strategies where
   arc consistency leaves them, as the start is made) and repaired (nodes at overflowing steps
   move to the strategy with the least extra cost per byte of overflow removed) and
   descended; the prices follow a subgradient step
   ``lam += step * (usage - capacity)`` sized by the gap between the best feasible cost and the
   priced cost. Every step proves a lower bound: TRW-S's bound on the priced cost
   (``MessagePassing.lower_bound``, from its backward pass) less the priced capacity. Where
   the process may use two cores and no whole MIP runs, region MIPs (6.) go on beside it on a
   copy of the state (``State.fork``) that follows the best answer.
5. Merge phase (large problems): the LP relaxation of the problem restricted to the strategies
   that the Lagrangian solutions used (``restrict``), solved on a thread while regions go on,
   rounded; the nodes it left fractional and their neighbours are re-solved as a MIP over the
   same strategies, then repair and descent. Its memory rows' duals are Lagrangian prices
   near the whole LP's optimal ones when those strategies are the ones that matter: TRW-S on
   the whole problem priced at them proves a bound near the whole LP's optimum (IOPDDL L:
   within 0.004% of it in 0.4 s, where the whole LP takes 110 s and the subgradient steps of
   4. stop 2.5% below it); an LP cut short gives its last round's prices, still a bound.
6. MIP phase (region_mip.py, HiGHS): regions with every other node fixed, sized so each
   solves in seconds: the long-lived nodes (memory over nine tenths of the steps: the one
   region that trades memory across the whole step), connected regions around the merge's
   fractional nodes, then around random nodes (half of them drawn by their regret at the
   Lagrangian's last prices, ``State.regret``). When
   the whole reduced problem's model is small, a second thread (HiGHS releases the GIL) solves
   it from the start (``lazy_memory.WholeModel``, with memory rows added only where an answer overflows:
   lazy_memory.py) -- its LP relaxation, then the whole MIP over the answers that cost at most
   the best yet or 1% over the LP's optimum, widened while none is found (reduced-cost fixing
   and a cutoff) -- while a short Lagrangian phase and the regions go on: the LP's optimum is a
   proven bound and is rounded as in the merge phase; the MIP's answer is taken when better and
   ends the search when proven optimal.
   An LP not solved within ``whole_lp_share`` of the time frees its core, and the search goes
   on as for a large problem (4., 5., then two regions at once).
   The whole MIP's dual bound (plus the reduction's offset, capped at its ceiling) is the
   Solution's proven ``bound``.
   When no whole MIP runs beside them, two regions (disjoint) are solved at once where the
   process may use two cores: HiGHS solves each on a thread while this one builds the next.
The search stops a margin before the time limit, measured from the start of ``solve``; HiGHS is
asked for less than the time left, since it checks its limit only between steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from autopar.errors import InfeasibleError

from ..problem import SearchProblem, Solution, check_fits
from . import anytime
from .graph_reduction import reduce, restrict
from .lazy_memory import WholeModel
from .region_mip import RegionMip, RegionResult
from .search_state import State
from .trws import MessagePassing


@dataclass(frozen=True)
class LocalSearchOptions:
    seed: int = 0  # random seed (orders, regions)
    default_time: float = 60.0  # seconds when solve() is given no time limit
    margin: float = 0.5  # seconds kept back before the time limit (at most a tenth) ...
    margin_share: float = 0.01  # ... plus this share of it (HiGHS overruns, expansion)
    whole_mip_columns: int = 400_000  # solve the whole reduced problem as one MIP up to this
    whole_lp_share: float = 0.6  # ... when its LP is solved within this share of the time left
    lagrangian_share: float = 0.5  # share of the time for the Lagrangian phase otherwise
    pool_size: int = 40  # Lagrangian solutions whose strategies the merge LP offers
    merge_share: float = 0.5  # most of the time left that the merge LP may take
    round_share: float = 0.25  # ... and the MIP that rounds the whole problem's LP (one MIP)
    lagrangian_sweeps: int = 3  # TRW-S sweeps per price update
    region_columns: int = 10_000  # starting MIP size of a region (grows/shrinks with success)
    region_seconds: float = 8.0  # time limit of one region MIP
    region_threads: int = 0  # regions solved at once when nothing else runs beside the
    # search (0: one per core this process may use, at most 2)
    progress_every: float = 1.0  # seconds between progress messages


class _Search:
    def __init__(
        self,
        st: State,
        opts: LocalSearchOptions,
        deadline: float,
        progress: Callable[[str], None] | None,
        started: float,
    ):
        self.st = st
        self.opts = opts
        self.rng = np.random.default_rng(opts.seed)
        self.region_rng = np.random.default_rng([opts.seed, 1])  # regions' roots and orders
        self.deadline = deadline
        self.progress = progress
        self.started = started
        self.last_report = started
        self.best: np.ndarray | None = None
        self.best_cost = np.inf
        self.optimal = False
        self.bound: float | None = None  # proven lower bound on every feasible cost, if any
        self.mip = RegionMip(st.r)
        self.pool: list[np.ndarray] = []  # solutions met in the Lagrangian phase
        self.start: np.ndarray | None = None
        self.unary: np.ndarray | None = None  # node costs at the Lagrangian phase's last prices
        self._long: np.ndarray | None = None  # long_lived(), once made
        self.budget = float(opts.region_columns)  # a region's MIP size (columns), adapted
        self.over = 0.0  # the most a region overran its limit (building it, HiGHS), per column
        self.solver = ThreadPoolExecutor(2, thread_name_prefix="autopar-region")
        # region being solved -> (nodes, start, limit, budget)
        self.pending: dict[Future[RegionResult], tuple[np.ndarray, float, float, float | None]]
        self.pending = {}
        self.busy = np.zeros(st.n, bool)  # the nodes of those regions

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def report(self, what: str, always: bool = False):
        """``progress`` about once every ``progress_every`` seconds, or now when ``always``."""
        now = time.monotonic()
        if self.progress is not None and (
            always or now - self.last_report >= self.opts.progress_every
        ):
            self.last_report = now
            self.progress(
                f"local_search {now - self.started:6.1f}s {what}: best {self.best_cost:.6g}"
            )

    def remember(self, st: State | None = None) -> bool:
        """Keep the choice of ``st`` (the search's state by default) when it fits and is the
        cheapest yet."""
        st = self.st if st is None else st
        if st.overflow():
            return False
        c = st.total()
        if c < self.best_cost:
            self.best_cost = c
            self.best = best = st.choice.copy()
            anytime.offer(c, lambda: st.r.expand(best))
            return True
        return False

    def prove(self, bound: float):
        """Keep ``bound``, a proven lower bound on every feasible cost, when it is the best."""
        if np.isfinite(bound) and (self.bound is None or bound > self.bound):
            self.bound = bound

    def restore(self):
        self.st.load(self.best)

    # ------------------------------------------------------------------ start, repair
    def initial(self):
        """The least-memory strategy of each node (the cheapest among equals) that keeps clear
        of forbidden pairs (``State.consistent``), then repaired."""
        st = self.st
        rank = np.zeros(len(st.node_flat))
        for x, d in enumerate(st.table):
            use = (d * st.lens[x]).sum(1) if d is not None else np.zeros(len(st.cost[x]))
            rank[st.node_off[x] + np.lexsort((st.cost[x], use))] = np.arange(len(use))
        st.load(st.consistent(rank))
        self.repair(np.inf)

    def repair(self, seconds: float) -> bool:
        """Move nodes live at overflowing steps until everything fits (or time runs out):
        each to the strategy with the least extra cost per byte of overflow it removes
        (``State.repair``, in C++, over the nodes in random order). True when it fits."""
        st = self.st
        if st.overflow():
            seconds = min(seconds, self.deadline - time.monotonic())
            st.repair(self.rng.permutation(st.n), max(seconds, 0.0))
        return not st.overflow()

    # ------------------------------------------------------------------ 1-opt
    def descend(self, nodes=None, st: State | None = None, rng=None):
        """1-opt over ``nodes`` (all by default, in an order drawn from ``rng``) of ``st``
        (the search's state by default): each to its cheapest strategy that fits, revisiting
        neighbours of moved nodes, until no move helps (``State.descend``, in C++)."""
        st = self.st if st is None else st
        order = np.arange(st.n) if nodes is None else np.array(nodes, np.int64)
        (self.rng if rng is None else rng).shuffle(order)
        st.descend(order, max(self.time_left(), 0.0))

    # ------------------------------------------------------------------ Lagrangian phase
    def lagrangian(self, until: float, regions: bool = False):
        """Price updates until ``until``; with ``regions``, region MIPs go on beside them, one
        at a time on a thread of their own, on a copy of the state that follows the best
        answer. The price steps follow the best of the phase's own answers (and the regions
        draw from a generator of their own), so regions change nothing in the phase."""
        st, r = self.st, self.st.r
        passing = MessagePassing(st.n, st.sizes, r.edges, r.edge_costs)
        lam = np.zeros(len(st.slack))
        step, stale = 1.0, 0
        side = st.fork() if regions else None
        side_seeds: list[np.ndarray] = []
        own = self.best_cost  # the best answer of the start or this phase
        while time.monotonic() < until and self.time_left() > 0:
            if side is not None and self.best is not None:
                self.collect(side, 0.0)
                if side.total() > self.best_cost:
                    side.load(self.best)
                    side_seeds = [self.long_lived()] if len(self.long_lived()) else []
                self.launch(side, side_seeds, 1)
            unary = st.price(lam)
            x = passing.sweep(unary, self.opts.lagrangian_sweeps)
            # every feasible choice costs at least the priced minimum less priced capacity
            self.prove(r.offset + passing.lower_bound() - float(lam @ r.capacity))
            st.load(x)
            g = -st.slack.astype(np.float64)  # usage - capacity
            priced = st.total(forbidden=passing.big) + float(lam @ g)
            move = np.where(lam > 0, g, np.maximum(g, 0))
            norm = float(move @ move)
            if norm > 0:
                ref = own if np.isfinite(own) else abs(priced) + 1.0
                size = step * max(ref - priced, 0.02 * ref) / norm
                lam = np.maximum(lam + size * move, 0.0)
            self.pool.append(x)
            if not np.isfinite(st.total()):  # forbidden pairs: the nearest choice without
                score = unary.copy()  # (x's strategy where left, else the cheapest)
                score[st.node_off + x] = -np.inf
                st.load(st.consistent(score))
            better = False
            if self.repair(max(1.0, 0.1 * (until - time.monotonic()))):
                self.descend()
                self.remember()
                better = st.total() < own
                own = min(own, st.total())
                self.pool.append(st.choice.copy())
            stale = 0 if better else stale + 1
            if stale >= 4:
                step, stale = max(step / 2, 1 / 64), 0
            self.unary = unary
            self.report("lagrangian")

    # ------------------------------------------------------------------ merge phase
    def merge(self, seconds: float) -> tuple:
        """LP over the strategies the pooled solutions use, solved on a thread of its own
        within ``seconds`` while regions are solved here (one at a time), then rounded
        (``round``). Returns the nodes it left fractional."""
        st, best, start = self.st, self.best, self.start
        assert best is not None and start is not None  # large(): only with an answer kept
        pool = self.pool[:: max(1, len(self.pool) // self.opts.pool_size)] + self.pool[-4:]
        keep = [np.unique([s[x] for s in pool + [best, start]]) for x in range(st.n)]
        sub = RegionMip(restrict(st.r, keep))
        self.restore()
        base = np.array([np.searchsorted(k, s) for k, s in zip(keep, best)], np.int64)
        lp = WholeModel(sub, base, st.slack, self.mip_seconds(seconds))
        self.regions(stop=lp.relaxed.is_set)
        self.restore()
        if lp.relax is not None and lp.relax.prices is not None and lp.model.pieces:
            lam = np.zeros(len(st.slack))
            np.add.at(lam, lp.model.steps, lp.relax.prices)
            self.priced_bound(lam, time.monotonic() + 0.1 * self.time_left())
        return self.round(
            lp.relax, sub, keep, time.monotonic() + self.opts.round_share * self.time_left()
        )

    def priced_bound(self, lam, until: float):
        """TRW-S sweeps over the whole problem with memory priced at ``lam`` (the restricted
        LP's prices: near the whole LP's when its strategies are the ones that matter) until
        its bound stalls or ``until``; each sweep's bound, less the priced capacity, is proven
        as the Lagrangian phase's are."""
        st, r = self.st, self.st.r
        passing = MessagePassing(st.n, st.sizes, r.edges, r.edge_costs)
        unary = st.price(lam)
        priced = float(lam @ r.capacity)
        history = []
        while time.monotonic() < until and self.time_left() > 0:
            passing.sweep(unary, 5)
            history.append(r.offset + passing.lower_bound() - priced)
            self.prove(history[-1])
            if len(history) > 10 and history[-1] - history[-11] <= 1e-5 * abs(history[-1]):
                break
        if history:
            self.report(
                f"LP's memory prices: bound {history[-1]:.6g} ({5 * len(history)} sweeps)",
                always=True,
            )

    def round(self, res, sub: RegionMip, keep, end: float) -> tuple:
        """An LP answer ``res`` of ``sub`` (whose node ``x`` offers the strategies ``keep[x]``;
        every strategy when ``keep`` is None) rounded: the nodes it left fractional and their
        neighbours re-solved as a MIP over the same strategies until ``end`` (not when that
        is half the problem or more: the whole MIP's work), then repaired and descended.
        Returns the fractional nodes."""
        st = self.st
        if res is None or res.choice is None:
            return ()
        original = (
            (lambda c: c)
            if keep is None
            else (lambda c: np.array([k[s] for k, s in zip(keep, c)], np.int64))
        )
        choice = res.choice.copy()
        unsure = np.array(res.unsure, np.int64)
        if len(unsure):
            st.load(original(choice))
            near = np.unique(np.concatenate([unsure] + [st.nbr_ids[x] for x in unsure]))
            if 2 * len(near) < st.n:
                fix = sub.solve(
                    choice, st.slack, near, self.mip_seconds(end - time.monotonic()), 1e-4
                )
                if fix.choice is not None:
                    choice[fix.nodes] = fix.choice
        st.load(original(choice))
        if self.repair(max(1.0, 0.1 * self.time_left())):
            self.descend()
            self.remember()
        self.report("merged" if keep is not None else "relaxed")
        return tuple(int(x) for x in unsure)

    # ------------------------------------------------------------------ MIP phase
    def grow_region(self, root, budget, busy=None):
        """A BFS ball from ``root`` whose MIP has about ``budget`` columns (none of the nodes
        ``busy`` marks: another region's, being solved)."""
        st, sizes = self.st, self.st.sizes
        inside = np.zeros(st.n, bool) if busy is None else busy.copy()
        inside[root] = True
        order, cols, head = [root], int(sizes[root]), 0
        while head < len(order):
            x = order[head]
            head += 1
            nb = st.nbr_ids[x]
            for w in nb[self.region_rng.permutation(len(nb))]:
                if inside[w]:
                    continue
                add = int(sizes[w]) * (1 + int(sizes[st.nbr_ids[w][inside[st.nbr_ids[w]]]].sum()))
                if cols + add > budget:
                    continue
                inside[w] = True
                order.append(int(w))
                cols += add
        return order

    @staticmethod
    def mip_seconds(left: float) -> float:
        """HiGHS' limit for ``left`` seconds: it overruns its limit by up to a fifth (the
        limit is checked between steps), so ask for less."""
        return 0.8 * left - 0.1

    def region_move(self, res, st: State):
        """Keep a region's answer ``res`` in ``st`` when it fits and is cheaper than the
        nodes' current strategies (``st`` may have moved since the model was built: checked
        as it is)."""
        if res.choice is None:
            return
        before = st.total()
        old = st.choice[res.nodes].copy()
        for x, s in zip(res.nodes, res.choice):
            st.set(int(x), int(s))
        if st.min_slack(res.nodes) >= 0 and st.total() < before:
            self.descend(res.nodes, st, self.region_rng)
            self.remember(st)
            return
        for x, s in zip(res.nodes, old):
            st.set(int(x), int(s))

    def long_lived(self) -> np.ndarray:
        """The nodes whose memory spans nine tenths of the kept steps or more (parameters and
        the like: every step's limit is shared with them), the longest first up to the
        starting region size; as one region, the MIP trades memory across the whole step,
        which no region grown around a node sees."""
        if self._long is None:
            st = self.st
            length = st.span[:, 1] - st.span[:, 0]
            nodes = np.flatnonzero(st.has_memory & (length >= 0.9 * len(st.slack)))
            nodes = nodes[np.argsort(-length[nodes], kind="stable")]
            fit = np.cumsum(st.sizes[nodes]) <= self.opts.region_columns
            self._long = np.sort(nodes[fit]) if len(nodes) > 1 else nodes[:0]
        return self._long

    def root(self, st: State) -> int:
        """A random node to grow a region from: half the time any node, otherwise drawn by
        its regret at the Lagrangian phase's last prices (how much more its strategy costs,
        memory priced, than its cheapest with its neighbours as now)."""
        rng = self.region_rng
        if self.unary is not None and rng.random() < 0.5:
            regret = st.regret(self.unary)
            regret = np.where(np.isfinite(regret), np.maximum(regret, 0.0), 0.0)
            if regret.sum() > 0:
                return int(rng.choice(st.n, p=regret / regret.sum()))
        return int(rng.integers(st.n))

    def launch(self, st: State, seeds: list, at_once: int, stop=lambda: False):
        """Region MIPs of ``st`` handed to HiGHS threads until ``at_once`` are being solved
        (disjoint), ``stop()`` or too little time is left: first ``seeds`` (popped: a node to
        grow a region from, or a region's nodes as an array), then regions grown from random
        nodes (``root``)."""
        while len(self.pending) < at_once and not stop():
            left = self.time_left()
            if self.over > 0 and self.over * self.budget > 0.5 * left > 0:
                self.budget = max(0.5 * left / self.over, 500.0)  # overran: smaller, not none
            limit = min(self.mip_seconds(left - self.over * self.budget), self.opts.region_seconds)
            if limit < 0.05:
                return
            seed = seeds.pop() if seeds else self.root(st)
            if self.busy[seed].any():
                continue
            nodes = (
                seed
                if isinstance(seed, np.ndarray)
                else self.grow_region(seed, self.budget, self.busy if self.pending else None)
            )
            t0 = time.monotonic()
            model = self.mip.build(st.choice, st.slack, nodes)
            job = self.solver.submit(
                RegionMip.solve_model, model, limit - (time.monotonic() - t0), 1e-6
            )
            self.pending[job] = (
                nodes,
                t0,
                limit,
                None if isinstance(seed, np.ndarray) else self.budget,
            )
            self.busy[nodes] = True

    def collect(self, st: State, timeout: float | None = None):
        """The answers of the regions solved within ``timeout`` seconds (None: until one is,
        or the search's time is up), kept in ``st`` where they still help (``region_move``);
        the region size grows after quick optimal answers and shrinks after unfinished ones."""
        if timeout is None:
            timeout = max(self.time_left(), 0.0)
        done, _ = wait(self.pending, timeout=timeout, return_when=FIRST_COMPLETED)
        for job in done:
            nodes, t0, limit, asked = self.pending.pop(job)
            self.busy[nodes] = False
            res = job.result()
            self.region_move(res, st)
            took = time.monotonic() - t0
            if asked is None:  # a given region: nothing to learn about the size
                continue
            self.over = max(self.over, (took - limit) / asked)
            if res.optimal and took < 0.3 * limit:
                self.budget *= 1.2
            elif not res.optimal:
                self.budget *= 0.7
            self.report(f"regions of ~{int(self.budget)} columns")

    def regions(self, seeds=(), stop=lambda: False, threads=1):
        """Region MIPs of the search's state around ``seeds`` first, then around random
        nodes, until time runs out or ``stop()``; with ``threads`` > 1, that many regions
        (disjoint) are solved at once, HiGHS on threads of its own while this one builds the
        next model and keeps answers."""
        seeds = list(seeds)
        self.region_rng.shuffle(seeds)
        if len(self.long_lived()):
            seeds.append(self.long_lived())
        while True:
            self.launch(self.st, seeds, threads, stop)
            if not self.pending or self.time_left() <= 0:  # HiGHS late: not waited for
                return
            self.collect(self.st)

    # ------------------------------------------------------------------ driver
    def run(self, seed: np.ndarray | None = None):
        """The phases of the module docstring; ``seed``, a reduced choice, competes with the
        least-memory start."""
        st = self.st
        if st.n == 0:
            self.best, self.best_cost = st.choice.copy(), st.total()
            return
        self.initial()
        self.descend()
        self.remember()
        self.start = st.choice.copy()
        if seed is not None:
            st.load(seed)
            if not st.overflow():
                self.descend()
                self.remember()
        self.report("start")
        threads = self.opts.region_threads or min(2, len(os.sched_getaffinity(0)))
        everything = int(st.sizes.sum()) + self.mip.pair_count(np.arange(st.n))
        if everything > self.opts.whole_mip_columns:
            return self.large(threads)
        left = self.time_left()
        whole = WholeModel(
            self.mip,
            st.choice,
            st.slack,
            self.mip_seconds(left),
            0.0 if everything < 20_000 else 1e-6,
            self.mip_seconds(self.opts.whole_lp_share * left),
            lambda: self.best_cost - st.r.offset,
        )
        if st.has_memory.any():
            self.lagrangian(time.monotonic() + min(0.15 * left, 10.0))
        if self.best is not None:
            self.restore()
        self.regions(stop=whole.relaxed.is_set)
        lp = whole.relax
        if lp is None or lp.choice is None:  # not solved in its share of the time
            return self.large(threads)
        self.prove(st.r.offset + lp.bound)
        self.report(f"whole LP, bound {self.bound:.6g}", always=True)
        unsure = self.round(
            lp, self.mip, None, time.monotonic() + self.opts.round_share * self.time_left()
        )
        if self.best is not None:
            self.restore()
        self.regions(unsure, stop=whole.done)
        res = whole.mip if whole.done() else None
        if res is not None:
            if res.bound is not None:  # the whole problem's: proven
                self.prove(st.r.offset + res.bound)
            if res.choice is not None:
                st.load(res.choice)
                if self.repair(max(1.0, 0.1 * self.time_left())):
                    self.descend()
                    self.remember()
                if self.best is not None:
                    self.restore()
            self.report(
                f"whole MIP over {len(lp.reduced) - whole.fixed} of "
                f"{len(lp.reduced)} columns ({whole.rounds} rounds)",
                always=True,
            )
            # done when the answer kept is proven: one HiGHS finds within its tolerances may
            # overflow by a few bytes and be repaired into a dearer one; or none cheaper than
            # the search's own is left (HiGHS' cutoff at it)
            if self.bound is not None and self.best_cost - self.bound <= 2e-6 * abs(self.best_cost):
                self.optimal = everything < 20_000
                return
        self.regions(unsure, threads=threads)

    def large(self, threads: int):
        """The search without the whole MIP: the Lagrangian phase (regions beside it on the
        second core), the merge phase, then regions (``threads`` at once)."""
        self.lagrangian(
            time.monotonic() + self.opts.lagrangian_share * self.time_left(), regions=threads > 1
        )
        unsure = ()
        if self.best is not None:
            self.restore()
            unsure = self.merge(self.opts.merge_share * self.time_left())
            self.restore()
        self.regions(unsure, threads=threads)


def solve(
    problem: SearchProblem,
    *,
    time_limit=None,
    initial=None,
    progress=None,
    options: LocalSearchOptions = LocalSearchOptions(),
) -> Solution:
    """The best feasible answer found within ``time_limit`` seconds (see the module
    docstring); ``initial`` seeds the search and is returned if nothing better is found."""
    started = time.monotonic()
    check_fits(problem)
    limit = options.default_time if time_limit is None else float(time_limit)
    red = reduce(problem)
    st = State(red)
    expand_time = 0.02 + 3e-6 * problem.num_nodes
    margin = min(options.margin, 0.1 * limit) + options.margin_share * limit + expand_time
    deadline = started + limit - margin
    search = _Search(st, options, deadline, progress, started)
    if progress is not None:
        progress(
            f"local_search {time.monotonic() - started:6.1f}s reduced {problem.num_nodes} "
            f"nodes to {red.num_nodes} ({int(st.sizes.sum())} strategies, "
            f"{red.num_edges} edges)"
        )
    try:
        search.run(None if initial is None else red.encode(initial.choice))
    finally:
        search.solver.shutdown(wait=False, cancel_futures=True)
    if search.best is None and (initial is None or not problem.feasible(initial.choice)):
        raise InfeasibleError(
            f"problem {problem.name!r}: no choice of finite cost within the memory limit of "
            f"{problem.usage_limit} was found in {limit:g} s."
        )
    seconds = time.monotonic() - started
    if (
        initial is not None
        and problem.feasible(initial.choice)
        and (search.best is None or problem.cost(initial.choice) < search.best_cost)
    ):
        return Solution.of(problem, initial.choice, "local_search", seconds)
    return Solution.of(
        problem,
        red.expand(search.best),
        "local_search",
        seconds,
        optimal=search.optimal,
        bound=search.bound,
    )
