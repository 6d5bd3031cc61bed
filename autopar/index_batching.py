"""Batch-aligned gathers and scatters as batching dimensions.

NumPy-style indexing that pairs each row with its own position, ``eo[idx, jnp.arange(B)[:, None],
jnp.arange(T)]`` (a per-token expert choice, a per-example class score), reaches the jaxpr as a
``gather`` (and, in the backward pass, a ``scatter-add``) whose index vector concatenates an
``iota`` per aligned dimension: the operator looks as if any row may read any row, so a
layout splitting the batch must gather the operand whole. This module proves such an index
column equal to the position along one index dimension and turns the pair into a batching
dimension (``operand_batching_dims`` / ``start_indices_batching_dims``, ``lax.gather``'s own
form of the same thing), which the indexing rules split with the batch.

In: a gather or scatter equation (``rewrite(eqn, ins, made)``: its operands as graph values and
``made``, value id -> the Node that computed it). Out: None when no index column is aligned, or
``(fn, args)``: a function of ``args`` (the operand, the index columns left, the updates) that
binds the same primitive with the aligned columns as batching dimensions; the same values for
every index, in every indexing mode (aligned positions are always in bounds).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .graph import Const, Value

GATHERS = {"gather"}
MAX_CONST = 1 << 20  # larger captured index constants are not inspected
SCATTERS = {
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter-mul",
    "scatter_mul",
    "scatter-min",
    "scatter_min",
    "scatter-max",
    "scatter_max",
}
INDEXING = GATHERS | SCATTERS


def iota_dim(x, made) -> int | None:
    """The dimension ``d`` for which ``x[i] == i[d]`` at every position ``i`` (an ``iota`` or a
    constant holding its positions, broadcast, converted to another integer type, or passed
    through jnp's negative-index wrap ``select_n(x < 0, x, x + n)``), or None where that is not
    proved."""
    if isinstance(x, Const):
        return _positions(np.asarray(x.value))
    node = made.get(x.id) if isinstance(x, Value) else None
    if node is None:
        return None
    p, ins = node.prim, node.inputs
    if p == "iota":
        return node.params["dimension"]
    if p == "convert_element_type" and np.issubdtype(node.outputs[0].dtype, np.integer):
        return iota_dim(ins[0], made)
    if p == "broadcast_in_dim":
        e = iota_dim(ins[0], made)
        if e is None:
            return None
        d = node.params["broadcast_dimensions"][e]
        return d if ins[0].shape[e] == x.shape[d] else None
    if p == "select_n" and len(ins) == 3:  # case 0, x itself, wherever x >= 0
        pred = made.get(ins[0].id) if isinstance(ins[0], Value) else None
        never = isinstance(ins[0], Const) and not np.any(np.asarray(ins[0].value))
        if never or (
            pred is not None
            and pred.prim == "lt"
            and pred.inputs[0] is ins[1]
            and isinstance(pred.inputs[1], Const)
            and np.all(np.asarray(pred.inputs[1].value) == 0)
        ):
            return iota_dim(ins[1], made)
    return None


def _positions(a) -> int | None:
    """The first dimension (of size > 1) along which constant ``a`` holds its positions
    (``np.arange(B)[:, None]``, a NumPy index the step captured), or None."""
    if a.size > MAX_CONST or not np.issubdtype(a.dtype, np.integer):
        return None
    for d, n in enumerate(a.shape):
        if n > 1:
            at = np.arange(n).reshape([n if k == d else 1 for k in range(a.ndim)])
            return d if np.array_equal(a, np.broadcast_to(at, a.shape)) else None
    return None


def _columns(indices, made):
    """The pieces of the index vector (last dimension) as (value, width): a concatenate's
    operands, or the whole index array."""
    node = made.get(indices.id) if isinstance(indices, Value) else None
    if (
        node is not None
        and node.prim == "concatenate"
        and node.params["dimension"] == len(indices.shape) - 1
    ):
        return [(v, v.shape[-1]) for v in node.inputs]
    return [(indices, indices.shape[-1])]


def rewrite(eqn, ins, made):
    name = eqn.primitive.name
    if name not in INDEXING or len(ins) < 2 or not ins[1].shape:
        return None
    operand, indices = ins[0], ins[1]
    dn = eqn.params["dimension_numbers"]
    scatter = name in SCATTERS
    index_map = dn.scatter_dims_to_operand_dims if scatter else dn.start_index_map
    dropped = dn.inserted_window_dims if scatter else dn.collapsed_slice_dims
    index_batching = dn.scatter_indices_batching_dims if scatter else dn.start_indices_batching_dims
    batch = dict(zip(dn.operand_batching_dims, index_batching))
    pieces, keep, k = _columns(indices, made), [], 0
    for v, width in pieces:
        d = iota_dim(v, made) if width == 1 and isinstance(v, (Value, Const)) else None
        od = index_map[k] if d is not None else None
        if (
            d is not None
            and d < len(indices.shape) - 1
            and od in dropped
            and operand.shape[od] == indices.shape[d]
            and d not in batch.values()
        ):
            batch[od] = d
        else:
            keep.append((v, k, width))
        k += width
    if len(batch) == len(dn.operand_batching_dims) or not keep:
        return None
    kept_map = tuple(m for _, k, w in keep for m in index_map[k : k + w])
    pairs = sorted(batch.items())
    common = {"operand_batching_dims": tuple(o for o, _ in pairs)}
    if scatter:
        dnums = lax.ScatterDimensionNumbers(
            update_window_dims=dn.update_window_dims,
            inserted_window_dims=tuple(d for d in dropped if d not in batch),
            scatter_dims_to_operand_dims=kept_map,
            scatter_indices_batching_dims=tuple(i for _, i in pairs),
            **common,
        )
    else:
        dnums = lax.GatherDimensionNumbers(
            offset_dims=dn.offset_dims,
            collapsed_slice_dims=tuple(d for d in dropped if d not in batch),
            start_index_map=kept_map,
            start_indices_batching_dims=tuple(i for _, i in pairs),
            **common,
        )
    params = dict(eqn.params, dimension_numbers=dnums)
    columns = [v for v, _, _ in keep]
    rest = list(ins[2:])
    prim = eqn.primitive

    def fn(op, *more):
        cols, tail = more[: len(columns)], more[len(columns) :]
        idx = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=-1)
        out = prim.bind(op, idx, *tail, **params)
        return list(out) if prim.multiple_results else [out]

    return fn, [operand, *columns, *rest]
