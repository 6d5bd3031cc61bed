"""Typed PRNG keys among a step's arguments and results (``jax.random.key``; Flax NNX keeps one
per ``Rngs`` stream in a model's state, so ``nnx.split`` hands them to every step), carried as
their key data.

In: the step and its example arguments (arrays or ``jax.ShapeDtypeStruct``s). Out: None when no
argument leaf is a typed key, else ``(step, args, KeyData)``: the step as a function of the
arguments with every typed-key leaf replaced by its data (uint32, the key's shape followed by
its implementation's, as ``jax.random.key_data`` gives it; the user's function still gets typed
keys, ``jax.random.wrap_key_data``, and any typed key it returns comes out as its data), those
arguments, and the ``KeyData`` that converts a call's arguments (``args_in``) and results
(``results_out``) the same way, so the compiled step takes and returns typed keys as the
function does. Inside the step a key is its data anyway (``autopar.trace_keys``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _data(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(x.shape) + tuple(x.dtype._impl.key_shape), np.uint32)
    return np.asarray(jax.random.key_data(x))


@dataclass
class KeyData:
    """Per flattened argument / result position, the key implementation of a typed-key leaf
    (the results' filled in when the step is traced)."""

    args: dict
    results: dict = field(default_factory=dict)

    def args_in(self, args) -> tuple:
        """``args`` with their typed-key leaves as key data."""
        flat, tree = jax.tree.flatten(args)
        return jax.tree.unflatten(
            tree, [_data(x) if i in self.args and _is_key(x) else x for i, x in enumerate(flat)]
        )

    def results_out(self, results):
        """A call's results with the typed keys the step returns wrapped again."""
        flat, tree = jax.tree.flatten(results)
        return tree.unflatten(
            [
                jax.random.wrap_key_data(x, impl=self.results[i]) if i in self.results else x
                for i, x in enumerate(flat)
            ]
        )


def split_keys(fn, args):
    """See the module docstring."""
    flat, _ = jax.tree.flatten(args)
    impls = {i: x.dtype._impl for i, x in enumerate(flat) if _is_key(x)}
    if not impls:
        return None
    keys = KeyData(impls)

    def step(*data):
        leaves, tree = jax.tree.flatten(data)
        out = fn(
            *tree.unflatten(
                [
                    jax.random.wrap_key_data(x, impl=impls[i]) if i in impls else x
                    for i, x in enumerate(leaves)
                ]
            )
        )
        leaves, tree = jax.tree.flatten(out)
        keys.results = {i: y.dtype._impl for i, y in enumerate(leaves) if _is_key(y)}
        return tree.unflatten(
            [jax.random.key_data(y) if i in keys.results else y for i, y in enumerate(leaves)]
        )

    step.__name__ = getattr(fn, "__name__", "step")
    return step, keys.args_in(args), keys
