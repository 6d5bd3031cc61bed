"""Elementwise primitives: every operand has the result's rank (size-1 dimensions broadcast)
or is a scalar.

In: a node of an elementwise primitive. Out: the spec ``"d0 d1 .., d0 d1 .. -> d0 d1 .."``;
scalar operands get no letters and a size-1 dimension broadcast against a larger one is ``_``.
Linear groups say where partial sums may flow through.
"""

from __future__ import annotations

import numpy as np

from .spec import OpSpec, Rule


def _letters(rank):
    return tuple(f"d{i}" for i in range(rank))


def _operands(node):
    shape = node.outputs[0].shape
    out = _letters(len(shape))
    ins = tuple(
        tuple(l if s == o else None for l, s, o in zip(out, x.shape, shape))
        if len(x.shape) == len(shape)
        else ()
        for x in node.inputs
    )
    return ins, out


def elementwise(linear=()):
    def spec(node):
        ins, out = _operands(node)
        return OpSpec(ins, tuple(out for _ in node.outputs), frozenset(), linear)

    return Rule(spec)


_NONLINEAR = [
    "exp",
    "log",
    "tanh",
    "logistic",
    "sqrt",
    "rsqrt",
    "integer_pow",
    "pow",
    "max",
    "min",
    "abs",
    "sign",
    "erf",
    "erf_inv",
    "log1p",
    "expm1",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "floor",
    "ceil",
    "round",
    "rem",
    "exp2",
    "is_finite",
    "square",
    "clamp",
    "nextafter",
    "atan2",
    "sin",
    "cos",
    "cbrt",
    "stop_gradient",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "threefry2x32",  # threefry2x32: each counter's bits from it and the key alone
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "erfc",
    "lgamma",
    "digamma",
    "polygamma",
    "zeta",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "regularized_incomplete_beta",
    "bessel_i0e",
    "bessel_i1e",
    "population_count",
    "clz",
    "mulhi",
    "eq_to",
    "le_to",
    "lt_to",
]  # *_to: total-order comparisons

RULES = {name: elementwise() for name in _NONLINEAR}
RULES.update(
    {
        "add": elementwise(linear=((0, 1),)),
        "sub": elementwise(linear=((0, 1),)),
        "add_any": elementwise(linear=((0, 1),)),
        "neg": elementwise(linear=((0,),)),
        "mul": elementwise(linear=((0,), (1,))),
        "div": elementwise(linear=((0,),)),
        "copy": elementwise(linear=((0,),)),
        "real": elementwise(linear=((0,),)),
        "imag": elementwise(linear=((0,),)),
        "conj": elementwise(linear=((0,),)),
        "complex": elementwise(linear=((0, 1),)),
        "convert_element_type": Rule(lambda node: _convert_spec(node)),
        "reduce_precision": elementwise(linear=((0,),)),
        "select_n": Rule(lambda node: _select_spec(node)),
        "bitcast_convert_type": Rule(lambda node: _bitcast_spec(node)),
    }
)


def _bitcast_spec(node):
    """Elementwise between types of one width; to a narrower type the result gains a last
    dimension (the pieces of an element), from one it loses it: never split."""
    (x,), (y,) = node.inputs, node.outputs
    if len(x.shape) == len(y.shape):
        return elementwise().spec(node)
    if len(y.shape) > len(x.shape):
        dims = _letters(len(x.shape))
        return OpSpec((dims,), (dims + (None,),), frozenset(), ())
    dims = _letters(len(y.shape))
    return OpSpec((dims + (None,),), (dims,), frozenset(), ())


def _convert_spec(node):
    """A conversion is linear only from a floating operand: a sum of bools is not a bool."""
    spec = elementwise().spec(node)
    if all(np.issubdtype(np.dtype(x.dtype), np.inexact) for x in node.inputs):
        spec = OpSpec(spec.inputs, spec.outputs, spec.reduce, ((0,),))
    return spec


def _select_spec(node):
    """``select_n(pred, *cases)``: linear jointly in the cases, never in the predicate."""
    ins, out = _operands(node)
    return OpSpec(ins, (out,), frozenset(), (tuple(range(1, len(node.inputs))),))
