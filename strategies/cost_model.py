"""The cost model: compute time, communication time and memory of one operator candidate.

In: a graph ``Node``, one of its ``Candidate``s and the ``LogicalMesh`` (whose ``Topology``
holds every constant: per-device FLOP/s and memory bandwidth, per-level alpha/beta).
Out: seconds and bytes, per device:
- ``flops(node)``: floating-point operations of the whole (unsharded) operator: a contraction
  is 2 x output elements x contracted size, a reduction one op per input element, everything
  else one op per output element;
- ``compute_time``: roofline on the local shapes, ``max(flops / S / F, bytes_moved / BW)`` where
  S is how many ways the candidate splits the work (output splits times split contractions) and
  ``bytes_moved`` the local inputs plus outputs;
- ``output_bytes``: the local bytes of each output (what the value occupies on one device).
Operators that only relabel their operand (``FREE``: reshape, squeeze, ap.shard) cost nothing.
Communication time between candidates comes from the redistribution planner.
"""
from __future__ import annotations

import math

import numpy as np

from autopar.graph import Const


def _size(shape) -> int:
    return int(math.prod(shape))


def flops(node) -> float:
    out = node.outputs[0]
    if node.prim == "dot_general":
        (lc, _), _ = node.params["dimension_numbers"]
        k = math.prod(node.inputs[0].shape[d] for d in lc)
        return 2.0 * _size(out.shape) * k
    if node.prim.startswith("reduce_") or node.prim in ("argmax", "argmin"):
        return float(_size(node.inputs[0].shape))
    return float(sum(_size(v.shape) for v in node.outputs))


def split_factor(cand, mesh) -> int:
    """How many ways a candidate divides the operator's work: every assigned axis divides it."""
    return math.prod(mesh.axis_size(a) for _, axes in cand.assign for a in axes)


def local_bytes(layout, value, mesh) -> int:
    return _size(layout.local_shape(value.shape, mesh)) * np.dtype(value.dtype).itemsize


# operators that only relabel their operand (XLA emits no kernel for them)
FREE = frozenset({"autopar_shard", "reshape", "squeeze", "expand_dims", "stop_gradient"})


def compute_time(node, cand, mesh) -> float:
    if node.prim in FREE:
        return 0.0
    topo = mesh.topology
    moved = sum(local_bytes(l, x, mesh) for x, l in zip(node.inputs, cand.in_layouts)
                if not isinstance(x, Const))
    moved += sum(local_bytes(l, v, mesh) for v, l in zip(node.outputs, cand.out_layouts))
    return max(flops(node) / split_factor(cand, mesh) / topo.flops, moved / topo.mem_bandwidth)


def output_bytes(node, cand, mesh) -> int:
    return sum(local_bytes(l, v, mesh) for v, l in zip(node.outputs, cand.out_layouts))
