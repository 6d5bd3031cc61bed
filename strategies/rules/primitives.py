"""JAX primitive objects from the names jaxprs print, so that a table keyed by a stale or
misspelt name fails when it is imported instead of never matching.

In: primitive names (``"add"``, ``"scatter-add"``, ``"add_any"``, ``"autopar_shard"``). Out:
``primitive(name)``, the ``jax.extend.core.Primitive`` a traced node of that name carries
(``node.primitive``), or ImportError; ``primitives(*names)``, a frozenset of them.
"""

from __future__ import annotations

from jax import lax
from jax._src.random.prng import iota_2x32_shape_p
from jax.extend.random import threefry2x32_p
from jax.interpreters import ad

from autopar.annotate import shard_p

_OTHER = {
    "autopar_shard": shard_p,
    "add_any": ad.add_jaxvals_p,  # not in jax.lax
    "threefry2x32": threefry2x32_p,
    "iota_2x32_shape": iota_2x32_shape_p,
}


def primitive(name: str):
    """The primitive a jaxpr prints as ``name``; ImportError when JAX has none."""
    attr = name.replace("-", "_") + "_p"
    p = _OTHER.get(name) or getattr(lax, attr, None) or getattr(lax.linalg, attr, None)
    if p is None or p.name != name:
        raise ImportError(
            f"no JAX primitive is named {name!r} (looked for jax.lax.{attr} and "
            f"jax.lax.linalg.{attr}): a rule or primitive table names an "
            "operator this JAX version does not have; fix or delete that key"
        )
    return p


def primitives(*names: str) -> frozenset:
    return frozenset(primitive(n) for n in names)
