"""Sharded checkpoints of a compiled step's state, with orbax-checkpoint (``Compiled.save`` /
``Compiled.restore``).

In: a ``Compiled``, a checkpoint directory, and the state (arrays laid out as the plan takes
them: the step's arguments at ``argnums``, or a run of them). Out: ``save`` writes it with
orbax's ``StandardCheckpointer`` (each device's block written from where it lives, as orbax
writes a sharded ``jax.Array``) plus the plan beside it (``autopar_strategy.json``, autopar's
Strategy JSON); ``restore`` reads it into the arguments' layouts of *this* step's plan, which
may be another plan than the one that saved it (8-way data parallel, 2x4 Megatron-LM, ZeRO
level 3: orbax reads each device's block of the saved arrays, whatever blocks they were saved
in). On the native backend the values go to and from the caller as host arrays, whole, as the
native runtime hands them back.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from ..config import Backend
from ..errors import ConfigError

STRATEGY_FILE = "autopar_strategy.json"


def _checkpointer():
    try:
        import orbax.checkpoint as ocp
    except ImportError:  # pragma: no cover - a dependency
        raise ConfigError(
            "checkpoints need orbax-checkpoint: pip install orbax-checkpoint"
        ) from None
    return ocp.StandardCheckpointer()


def save(compiled, path, state, argnums=None) -> str:
    """Write ``state`` (the step's argument(s) ``argnums``; None: the ones it matches) at
    ``path`` (a new directory); returns the absolute path."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise ConfigError(
            f"save: {path} exists; give a new directory (orbax writes one per "
            "checkpoint; a step number in the name keeps several)."
        )
    compiled._matching(state, argnums, "save's state")  # the step's own arguments
    native = compiled.config.backend is Backend.NATIVE
    tree = jax.tree.map(np.asarray, state) if native else state
    ckpt = _checkpointer()
    ckpt.save(path, tree)
    ckpt.wait_until_finished()
    with open(os.path.join(path, STRATEGY_FILE), "w") as f:
        f.write(compiled.strategy.to_json())
    return path


def restore(compiled, path, argnums):
    """The state saved at ``path``, as the step's argument(s) ``argnums`` in this plan's
    layouts (jax and xla backends: ``jax.Array``s placed by ``in_shardings``; native: host
    numpy arrays)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ConfigError(f"restore: no checkpoint at {path}.")
    types = compiled._argument_types(argnums)
    leaf = lambda t: isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], tuple)
    native = compiled.config.backend is Backend.NATIVE
    if native:
        target = jax.tree.map(lambda t: jax.ShapeDtypeStruct(*t), types, is_leaf=leaf)
    else:
        target = jax.tree.map(
            lambda t, s: jax.ShapeDtypeStruct(*t, sharding=s),
            types,
            compiled._argument_shardings(argnums),
            is_leaf=leaf,
        )
    got = _checkpointer().restore(path, target)
    return jax.tree.map(np.asarray, got) if native else got
