"""``ap.comm``: collectives a hybrid_parallel step calls itself, on per-device values.

In: per-device arrays inside a step compiled with ``parallel_mode="hybrid_parallel"`` and the
names of mesh axes (one name or a tuple, taken as one group, first axis major). Out: the
collective's per-device result. Each is the ``jax.lax`` collective of the same meaning, so it
differentiates as ``jax.lax``'s does inside ``jax.shard_map`` (with its replication typing: the
gradient of a parameter every device holds whole arrives already summed over the devices);
autopar lowers each to one collective of its runtimes:

| call                                        | jax.lax                                   | result per device                      |
|---------------------------------------------|-------------------------------------------|----------------------------------------|
| ``all_reduce(x, axis, op="sum")``           | ``psum`` / ``pmax`` / ``pmin``            | the reduction over the group           |
| ``all_gather(x, axis, dim=0)``              | ``all_gather_invariant(tiled=True)``      | blocks concatenated along ``dim`` (typed the same on every device) |
| ``reduce_scatter(x, axis, dim=0)``          | ``psum_scatter(tiled=True)``              | this device's block of the sum         |
| ``all_to_all(x, axis, split_dim, concat_dim)`` | ``all_to_all(tiled=True)``             | block j of ``split_dim`` sent to device j, received blocks concatenated along ``concat_dim`` |
| ``axis_index(axis)``                        | ``axis_index``                            | this device's index in the group (int32) |

As in ``jax.lax``, ``op="max"``/``"min"`` have no derivative (apply them to
``jax.lax.stop_gradient`` values inside a differentiated function). Called outside such a step (no mesh axis of that name is bound) they raise ``ConfigError``.
"""

from __future__ import annotations

from jax import lax

from .errors import ConfigError

try:  # JAX >= 0.6; not in jax.lax's public names yet
    from jax._src.lax.parallel import all_gather_invariant as _gather
except ImportError:  # pragma: no cover - older JAX
    _gather = lax.all_gather

_REDUCE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


def _bound(what, axis, call):
    try:
        return call()
    except NameError as e:
        raise ConfigError(
            f"ap.comm.{what} over axis {axis!r}: {e}. ap.comm collectives run inside a step "
            "compiled with parallel_mode='hybrid_parallel' whose mesh has that axis (see "
            "mesh_shape / mesh_axis_names)."
        ) from None


def all_reduce(x, axis, op: str = "sum"):
    if op not in _REDUCE:
        raise ConfigError(
            f"ap.comm.all_reduce: op={op!r} is not valid; choose one of "
            f"{', '.join(map(repr, _REDUCE))}."
        )
    return _bound("all_reduce", axis, lambda: _REDUCE[op](x, axis))


def all_gather(x, axis, dim: int = 0):
    # the gathered value is the same on every device of the group, and JAX's replication
    # typing knows it only from all_gather_invariant (lax.all_gather's result counts as
    # varying: a loss over the gathered batch could not be returned, and its parameters'
    # gradients would have been summed over the group once more)
    return _bound("all_gather", axis, lambda: _gather(x, axis, axis=dim, tiled=True))


def reduce_scatter(x, axis, dim: int = 0):
    return _bound(
        "reduce_scatter", axis, lambda: lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    )


def all_to_all(x, axis, split_dim: int, concat_dim: int):
    return _bound(
        "all_to_all",
        axis,
        lambda: lax.all_to_all(x, axis, split_axis=split_dim, concat_axis=concat_dim, tiled=True),
    )


def axis_index(axis):
    return _bound("axis_index", axis, lambda: lax.axis_index(axis))
