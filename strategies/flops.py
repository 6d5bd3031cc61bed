"""FLOPs of one operator, whole (unsplit).

In: a graph ``Node``. Out: ``flops(node)``: a contraction is 2 x output elements x contracted
size (a convolution's: its kernel's input features, of its group, times its window), a
reduction one op per input element, a factorisation, solve or FFT its usual count
(``rules.linalg.flops``), everything else one op per output element (``threefry2x32``, random
bits: its 20 rounds of add, rotate and xor and 5 key injections, ~58 integer ops per output
word). ``CONTRACTIONS``: the operators priced at a matmul's rate.
"""

from __future__ import annotations

import math

from jax import lax

from .rules import linalg

LINALG = frozenset(linalg.RULES)
CONTRACTIONS = frozenset({lax.dot_general_p.name, lax.conv_general_dilated_p.name})


def flops(node) -> float:
    out = node.outputs[0]
    if node.prim == lax.dot_general_p.name:
        (lc, _), _ = node.params["dimension_numbers"]
        k = math.prod(node.inputs[0].shape[d] for d in lc)
        return 2.0 * _size(out.shape) * k
    if node.prim == lax.conv_general_dilated_p.name:
        _, rhs_spec, _ = node.params["dimension_numbers"]
        kernel = node.inputs[1].shape  # an output element: its output feature's slice
        return 2.0 * _size(out.shape) * (_size(kernel) // kernel[rhs_spec[0]])
    if node.prim.startswith("reduce_") or node.prim in (lax.argmax_p.name, lax.argmin_p.name):
        return float(_size(node.inputs[0].shape))
    if node.prim in LINALG:
        return linalg.flops(node)
    return float(sum(_size(v.shape) for v in node.outputs)) * _OPS_PER_ELEMENT.get(node.prim, 1)


_OPS_PER_ELEMENT = {"threefry2x32": 58}  # see the module docstring


def _size(shape) -> int:
    return int(math.prod(shape))
