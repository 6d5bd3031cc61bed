"""Candidate strategies of one operator on a logical mesh.

In: a graph ``Node``, its ``OpSpec`` (from the rule table) and a ``LogicalMesh``. Out: every
``Candidate``: an assignment of mesh axes to the spec's letters (each axis used at most once,
axes of one letter in mesh order, every split dividing the dimensions it splits), optionally
with the remaining axes turned into pending partial sums fed to one linear input group; with the
input and output ``Layout``s it implies. Enumeration order is deterministic; index 0 is always
the fully replicated candidate.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from autopar.frozen import cached_hash
from autopar.graph import Const, Value
from autopar.layout import Layout
from autopar.mesh import LogicalMesh

from .rules import rule_for
from .rules.spec import OpSpec


@cached_hash
@dataclass(frozen=True)
class Candidate:
    assign: tuple  # ((letter, (axis, ...)), ...) for split letters only
    partial: frozenset  # axes over which linear group ``group`` receives partial sums
    group: int  # index into OpSpec.linear, or -1
    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout, ...]

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.in_layouts))
        outs = ", ".join(map(str, self.out_layouts))
        return f"{ins} -> {outs}"

    @property
    def num_splits(self) -> int:
        return sum(len(a) for _, a in self.assign) + len(self.partial)


def _is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.inexact)


def enumerate_candidates(
    node, spec: OpSpec, mesh: LogicalMesh, picks=None, group=None
) -> list[Candidate]:
    """Every candidate (see the module docstring). ``picks`` restricts the enumeration to the
    given per-axis choices (one tuple per combination, over the mesh axes of size > 1: None,
    a letter of the spec, or "+" for a partial input) and ``group`` to one linear group; the
    recursive search enumerates one axis at a time this way instead of the whole product."""
    letters = spec.letters
    axes = [a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1]
    groups = [
        g
        for g in spec.linear
        if all(not isinstance(node.inputs[i], Const) for i in g)
        and all(_is_float(v.dtype) for v in node.outputs)
    ]
    in_shapes = [x.shape for x in node.inputs]
    out_shapes = [v.shape for v in node.outputs]
    if picks is None:  # each axis: None (unused), a letter, or "+" (partial input)
        picks = itertools.product([None, *letters] + (["+"] if groups else []), repeat=len(axes))
    out: list[Candidate] = []
    for pick in picks:
        if "+" in pick and not groups:
            continue
        assign: dict[str, list[str]] = {}  # letter -> the mesh axes splitting it
        for a, c in zip(axes, pick):
            if c not in (None, "+"):
                assign.setdefault(c, []).append(a)
        partial = frozenset(a for a, c in zip(axes, pick) if c == "+")
        for gi in range(len(spec.linear)) if partial else [-1]:
            if partial and (spec.linear[gi] not in groups or group not in (None, gi)):
                continue
            cand = _build(spec, assign, partial, gi, in_shapes, out_shapes, mesh)
            if cand is not None:
                out.append(cand)
    return out


def axis_choices(cand: Candidate, axes) -> tuple:
    """Per axis of ``axes``: the letter ``cand`` splits over it, "+" if it leaves a partial sum
    over it, or None (the inverse of enumeration's picks)."""
    use = {a: letter for letter, group in cand.assign for a in group}
    use.update(dict.fromkeys(cand.partial, "+"))
    return tuple(use.get(a) for a in axes)


def candidates_of(graph, mesh) -> dict:
    """node id -> candidate list (rule errors surface here, naming the primitive and source).
    Nodes with equal ``signature`` share one list object, computed once: build.py reuses
    costs per shared list, so the layers of a deep model are priced once."""
    memo, out = {}, {}
    for n in graph.nodes:
        sig = n.signature
        if sig not in memo:
            memo[sig] = enumerate_candidates(n, rule_for(n).spec(n), mesh)
        out[n.id] = memo[sig]
    return out


def _layout(dims, assign, partial=frozenset()) -> Layout:
    return Layout(tuple(tuple(assign.get(l, ())) if l else () for l in dims), partial)


def _fits(dims, shape, assign, mesh) -> bool:
    for l, s in zip(dims, shape):
        if l in assign and s % math.prod(mesh.axis_size(a) for a in assign[l]):
            return False
    return True


def _build(spec, assign, partial, gi, in_shapes, out_shapes, mesh):
    for dims, shape in zip(spec.inputs + spec.outputs, list(in_shapes) + list(out_shapes)):
        if not _fits(dims, shape, assign, mesh):
            return None
    group = set(spec.linear[gi]) if gi >= 0 else set()
    reduced = frozenset(a for l in spec.reduce for a in assign.get(l, ()))
    ins = tuple(
        _layout(
            d,
            assign,
            (partial if i in group else frozenset())
            | (reduced if i in spec.reduce_partial else frozenset()),
        )
        for i, d in enumerate(spec.inputs)
    )
    outs = tuple(_layout(d, assign, partial | reduced) for d in spec.outputs)
    order = {l: i for i, l in enumerate(spec.letters)}
    key = tuple(sorted(((l, tuple(a)) for l, a in assign.items()), key=lambda t: order[t[0]]))
    return Candidate(key, partial, gi, ins, outs)


def candidate_for(node, spec: OpSpec, layout: Layout, mesh: LogicalMesh) -> Candidate | None:
    """The candidate of ``node`` whose every output is in ``layout``, with no partial sums,
    keeping ``layout``'s axis order within a dimension (which enumeration, mesh order only,
    may not produce), or None where the operator cannot produce it."""
    assign: dict[str, list[str]] = {}  # letter -> the mesh axes splitting it
    for dims in spec.outputs:
        if len(dims) != len(layout.dims):
            return None
        for letter, axes in zip(dims, layout.dims):
            if axes and (not letter or assign.setdefault(letter, list(axes)) != list(axes)):
                return None
    cand = _build(
        spec,
        assign,
        frozenset(),
        -1,
        [x.shape for x in node.inputs],
        [v.shape for v in node.outputs],
        mesh,
    )
    return cand if cand is not None and all(l == layout for l in cand.out_layouts) else None


def batch_candidate(node, cands: list, mesh: LogicalMesh) -> Candidate:
    """MindSpore's default strategy for an operator semi_auto leaves unannotated: its first
    operand's dimension 0 (its output's, with no operand) split over every mesh axis of size
    > 1, nothing else split and no partial sum in or out (the operator's batch dimension, as
    MindSpore's ``GenerateBatchStrategies``); replicated (``cands[0]``) where that split does
    not divide the dimension or the operator has none."""
    axes = tuple(a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1)
    ranked = [v for v in node.inputs if getattr(v, "shape", ())]
    lead = ranked[0] if ranked else (node.outputs[0] if node.outputs[0].shape else None)
    if lead is not None and axes:
        at = next(i for i, v in enumerate(node.inputs) if v is lead) if ranked else None
        for c in cands:
            layout = c.in_layouts[at] if at is not None else c.out_layouts[0]
            if (
                layout.dims[0] == axes
                and len(layout.axes) == len(axes)
                and not c.partial
                and not any(l.partial for l in c.in_layouts)
                and sum(len(a) for _, a in c.assign) == len(axes)
            ):
                return c
    return cands[0]


def batch_defaults(graph, cands: dict, mesh: LogicalMesh, annotated, batch: set) -> dict:
    """``cands`` with each operator that reads the batch and no annotation touches held to its
    ``batch_candidate`` (semi_auto's ``unannotated="batch"``). Reading the batch: its first
    operand with a dimension has the batch's rows in dimension 0: a graph input in ``batch``
    (positions), or an output that the batch split of such an operator leaves split in
    dimension 0 (activations and their cotangents; not a sum over the batch, such as a weight
    gradient). Operators on parameters alone (the update, a weight's transpose) and on sums
    over the batch follow by propagation, as MindSpore derives its backward operators from the
    forward strategies and its optimizer's from the parameters'. ``annotated``: the node ids
    of the annotations (``ap.shard``); the operators reading them or read by them keep their
    candidates (their outputs carry the batch when their first operand does)."""
    keep = set(annotated)
    for n in graph.nodes:
        if n.id in annotated:
            keep |= {u.id for v in n.outputs for u, _ in graph.users[v.id]}
            keep |= {
                graph.producer[x.id].id
                for x in n.inputs
                if isinstance(x, Value) and x.id in graph.producer
            }
    axes = tuple(a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1)
    rows = {graph.inputs[j].id for j in batch}  # values with the batch's rows in dim 0
    out = dict(cands)
    for n in graph.nodes:
        lead = next((x for x in n.inputs if getattr(x, "shape", ())), None)
        if not isinstance(lead, Value) or lead.id not in rows:
            continue
        if n.id in keep:
            rows |= {v.id for v in n.outputs if v.shape}
            continue
        c = batch_candidate(n, cands[n.id], mesh)
        out[n.id] = [c]
        rows |= {
            v.id
            for v, l in zip(n.outputs, c.out_layouts)
            if l.dims and l.dims[0] == axes and not l.partial
        }
    return out


def identity_candidate(layout: Layout) -> Candidate:
    """The one candidate of an identity operator (``ap.shard``) held in ``layout``: any axis
    order, which enumeration (mesh order only) may not produce."""
    assign = tuple((f"d{i}", tuple(axes)) for i, axes in enumerate(layout.dims) if axes)
    return Candidate(assign, frozenset(), -1, (layout,), (layout,))
