"""Results that stay in the native workers between calls (``RuntimeOptions.resident``).

A training step threads its parameters and optimizer state through every call. With residency
on, each rank also keeps its block of every result of ``RESIDENT_BYTES`` or more, and the caller
gets that result as a read-only numpy array. Passed back unchanged to the step that made it, in
the layout the step takes for that argument, only its key goes to the workers; so a loop
``loss, params = step(params, batch)`` sends the batch in, not the parameters. The smaller
results a whole step packs (``runtime.packing``) stay too, the replicated ones' pack of the last
call only, under a negative key (``Residency.pack_key``), and come back as read-only views of
the caller's one copy of it; when a call's replicated arguments are those arrays, in a row as
the step takes them, that pack's key goes instead (``ArgPacker.fill``). The results
are ordinary numpy arrays (JAX, numpy and optax take them as before); an array made writable
again (``flags.writeable = True``) is sent whole, as any other argument, since it may have
changed. A block is dropped in the workers at the call after its array was garbage collected.

Caller side: ``Residency`` (a runner's bookkeeping). Worker side: ``take`` (argument blocks, a
reference replaced by the block it names; dropped keys forgotten), ``keep`` (results stored
under their keys). A reference to a kept block is its key, a plain ``int`` in the call's list
of blocks (``is_ref``; every other block is an array): pickled 20x faster than an object of
a class of its own (0.7 against 13.7 us for a step's 16 parameters, per rank per call).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.errors import CollectiveError
from autopar.layout import Layout

from . import wire

if TYPE_CHECKING:
    from .launcher import Job

RESIDENT_BYTES = 64 << 10  # results this large or larger stay in the workers too

# ------------------------------------------------------------------ worker side

STORE: dict = {}  # this worker's kept blocks, by key


def is_ref(block) -> bool:
    """Whether an argument block is a reference to a block the worker kept (its key)."""
    return type(block) is int


def take(blocks, drop) -> list:
    """Forget the blocks under ``drop``; ``blocks`` with each reference replaced by its block."""
    for key in drop:
        STORE.pop(key, None)
    out = []
    for b in blocks:
        if type(b) is int:
            if b not in STORE:
                raise CollectiveError(
                    f"a resident argument (key {b}) is not in this worker; "
                    "it was dropped or made by another job."
                )
            b = STORE[b]
        out.append(b)
    return out


def keep(results, keys) -> None:
    """Store ``results[i]`` under ``keys[i]`` for each result index in ``keys`` (its own copy if
    it is an argument's block still in the call's shared memory, ``wire.owned``)."""
    for i, key in keys.items():
        STORE[key] = wire.owned(results[i])


# ------------------------------------------------------------------ caller side


@dataclass(frozen=True)
class _Kept:
    array: weakref.ref[np.ndarray]
    key: int
    job: Job
    layout: Layout


class Residency:
    """A runner's results kept in its workers: fresh keys, each kept result's array (by id,
    weakly), and the keys whose arrays are gone (dropped at the next call)."""

    def __init__(self) -> None:
        self._keys, self._pack_keys = itertools.count(), itertools.count(-1, -1)
        self._gone: list[int] = []  # keys whose arrays are gone
        self._lock = threading.Lock()
        self._kept: dict[int, _Kept] = {}

    def key(self) -> int:
        return next(self._keys)

    def pack_key(self) -> int:
        """A fresh key for a whole step's replicated results' pack (negative: apart)."""
        return next(self._pack_keys)

    def kept(self, array: np.ndarray, key: int, job, layout) -> np.ndarray:
        """Record that the workers of ``job`` hold ``array`` (a result in ``layout``) under
        ``key``; ``array``, now read-only."""
        array.flags.writeable = False
        ident = id(array)
        # the weak reference's callback (not a weakref.finalize: a third of the time) drops it
        self._kept[ident] = _Kept(
            weakref.ref(array, lambda _: self._release(ident, key)), key, job, layout
        )
        return array

    def _release(self, ident, key) -> None:
        with self._lock:
            self._gone.append(key)
            if ident in self._kept and self._kept[ident].key == key:
                del self._kept[ident]

    def drops(self) -> list:
        """The keys whose arrays are gone since the last call (the workers drop them)."""
        with self._lock:
            out, self._gone = self._gone, []
        return out

    def dropped_later(self, keys) -> None:
        with self._lock:
            self._gone.extend(keys)

    def ref_for(self, x, job, layout):
        """The key of ``x`` (a reference, ``is_ref``) when it is a result the workers of
        ``job`` hold in ``layout``, still read-only; else None."""
        k = self._kept.get(id(x))
        if (
            k is None
            or k.array() is not x
            or k.job is not job
            or k.layout != layout
            or not isinstance(x, np.ndarray)
            or x.flags.writeable
        ):
            return None
        return k.key
