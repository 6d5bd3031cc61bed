"""Benchmark: the local_search solver on the public IOPDDL contest problems.

In: the problems in ``../shared/iopddl`` (``--data``), a selection (``--problems A,G,M,S``; also
``example``), a factor on the contest timeouts (``--scale``), optional ``--json``/``--markdown``
output paths. Out: one row per problem -- nodes, edges, timeout, cost reached, best known
contest cost, their ratio, peak memory against the limit, seconds (loading included) -- printed
as a markdown table and written where asked.

The clock of each problem starts before its file is read, as in the contest: the solver gets
``timeout * scale`` minus the load time.

    python benchmarks/iopddl.py                      # all four, contest timeouts
    python benchmarks/iopddl.py --problems G --scale 0.25 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autopar.strategies.problem import SearchProblem          # noqa: E402
from autopar.strategies.solvers import local_search           # noqa: E402

DATA = ROOT.parent / "shared" / "iopddl"
# problem -> (file, contest timeout in seconds, best known cost)
PROBLEMS = {
    "example": ("example.json", 10.0, 445),
    "A": ("asplos-2025-iopddl-A.json.gz", 60.0, 6_548_641_531),
    "G": ("asplos-2025-iopddl-G.json.gz", 120.0, 217_039),
    "M": ("asplos-2025-iopddl-M.json.gz", 180.0, 49_928_460_991),
    "S": ("asplos-2025-iopddl-S.json.gz", 240.0, 1_534_613_444),
}


@dataclass(frozen=True)
class Row:
    problem: str
    nodes: int
    edges: int
    timeout: float         # seconds allowed (contest timeout x scale)
    cost: float
    best: float            # best known contest cost
    ratio: float           # cost / best
    peak: int
    limit: int             # usage limit (0: none)
    feasible: bool
    seconds: float         # wall time, loading included


def run(name: str, data: Path, scale: float, progress=None) -> Row:
    file, timeout, best = PROBLEMS[name]
    allowed = timeout * scale
    start = time.monotonic()
    problem = SearchProblem.load(data / file)
    left = allowed - (time.monotonic() - start)
    sol = local_search.solve(problem, time_limit=left, progress=progress)
    seconds = time.monotonic() - start
    return Row(name, problem.num_nodes, problem.num_edges, allowed, sol.cost, best,
               sol.cost / best, sol.peak, problem.usage_limit or 0, problem.feasible(sol.choice),
               seconds)


def markdown(rows) -> str:
    lines = ["| problem | nodes | edges | timeout (s) | cost | best known | ratio | "
             "peak / limit | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mem = f"{r.peak / r.limit:.4f}" if r.limit else "-"
        if not r.feasible:
            mem += " (over!)"
        lines.append(f"| {r.problem} | {r.nodes:,} | {r.edges:,} | {r.timeout:g} | "
                     f"{r.cost:,.0f} | {r.best:,.0f} | {r.ratio:.4f} | {mem} | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default="A,G,M,S",
                    help="comma-separated subset of " + ",".join(PROBLEMS))
    ap.add_argument("--scale", type=float, default=1.0, help="factor on the contest timeouts")
    ap.add_argument("--data", type=Path, default=DATA, help="folder of the problem files")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.problems.split(",") if p.strip()]
    unknown = [p for p in names if p not in PROBLEMS]
    if unknown:
        ap.error(f"unknown problem(s) {unknown}; choose from {list(PROBLEMS)}")

    def progress(msg):
        if not args.quiet:
            print("   ", msg, file=sys.stderr, flush=True)

    rows = []
    for name in names:
        row = run(name, args.data, args.scale, progress)
        print(f"{name}: cost {row.cost:,.0f} ratio {row.ratio:.4f} in {row.seconds:.1f}s "
              f"(timeout {row.timeout:g}s)", file=sys.stderr, flush=True)
        rows.append(row)
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0 if all(r.feasible for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
