"""Shape primitives: data movement without arithmetic.

In: a node of ``broadcast_in_dim``, ``reshape``, ``transpose``, ``squeeze``, ``concatenate``,
``split``, ``stack``, ``unstack``, ``tile``, ``slice``, ``pad``, ``rev`` or ``iota``. Out: its
``OpSpec`` (and, for ``slice``, the local-params function). Every op here is linear in its
array operands, so partial sums flow through unchanged. A dimension gets a letter only where
each device computing on its block gives exactly its block of the result:

- ``broadcast_in_dim``: an operand dimension shares the output letter if it keeps its size; a
  size-1 operand dimension broadcast to size ``n`` is ``_`` on the operand and a free letter on
  the output (every device broadcasts to its own block). ``jnp.expand_dims`` lowers to this.
- ``reshape``: dimensions are grouped into runs whose sizes multiply to the same number; only
  the major (first) dimension of a group, in and out, shares a letter: a split of it is a
  contiguous chunk of the flattened group on both sides (the candidate check makes the split
  count divide both sizes). Size-1 dimensions are left out of groups.
- ``concatenate``/``split``/``stack``/``unstack``: the joined axis is ``_``.
- ``slice``/``pad``/``tile``/``rev``/``iota``: only dimensions the op leaves whole (taken in full,
  not padded, not tiled, not reversed; iota's counting dimension) may be split.

``expand_dims`` is not a JAX primitive (it is ``broadcast_in_dim``); ``convert_element_type``,
``copy`` and ``select_n`` are elementwise (see ``elementwise.py``).
"""

from __future__ import annotations

import numpy as np

from autopar.graph import Const

from .spec import OpSpec, Rule


def _letters(rank, prefix="d"):
    return tuple(f"{prefix}{i}" for i in range(rank))


def _linear_all(node):
    return (tuple(range(len(node.inputs))),)


# ---------------------------------------------------------------- broadcast_in_dim


def broadcast_in_dim_spec(node):
    out_shape = node.outputs[0].shape
    out = list(_letters(len(out_shape)))
    x = node.inputs[0]
    ins = [None] * len(x.shape)
    for i, o in enumerate(node.params["broadcast_dimensions"]):
        if x.shape[i] == out_shape[o]:
            ins[i] = out[o]
    extra = tuple(() for _ in node.inputs[1:])  # dynamic-shape operands, never split
    return OpSpec((tuple(ins),) + extra, (tuple(out),), frozenset(), ((0,),))


# ---------------------------------------------------------------- reshape


def reshape_groups(in_shape, out_shape):
    """Runs of dimensions with equal size products: ``[(in_dims, out_dims), ...]``, size-1
    dimensions left out. ``(4, 8, 32) -> (4, 8, 4, 8)`` gives
    ``[([0],[0]), ([1],[1]), ([2],[2,3])]``.
    Returns ``[]`` when a zero-size dimension makes grouping meaningless."""
    if 0 in in_shape or 0 in out_shape:
        return []
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        pi, pj = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            else:
                gj.append(outs[j])
                pj *= out_shape[outs[j]]
                j += 1
        groups.append((gi, gj))
    return groups


def reshape_spec(node):
    in_shape, out_shape = node.inputs[0].shape, node.outputs[0].shape
    ins, outs = [None] * len(in_shape), [None] * len(out_shape)
    if node.params.get("dimensions") is None:
        for k, (gi, gj) in enumerate(reshape_groups(in_shape, out_shape)):
            ins[gi[0]] = outs[gj[0]] = f"g{k}"
    extra = tuple(() for _ in node.inputs[1:])
    return OpSpec((tuple(ins),) + extra, (tuple(outs),), frozenset(), ((0,),))


# ---------------------------------------------------------------- permutations and axes


def transpose_spec(node):
    perm = node.params["permutation"]
    ins = _letters(len(perm))
    return OpSpec((ins,), (tuple(ins[p] for p in perm),), frozenset(), ((0,),))


def squeeze_spec(node):
    rank = len(node.inputs[0].shape)
    drop = {d % rank for d in node.params["dimensions"]}
    ins = tuple(None if d in drop else f"d{d}" for d in range(rank))
    return OpSpec((ins,), (tuple(l for l in ins if l),), frozenset(), ((0,),))


def _axis_spec(rank, axis):
    return tuple(None if d == axis else f"d{d}" for d in range(rank))


def concatenate_spec(node):
    dims = _axis_spec(len(node.outputs[0].shape), node.params["dimension"])
    return OpSpec(tuple(dims for _ in node.inputs), (dims,), frozenset(), _linear_all(node))


def split_spec(node):
    dims = _axis_spec(len(node.inputs[0].shape), node.params["axis"])
    return OpSpec((dims,), tuple(dims for _ in node.outputs), frozenset(), ((0,),))


def stack_spec(node):
    axis = node.params["axis"]
    out = _axis_spec(len(node.outputs[0].shape), axis)
    ins = out[:axis] + out[axis + 1 :]
    return OpSpec(tuple(ins for _ in node.inputs), (out,), frozenset(), _linear_all(node))


def unstack_spec(node):
    axis = node.params["axis"]
    ins = _axis_spec(len(node.inputs[0].shape), axis)
    out = ins[:axis] + ins[axis + 1 :]
    return OpSpec((ins,), tuple(out for _ in node.outputs), frozenset(), ((0,),))


def tile_spec(node):
    reps = node.params["reps"]
    dims = tuple(f"d{d}" if r == 1 else None for d, r in enumerate(reps))
    return OpSpec((dims,), (dims,), frozenset(), ((0,),))


def rev_spec(node):
    rank = len(node.inputs[0].shape)
    rev = set(node.params["dimensions"])
    dims = tuple(None if d in rev else f"d{d}" for d in range(rank))
    return OpSpec((dims,), (dims,), frozenset(), ((0,),))


def iota_spec(node):
    p = node.params
    out = _axis_spec(len(p["shape"]), p["dimension"])
    return OpSpec(tuple(() for _ in node.inputs), (out,), frozenset(), ())


def iota_2x32_spec(node):
    """A 64-bit counter over the whole shape (random bits' threefry counters), as two uint32
    halves: every element's value depends on its place in every dimension, so never split
    (a split layout is a slice of it, made locally). The trace rewrites it into elementwise
    operators that split (``autopar.trace_keys.counters``); only a graph built otherwise
    reaches the planner with it."""
    out = (None,) * len(node.params["shape"])
    return OpSpec((), (out, out), frozenset(), ())


# ---------------------------------------------------------------- slice and pad


def _slice_whole(node):
    """Per dimension: True where ``slice`` takes the whole dimension (start 0, stride 1)."""
    p, shape = node.params, node.inputs[0].shape
    strides = p.get("strides") or (1,) * len(shape)
    return [
        s == 0 and l == n and st == 1
        for s, l, st, n in zip(p["start_indices"], p["limit_indices"], strides, shape)
    ]


def slice_spec(node):
    dims = tuple(f"d{d}" if whole else None for d, whole in enumerate(_slice_whole(node)))
    return OpSpec((dims,), (dims,), frozenset(), ((0,),))


def slice_local_params(node, in_shapes, out_shapes):
    p = dict(node.params)
    p["limit_indices"] = tuple(
        in_shapes[0][d] if whole else l
        for d, (whole, l) in enumerate(zip(_slice_whole(node), p["limit_indices"]))
    )
    return p


def _is_zero_const(x) -> bool:
    return isinstance(x, Const) and bool(np.all(np.asarray(x.value) == 0))


def pad_spec(node):
    """``pad(x, v)``: unpadded dimensions may be split. Jointly linear in ``(x, v)``; in ``x``
    alone when ``v`` is a literal zero."""
    dims = tuple(
        f"d{d}" if tuple(c) == (0, 0, 0) else None
        for d, c in enumerate(node.params["padding_config"])
    )
    linear = ((0,),) if _is_zero_const(node.inputs[1]) else ((0, 1),)
    return OpSpec((dims, ()), (dims,), frozenset(), linear)


RULES = {
    "broadcast_in_dim": Rule(broadcast_in_dim_spec),
    "reshape": Rule(reshape_spec),
    "transpose": Rule(transpose_spec),
    "squeeze": Rule(squeeze_spec),
    "concatenate": Rule(concatenate_spec),
    "split": Rule(split_spec),
    "stack": Rule(stack_spec),
    "unstack": Rule(unstack_spec),
    "tile": Rule(tile_spec),
    "rev": Rule(rev_spec),
    "iota": Rule(iota_spec),
    "iota_2x32_shape": Rule(iota_2x32_spec),
    "slice": Rule(slice_spec, slice_local_params),
    "pad": Rule(pad_spec),
}

__all__ = ["RULES", "reshape_groups"]
