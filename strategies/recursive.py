"""recursive_programming: cut the devices one mesh axis at a time, each cut an exact small search.

In: a Graph, a LogicalMesh, ``fixed`` (node id -> its one Candidate, from ``ap.shard``),
``arg_fixed`` (graph input index -> Layout), a ``reshard_cost(src, dst, shape, dtype) ->
seconds`` function (the redistribution planner's), the per-device memory limit, and ``solve``
(a solver from strategies/solvers, by default dynamic programming) for each cut's problem;
``state_pairs`` as in build.py.
Out: an ``Assignment`` (node id -> Candidate on the whole mesh, a Layout per graph input).

Algorithm (after MindSpore's recursive programming): the mesh axes of size > 1 are taken
outermost (slowest links) first. Cut k asks every operator one question -- which of its
dimensions (or contracted dimensions, leaving a partial sum) axis k splits, or none -- with the
answers of cuts 0..k-1 kept and axes after k unused. So an operator has at most
(letters + 2) options per cut instead of their product over all axes, and the full candidate
product is never enumerated: a mesh of size-2 axes is cut in halvings, one small search each. Each cut builds a SearchProblem over those options (build.py: costs and
reshard matrices computed once per repeated layer) and solves it. The memory limit of cut k is
the cap times the devices of the later axes (what a device may hold if the remaining cuts
split everything), so only the last cut checks the exact cap; an early cut may commit to a
plan the last cut cannot fit, and then the error says so (dynamic_programming searches all
axes jointly).
"""
from __future__ import annotations

import math
import time

from autopar.errors import InfeasibleError

from .build import arg_layouts, build_problem
from .candidates import axis_choices, enumerate_candidates
from .propagation import Assignment
from .rules import rule_for


def search(graph, mesh, fixed, arg_fixed, reshard_cost, usage_limit, solve, *, time_limit=None,
           progress=None, name="autopar", arg_names=None, state_pairs=()) -> Assignment:
    axes = [a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1]
    specs: dict = {}
    decided = {n.id: ((), None) for n in graph.nodes}       # (picks so far, linear group or None)
    arg_decided = [()] * len(graph.inputs)
    lists: dict = {}                                         # shared option lists, see build.py
    fixed_lists = {nid: [c] for nid, c in fixed.items()}
    deadline = None if time_limit is None else time.monotonic() + time_limit
    choice, inputs, cost = {}, (), 0.0
    for k in range(max(len(axes), 1)):
        rest = (None,) * max(len(axes) - k - 1, 0)
        cands = {}
        for n in graph.nodes:
            if n.id in fixed_lists:
                cands[n.id] = fixed_lists[n.id]
                continue
            sig, (done, group) = n.signature, decided[n.id]
            key = (sig, done, group)
            if key not in lists:
                if sig not in specs:
                    specs[sig] = rule_for(n).spec(n)
                spec = specs[sig]
                now = [None, *spec.letters, "+"] if axes else []
                picks = [done + (c,) + rest for c in now] if axes else [()]
                lists[key] = enumerate_candidates(n, spec, mesh, picks, group)
            cands[n.id] = lists[key]
        options = []
        for i, v in enumerate(graph.inputs):
            if i in arg_fixed:
                options.append(lists.setdefault(("fixed arg", i), [arg_fixed[i]]))
                continue
            key = ("arg", v.shape, str(v.dtype), arg_decided[i])
            if key not in lists:
                now = [None, *range(len(v.shape))]
                picks = [arg_decided[i] + (d,) + rest for d in now] if axes else [()]
                lists[key] = arg_layouts(v, mesh, picks)
            options.append(lists[key])
        later = math.prod(mesh.axis_size(a) for a in axes[k + 1:])
        limit = None if usage_limit is None else usage_limit * later
        built = build_problem(graph, mesh, cands, {}, reshard_cost, limit,
                              f"{name} cut {k + 1}/{len(axes)}", arg_names, tuple(options),
                              state_pairs)
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0) / (len(axes) - k or 1)
        if progress:
            progress(f"cut {k + 1}/{max(len(axes), 1)}"
                     + (f" (axis {axes[k]})" if axes else "")
                     + f": {built.problem.num_nodes} nodes")
        try:
            solution = solve(built.problem, time_limit=left, progress=progress)
        except InfeasibleError as e:
            if k == 0:
                raise
            raise InfeasibleError(f"{e} (recursive_programming committed to the splits of axes "
                                  f"{', '.join(axes[:k])} before this cut; search_mode="
                                  "'dynamic_programming' searches all axes jointly.)") from None
        choice, inputs = built.assignment(solution.choice)
        cost = solution.cost
        upto = axes[:k + 1]
        for n in graph.nodes:
            c = choice[n.id]
            decided[n.id] = (axis_choices(c, upto), c.group if c.partial else None)
        arg_decided = [tuple(next((d for d, ax in enumerate(l.dims) if a in ax), None) for a in upto)
                       for l in inputs]
    return Assignment(choice, inputs, cost)
