"""Benchmark: ``autopar solve`` on the public IOPDDL contest problems, as a user runs it.

In: the problems in ``../shared/iopddl`` (``--data``), a selection (``--problems``: names, or
``tuning`` / ``evaluation`` / ``all``), a factor on the contest timeouts (``--scale``), the solver
(``--solver``, default ``best`` as ``autopar solve``), optional ``--json``/``--markdown`` output.
Out: one row per problem -- nodes, timeout, cost reached, best contest cost, their ratio, peak
memory against the limit, wall seconds and the solver process's peak resident memory -- and the
geometric mean of the ratios per set, printed as markdown and written where asked.

Each problem runs ``python -m autopar.cli solve FILE TIMEOUT`` in its own process (the
timeout covers reading the file, as in the contest); the answer, the last line it prints, is
checked by ``iopddl_check.py``, which shares no code with the solver: a row counts only when
that check passes. The lower bound and gap the solver reports on stderr are shown when given.

Sets: the solver is tuned on ``TUNING``: A, G, M, S (the problems earlier work was measured on)
and, from 2026-11-27, N and R (the two furthest from the contest's best after the first run of
all 13; their earlier rows were evaluation rows). ``EVALUATION`` holds the other seven,
reported separately so tuning cannot hide in them.

    python benchmarks/iopddl.py --problems all
    python benchmarks/iopddl.py --problems G,C --scale 0.25 --json out.json
    python benchmarks/iopddl.py --files /tmp/variants/*.json.gz      # iopddl_variants.py's
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import iopddl_check                                        # noqa: E402

DATA = ROOT.parent / "shared" / "iopddl"
# problem -> (file, contest timeout in seconds, best contest cost)
PROBLEMS = {
    "example": ("example.json", 10.0, 445),
    "A": ("asplos-2025-iopddl-A.json.gz", 60.0, 6_548_641_531),
    "C": ("asplos-2025-iopddl-C.json.gz", 60.0, 84_102_445_260),
    "D": ("asplos-2025-iopddl-D.json.gz", 60.0, 313_613_524_736),
    "G": ("asplos-2025-iopddl-G.json.gz", 120.0, 217_039),
    "L": ("asplos-2025-iopddl-L.json.gz", 180.0, 1_970_993_742),
    "M": ("asplos-2025-iopddl-M.json.gz", 180.0, 49_928_460_991),
    "N": ("asplos-2025-iopddl-N.json.gz", 180.0, 202_739_586_553),
    "P": ("asplos-2025-iopddl-P.json.gz", 240.0, 662_197_407_330),
    "Q": ("asplos-2025-iopddl-Q.json.gz", 240.0, 526_776_842_042),
    "R": ("asplos-2025-iopddl-R.json.gz", 240.0, 371_899_551_572),
    "S": ("asplos-2025-iopddl-S.json.gz", 240.0, 1_534_613_444),
    "T": ("asplos-2025-iopddl-T.json.gz", 240.0, 682_895_254_913),
    "U": ("asplos-2025-iopddl-U.json.gz", 300.0, 2_569_342_178),
}
TUNING = ("A", "G", "M", "S", "N", "R")
EVALUATION = ("C", "D", "L", "P", "Q", "T", "U")
SETS = {"tuning": TUNING, "evaluation": EVALUATION, "all": TUNING + EVALUATION}


@dataclass(frozen=True)
class Row:
    problem: str
    set: str               # tuning / evaluation / other
    nodes: int
    timeout: float         # seconds allowed (contest timeout x scale)
    cost: float            # as the independent check computes it (nan: no valid answer)
    best: float            # best contest cost
    ratio: float           # cost / best
    peak: int
    limit: int             # usage limit (0: none)
    valid: bool            # the independent check passed
    seconds: float         # wall time of the solver process
    rss_mb: float          # its peak resident memory
    bound: float           # the lower bound it reported (nan: none)
    error: str = ""


def _bound(stderr: str) -> float:
    found = re.findall(r"lower bound ([0-9.eE+-]+)", stderr)
    return float(found[-1]) if found else math.nan


def run(name: str, data: Path, scale: float, solver: str, echo=None) -> Row:
    file, timeout, best = PROBLEMS[name]
    return run_file(name, str(data / file), timeout * scale, best, solver, echo)


def variant_timeout(path: Path) -> float:
    """The contest timeout of the problem a variant file (``...-iopddl-X-KIND``) comes from."""
    found = re.search(r"iopddl-([A-Z])-", path.name)
    return PROBLEMS[found.group(1)][1] if found and found.group(1) in PROBLEMS else 60.0


def run_file(name: str, path: str, allowed: float, best: float, solver: str, echo=None) -> Row:
    problem = iopddl_check.read_problem(path)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "autopar.cli", "solve", path, f"{allowed:g}",
                             "--solver", solver], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    got_out, got_err = [], []
    readers = [threading.Thread(target=lambda f=f, into=into: into.append(f.read()))
               for f, into in ((proc.stdout, got_out), (proc.stderr, got_err))]
    for t in readers:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)       # the child's own peak resident memory
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - start
    for t in readers:
        t.join()
    out, err, rss = got_out[0], got_err[0], usage.ru_maxrss / 1024
    if echo:
        echo(err)
    set_ = "tuning" if name in TUNING else "evaluation" if name in EVALUATION else (
        "variant" if math.isnan(best) else "other")
    nodes = len(problem["nodes"]["costs"])
    limit = problem.get("usage_limit") or 0
    try:
        got = iopddl_check.check(problem, iopddl_check.read_answer(out))
    except ValueError as e:
        got = {"valid": False, "errors": [str(e)]}
    if not got["valid"]:
        return Row(name, set_, nodes, allowed, math.nan, best, math.nan, got.get("peak", 0),
                   limit, False, seconds, rss, _bound(err),
                   "; ".join(got["errors"]) + f" (exit {proc.returncode})")
    return Row(name, set_, nodes, allowed, got["cost"], best, got["cost"] / best, got["peak"],
               limit, True, seconds, rss, _bound(err))


def geomean(rows) -> float:
    ok = [r.ratio for r in rows if r.valid]
    return math.exp(sum(map(math.log, ok)) / len(ok)) if ok and len(ok) == len(rows) else math.nan


def markdown(rows) -> str:
    lines = ["| problem | set | nodes | timeout (s) | cost | best contest | ratio | lower bound / "
             "gap | peak / limit | seconds | peak RSS MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mem = f"{r.peak / r.limit:.4f}" if r.limit and r.valid else "-"
        bound = "-" if math.isnan(r.bound) else (
            f"{r.bound:,.0f} / {max(0.0, (r.cost - r.bound) / r.cost):.2%}" if r.valid
            else f"{r.bound:,.0f}")
        cost = f"{r.cost:,.0f}" if r.valid else f"invalid: {r.error}"
        ratio = f"{r.ratio:.4f}" if r.valid and not math.isnan(r.ratio) else "-"
        best = "-" if math.isnan(r.best) else f"{r.best:,.0f}"
        lines.append(f"| {r.problem} | {r.set} | {r.nodes:,} | {r.timeout:g} | {cost} | "
                     f"{best} | {ratio} | {bound} | {mem} | {r.seconds:.1f} | "
                     f"{r.rss_mb:.0f} |")
    for s in ("tuning", "evaluation"):
        part = [r for r in rows if r.set == s]
        if part:
            worst = max((r.ratio for r in part if r.valid), default=math.nan)
            lines.append(f"\n{s}: {len(part)} problems, geometric mean ratio {geomean(part):.4f}, "
                         f"worst {worst:.4f}, valid {sum(r.valid for r in part)}/{len(part)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default="all",
                    help="comma-separated names of " + ",".join(PROBLEMS) + ", or tuning, "
                         "evaluation, all")
    ap.add_argument("--scale", type=float, default=1.0, help="factor on the contest timeouts")
    ap.add_argument("--solver", default="best", help="autopar solve --solver")
    ap.add_argument("--data", type=Path, default=DATA, help="folder of the problem files")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    ap.add_argument("--quiet", action="store_true", help="do not echo the solver's progress")
    ap.add_argument("--files", nargs="+", type=Path, default=[],
                    help="other problem files instead (iopddl_variants.py's): no best cost; the "
                         "timeout of the problem each was derived from, times --scale")
    args = ap.parse_args(argv)
    if args.files:
        args.problems = ""
    names = []
    for p in (p.strip() for p in args.problems.split(",") if p.strip()):
        names += SETS.get(p, (p,))
    unknown = [p for p in names if p not in PROBLEMS]
    if unknown:
        ap.error(f"unknown problem(s) {unknown}; choose from {list(PROBLEMS)} or {list(SETS)}")
    echo = None if args.quiet else (lambda text: sys.stderr.write(text))
    jobs = [(n, lambda n=n: run(n, args.data, args.scale, args.solver, echo)) for n in names]
    jobs += [(f.name.split(".")[0], lambda f=f: run_file(
        f.name.split(".")[0], str(f), variant_timeout(f) * args.scale, math.nan, args.solver, echo))
        for f in args.files]
    rows = []
    for name, job in jobs:
        row = job()
        print(f"{name}: {'cost %.0f ratio %.4f' % (row.cost, row.ratio) if row.valid else row.error}"
              f" in {row.seconds:.1f}s (timeout {row.timeout:g}s), {row.rss_mb:.0f} MB",
              file=sys.stderr, flush=True)
        rows.append(row)
        if args.json:                       # after every problem: a long run keeps its rows
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    table = markdown(rows)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0 if all(r.valid for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
