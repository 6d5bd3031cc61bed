"""Repeated blocks folded: a SearchProblem whose nodes of the same kind share one variable.

In: a ``SearchProblem``. Out: a ``Fold`` (or None where folding would not shrink it by
``MIN_SHRINK``): ``members`` (the class of every node), ``problem`` (one node per class, for
the costs only: no memory), ``costs(flat_costs)`` (the per-node cost vectors summed per class)
and ``unfold(choice)`` (a class's strategy given to each of its members).

A model of L identical layers traces into L copies of the same operators, and every copy has
the same candidates, costs and edge matrices: its problem is L times the size of one layer's.
Two nodes are of one kind when their cost and usage vectors are equal and so are their
neighbourhoods ``ROUNDS`` edges deep (colour refinement, the 1-dimensional Weisfeiler-Leman
test: each round a node's colour becomes its colour and the sorted colours of its edges and
their far ends). The first and last few layers, whose neighbourhoods reach the embedding or
the loss, keep kinds of their own; so does every operator that occurs once.

The folded problem is exact for any choice that gives all members of a class one strategy:
a class's node cost is the sum of its members', an edge between two classes carries the sum
of their edges' matrices (parallel edges, which elimination adds), and an edge inside a
class is a self-edge (its diagonal, which elimination adds to the node), and the members'
edges between two classes are summed once here. What folding gives up is the choices that
tell members apart (the first layer split unlike the tenth); ``dp.solve`` descends from the
unfolded answer on the whole problem (1-opt), which may untie them. Memory is not folded: a
choice is checked, and penalised, on the whole problem, where each step's live nodes are
known.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.strategies.problem import SearchProblem

ROUNDS = 4  # colour refinement rounds: how far a node's neighbourhood must match
MIN_SHRINK = 2.0  # fold only when it divides the node count by at least this


@dataclass(frozen=True, eq=False)
class Fold:
    """A problem's nodes grouped into classes that take one strategy (module docstring)."""

    members: np.ndarray  # int64 per node of the whole problem: its class
    problem: SearchProblem  # one node per class; costs only (no usages, no limit)
    gather: np.ndarray  # the whole problem's flat strategy entries (problem.py), by class
    runs: tuple  # per class (start, members, strategies) of its run in ``gather``

    @property
    def shrink(self) -> float:
        """The whole problem's node count over the folded one's."""
        return len(self.members) / max(1, self.problem.num_nodes)

    def costs(self, flat_costs: np.ndarray) -> tuple:
        """Per class, the sum of its members' cost vectors; ``flat_costs``: the whole
        problem's, as ``SearchProblem.flat_costs`` lays them out (as given or penalised)."""
        return _summed(flat_costs, self.gather, self.runs)

    def unfold(self, choice) -> np.ndarray:
        """The whole problem's choice: each node takes its class's strategy."""
        return np.asarray(choice, np.int64)[self.members]


def classes(problem: SearchProblem, rounds: int = ROUNDS) -> np.ndarray:
    """Each node's class (0 .. k-1, numbered by first appearance): equal cost and usage
    vectors, and neighbourhoods equal ``rounds`` edges deep (module docstring)."""
    n = problem.num_nodes
    colour = _numbered(
        [(c.tobytes(), u.tobytes()) for c, u in zip(problem.node_costs, problem.node_usages)]
    )
    if not problem.num_edges:
        return colour
    edge_colour = _numbered([(m.shape, m.tobytes()) for m in problem.edge_costs]).tolist()
    ends = problem.edges.tolist()
    for _ in range(rounds):
        seen: list[list] = [[] for _ in range(n)]
        c = colour.tolist()
        for (u, v), e in zip(ends, edge_colour):
            seen[u].append((e, 0, c[v]))
            seen[v].append((e, 1, c[u]))
        refined = _numbered([(c[i], tuple(sorted(s))) for i, s in enumerate(seen)])
        if refined.max() == colour.max():  # stable: no class split this round
            break
        colour = refined
    return colour


def fold(problem: SearchProblem, rounds: int = ROUNDS) -> Fold | None:
    """The problem folded by ``classes``, or None where it would not shrink the node count
    ``MIN_SHRINK`` times (nothing repeats enough to pay for the restriction)."""
    members = classes(problem, rounds)
    k = int(members.max()) + 1 if len(members) else 0
    if k == 0 or len(members) / k < MIN_SHRINK:
        return None
    order = np.argsort(members, kind="stable")
    sizes = problem.sizes
    gather = np.concatenate([problem.offsets[i] + np.arange(sizes[i]) for i in order.tolist()])
    counts = np.bincount(members, minlength=k)
    first = order[np.r_[0, np.cumsum(counts)[:-1]]]  # a member of each class
    runs, at = [], 0
    for m, strategies in zip(counts.tolist(), sizes[first].tolist()):
        runs.append((at, m, strategies))
        at += m * strategies
    pairs: dict = {}  # (class, class) -> the summed matrices of its members' edges
    for (u, v), mat in zip(members[problem.edges].tolist(), problem.edge_costs):
        if (v, u) in pairs and u != v:
            u, v, mat = v, u, mat.T
        pairs[u, v] = pairs[u, v] + mat if (u, v) in pairs else mat
    costs = _summed(problem.flat_costs, gather, tuple(runs))
    folded = SearchProblem(
        costs,
        tuple(np.zeros(len(c), np.int64) for c in costs),
        np.zeros((k, 2), np.int64),
        np.array(list(pairs), np.int64).reshape(-1, 2),
        tuple(pairs.values()),
        None,
        f"{problem.name} folded",
    )
    return Fold(members, folded, gather, tuple(runs))


def _summed(flat_costs: np.ndarray, gather: np.ndarray, runs: tuple) -> tuple:
    """Per class (its run ``(start, members, strategies)`` of ``flat_costs[gather]``), its
    members' cost vectors summed."""
    v = flat_costs[gather]
    return tuple(v[a : a + m * k].reshape(m, k).sum(0) for a, m, k in runs)


def _numbered(keys: list) -> np.ndarray:
    """Each key's number, 0 .. k-1 in order of first appearance."""
    ids: dict = {}
    return np.fromiter((ids.setdefault(key, len(ids)) for key in keys), np.int64, len(keys))
