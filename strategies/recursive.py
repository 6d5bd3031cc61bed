"""recursive_programming: cut the devices one mesh axis at a time, each cut an exact small search.

In: a Graph, a LogicalMesh, ``fixed`` (node id -> its one Candidate, from ``ap.shard``),
``arg_fixed`` (graph input index -> Layout), a ``reshard_cost(src, dst, shape, dtype) ->
seconds`` function (the redistribution planner's), the per-device memory limit, and ``solve``
(a solver from strategies/solvers, by default dynamic programming) for each cut's problem;
``state_pairs`` and ``state_pricing`` as in build.py.
Out: an ``Assignment`` (node id -> Candidate on the whole mesh, a Layout per graph input).

Algorithm (after MindSpore's recursive programming): the mesh axes of size > 1 are taken
outermost (slowest links) first. Cut k asks every operator one question -- which of its
dimensions (or contracted dimensions, leaving a partial sum) axis k splits, or none -- with the
answers of cuts 0..k-1 kept and axes after k unused. So an operator has at most
(letters + 2) options per cut instead of their product over all axes, and the full candidate
product is never enumerated: a mesh of size-2 axes is cut in halvings, one small search each.
Each cut builds a SearchProblem over those options (build.py: costs and reshard matrices
computed once per repeated layer) and solves it. The memory limit of cut k is the cap times
the devices of the later axes (what a device may hold if the remaining cuts split everything),
so only the last cut checks the exact cap; an early cut may commit to a plan the last cut
cannot fit, and then the error says so (dynamic_programming searches all axes jointly).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from autopar.errors import InfeasibleError
from autopar.graph import Graph
from autopar.layout import Layout
from autopar.mesh import LogicalMesh

from .build import StatePricing, arg_layouts, build_problem
from .candidates import Candidate, axis_choices, enumerate_candidates
from .microbatch import MicroFit
from .propagation import Assignment
from .rules import rule_for


def search(
    graph,
    mesh,
    fixed,
    arg_fixed,
    reshard_cost,
    usage_limit,
    solve,
    *,
    time_limit=None,
    progress=None,
    name="autopar",
    arg_names=None,
    state_pairs=(),
    state_pricing=StatePricing(),
    fit=None,
) -> Assignment:
    """See the module docstring: one cut per mesh axis of size > 1 (one cut when there is
    none), each a SearchProblem over the options the earlier cuts' answers leave, solved by
    ``solve``; the last cut's solution, as an ``Assignment``. ``fit``: a MicroFit
    (strategies.microbatch) the options must pass, or None."""
    axes = [a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1]
    options = _OptionLists(
        graph, mesh, axes, {nid: [c] for nid, c in fixed.items()}, arg_fixed, fit
    )
    decided = _Decided({n.id: ((), None) for n in graph.nodes}, [()] * len(graph.inputs))
    deadline = None if time_limit is None else time.monotonic() + time_limit
    choice, inputs, cost, held = {}, (), 0.0, {}
    for k in range(max(len(axes), 1)):
        later = math.prod(mesh.axis_size(a) for a in axes[k + 1 :])
        limit = None if usage_limit is None else usage_limit * later
        built = build_problem(
            graph,
            mesh,
            options.for_nodes(k, decided.nodes),
            {},
            reshard_cost,
            limit,
            f"{name} cut {k + 1}/{len(axes)}",
            arg_names,
            options.for_inputs(k, decided.inputs),
            state_pairs,
            state_pricing=state_pricing,
        )
        solution = _solve_cut(built.problem, solve, axes, k, deadline, progress)
        choice, inputs = built.assignment(solution.choice)
        cost, held = solution.cost, built.held(solution.choice, choice)
        decided = _decided(graph, choice, inputs, axes[: k + 1])
    return Assignment(choice, inputs, cost, held)


class _Decided(NamedTuple):
    """What the cuts so far answered: per node id ``(picks, linear group or None)`` (picks:
    per cut axis, the letter it splits, "+" or None), and per graph input the dimension each
    cut axis splits (or None)."""

    nodes: dict
    inputs: list


def _decided(graph, choice, inputs, upto) -> _Decided:
    """A cut's assignment (node id -> Candidate, input layouts) and the axes cut so far ->
    what the next cut keeps of it."""
    nodes = {}
    for n in graph.nodes:
        c = choice[n.id]
        nodes[n.id] = (axis_choices(c, upto), c.group if c.partial else None)
    return _Decided(
        nodes,
        [
            tuple(next((d for d, ax in enumerate(l.dims) if a in ax), None) for a in upto)
            for l in inputs
        ],
    )


@dataclass(eq=False)
class _OptionLists:
    """The option lists every cut offers, made once per distinct key and shared by the cuts
    and nodes that ask for it (build.py shares work per list)."""

    graph: Graph
    mesh: LogicalMesh
    axes: list[str]  # the mesh axes of size > 1, one cut each, outermost first
    fixed: dict[int, list[Candidate]]  # node id -> [its one Candidate]
    arg_fixed: dict[int, Layout]  # graph input index -> its Layout
    fit: MicroFit | None  # MicroFit the options must pass, or None
    lists: dict = field(default_factory=dict)  # key -> option list, see the methods
    specs: dict = field(default_factory=dict)  # node signature -> its rule's spec

    def _rest(self, k: int) -> tuple:
        """Cut ``k`` -> the picks of the axes after it (unused: None each)."""
        return (None,) * max(len(self.axes) - k - 1, 0)

    def for_nodes(self, k: int, decided: dict) -> dict:
        """Cut ``k`` and each node's (picks so far, linear group) -> node id -> its candidates:
        the earlier picks kept, axis k splitting one letter, a partial sum ("+") or nothing."""
        rest, cands = self._rest(k), {}
        for n in self.graph.nodes:
            if n.id in self.fixed:
                cands[n.id] = self.fixed[n.id]
                continue
            sig, (done, group) = n.signature, decided[n.id]
            key = (sig, done, group)
            if key not in self.lists:
                if sig not in self.specs:
                    self.specs[sig] = rule_for(n).spec(n)
                spec = self.specs[sig]
                now = [None, *spec.letters, "+"] if self.axes else []
                picks = [done + (c,) + rest for c in now] if self.axes else [()]
                self.lists[key] = enumerate_candidates(n, spec, self.mesh, picks, group)
            cands[n.id] = self.lists[key] if self.fit is None else self.fit.node(n, self.lists[key])
        return cands

    def for_inputs(self, k: int, decided: list) -> tuple:
        """Cut ``k`` and each graph input's dims picked so far -> per input its layouts: the
        earlier picks kept, axis k splitting one dimension or nothing (a fixed input: its own)."""
        rest, out = self._rest(k), []
        for i, v in enumerate(self.graph.inputs):
            if i in self.arg_fixed:
                out.append(self.lists.setdefault(("fixed arg", i), [self.arg_fixed[i]]))
                continue
            key = ("arg", v.shape, str(v.dtype), decided[i])
            if key not in self.lists:
                now = [None, *range(len(v.shape))]
                picks = [decided[i] + (d,) + rest for d in now] if self.axes else [()]
                self.lists[key] = arg_layouts(v, self.mesh, picks)
            out.append(
                self.lists[key] if self.fit is None else self.fit.argument(v, self.lists[key])
            )
        return tuple(out)


def _solve_cut(problem, solve, axes, k: int, deadline, progress):
    """Cut ``k``'s SearchProblem -> ``solve``'s Solution in an equal share of the time left;
    an infeasible later cut says the earlier cuts committed to their splits."""
    left = (
        None if deadline is None else max(deadline - time.monotonic(), 0.0) / (len(axes) - k or 1)
    )
    if progress:
        progress(
            f"cut {k + 1}/{max(len(axes), 1)}"
            + (f" (axis {axes[k]})" if axes else "")
            + f": {problem.num_nodes} nodes"
        )
    try:
        return solve(problem, time_limit=left, progress=progress)
    except InfeasibleError as e:
        if k == 0:
            raise
        raise InfeasibleError(
            f"{e} (recursive_programming committed to the splits of axes "
            f"{', '.join(axes[:k])} before this cut; search_mode="
            "'dynamic_programming' searches all axes jointly.)"
        ) from None
