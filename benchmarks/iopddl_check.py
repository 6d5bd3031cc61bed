"""An IOPDDL answer checker that shares no code with autopar's solvers.

In: a problem file (IOPDDL JSON, optionally gzipped) and an answer: a list of strategy indices,
one per node (``[s0, s1, ...]``, as ``autopar solve`` prints last; a file, or ``-`` for stdin,
where the last line that parses as a list is the answer). Out: one JSON line with the total cost,
the peak memory and the usage limit, and whether the answer is valid: one index per node, each
in range, no strategy of infinite cost, and at no time step the sum of the live nodes' usages
above the limit. Exit status 0 when valid, 1 when not.

It reads the JSON with the standard library only and computes in plain Python integers and
floats (the contest's own definition: node costs plus edge costs of the chosen pairs; memory
by a sweep over interval starts and ends), so a bug in autopar's ``SearchProblem`` cannot hide
in both the solver and its check.

    python benchmarks/iopddl_check.py PROBLEM.json.gz ANSWER.txt
    autopar solve PROBLEM.json.gz 60 | python benchmarks/iopddl_check.py PROBLEM.json.gz -
"""
from __future__ import annotations

import gzip
import json
import math
import sys


def read_problem(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("problem", data)


def read_answer(text: str) -> list:
    """The last line of ``text`` that is a JSON list of integers."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            try:
                got = json.loads(line)
            except ValueError:
                continue
            if isinstance(got, list) and all(isinstance(x, int) for x in got):
                return got
    raise ValueError("no answer: no line of the form [s0, s1, ...]")


def check(problem: dict, answer: list) -> dict:
    nodes, edges = problem["nodes"], problem.get("edges", {})
    costs, usages, intervals = nodes["costs"], nodes["usages"], nodes["intervals"]
    errors = []
    if len(answer) != len(costs):
        errors.append(f"{len(answer)} indices for {len(costs)} nodes")
        return {"valid": False, "errors": errors}
    bad = [i for i, s in enumerate(answer) if not 0 <= s < len(costs[i])]
    if bad:
        errors.append(f"index out of range at nodes {bad[:5]}")
        return {"valid": False, "errors": errors}
    total = 0.0
    for i, s in enumerate(answer):
        total += costs[i][s]
    for (u, v), m in zip(edges.get("nodes", []), edges.get("costs", [])):
        total += m[answer[u] * len(costs[v]) + answer[v]]
    if not math.isfinite(total):
        errors.append("infinite cost")
    events = {}
    for i, s in enumerate(answer):
        start, end = intervals[i]
        if end > start and usages[i][s]:
            events[start] = events.get(start, 0) + usages[i][s]
            events[end] = events.get(end, 0) - usages[i][s]
    live = peak = 0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    limit = problem.get("usage_limit")
    if limit is not None and peak > limit:
        errors.append(f"peak memory {peak} above the usage limit {limit}")
    return {"valid": not errors, "cost": total, "peak": peak, "limit": limit, "errors": errors}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    text = sys.stdin.read() if argv[1] == "-" else open(argv[1]).read()
    result = check(read_problem(argv[0]), read_answer(text))
    print(json.dumps(result))
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
