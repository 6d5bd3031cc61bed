"""``@ap.parallel``: a step function compiled on first call, once per argument shapes, config
and static arguments.

In: the step and ``compile``'s keyword options (a config, or none: the MindSpore-style context's
at each call). Out: a ``ParallelFunction`` that carries the step's name, doc and signature,
``.compile(*args)`` gives the ``Compiled`` for those arguments, and calling it runs that.
"""

from __future__ import annotations

import functools

import jax

from ..arguments import leaf_type
from ..config import ParallelConfig
from ..context import context_config
from .api import compile
from .call_args import split_static
from .compiled import Compiled, positional


class ParallelFunction:
    """What ``@ap.parallel`` returns: ``.compile(*args)`` or call it directly (compiled once per
    argument shapes and config: a bare decorator follows the context as it is at each call)."""

    def __init__(self, fn, config, **kw):
        self.fn, self.config, self.kw = fn, config, kw
        self._cache = {}
        functools.update_wrapper(self, fn)  # the step's name, doc, signature, module

    def compile(self, *args) -> Compiled:
        _, dynamic, call = split_static(
            self.fn, args, self.kw.get("static_argnums"), self.kw.get("static_argnames")
        )
        flat, tree = jax.tree.flatten(dynamic)
        config = self.config or context_config()
        key = (tree, tuple(leaf_type(x) for x in flat), config, call.values)
        if key not in self._cache:
            self._cache[key] = compile(self.fn, *args, config=config, **self.kw)
        return self._cache[key]

    def __call__(self, *args, **kwargs):
        if kwargs:  # by the step's signature, as a compiled step takes them
            args = positional(self.fn, args, kwargs)
        return self.compile(*args)(*args)


def parallel(fn=None, *, config: ParallelConfig | None = None, **kw):
    """``@ap.parallel(config=cfg)`` on a step function, or bare ``@ap.parallel`` (the config
    of ``ap.set_auto_parallel_context`` when the step is first compiled for its shapes)."""
    if fn is None:
        return lambda f: ParallelFunction(f, config, **kw)
    return ParallelFunction(fn, config, **kw)
