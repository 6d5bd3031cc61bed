"""The ``autopar`` command line.

In: ``sys.argv``. Out: exit status and text. Subcommands:
- ``autopar solve PROBLEM TIMEOUT [--solver NAME]``: read an IOPDDL problem (``.json`` or
  ``.json.gz``), search within TIMEOUT seconds (reading the file counts), print progress and the
  cost to stderr and, last on stdout, the chosen strategy indices ``[s0, s1, ...]`` (the
  contest's output format).
"""
from __future__ import annotations

import argparse
import sys
import time

from .errors import AutoparError


def _solve(args) -> int:
    from .strategies.problem import SearchProblem
    from .strategies.solvers import get
    start = time.monotonic()
    problem = SearchProblem.load(args.problem)
    loaded = time.monotonic() - start
    say = lambda msg: print(f"[{time.monotonic() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)
    say(f"{problem.name}: {problem.num_nodes} nodes, {problem.num_edges} edges, limit "
        f"{problem.usage_limit} (read in {loaded:.1f}s)")
    left = args.timeout - (time.monotonic() - start)
    solution = get(args.solver)(problem, time_limit=max(left, 1.0), progress=say)
    say(f"cost {solution.cost:.10g}, peak memory {solution.peak} of {problem.usage_limit}, "
        f"solver {solution.solver}{' (optimal)' if solution.optimal else ''}")
    print(solution, flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description="autopar: auto-parallel "
                                     "compiler for JAX training steps.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("solve", help="solve an IOPDDL strategy-search problem",
                       description="Solve an IOPDDL problem file within a time limit and print "
                                   "the chosen strategy indices last.")
    p.add_argument("problem", help="problem file (.json or .json.gz, IOPDDL format)")
    p.add_argument("timeout", type=float, help="seconds for the whole run, reading included")
    p.add_argument("--solver", default="best",
                   help="best (default), ilp, dynamic_programming, sharding_propagation, "
                        "local_search or brute_force")
    p.set_defaults(run=_solve)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except AutoparError as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
