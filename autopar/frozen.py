"""Frozen value types hashed once.

In: a frozen dataclass (``@cached_hash`` above its ``@dataclass(frozen=True)``). Out: the same
class whose ``hash`` is computed from its fields once per object and kept on it; equality is
unchanged. Planning uses layouts, meshes, topologies and candidates as dictionary keys millions
of times on a large model, where rehashing their nested tuples each time was a tenth of the
planning time. The kept hash is never pickled: string hashes differ between processes.
"""

from __future__ import annotations

import dataclasses


def cached_hash(cls):
    names = tuple(f.name for f in dataclasses.fields(cls) if f.hash or f.hash is None and f.compare)

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, n) for n in names))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    cls.__hash__ = __hash__
    cls.__getstate__ = __getstate__
    return cls
