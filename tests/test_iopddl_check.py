"""benchmarks/iopddl_check.py, the IOPDDL answer checker that shares no code with the solvers,
agrees with SearchProblem on cost and peak and refuses answers that break the rules."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from autopar.strategies.problem import SearchProblem
from autopar.strategies.solvers.random_problems import random_problem

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("iopddl_check", ROOT / "benchmarks" / "iopddl_check.py")
check_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_mod)


def _dict(problem: SearchProblem) -> dict:
    return json.loads(problem.to_json())["problem"]


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_search_problem(seed):
    p = random_problem(seed)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        choice = [int(rng.integers(len(c))) for c in p.node_costs]
        got = check_mod.check(_dict(p), choice)
        assert got["cost"] == pytest.approx(p.cost(choice))
        assert got["peak"] == p.peak(choice)
        assert got["valid"] == p.feasible(choice)


def test_refuses_wrong_length_range_and_memory():
    d = json.loads((ROOT / "tests" / "data" / "iopddl" / "example.json").read_text())["problem"]
    n = len(d["nodes"]["costs"])
    assert not check_mod.check(d, [0] * (n - 1))["valid"]
    assert not check_mod.check(d, [99] * n)["valid"]
    d["usage_limit"] = 0
    biggest = [int(np.argmax(u)) for u in d["nodes"]["usages"]]
    got = check_mod.check(d, biggest)
    assert not got["valid"] and "above the usage limit" in got["errors"][0]


def test_reads_the_last_list_line():
    assert check_mod.read_answer("progress [1, 2]x\n[0, 1, 2]\n") == [0, 1, 2]
    with pytest.raises(ValueError, match="no answer"):
        check_mod.read_answer("cost 3\n")
