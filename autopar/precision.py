"""Silent promotions: 16-bit activations turned into float32 by a strongly typed constant.

In: a jaxpr (``jax.make_jaxpr``'s, before autopar inlines it). Out: ``promotions(jaxpr)``: the
source lines where an operator reads a bfloat16 or float16 value that JAX converted to float32
for it because its other operand is a float32 scalar constant that is not weakly typed (a
NumPy scalar: ``x / np.sqrt(d)`` is ``x / np.float64(...)``, which JAX takes as float32;
``jnp.float32(c)``): everything computed from there on is float32, twice the activation bytes
and, on an accelerator, the matmuls at the float32 rate. A Python float (``x / 8.0``,
``x / math.sqrt(d)``) is weakly typed and keeps the 16-bit dtype; an explicit ``astype`` is
the user's choice and is not reported.
"""

from __future__ import annotations

import numpy as np
from jax._src import source_info_util
from jax.extend.core import Literal

SIXTEEN = ("bfloat16", "float16")
# the frames of an explicit conversion (x.astype, lax.convert_element_type) as JAX records them
EXPLICIT = ("astype", "convert_element_type", "_convert_element_type")


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(j, "jaxpr", j)
            if hasattr(inner, "eqns"):
                yield inner


def _explicit(eqn) -> bool:
    tb = eqn.source_info.traceback
    names = [f.function_name for f in tb.frames] if tb is not None else []
    return any(n in EXPLICIT for n in names)


def _scalar_f32_const(v, consts) -> bool:
    aval = v.aval
    return (
        aval.shape == ()
        and str(aval.dtype) == "float32"
        and not aval.weak_type
        and (isinstance(v, Literal) or v in consts)
    )


def promotions(jaxpr, consts=frozenset()) -> list:
    """Source lines (``file:line (function)``) of the promotions in ``jaxpr`` and the jaxprs
    inside it, each once, in program order."""
    out: list[str] = []
    _walk(jaxpr, set(consts), out)
    return list(dict.fromkeys(out))


def _walk(jaxpr, consts, out):
    promoted = {}  # var -> the convert equation that made it
    for eqn in jaxpr.eqns:
        if (
            eqn.primitive.name == "convert_element_type"
            and len(eqn.invars) == 1
            and str(eqn.invars[0].aval.dtype) in SIXTEEN
            and np.dtype(eqn.params["new_dtype"]) == np.float32
            and not _explicit(eqn)
        ):
            promoted[eqn.outvars[0]] = eqn
        elif len(eqn.invars) == 2:
            a, b = eqn.invars
            for x, y in ((a, b), (b, a)):
                if not isinstance(x, Literal) and x in promoted and _scalar_f32_const(y, consts):
                    out.append(source_info_util.summarize(eqn.source_info))
        for inner in _sub_jaxprs(eqn):
            _walk(inner, set(getattr(inner, "constvars", ())), out)
