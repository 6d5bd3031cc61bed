"""Redistribution planner: the cheapest sequence of collectives from one layout to another.

In: a ``LogicalMesh`` (for ``Planner``), then per query a source and a destination ``Layout``,
the global tensor shape and its dtype. Out: a frozen ``Plan`` holding the ordered ``Step``s
that turn per-device blocks of ``src`` into per-device blocks of ``dst``, and their estimated
time in seconds. Pure planning: nothing here touches devices.

Transitions (a step moves one mesh axis ``a``, or a group of axes acting as one combined axis,
first axis major: several partial axes reduced or reduce-scattered together, an innermost run
of a dimension's axes gathered or moved together; "innermost" = last axes of a dimension):

| from -> to           | step                                | effect on the layout              |
|----------------------|-------------------------------------|-----------------------------------|
| replicate -> shard   | ``slice(a, dim=d)`` (local)         | unused ``a`` becomes innermost of d |
| shard -> replicate   | ``all_gather(a, dim=d)``            | innermost ``a`` of d removed      |
| partial -> replicate | ``all_reduce(a)``                   | ``a`` leaves the partial set      |
| partial -> shard     | ``reduce_scatter(a, dim=d)``        | ``a``: partial -> innermost of d  |
| shard(i) -> shard(j) | ``all_to_all(a, dim=i, dst_dim=j)`` | innermost of i -> innermost of j  |

Slices are local and free; every other step costs ``collective_time(kind, local input bytes,
axis size, level.alpha, level.beta)`` from ``strategies.comm_cost`` on the axis's topology level
(a group of axes on the slowest of theirs, plus, when it spans hosts and the inside of a host,
the intra-host size and level as ``inner``, for the 2D all-reduces; a group inside one host is
``shared``, for the direct all-reduce), plus, for a gather, scatter or all-to-all whose pieces
are strided in the local block, the copy that moves them into place (``relayout_seconds``).
The planner runs Dijkstra over layout states (only states whose splits divide the shape), so
paths through intermediate layouts (``[x,y] -> [y,x]``) come out exact. Path costs are compared
in whole picoseconds; ties go to fewer steps, then to the step sequence in a fixed order (kind
order as in ``KINDS``, then mesh axis order, then dims); ``Plan.cost`` is the float sum. A
partial axis can only be reduced, never created: an axis partial in ``dst`` must be partial in
``src`` too (and then stays partial), otherwise ``RedistributionError``, as for a layout that
names unknown axes or does not divide the shape. Results are memoised per ``Planner`` instance
(one resumable Dijkstra per source answers every destination).

API: ``Planner(mesh).plan(src, dst, shape, dtype) -> Plan``, ``.cost(...) -> seconds`` and
``.step_costs(plan)`` (per step: local shapes, bytes, seconds, algorithm, for lowering).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from autopar.errors import RedistributionError
from autopar.layout import Layout
from autopar.mesh import LogicalMesh
from autopar.program import StepKind
from autopar.strategies.comm_cost import ALL_REDUCE, all_reduce_times, collective_time

KINDS = (
    StepKind.SLICE,
    StepKind.ALL_GATHER,
    StepKind.ALL_REDUCE,
    StepKind.REDUCE_SCATTER,
    StepKind.ALL_TO_ALL,
)  # the planner's steps, in tie order
_KIND_RANK = {k: i for i, k in enumerate(KINDS)}


@dataclass(frozen=True)
class Step:
    """One redistribution step over mesh ``axes`` (the planner emits one axis per step).
    ``dim``: the sliced, gathered or scattered dim (all_to_all: the dim the axis leaves);
    ``dst_dim``: all_to_all only, the dim the axis moves to."""

    kind: str
    axes: tuple[str, ...]
    dim: int | None = None
    dst_dim: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))
        if type(self.kind) is not StepKind:
            object.__setattr__(self, "kind", StepKind.of(self.kind, "Step"))

    def __str__(self) -> str:
        ax = ",".join(self.axes)
        if self.kind == StepKind.ALL_TO_ALL:
            return f"all_to_all({ax}, {self.dim}->{self.dst_dim})"
        if self.dim is None:
            return f"{self.kind}({ax})"
        return f"{self.kind}({ax}, dim={self.dim})"


@dataclass(frozen=True)
class StepCost:
    """A step of a plan with its local (per-device) shapes, input bytes, time and algorithm."""

    step: Step
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_bytes: int
    out_bytes: int
    seconds: float
    algorithm: str

    def __str__(self) -> str:
        return (
            f"{self.step} {self.in_shape}->{self.out_shape} {self.seconds:.3g}s [{self.algorithm}]"
        )


@dataclass(frozen=True)
class Plan:
    """The steps from ``src`` to ``dst`` for a tensor of global ``shape`` and ``dtype`` (a numpy
    dtype), and their total estimated seconds; ``steps == ()`` and ``cost == 0`` if equal."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    dtype: np.dtype
    steps: tuple[Step, ...]
    cost: float

    def __str__(self) -> str:
        body = "; ".join(map(str, self.steps)) if self.steps else "nothing"
        return f"{self.src} -> {self.dst}: {body} ({self.cost:.3g}s)"


class Planner:
    """Cheapest redistribution plans on one mesh, memoised on the instance."""

    def __init__(self, mesh: LogicalMesh):
        self.mesh = mesh
        self._size = dict(zip(mesh.axis_names, mesh.shape))
        self._order = {a: i for i, a in enumerate(mesh.axis_names)}
        self._lvl = {a: mesh.level(a) for a in mesh.axis_names}
        # axes inside one host (the topology's innermost level), and each axis's factor inside
        # a host (an axis spanning hosts has its minor factor there): the 2D algorithms' part
        self._intra = {a for a in mesh.axis_names if mesh.level(a) == mesh.topology.levels[-1]}
        self._inside = {a: mesh.inner_size(a) for a in mesh.axis_names}
        inner_level = mesh.topology.levels[-1]
        self._inner_lvl = (inner_level.alpha, inner_level.beta_for("all_reduce"))
        self._gamma = 1 / mesh.topology.mem_bandwidth  # a reduction streams at memory speed
        self._memo: dict = {}  # (src, dst, shape, dtype) -> Plan
        self.steps_memo: dict = {}  # lower.plan_steps' answers, by the same key
        self._searches: dict = {}  # (src state, kept partial, shape, itemsize) -> _Search
        self._edges: dict = {}  # (shape, itemsize) -> {state: moves}

    # ------------------------------------------------------------------ public
    def plan(self, src: Layout, dst: Layout, shape, dtype) -> Plan:
        shape = tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        key = (src, dst, shape, dt)
        hit = self._memo.get(key)
        if hit is None:
            self._validate(src, dst, shape)
            steps, cost = self._search(src, dst, shape, dt.itemsize)
            hit = self._memo[key] = Plan(src, dst, shape, dt, steps, cost)
        return hit

    def cost(self, src: Layout, dst: Layout, shape, dtype) -> float:
        return self.plan(src, dst, shape, dtype).cost

    def step_costs(self, plan: Plan) -> tuple[StepCost, ...]:
        """Per step of ``plan``: local input/output shapes, bytes, time and algorithm."""
        dims = plan.src.dims
        partial = tuple(sorted(plan.src.partial, key=self._order.__getitem__))
        out = []
        item = np.dtype(plan.dtype).itemsize
        for st in plan.steps:
            in_shape = self._local(plan.shape, dims)
            dims, partial = _apply(dims, partial, st)
            out_shape = self._local(plan.shape, dims)
            b_in, b_out = item * math.prod(in_shape), item * math.prod(out_shape)
            sec, alg = self.step_time(st.kind, st.axes, b_in)
            sec += self.relayout_seconds(st.kind, in_shape, st.dim, st.dst_dim, max(b_in, b_out))
            out.append(StepCost(st, in_shape, out_shape, b_in, b_out, sec, alg))
        return tuple(out)

    # ------------------------------------------------------------------ internals
    def _local(self, shape, dims) -> tuple[int, ...]:
        return tuple(s // math.prod(self._size[a] for a in d) for s, d in zip(shape, dims))

    def step_time(self, kind: str, axes, nbytes: int):
        """Seconds and algorithm of one step over ``axes`` (one name or a tuple of names, taken
        as one group, first axis major, priced on the slowest of their levels). A group with
        ranks both inside a host (the innermost topology level) and across hosts (axes of
        both, or one axis spanning hosts, as data parallelism over every device) is also
        priced as two levels: the 2D all-reduces, with the group's ranks in one host and the
        innermost level's constants inside."""
        if kind == StepKind.SLICE:
            return 0.0, "local"
        n, alpha, beta, inner, launch = self._group(axes, kind)
        seconds, algo = collective_time(
            kind, nbytes, n, alpha, beta, inner, self._gamma, self._shared(axes), self._reducers(n)
        )
        return seconds + launch, algo

    def relayout_seconds(self, kind, shape, dim, dst_dim, nbytes: int) -> float:
        """Seconds of the local copies a collective of ``kind`` over a local block of ``shape``
        makes where its pieces are strided (some dimension before the one gathered, scattered
        or split has more than one element): both backends then gather into, or scatter out
        of, a block stacked along a new first dimension and copy it into place
        (``runtime.native_step``, ``runtime.jax_collectives``), a read and a write of
        ``nbytes`` (the larger of its local input and output) at memory speed per copy; an
        all-to-all may copy on both sides (``dst_dim``: the dimension it splits)."""
        before = lambda d: math.prod(shape[:d]) > 1
        if kind in (StepKind.ALL_GATHER, StepKind.REDUCE_SCATTER):
            copies = int(before(dim))
        elif kind == StepKind.ALL_TO_ALL:
            copies = int(before(dst_dim)) + int(before(dim))
        else:
            return 0.0
        return copies * 2 * nbytes * self._gamma

    def all_reduce_prices(self, axes) -> tuple:
        """``((algorithm, seconds at 0 bytes, seconds per byte), ...)`` of every all-reduce over
        ``axes``, in ``ALL_REDUCE`` order (the tie order): each price is affine in the bytes, so
        a runtime picks the algorithm for any size (a fused bucket) without the planner."""
        n, alpha, beta, inner, _ = self._group(axes)
        if n <= 1:
            return ()
        at = lambda nbytes: all_reduce_times(
            nbytes, n, alpha, beta, inner, self._gamma, self._shared(axes), self._reducers(n)
        )
        t0, t1 = at(0), at(1)
        return tuple((a, t0[a], t1[a] - t0[a]) for a in ALL_REDUCE if a in t0)

    def _reducers(self, n: int) -> int:
        """The topology's Reduction Server processes, for a group of ``n`` ranks: they serve
        groups of every device of the mesh only (one group of workers per reducer)."""
        return self.mesh.topology.reducers if n == self.mesh.size else 0

    def _shared(self, axes) -> bool:
        """Whether the group over ``axes`` lies inside one host (its ranks share memory)."""
        return all(a in self._intra for a in ((axes,) if isinstance(axes, str) else axes))

    def _group(self, axes, kind=StepKind.ALL_REDUCE):
        """(ranks, alpha, beta, inner, launch) of the group over ``axes`` (see ``step_time``),
        ``beta`` that of a collective ``kind``."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        n = math.prod(self._size[a] for a in axes)
        L = math.prod(self._inside[a] for a in axes)  # the group's ranks in one host
        inner = (L, *self._inner_lvl) if 1 < L < n else None
        levels = [self._lvl[a] for a in axes]
        return (
            n,
            max(lv.alpha for lv in levels),
            max(lv.beta_for(kind) for lv in levels),
            inner,
            max(lv.launch for lv in levels),
        )

    def _fail(self, src, dst, shape, why: str):
        raise RedistributionError(
            f"cannot redistribute a tensor of shape {shape} on {self.mesh} "
            f"from {src} to {dst}: {why}"
        )

    def _validate(self, src: Layout, dst: Layout, shape) -> None:
        for name, lay in (("source", src), ("destination", dst)):
            if lay.rank != len(shape):
                self._fail(
                    src,
                    dst,
                    shape,
                    f"the {name} layout has {lay.rank} dimensions but the "
                    f"shape has {len(shape)}; give one entry per tensor dimension.",
                )
            unknown = sorted((lay.axes | lay.partial) - set(self._size))
            if unknown:
                self._fail(
                    src,
                    dst,
                    shape,
                    f"the {name} layout names axes {unknown} that are not "
                    f"on the mesh (axes {self.mesh.axis_names}); use mesh axis names.",
                )
            for i, d in enumerate(lay.dims):
                c = math.prod(self._size[a] for a in d)
                if shape[i] % c:
                    self._fail(
                        src,
                        dst,
                        shape,
                        f"the {name} layout splits dimension {i} of size "
                        f"{shape[i]} {c} ways, which does not divide it; choose axes whose "
                        "sizes multiply to a divisor of the dimension.",
                    )
        extra = sorted(dst.partial - src.partial)
        if extra:
            self._fail(
                src,
                dst,
                shape,
                f"the destination is a partial sum over {extra} but the "
                "source is not; a partial sum cannot be created by communication, so "
                "make the destination not partial over those axes.",
            )

    def _search(self, src: Layout, dst: Layout, shape, itemsize: int):
        """Dijkstra from ``src`` with priority ``(picoseconds, #steps, step sort keys)``. The
        search is kept on the instance per (src, dst.partial, shape, itemsize) and resumed by
        later queries: settled states are final, so one search answers every destination."""
        order = self._order
        start = (src.dims, tuple(sorted(src.partial, key=order.__getitem__)))
        goal = (dst.dims, tuple(sorted(dst.partial, key=order.__getitem__)))
        if start == goal:
            return (), 0.0
        skey = (start, dst.partial, shape, itemsize)
        search = self._searches.get(skey)
        if search is None:
            search = self._searches[skey] = _Search(start)
        edges = self._edges.get((shape, itemsize))
        if edges is None:
            edges = self._edges[(shape, itemsize)] = {}
        keep = dst.partial
        heap, best, parent, done = search.heap, search.best, search.parent, search.done
        while goal not in done and heap:
            ps, n, pkey, state = heapq.heappop(heap)
            if state in done:
                continue
            done.add(state)
            out = edges.get(state)
            if out is None:
                out = edges[state] = self._moves(state, shape, itemsize)
            for nxt, sec, eps, k, st, reduced in out:
                if nxt in done or any(r in keep for r in reduced):
                    continue
                cand = (ps + eps, n + 1, pkey + (k,))
                old = best.get(nxt)
                if old is None or cand < old:
                    best[nxt] = cand
                    parent[nxt] = (state, st, sec)
                    heapq.heappush(heap, (*cand, nxt))
        if goal not in done:
            self._fail(
                src,
                dst,
                shape,
                "no sequence of collectives reaches the destination "
                "(internal planner error; please report it).",
            )
        path = []
        state = goal
        while state != start:
            state, st, sec = parent[state]
            path.append((st, sec))
        path.reverse()
        return tuple(st for st, _ in path), sum(sec for _, sec in path)

    def _moves(self, state, shape, itemsize) -> tuple[_Move, ...]:
        """Every legal step from ``state = (dims, partial)`` -> ``_Move``s (next state, seconds,
        integer picoseconds, sort key, Step, reduced partial axes); only states whose splits
        divide the shape are produced. One-axis steps come first, then grouped ones."""
        dims, partial = state
        splits = tuple(math.prod(self._size[a] for a in d) for d in dims)
        nbytes = itemsize * math.prod(s // c for s, c in zip(shape, splits))
        at = _At(dims, partial, shape, splits, nbytes)
        used = {a for d in dims for a in d}
        out: list[_Move] = []
        for a in self.mesh.axis_names:  # one axis: reduce it if partial, slice it if unused
            if a in partial:
                out += self._reduce_moves(at, (a,))
            elif a not in used:
                out += self._slice_moves(at, a)
        for i, d in enumerate(dims):  # one axis: a dimension's innermost one leaves it
            if d:
                out += self._gather_moves(at, i, 1)
        # grouped steps: several axes act as one combined axis (first axis major)
        for k in range(2, len(partial) + 1):  # all_reduce / reduce_scatter over partial axes
            for group in itertools.combinations(partial, k):
                out += self._reduce_moves(at, group)
        for i, d in enumerate(dims):  # all_gather / all_to_all of an innermost run
            for k in range(2, len(d) + 1):
                out += self._gather_moves(at, i, k)
        return tuple(out)

    def _slice_moves(self, at: _At, a: str) -> list[_Move]:
        """From ``at``, unused axis ``a`` -> one free slice per dimension it divides."""
        n, ai = self._size[a], self._order[a]
        return [
            _Move.of(
                (_put(at.dims, d, (a,)), at.partial),
                0.0,
                (0, ai, d, -1),
                Step(StepKind.SLICE, (a,), d),
            )
            for d in range(len(at.dims))
            if at.fits(d, n)
        ]

    def _reduce_moves(self, at: _At, group: tuple[str, ...]) -> list[_Move]:
        """From ``at``, partial axes ``group`` (one or several) -> their all_reduce, then a
        reduce_scatter onto each dimension the group divides."""
        rest = tuple(p for p in at.partial if p not in group)
        n = math.prod(self._size[g] for g in group)
        head = self._order[group[0]]
        k = len(group) if len(group) > 1 else -1  # the group size in the sort key, -1 for one
        sec = self.step_time(StepKind.ALL_REDUCE, group, at.nbytes)[0]
        out = [
            _Move.of(
                (at.dims, rest), sec, (2, head, k, -1), Step(StepKind.ALL_REDUCE, group), group
            )
        ]
        sec = self.step_time(StepKind.REDUCE_SCATTER, group, at.nbytes)[0]
        local = at.local()
        out += [
            _Move.of(
                (_put(at.dims, d, group), rest),
                sec + self.relayout_seconds(StepKind.REDUCE_SCATTER, local, d, None, at.nbytes),
                (3, head, d, k),
                Step(StepKind.REDUCE_SCATTER, group, d),
                group,
            )
            for d in range(len(at.dims))
            if at.fits(d, n)
        ]
        return out

    def _gather_moves(self, at: _At, i: int, k: int) -> list[_Move]:
        """From ``at``, the innermost ``k`` axes of dimension ``i`` -> their all_gather, then an
        all_to_all onto each other dimension they divide."""
        group = at.dims[i][-k:]
        n = math.prod(self._size[g] for g in group)
        head = self._order[group[0]]
        gone = at.dims[:i] + (at.dims[i][:-k],) + at.dims[i + 1 :]
        local = at.local()
        sec = self.step_time(StepKind.ALL_GATHER, group, at.nbytes)[0] + self.relayout_seconds(
            StepKind.ALL_GATHER, local, i, None, n * at.nbytes
        )
        out = [
            _Move.of(
                (gone, at.partial),
                sec,
                (1, head, i, k if k > 1 else -1),
                Step(StepKind.ALL_GATHER, group, i),
            )
        ]
        sec = self.step_time(StepKind.ALL_TO_ALL, group, at.nbytes)[0]
        out += [
            _Move.of(
                (_put(gone, j, group), at.partial),
                sec + self.relayout_seconds(StepKind.ALL_TO_ALL, local, i, j, at.nbytes),
                (4, head, i, j * 8 + k if k > 1 else j),
                Step(StepKind.ALL_TO_ALL, group, i, j),
            )
            for j in range(len(at.dims))
            if j != i and at.fits(j, n)
        ]
        return out


@dataclass(frozen=True)
class _At:
    """The state a move starts from: its ``dims`` and ``partial`` axes, the global ``shape``,
    the ways each dimension is split and the local bytes (every step's input)."""

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...]
    shape: tuple[int, ...]
    splits: tuple[int, ...]
    nbytes: int

    def local(self) -> tuple[int, ...]:
        """The local block's shape."""
        return tuple(s // k for s, k in zip(self.shape, self.splits))

    def fits(self, d: int, n: int) -> bool:
        """Whether dimension ``d`` split ``n`` more ways still divides the shape."""
        return self.shape[d] % (self.splits[d] * n) == 0


class _Move(NamedTuple):
    """One edge of the search: the next ``(dims, partial)`` state, the step's seconds and whole
    picoseconds, its tie-order sort key, the ``Step`` and the partial axes it reduces."""

    state: tuple
    seconds: float
    ps: int
    key: tuple
    step: Step
    reduced: tuple[str, ...]

    @staticmethod
    def of(state, seconds: float, key: tuple, step: Step, reduced=()) -> _Move:
        """A move from its parts -> the ``_Move``, its picoseconds computed by ``_ps``."""
        return _Move(state, seconds, _ps(seconds), key, step, tuple(reduced))


def _put(dims, d: int, axes: tuple[str, ...]):
    """``dims`` with ``axes`` appended (innermost) to dimension ``d``."""
    return dims[:d] + (dims[d] + axes,) + dims[d + 1 :]


def _ps(seconds: float) -> int:
    """Whole picoseconds: path costs are compared as exact integer sums, so float noise never
    decides a tie (the propagation search compares costs to the picosecond too)."""
    return round(seconds * 1e12)


class _Search:
    """A resumable single-source Dijkstra: heap of ``(picoseconds, #steps, keys, state)``, the
    best key and parent ``(state, Step, seconds)`` per reached state, and the settled set."""

    __slots__ = ("heap", "best", "parent", "done")

    def __init__(self, start: tuple) -> None:
        self.heap: list[tuple[int, int, tuple, tuple]] = [(0, 0, (), start)]
        self.best: dict[tuple, tuple[int, int, tuple]] = {start: (0, 0, ())}
        self.parent: dict = {}
        self.done: set = set()


def after(layout: Layout, st: Step) -> Layout:
    """The layout after one planner step."""
    dims, partial = _apply(layout.dims, tuple(layout.partial), st)
    return Layout(dims, frozenset(partial))


def _apply(dims, partial, st: Step):
    """The layout state after ``st`` (no validation; used to annotate planned steps)."""
    dims = list(dims)
    axes = tuple(st.axes)
    if st.kind in (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER):
        partial = tuple(p for p in partial if p not in axes)
    if st.kind in (StepKind.ALL_GATHER, StepKind.ALL_TO_ALL):
        dims[st.dim] = dims[st.dim][: len(dims[st.dim]) - len(axes)]
    if st.kind in (StepKind.SLICE, StepKind.REDUCE_SCATTER):
        dims[st.dim] = dims[st.dim] + axes
    if st.kind == StepKind.ALL_TO_ALL:
        dims[st.dst_dim] = dims[st.dst_dim] + axes
    return tuple(dims), partial
