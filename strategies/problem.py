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

import gzip
import math
import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from autopar.errors import ConfigError


@dataclass(frozen=True, eq=False)
class SearchProblem:
    node_costs: tuple              # np.ndarray float64 per node, one entry per strategy
    node_usages: tuple             # np.ndarray int64 per node
    intervals: np.ndarray          # (nodes, 2) int64, [start, end)
    edges: np.ndarray              # (edges, 2) int64, (u, v)
    edge_costs: tuple              # np.ndarray float64 (len(costs[u]), len(costs[v])) per edge
    usage_limit: Optional[int] = None
    name: str = "problem"
    node_names: tuple = field(default=(), repr=False)   # optional labels (autopar operator names)

    def __post_init__(self):
        n = len(self.node_costs)
        if len(self.node_usages) != n or self.intervals.shape != (n, 2):
            raise ConfigError(f"problem {self.name!r}: {n} nodes but {len(self.node_usages)} usage "
                              f"lists and intervals of shape {self.intervals.shape}.")
        for i, (c, u) in enumerate(zip(self.node_costs, self.node_usages)):
            if len(c) == 0 or len(c) != len(u):
                raise ConfigError(f"problem {self.name!r}: node {i} has {len(c)} costs and "
                                  f"{len(u)} usages; every node needs >= 1 strategy, one usage each.")
        for e, ((u, v), m) in enumerate(zip(self.edges, self.edge_costs)):
            if m.shape != (len(self.node_costs[u]), len(self.node_costs[v])):
                raise ConfigError(f"problem {self.name!r}: edge {e} ({u}, {v}) has a cost matrix "
                                  f"of shape {m.shape}, expected "
                                  f"{(len(self.node_costs[u]), len(self.node_costs[v]))}.")

    # ------------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_edges(self) -> int:
        return len(self.edge_costs)

    def cost(self, choice) -> float:
        c = np.asarray(choice).tolist()           # Python ints index fastest
        total = sum(float(nc[s]) for nc, s in zip(self.node_costs, c))
        total += sum(float(m[c[u], c[v]])
                     for (u, v), m in zip(self.edges.tolist(), self.edge_costs))
        return total

    def usage_profile(self, choice) -> np.ndarray:
        """Memory in use at every time step 0 .. max(end) - 1."""
        if self.num_nodes == 0:
            return np.zeros(0, np.int64)
        horizon = int(self.intervals[:, 1].max()) if self.num_nodes else 0
        delta = np.zeros(horizon + 1, np.int64)
        for (s, e), us, k in zip(self.intervals, self.node_usages, choice):
            if e > s:
                delta[s] += us[k]
                delta[e] -= us[k]
        return np.cumsum(delta)[:horizon]

    def peak(self, choice) -> int:
        prof = self.usage_profile(choice)
        return int(prof.max()) if len(prof) else 0

    def feasible(self, choice) -> bool:
        return self.usage_limit is None or self.peak(choice) <= self.usage_limit

    # ------------------------------------------------------------------ IOPDDL JSON
    @staticmethod
    def from_dict(d: dict) -> "SearchProblem":
        p = d.get("problem", d)
        nodes, edges = p["nodes"], p.get("edges", {"nodes": [], "costs": []})
        costs = tuple(np.asarray(c, np.float64) for c in nodes["costs"])
        usages = tuple(np.asarray(u, np.int64) for u in nodes["usages"])
        intervals = np.asarray(nodes["intervals"], np.int64).reshape(len(costs), 2)
        ends = np.asarray(edges["nodes"], np.int64).reshape(-1, 2)
        ecosts = tuple(np.asarray(m, np.float64).reshape(len(costs[u]), len(costs[v]))
                       for (u, v), m in zip(ends, edges["costs"]))
        limit = p.get("usage_limit")
        return SearchProblem(costs, usages, intervals, ends, ecosts,
                             None if limit is None else int(limit), p.get("name", "problem"))

    def to_dict(self) -> dict:
        def num(a):
            return [int(x) if float(x).is_integer() else float(x) for x in np.ravel(a)]
        p = {"name": self.name,
             "nodes": {"intervals": self.intervals.tolist(),
                       "costs": [num(c) for c in self.node_costs],
                       "usages": [num(u) for u in self.node_usages]},
             "edges": {"nodes": self.edges.tolist(), "costs": [num(m) for m in self.edge_costs]}}
        if self.usage_limit is not None:
            p["usage_limit"] = int(self.usage_limit)
        return {"problem": p}

    @staticmethod
    def from_json(text: str) -> "SearchProblem":
        return SearchProblem.from_dict(json.loads(text))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def load(path) -> "SearchProblem":
        path = str(path)
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            return SearchProblem.from_dict(json.load(f))

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
    optimal: bool = False         # proven optimal by an exact solver
    bound: Optional[float] = None  # the best lower bound on any feasible cost the solver proved

    @property
    def lower_bound(self) -> Optional[float]:
        """The proven lower bound (the cost itself when optimal), or None when none is known."""
        return self.cost if self.optimal else self.bound

    @property
    def gap(self) -> Optional[float]:
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
    def of(problem: SearchProblem, choice, solver: str, seconds: float = 0.0,
           optimal: bool = False, bound: Optional[float] = None) -> "Solution":
        choice = tuple(int(c) for c in choice)
        cost = problem.cost(choice)
        return Solution(choice, cost, problem.peak(choice), solver, seconds, optimal,
                        None if bound is None else min(float(bound), cost))


def check_fits(problem: SearchProblem) -> None:
    """Raise InfeasibleError when even the smallest strategy of every node breaks the limit:
    the message names the peak time step, the largest nodes live there (by ``node_names`` when
    the problem has them), the bytes the smallest choice needs there, and the limit."""
    if problem.usage_limit is None or problem.num_nodes == 0:
        return
    smallest = [int(np.argmin(u)) for u in problem.node_usages]
    prof = problem.usage_profile(smallest)
    t = int(np.argmax(prof))
    if prof[t] <= problem.usage_limit:
        return
    from autopar.errors import InfeasibleError
    live = [i for i, (s, e) in enumerate(problem.intervals) if s <= t < e]
    live.sort(key=lambda i: -int(problem.node_usages[i][smallest[i]]))
    names = problem.node_names or tuple(f"node {i}" for i in range(problem.num_nodes))
    top = ", ".join(f"{names[i]} ({int(problem.node_usages[i][smallest[i]])} B)" for i in live[:5])
    raise InfeasibleError(
        f"no strategy fits the memory limit of {problem.usage_limit} bytes per device: at step {t} "
        f"the smallest strategies still need {int(prof[t])} bytes (largest live: {top}). Raise "
        "max_device_memory, use more devices, or shrink the model or batch there.")
