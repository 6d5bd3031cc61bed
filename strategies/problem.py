"""SearchProblem: the strategy-search problem every solver takes, in the IOPDDL shape.

In: per node, a cost and a memory usage per candidate strategy and a half-open live interval
``[start, end)``; per edge ``(u, v)``, a cost matrix over (u's strategy, v's strategy); an
optional per-device memory limit. Out: a frozen ``SearchProblem`` with ``cost(choice)``,
``usage_profile(choice)``/``peak(choice)``/``feasible(choice)``, and the public ASPLOS/EuroSys
2025 IOPDDL JSON format both ways (``from_json``/``load`` accept ``.json`` and ``.json.gz``;
``to_json``/``save``). ``Solution`` is a solver's answer: one strategy index per node, its cost
and peak, and the lower bound on any feasible cost the solver proved (``lower_bound``, ``gap``).

Format (``../shared/iopddl/README.md``): ``problem.nodes.intervals[i] = [start, end)``,
``problem.nodes.costs[i][s]``, ``problem.nodes.usages[i][s]``, ``problem.edges.nodes[e] = [u, v]``,
``problem.edges.costs[e][su * len(costs[v]) + sv]``, optional ``problem.usage_limit``: at every
time step the usages of the live nodes' chosen strategies sum to at most the limit.
Total cost = chosen node costs + chosen edge costs.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import math
from dataclasses import dataclass, field

import numpy as np
import orjson

from autopar.errors import ConfigError


def _array(x, dtype) -> np.ndarray:
    """``x`` as an array of ``dtype``: numbers only (no strings, booleans or objects)."""
    a = np.asarray(x)
    if a.dtype.kind not in "iuf" and not (a.size == 0 and a.dtype.kind in "fO"):
        raise ValueError(f"{_short(x)} is not numbers")
    if dtype == np.int64 and a.dtype.kind == "f":
        if not np.isfinite(a).all() or (a != np.round(a)).any():
            raise ValueError(f"{_short(x)} is not integers")
    return a.astype(dtype)


def _integer(x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not float(x).is_integer():
        raise ValueError(f"{x!r} is not an integer")
    return int(x)


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True, eq=False)
class SearchProblem:
    node_costs: tuple  # np.ndarray float64 per node, one entry per strategy
    node_usages: tuple  # np.ndarray int64 per node
    intervals: np.ndarray  # (nodes, 2) int64, [start, end)
    edges: np.ndarray  # (edges, 2) int64, (u, v)
    edge_costs: tuple  # np.ndarray float64 (len(costs[u]), len(costs[v])) per edge
    usage_limit: int | None = None
    name: str = "problem"
    node_names: tuple = field(default=(), repr=False)  # optional labels (autopar operator names)

    def __post_init__(self):
        n, where = len(self.node_costs), f"problem {self.name!r}"
        if len(self.node_usages) != n or self.intervals.shape != (n, 2):
            raise ConfigError(
                f"{where}: {n} nodes but {len(self.node_usages)} usage "
                f"lists and intervals of shape {self.intervals.shape}."
            )
        for i, (c, u) in enumerate(zip(self.node_costs, self.node_usages)):
            if c.ndim != 1 or len(c) == 0 or c.shape != u.shape:
                raise ConfigError(
                    f"{where}: node {i} has costs of shape {c.shape} and usages of "
                    f"shape {u.shape}; every node needs >= 1 strategy, one cost "
                    "and one usage each."
                )
        _check_values(where, "node", "cost", self.node_costs)
        _check_values(where, "node", "usage", self.node_usages)
        if n and (
            (self.intervals < 0).any() or (self.intervals[:, 1] < self.intervals[:, 0]).any()
        ):
            i = int(
                np.flatnonzero(
                    (self.intervals < 0).any(1) | (self.intervals[:, 1] < self.intervals[:, 0])
                )[0]
            )
            raise ConfigError(
                f"{where}: node {i} lives in {self.intervals[i].tolist()}; an "
                "interval is [start, end) with 0 <= start <= end."
            )
        if self.edges.shape != (len(self.edge_costs), 2):
            raise ConfigError(
                f"{where}: edges of shape {self.edges.shape} for "
                f"{len(self.edge_costs)} edge cost matrices; one [u, v] per edge."
            )
        bad = ((self.edges < 0) | (self.edges >= n)).any(1)
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            raise ConfigError(
                f"{where}: edge {e} joins {self.edges[e].tolist()}, not nodes of "
                f"this problem (0 .. {n - 1})."
            )
        if self.num_edges:
            shapes = np.array([m.shape if m.ndim == 2 else (-1, -1) for m in self.edge_costs])
            wrong = (shapes != self.sizes[self.edges]).any(1)
            if wrong.any():
                e = int(np.flatnonzero(wrong)[0])
                (u, v), m = self.edges[e].tolist(), self.edge_costs[e]
                raise ConfigError(
                    f"{where}: edge {e} ({u}, {v}) has a cost matrix of shape {m.shape}, "
                    f"expected {(len(self.node_costs[u]), len(self.node_costs[v]))}."
                )
        _check_values(where, "edge", "cost", self.edge_costs)
        _check_limit(where, self.usage_limit)

    def with_limit(self, limit) -> SearchProblem:
        """This problem within ``limit`` bytes (None: no limit); its arrays, and the flat views
        of them (made first), shared rather than checked again."""
        if limit == self.usage_limit:
            return self
        _check_limit(f"problem {self.name!r}", limit)
        for view in ("offsets", "flat_costs", "flat_usages", "_flat_edges"):
            getattr(self, view)
        new = copy.copy(self)  # the instance dict: the fields and the cached properties
        object.__setattr__(new, "usage_limit", limit)
        return new

    # ------------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_edges(self) -> int:
        return len(self.edge_costs)

    def cost(self, choice) -> float:
        """The summed node and edge costs of ``choice``, correctly rounded (``math.fsum``: the
        same figure whatever the order of the terms)."""
        c = np.asarray(choice, np.int64)
        terms = [self.flat_costs[self.offsets + c]]
        if self.num_edges:
            u, v = self.edges[:, 0], self.edges[:, 1]
            flat, base, cols = self._flat_edges
            terms.append(flat[base + c[u] * cols + c[v]])
        return math.fsum(np.concatenate(terms).tolist())

    @functools.cached_property
    def _flat_edges(self) -> tuple:
        """(every distinct edge matrix raveled one after another, where each edge's starts,
        each edge's column count): a matrix shared by several edges is stored once."""
        start: dict[int, int] = {}
        parts, size = [], 0
        for m in self.edge_costs:
            if id(m) not in start:
                start[id(m)] = size
                parts.append(np.ravel(m))
                size += m.size
        base = np.fromiter((start[id(m)] for m in self.edge_costs), np.int64, self.num_edges)
        cols = np.fromiter((m.shape[1] for m in self.edge_costs), np.int64, self.num_edges)
        flat = np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)
        return flat, base, cols

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Each node's strategy count."""
        return np.fromiter((len(c) for c in self.node_costs), np.int64, self.num_nodes)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Where each node's strategies begin in ``flat_costs`` / ``flat_usages``."""
        return np.cumsum(self.sizes) - self.sizes

    @functools.cached_property
    def flat_costs(self) -> np.ndarray:
        """Every node's cost vector, one after another (node i's at ``offsets[i]``)."""
        return np.concatenate(self.node_costs) if self.num_nodes else np.zeros(0)

    @functools.cached_property
    def flat_usages(self) -> np.ndarray:
        """Every node's usage vector, one after another (node i's at ``offsets[i]``)."""
        if not self.num_nodes:
            return np.zeros(0, np.int64)
        return np.concatenate(self.node_usages).astype(np.int64)

    def usages(self, choice) -> np.ndarray:
        """Each node's bytes in its strategy of ``choice`` (int64)."""
        return self.flat_usages[self.offsets + np.asarray(choice, np.int64)]

    def usage_profile(self, choice) -> np.ndarray:
        """Memory in use at every time step 0 .. max(end) - 1."""
        if self.num_nodes == 0:
            return np.zeros(0, np.int64)
        horizon = int(self.intervals[:, 1].max())
        use = self.usages(choice)
        delta = np.zeros(horizon + 1, np.int64)
        np.add.at(delta, self.intervals[:, 0], use)  # an empty interval adds and takes back
        np.add.at(delta, self.intervals[:, 1], -use)
        return np.cumsum(delta)[:horizon]

    def smallest(self) -> list:
        """Each node's strategy of the fewest bytes (the first on a tie): within less than its
        ``peak``, no choice fits."""
        return [int(np.argmin(u)) for u in self.node_usages]

    def peak(self, choice) -> int:
        prof = self.usage_profile(choice)
        return int(prof.max()) if len(prof) else 0

    def feasible(self, choice) -> bool:
        return self.usage_limit is None or self.peak(choice) <= self.usage_limit

    # ------------------------------------------------------------------ IOPDDL JSON
    @staticmethod
    def from_dict(d: dict) -> SearchProblem:
        """The problem in IOPDDL's JSON shape; ConfigError naming the first part that is
        missing or malformed."""
        p = d.get("problem", d) if isinstance(d, dict) else d
        name = p.get("name", "problem") if isinstance(p, dict) else "problem"
        where = f"problem {name!r}"
        part = "problem"
        try:
            part = "problem.nodes"
            nodes = p["nodes"]
            edges = p.get("edges", {"nodes": [], "costs": []})
            part = "problem.nodes.costs"
            costs = tuple(_array(c, np.float64) for c in nodes["costs"])
            part = "problem.nodes.usages"
            usages = tuple(_array(u, np.int64) for u in nodes["usages"])
            part = "problem.nodes.intervals"
            intervals = _array(nodes["intervals"], np.int64).reshape(len(costs), 2)
            part = "problem.edges.nodes"
            ends = _array(edges["nodes"], np.int64).reshape(-1, 2)
            part = "problem.edges.costs"
            if len(edges["costs"]) != len(ends):
                raise ValueError(f"{len(edges['costs'])} matrices for {len(ends)} edges")
            ecosts = tuple(_array(m, np.float64) for m in edges["costs"])
            ecosts = tuple(
                m.reshape(len(costs[u]), len(costs[v]))
                if 0 <= u < len(costs)
                and 0 <= v < len(costs)
                and m.size == len(costs[u]) * len(costs[v])
                else m
                for (u, v), m in zip(ends.tolist(), ecosts)
            )
            part = "problem.usage_limit"
            limit = p.get("usage_limit")
            limit = None if limit is None else _integer(limit)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            if isinstance(e, KeyError):
                part, what = part.rsplit(".", 1)[0], f"has no {e}"
            else:
                what = f"is malformed ({e})"
            raise ConfigError(
                f"{where}: {part} {what}; see the IOPDDL format in strategies/problem.py."
            ) from None
        return SearchProblem(costs, usages, intervals, ends, ecosts, limit, str(name))

    def to_dict(self) -> dict:
        def num(a):
            return [int(x) if float(x).is_integer() else float(x) for x in np.ravel(a)]

        p: dict[str, object] = {
            "name": self.name,
            "nodes": {
                "intervals": self.intervals.tolist(),
                "costs": [num(c) for c in self.node_costs],
                "usages": [num(u) for u in self.node_usages],
            },
            "edges": {"nodes": self.edges.tolist(), "costs": [num(m) for m in self.edge_costs]},
        }
        if self.usage_limit is not None:
            p["usage_limit"] = int(self.usage_limit)
        return {"problem": p}

    @staticmethod
    def from_json(text) -> SearchProblem:
        """The problem in ``text`` (str or UTF-8 bytes), parsed by orjson (3x the standard
        library's speed on the contest's 300 MB files); text orjson refuses (``NaN`` or
        ``Infinity``, which Python's json writes) goes to the standard library's parser."""
        try:
            d = orjson.loads(text)
        except orjson.JSONDecodeError:
            try:
                d = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                raise ConfigError(f"not an IOPDDL problem: {e}.") from None
        return SearchProblem.from_dict(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def load(path) -> SearchProblem:
        path = str(path)
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                text = f.read()
        except (OSError, EOFError) as e:
            raise ConfigError(
                f"cannot read the problem file {path}: {getattr(e, 'strerror', None) or e}."
            ) from None
        return SearchProblem.from_json(text)

    def save(self, path) -> None:
        path = str(path)
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wt") as f:
            f.write(self.to_json())


@dataclass(frozen=True)
class Solution:
    """One strategy index per node, with its total cost and peak memory."""

    choice: tuple
    cost: float
    peak: int
    solver: str
    seconds: float = 0.0
    optimal: bool = False  # proven optimal by an exact solver
    bound: float | None = None  # the best lower bound on any feasible cost the solver proved
    folded: bool = False  # found with the problem's repeated blocks folded (solvers/fold.py)

    @property
    def lower_bound(self) -> float | None:
        """The proven lower bound (the cost itself when optimal), or None when none is known."""
        return self.cost if self.optimal else self.bound

    @property
    def gap(self) -> float | None:
        """(cost - lower bound) / cost, 0 when optimal; None without a bound."""
        lb = self.lower_bound
        if lb is None:
            return None
        if self.cost == lb:
            return 0.0
        return (self.cost - lb) / abs(self.cost) if self.cost else math.inf

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.choice)) + "]"

    @staticmethod
    def of(
        problem: SearchProblem,
        choice,
        solver: str,
        seconds: float = 0.0,
        optimal: bool = False,
        bound: float | None = None,
    ) -> Solution:
        choice = tuple(int(c) for c in choice)
        cost = problem.cost(choice)
        return Solution(
            choice,
            cost,
            problem.peak(choice),
            solver,
            seconds,
            optimal,
            None if bound is None else min(float(bound), cost),
        )


def _check_values(where, kind, what, arrays) -> None:
    """ConfigError naming the first of ``arrays`` (one per node or edge) holding a value that
    is not finite or is negative."""
    if not arrays:
        return
    first: dict[int, int] = {}  # an array shared by several nodes or edges is checked once
    for i, a in enumerate(arrays):
        first.setdefault(id(a), i)
    firsts = list(first.values())
    flat = np.concatenate([np.ravel(arrays[i]) for i in firsts]).astype(np.float64, copy=False)
    ok = np.isfinite(flat) & (flat >= 0)
    if ok.all():
        return
    k = int(np.argmin(ok))
    sizes = np.cumsum([np.size(arrays[i]) for i in firsts])
    at_first = int(np.searchsorted(sizes, k, side="right"))
    i = firsts[at_first]  # the first node or edge holding it
    j = k - (int(sizes[at_first - 1]) if at_first else 0)
    entry = [int(x) for x in np.unravel_index(j, np.shape(arrays[i]))]
    at = f"strategy {entry[0]}" if kind == "node" else f"strategy pair {entry}"
    raise ConfigError(
        f"{where}: {kind} {i}, {at}: {what} {float(flat[k])!r}; "
        f"{what}s must be finite and >= 0 (mark an impossible strategy or pair "
        "with a large finite cost, e.g. 1e18)."
    )


def _check_limit(where: str, limit) -> None:
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0
    ):
        raise ConfigError(f"{where}: usage_limit {limit!r} is not an integer >= 0.")


def check_fits(problem: SearchProblem) -> None:
    """Raise InfeasibleError when even the smallest strategy of every node breaks the limit:
    the message names the peak time step, the largest nodes live there (by ``node_names`` when
    the problem has them), the bytes the smallest choice needs there, and the limit."""
    if problem.usage_limit is None or problem.num_nodes == 0:
        return
    if problem.peak(problem.smallest()) <= problem.usage_limit:
        return
    from autopar.errors import InfeasibleError

    raise InfeasibleError(
        f"no strategy fits the memory limit of {problem.usage_limit} bytes per device: "
        f"{least_need(problem)}. Raise max_device_memory, use more devices, or shrink the model "
        "or batch there."
    )


def least_need(problem: SearchProblem) -> str:
    """Where the smallest strategy of every node holds the most: "at step t the smallest
    strategies still need B bytes (largest live: ...)", naming the five largest nodes live
    there (by ``node_names`` when the problem has them)."""
    smallest = problem.smallest()
    prof = problem.usage_profile(smallest)
    t = int(np.argmax(prof)) if len(prof) else 0
    live = [i for i, (s, e) in enumerate(problem.intervals) if s <= t < e]
    live.sort(key=lambda i: -int(problem.node_usages[i][smallest[i]]))
    names = problem.node_names or tuple(f"node {i}" for i in range(problem.num_nodes))
    top = ", ".join(f"{names[i]} ({int(problem.node_usages[i][smallest[i]])} B)" for i in live[:5])
    need = int(prof[t]) if len(prof) else 0
    return f"at step {t} the smallest strategies still need {need} bytes (largest live: {top})"
