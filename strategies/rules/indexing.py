"""Indexing primitives: ``gather``, the ``scatter`` family, ``dynamic_slice`` and
``dynamic_update_slice``.

In: a node of one of them. Out: its ``OpSpec`` (Python: the letters follow the dimension
numbers) and, where slice sizes are shape parameters, its local-params function.

gather (``wte[tokens]``, ``take_along_axis``): a dimension of the indices (other than the last,
the index vector) and the result dimension it produces share a letter; when it is a batching
dimension the matching operand dimension carries it too. An operand dimension copied whole into
the result (window size = its size, not indexed) shares a letter with that result dimension,
e.g. the embedding feature dimension. Indexed operand dimensions (the vocabulary of ``wte``) are
``_``: a device holding part of the table cannot look up an index it does not hold. Linear in
the operand (unless out-of-bound indices read a non-zero, non-NaN ``fill_value``).

scatter-add / scatter-sub (the backward of a gather): operand and result dimensions share
letters; batching dimensions are shared with indices and updates; whole window dimensions with
the updates. A scatter (non-batching) dimension of indices/updates adds many updates into one
operand row, so splitting it leaves partial sums: it is a ``+`` letter, and the operand must
then arrive as a partial sum over the same axes (``reduce_partial``), unless it is a literal zero
constant (a non-zero constant operand forbids the split: every device would add it once).
Jointly linear in (operand, updates). ``scatter`` (set), ``scatter-mul``/``-min``/``-max`` never
split scatter dimensions.

dynamic_slice / dynamic_update_slice: a dimension taken (or overwritten) in full may be split
(its start index is clamped to 0); the scalar start indices never carry letters.
"""

from __future__ import annotations

import numpy as np
from jax import lax
from jax.lax import GatherScatterMode

from autopar.graph import Const

from .spec import OpSpec, Rule


def _is_zero_const(x) -> bool:
    return isinstance(x, Const) and bool(np.all(np.asarray(x.value) == 0))


# ---------------------------------------------------------------- gather


def _whole_window_dims(operand_shape, window_sizes, window_operand_dims, indexed):
    """Operand dimensions of a window that are copied whole and not indexed."""
    return {
        d for d in window_operand_dims if window_sizes[d] == operand_shape[d] and d not in indexed
    }


def gather_spec(node):
    dn = node.params["dimension_numbers"]
    operand, indices = node.inputs[0].shape, node.inputs[1].shape
    out_rank = len(node.outputs[0].shape)
    slice_sizes = node.params["slice_sizes"]
    O, I, R = [None] * len(operand), [None] * len(indices), [None] * out_rank
    batch_out = [d for d in range(out_rank) if d not in set(dn.offset_dims)]
    for i, o in enumerate(batch_out):  # indices dims except the index vector
        I[i] = R[o] = f"i{i}"
    for od, idd in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        O[od] = I[idd]
    window = [
        d
        for d in range(len(operand))
        if d not in set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    ]
    whole = _whole_window_dims(operand, slice_sizes, window, set(dn.start_index_map))
    for d, o in zip(window, sorted(dn.offset_dims)):
        if d in whole:
            O[d] = R[o] = f"w{d}"
    fill = node.params.get("fill_value")
    fills = node.params.get("mode") == GatherScatterMode.FILL_OR_DROP
    linear = ((0,),) if not fills or fill is None or fill == 0 or np.isnan(fill) else ()
    return OpSpec((tuple(O), tuple(I)), (tuple(R),), frozenset(), linear)


def gather_local_params(node, in_shapes, out_shapes):
    """Whole-window dimensions take the local operand size as their slice size."""
    p = dict(node.params)
    operand = node.inputs[0].shape
    p["slice_sizes"] = tuple(
        in_shapes[0][d] if s == operand[d] else s for d, s in enumerate(p["slice_sizes"])
    )
    return p


# ---------------------------------------------------------------- scatter family


def _scatter(summable: bool, linear):
    """``summable``: scatter dimensions may be ``+`` letters when the operand is a literal zero
    (scatter-add/-sub). ``linear``: the op's linear groups."""

    def spec(node):
        dn = node.params["dimension_numbers"]
        operand, indices, updates = (x.shape for x in node.inputs[:3])
        O, I, U = [None] * len(operand), [None] * len(indices), [None] * len(updates)
        scatter_u = [d for d in range(len(updates)) if d not in set(dn.update_window_dims)]
        batching = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims))
        operand_value = node.inputs[0]
        zero = _is_zero_const(operand_value)
        summed = summable and (zero or not isinstance(operand_value, Const))
        reduce = set()
        for i, u in enumerate(scatter_u):  # indices dims except the index vector
            if i in batching:
                I[i] = U[u] = O[batching[i]] = f"i{i}"
            elif summed:
                I[i] = U[u] = f"s{i}"
                reduce.add(f"s{i}")
        window = [
            d
            for d in range(len(operand))
            if d not in set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
        ]
        sizes = dict(zip(window, (updates[u] for u in dn.update_window_dims)))
        sizes = [sizes.get(d, 1) for d in range(len(operand))]
        whole = _whole_window_dims(operand, sizes, window, set(dn.scatter_dims_to_operand_dims))
        for d, u in zip(window, dn.update_window_dims):
            if d in whole:
                O[d] = U[u] = f"w{d}"
        return OpSpec(
            (tuple(O), tuple(I), tuple(U)),
            (tuple(O),),
            frozenset(reduce),
            linear(node) if callable(linear) else linear,
            () if zero or not reduce else (0,),
        )

    return Rule(spec)


def _set_linear(node):
    """``scatter`` (set) is jointly linear in (operand, updates) when no index repeats; with
    repeats, which update wins may differ between the addends."""
    return ((0, 2),) if node.params.get("unique_indices") else ()


# ---------------------------------------------------------------- dynamic slices


def dynamic_slice_spec(node):
    operand = node.inputs[0].shape
    dims = tuple(
        f"d{d}" if s == n else None
        for d, (s, n) in enumerate(zip(node.params["slice_sizes"], operand))
    )
    return OpSpec((dims,) + tuple(() for _ in node.inputs[1:]), (dims,), frozenset(), ((0,),))


def dynamic_slice_local_params(node, in_shapes, out_shapes):
    p = dict(node.params)
    p["slice_sizes"] = tuple(out_shapes[0])
    return p


def dynamic_update_slice_spec(node):
    operand, update = node.inputs[0].shape, node.inputs[1].shape
    dims = tuple(f"d{d}" if u == n else None for d, (u, n) in enumerate(zip(update, operand)))
    return OpSpec(
        (dims, dims) + tuple(() for _ in node.inputs[2:]), (dims,), frozenset(), ((0, 1),)
    )


def index_bounds(node) -> dict:
    """For a checker or test data generator: input position -> per-index-component exclusive
    upper bound of valid start indices (``{1: (64,)}`` for ``wte[tokens]``); ``{}`` when the
    node's integer inputs are not indices."""
    prim, p = node.prim, node.params
    shapes = [x.shape for x in node.inputs]
    if prim == lax.gather_p.name:
        dn = p["dimension_numbers"]
        return {1: tuple(shapes[0][d] - p["slice_sizes"][d] + 1 for d in dn.start_index_map)}
    if prim.startswith("scatter"):
        dn = p["dimension_numbers"]
        window = [
            d
            for d in range(len(shapes[0]))
            if d not in set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
        ]
        sizes = dict(zip(window, (shapes[2][u] for u in dn.update_window_dims)))
        return {
            1: tuple(shapes[0][d] - sizes.get(d, 1) + 1 for d in dn.scatter_dims_to_operand_dims)
        }
    if prim == lax.dynamic_slice_p.name:
        return {1 + i: (n - s + 1,) for i, (n, s) in enumerate(zip(shapes[0], p["slice_sizes"]))}
    if prim == lax.dynamic_update_slice_p.name:
        return {2 + i: (n - u + 1,) for i, (n, u) in enumerate(zip(shapes[0], shapes[1]))}
    return {}


RULES = {
    "gather": Rule(gather_spec, gather_local_params),
    "scatter-add": _scatter(True, ((0, 2),)),
    "scatter-sub": _scatter(True, ((0, 2),)),
    "scatter": _scatter(False, _set_linear),
    "scatter-mul": _scatter(False, ((0,),)),
    "scatter-min": _scatter(False, ()),
    "scatter-max": _scatter(False, ()),
    "dynamic_slice": Rule(dynamic_slice_spec, dynamic_slice_local_params),
    "dynamic_update_slice": Rule(dynamic_update_slice_spec),
}
