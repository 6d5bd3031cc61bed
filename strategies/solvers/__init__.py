"""Solvers over a SearchProblem, and the registry ``search_mode`` names map to.

In: a ``SearchProblem`` (strategies/problem.py). Out: a ``Solution`` (one strategy index per
node) that respects ``usage_limit``; ``InfeasibleError`` (via ``problem.check_fits``) when none
can. Every solver has the signature

    solve(problem, *, time_limit=None, initial=None, progress=None) -> Solution

``time_limit`` in seconds (None: the solver's own default), ``initial`` a Solution to start
from or polish, ``progress`` an optional callable ``progress(message: str)`` for searches that
take more than a second. Solvers are pure: no devices, no global state.
"""
