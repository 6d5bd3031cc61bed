"""A plan's layouts as JAX shardings: what ``jax.jit``, Flax and orbax take.

In: a Layout per flattened argument or result leaf, a ``jax.sharding.Mesh`` (or
``AbstractMesh``) whose axis names are the layouts', the pytree structure of those leaves and,
for typed PRNG key leaves, how many trailing dimensions of the key's data are its
implementation's. Out: the same pytree of ``NamedSharding``s (``named_shardings``), ready for
``jax.jit(step, in_shardings=..., out_shardings=...)``; ``mesh_of`` checks the mesh. A layout
holding partial sums has no PartitionSpec: results never do.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .errors import ConfigError


def mesh_of(mesh, axis_names, shape):
    """``mesh`` if it is a jax Mesh or AbstractMesh with ``axis_names`` of sizes ``shape``,
    else a ConfigError saying what differs."""
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ConfigError(
            f"{mesh!r} is not a jax.sharding.Mesh or AbstractMesh; build one "
            f"with axes {tuple(axis_names)} of sizes {tuple(shape)}, e.g. "
            f"jax.make_mesh({tuple(shape)}, {tuple(axis_names)})."
        )
    if tuple(mesh.axis_names) != tuple(axis_names) or tuple(mesh.axis_sizes) != tuple(shape):
        raise ConfigError(
            f"the plan's mesh has axes {tuple(axis_names)} of sizes "
            f"{tuple(shape)}; {mesh} has {tuple(mesh.axis_names)} of "
            f"{tuple(mesh.axis_sizes)}; give a mesh like the plan's."
        )
    return mesh


def named_shardings(layouts, mesh, tree=None, key_dims=None):
    """A NamedSharding on ``mesh`` per layout (``key_dims``: flat position -> trailing key
    data dimensions dropped, so a typed key's sharding has the key's rank), unflattened into
    ``tree`` (else a tuple)."""
    key_dims = key_dims or {}
    out = []
    for j, layout in enumerate(layouts):
        spec = tuple(layout.to_partition_spec())  # one entry per dimension
        out.append(NamedSharding(mesh, PartitionSpec(*spec[: layout.rank - key_dims.get(j, 0)])))
    return tuple(out) if tree is None else jax.tree.unflatten(tree, out)
