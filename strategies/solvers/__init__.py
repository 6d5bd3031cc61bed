"""Solvers over a SearchProblem, and the registry ``search_mode`` names map to.

In: a ``SearchProblem`` (strategies/problem.py). Out: a ``Solution`` (one strategy index per
node) that respects ``usage_limit``; ``InfeasibleError`` (via ``problem.check_fits``) when none
can. Every solver has the signature

    solve(problem, *, time_limit=None, initial=None, progress=None) -> Solution

``time_limit`` in seconds (None: the solver's own default), ``initial`` a Solution to start
from or polish, ``progress`` an optional callable ``progress(message: str)`` for searches that
take more than a second. Solvers are pure: no devices, and no global state except the
anytime offers (anytime.py) of their best answers so far, which only a caller watching reads.
"""

from __future__ import annotations

import importlib

from autopar.errors import ConfigError

# search_mode (MindSpore's names, plus autopar's own) -> module implementing ``solve``
MODULES = {
    "sharding_propagation": "bfs_propagation",
    "dynamic_programming": "dp",
    "ilp": "ilp",
    "local_search": "local_search",
    "brute_force": "brute",
    # what ``autopar solve`` runs by default: on G's family (tuning set; BENCHMARKS.md) it
    # proved every variant optimal in 15-30 s, where CP-SAT seeded by dynamic programming left
    # a 16% gap on one at 120 s; every larger IOPDDL problem already went to it
    "best": "local_search",
}


def get(name: str):
    """The ``solve`` function registered under ``name``."""
    if name not in MODULES:
        raise ConfigError(f"no solver named {name!r}; choose one of {', '.join(sorted(MODULES))}.")
    return importlib.import_module(f".{MODULES[name]}", __name__).solve
