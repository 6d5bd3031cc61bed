"""The autopar command line: ``autopar solve`` on IOPDDL files."""
import os
import subprocess
import sys

from autopar.strategies.problem import SearchProblem

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "iopddl")
EXAMPLE = os.path.join(SHARED, "example.json")


def run(*args):
    return subprocess.run([sys.executable, "-m", "autopar.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_solve_example_finds_the_optimum():
    r = run("solve", EXAMPLE, "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[0, 0, 2, 1, 0]"
    assert "cost 445" in r.stderr


def test_solve_round_trips_a_written_problem(tmp_path):
    from autopar.strategies.solvers.random_problems import random_problem
    p = random_problem(7)
    path = tmp_path / "p.json.gz"
    p.save(path)
    q = SearchProblem.load(path)
    assert q.to_json() == p.to_json()
    r = run("solve", str(path), "10", "--solver", "ilp")
    choice = eval(r.stdout.strip().splitlines()[-1])
    assert len(choice) == p.num_nodes and q.feasible(choice)


def test_solve_errors_are_reported():
    r = run("solve", "/nonexistent.json", "1")
    assert r.returncode != 0
    r = run("solve", EXAMPLE, "5", "--solver", "nonsense")
    assert r.returncode == 2 and "choose one of" in r.stderr
