"""Anytime answers: the best feasible choice any solver has found so far, for a caller that
must answer before the solver returns (``autopar solve`` on SIGINT or past its deadline).

In: solvers call ``offer(cost, choice)`` whenever they hold a feasible answer (``choice``: the
full choice, or a function returning it, called only when the answer is asked for, so an
offer costs a comparison); a caller opens ``watch()`` around the solve, in another thread if
need be, and reads ``Watch.best()``. Out: ``best()`` -> ``(cost, choice)`` of the cheapest
offer, or None. Offers while nobody watches cost nothing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

_lock = threading.Lock()
_current: Watch | None = None


class Watch:
    """The cheapest offer made while it is open."""

    def __init__(self):
        self.cost = math.inf
        self._get: Callable[[], np.ndarray] | None = None

    def best(self) -> tuple | None:
        with _lock:
            cost, get = self.cost, self._get
        return None if get is None else (cost, np.asarray(get(), np.int64))


@contextmanager
def watch():
    """Collect offers until the block ends (one watch at a time)."""
    global _current
    w = Watch()
    with _lock:
        _current = w
    try:
        yield w
    finally:
        with _lock:
            if _current is w:
                _current = None


def offer(cost: float, choice: np.ndarray | Callable[[], np.ndarray]) -> None:
    """A feasible answer of total ``cost``; kept when it is the cheapest so far."""
    w = _current
    if w is None or not cost < w.cost:
        return
    if callable(choice):
        get = choice
    else:
        fixed = np.array(choice, np.int64)
        get = lambda: fixed
    with _lock:
        if cost < w.cost:
            w.cost, w._get = cost, get
