"""The autopar command line: plan, show, report, solve, calibrate, bench."""
import json
import os
import subprocess
import sys

import pytest

from autopar.strategies.problem import SearchProblem

TESTS = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(TESTS, "data", "iopddl", "example.json")
AUTOPAR = os.path.join(os.path.dirname(sys.executable), "autopar")   # the installed console script


def run(*args, cwd=None, env=None):
    """``autopar ARGS`` as a user runs it: the console script that installing autopar put
    beside this Python."""
    assert os.path.exists(AUTOPAR), f"no autopar console script at {AUTOPAR}: pip install -e ."
    return subprocess.run([AUTOPAR, *args], capture_output=True, text=True, timeout=180, cwd=cwd,
                          env=env)
MODEL = f"""
import sys

import pytest
sys.path.insert(0, {TESTS!r})
import models as m

def build():
    return (m.gpt_sgd_step, (m.gpt_params(layers=2, abstract=True),
                             m.gpt_batch(batch=8, abstract=True)))

def build_with_bad_options():
    return build() + ({{"bogus": 1}},)

def build_with_options():                     # w1, w2: 128 KB, over the 64 KB threshold
    p = m.mlp_params(sizes=(128, 256, 128))
    return m.mlp_adam_step, (p, m.adam_init(p), m.mlp_batch(sizes=(128, 256, 128))), \
        {{"batch_argnums": (2,)}}
"""


def test_plan_then_show(tmp_path):
    (tmp_path / "mymodel.py").write_text(MODEL)
    out = tmp_path / "s.json"
    r = run("plan", "mymodel.py:build", "--mesh", "2x2", "--max-memory", "64MB", "-o", str(out),
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "mode=auto_parallel" in r.stdout and "cap 64.0 MB" in r.stdout
    assert f"saved {out}" in r.stdout
    from autopar import Strategy
    s = Strategy.load(out)
    assert s.mesh_shape == (2, 2) and s.memory_limit == 64 << 20 and len(s.ops) > 100
    r = run("show", str(out))
    assert r.returncode == 0 and "operator" in r.stdout and "dot_general" in r.stdout
    # a module on the path, options passed to ap.plan, MindSpore's format, the parallel optimizer
    out2 = tmp_path / "ms.json"
    r = run("plan", "mymodel:build_with_options", "--devices", "4", "--mode", "data_parallel",
            "--optimizer-level", "level2", "--format", "mindspore", "-o", str(out2), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    items = json.loads(out2.read_text())["parallel_layout_item"]
    assert items["w1"]["opt_weight_shard_size"] == 4


def test_plan_with_a_topology_file_and_presets(tmp_path):
    import autopar as ap
    (tmp_path / "mymodel.py").write_text(MODEL)
    slow = ap.Topology((ap.Level("host", 1, alpha=1e-3, beta=1e-6),), flops=1e9,
                       mem_bandwidth=1e9)
    slow.save(tmp_path / "topo.json")
    assert ap.Topology.preset(str(tmp_path / "topo.json"), 4).levels[0].size == 4
    assert ap.Topology.preset("cluster:2x4", 8).num_devices == 8
    r = run("plan", "mymodel.py:build", "--devices", "4", "--topology", "topo.json", "-o",
            "a.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r2 = run("plan", "mymodel.py:build", "--devices", "4", "-o", "b.json", cwd=tmp_path)
    assert r.returncode == 0 and r2.returncode == 0, r2.stderr
    a, b = (ap.Strategy.load(tmp_path / f) for f in ("a.json", "b.json"))
    assert a.step_time > 10 * b.step_time       # priced on the slow machine's constants


def test_plan_errors(tmp_path):
    (tmp_path / "mymodel.py").write_text(MODEL)
    r = run("plan", "mymodel.py:nope", cwd=tmp_path)
    assert r.returncode == 2 and "no function 'nope'" in r.stderr
    r = run("plan", "mymodel.py:build", "--devices", "4", "--topology", "nothere", cwd=tmp_path)
    assert r.returncode == 2 and "cluster:HOSTSxPER_HOST" in r.stderr
    r = run("plan", "nocolon")
    assert r.returncode == 2 and "MODULE:FUNCTION" in r.stderr
    r = run("plan", "mymodel.py:build_with_bad_options", cwd=tmp_path)
    assert r.returncode == 2 and "['bogus'] that ap.plan does not take" in r.stderr


def test_launch_runs_a_module(tmp_path):
    """``autopar launch -m MODULE ARGS`` as its help says (argparse took -m for an option)."""
    (tmp_path / "j.json").write_text('{"a": 1}')
    for extra in ([], ["--"]):
        r = run("launch", "--nprocs", "1", *extra, "-m", "json.tool", "j.json", cwd=tmp_path)
        assert r.returncode == 0 and '"a": 1' in r.stdout, r.stderr


def test_every_command_has_complete_help():
    says = {}
    for cmd in ("plan", "show", "report", "solve", "calibrate", "bench"):
        r = run(cmd, "--help")
        assert r.returncode == 0 and "usage: autopar " + cmd in r.stdout, (cmd, r.stderr)
        says[cmd] = r.stdout
    assert "--max-memory" in says["plan"] and "--algorithm" in says["bench"]


@pytest.mark.xdist_group("processes")      # it times this machine
def test_calibrate_measures_the_topology_plans_use(tmp_path, monkeypatch):
    """``autopar calibrate`` writes this machine's constants into the cache, and a plan
    without a topology prices on them (tests otherwise pin the ``local`` preset)."""
    import autopar as ap
    import models as m
    env = {k: v for k, v in os.environ.items() if k != "AUTOPAR_TOPOLOGY"}
    env["AUTOPAR_CACHE_DIR"] = str(tmp_path)
    r = run("calibrate", "--backend", "jax", "--devices", "2", env=env)
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.glob("topology-*-jax-2.json")
    topo = ap.Topology.load(path)
    (lv,) = topo.levels
    assert lv.size == 2 and lv.launch >= 0 and 0 < lv.beta < 1e-7
    assert [k for k, _ in lv.betas] == ["all_gather", "all_to_all", "reduce_scatter"]
    assert all(0 < b < 1e-7 for _, b in lv.betas) and "all_to_all_4MB_us" in r.stdout
    assert topo.flops > 1e8 and topo.mem_bandwidth > 1e8 and topo.step_overhead > 0
    assert "launch_us" in r.stdout and str(path) in r.stdout
    assert "all_reduce_1KB_amid_compute_us" in r.stdout      # what launch is fitted from
    assert "compute_slowdown" in r.stdout and "reference_step_ms" in r.stdout
    assert 0 < topo.reference_compute < 10 and "reference_compute_ms" in r.stdout
    assert 0 <= topo.arg_overhead < 1e-2 and "arg_overhead_us" in r.stdout
    p, b = m.mlp_params(sizes=(64, 128, 64)), m.mlp_batch(batch=16, sizes=(64, 128, 64))
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="jax",
                            progress=False)
    preset = ap.plan(m.mlp_sgd_step, p, b, config=cfg)
    monkeypatch.delenv("AUTOPAR_TOPOLOGY")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    here = ap.plan(m.mlp_sgd_step, p, b, config=cfg)
    assert preset.overhead_time == 0 and here.overhead_time >= topo.step_overhead
    assert here.compute_time != preset.compute_time
    monkeypatch.setenv("AUTOPAR_TOPOLOGY", "local")           # an explicit preset still wins
    assert ap.plan(m.mlp_sgd_step, p, b, config=cfg).step_time == preset.step_time


def test_calibrate_output_file_is_written_from_a_text_path(tmp_path):
    """``autopar calibrate -o FILE`` hands ``save`` the path as text (it crashed on str)."""
    import autopar as ap
    from autopar.tools.calibrate import save
    topo = ap.Topology.local(2)
    save(topo, str(tmp_path / "new" / "topology.json"))
    assert ap.Topology.load(tmp_path / "new" / "topology.json") == topo


def test_calibration_fits_the_reference_steps_slowdown():
    """The reference step's fit: ``measured = k * compute + rest``, ``k`` kept in range."""
    from autopar.tools.calibrate import SLOWDOWN, _fit
    assert _fit((1.3 * 0.05 + 0.004, 0.05, 0.004)) == pytest.approx(1.3)
    assert _fit((0.005, 0.05, 0.004)) == SLOWDOWN[0]
    assert _fit((1.0, 0.05, 0.004)) == SLOWDOWN[1]


def test_calibration_refuses_impossible_figures_its_repeat_does_not_confirm(monkeypatch):
    """A figure no CPU host gives (an infinite host rate, a negative time, a 4 MB all-reduce
    faster than a 1 KB one) measures again; the repeat is kept when it is plausible and
    agrees with the first run's plausible figures, else calibration is refused, naming them,
    and nothing is saved; a first compile falls back to the local preset."""
    import autopar as ap
    from autopar.tools import calibrate as cal
    good = {"step_overhead_us": 300.0, "host_GBps": 9.0, "matmul_GFLOPs": 70.0,
            "all_reduce_1KB_us": 50.0, "all_reduce_4MB_us": 700.0, "link_GBps": 6.0,
            "compute_slowdown": 1.3}
    assert cal.implausible(good) == []
    bad = dict(good, host_GBps=float("inf"), all_reduce_1KB_us=-3.0)
    assert [b.split("=")[0] for b in cal.implausible(bad)] == ["host_GBps", "all_reduce_1KB_us"]
    assert cal.implausible(dict(good, all_reduce_4MB_us=20.0))[0].startswith(
        "all_reduce_4MB_us=20 below")
    runs = []

    def measures(*reports):
        runs.clear()
        it = iter(reports)
        monkeypatch.setattr(cal, "measure", lambda b, n, f: (runs.append(1) or "topo", next(it)))
    measures(good)
    assert cal.calibrate("jax", 2, ap.compile)[1]["matmul_GFLOPs"] == 70.0 and len(runs) == 1
    measures(bad, dict(good, matmul_GFLOPs=80.0))
    topo, report = cal.calibrate("jax", 2, ap.compile)
    assert len(runs) == 2 and report["matmul_GFLOPs"] == 80.0 and "host_GBps" in report["remeasured"]
    measures(bad, bad)
    with pytest.raises(ap.ConfigError, match="impossible figures twice.*host_GBps=inf.*nothing "
                                             "was saved"):
        cal.calibrate("jax", 2, ap.compile)
    measures(bad, dict(good, matmul_GFLOPs=20.0))
    with pytest.raises(ap.ConfigError, match=r"disagrees with it by over 2x on matmul_GFLOPs"):
        cal.calibrate("jax", 2, ap.compile)
    monkeypatch.delenv("AUTOPAR_TOPOLOGY", raising=False)
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "/nonexistent-autopar-cache")
    measures(bad, bad)
    assert cal.machine_topology("jax", 2, True, ap.compile) == ap.Topology.local(2)


@pytest.mark.xdist_group("processes")      # native ranks
def test_bench_prints_json_rows():
    r = run("bench", "--op", "all_reduce", "--ranks", "2", "--size", "4KB", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["op"] == "all_reduce" and row["bytes"] == 4096 and row["latency_us"] > 0


def test_solve_example_finds_the_optimum():
    r = run("solve", EXAMPLE, "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[0, 0, 2, 1, 0]"
    assert "cost 445" in r.stderr


def test_solve_reports_the_lower_bound_and_gap():
    r = run("solve", EXAMPLE, "10")
    assert "lower bound 445, gap 0.0000%" in r.stderr
    r = run("solve", EXAMPLE, "10", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["cost"] == got["lower_bound"] == 445 and got["gap"] == 0 and got["optimal"]
    assert got["choice"] == [0, 0, 2, 1, 0] and got["usage_limit"] == 50


def test_solve_counts_its_time_limit_from_the_process_start():
    """``autopar solve``'s clock starts when its process did, so its time limit covers the
    interpreter's start and the imports, as a contest's wall clock does."""
    code = ("import time; time.sleep(1.0); from autopar import cli; "
            "print(time.monotonic() - cli._process_start())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert 1.0 <= float(r.stdout) < 100


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


def test_report_writes_the_html_page(tmp_path):
    (tmp_path / "mymodel.py").write_text(MODEL)
    assert run("plan", "mymodel.py:build", "--mesh", "2x2", "-o", "s.json",
               cwd=tmp_path).returncode == 0
    r = run("report", "s.json", "-o", "r.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "application/json" in page
    assert "dot_general" in page and "http://" not in page.replace("http://www.w3.org", "")


ANYTIME = f"""
import sys, time
from autopar.cli import _solve_anytime
import autopar.cli as cli
from autopar.strategies.problem import SearchProblem
from autopar.strategies.solvers import anytime
problem = SearchProblem.load({EXAMPLE!r})
cli.GRACE = float(sys.argv[2])

def slow(problem, time_limit, progress):
    anytime.offer(problem.cost([0, 0, 0, 0, 0]), [0, 0, 0, 0, 0])   # a feasible answer...
    print("ready", flush=True)
    if sys.argv[3:] == ["here"]:            # a SIGINT the kernel hands to this thread
        import signal, threading
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    time.sleep(60)                                                   # ...then nothing more
    raise AssertionError("not interrupted")

sol, why = _solve_anytime(slow, problem, float(sys.argv[1]), print)
print(why, "|", sol.cost, list(sol.choice), flush=True)
"""


def test_solve_answers_with_the_best_so_far_on_sigint_and_past_the_deadline():
    """A SIGINT, or a solver still running past its time limit and grace, ends ``autopar solve``
    with the best feasible answer offered so far, not with nothing."""
    import signal
    cost = SearchProblem.load(EXAMPLE).cost([0, 0, 0, 0, 0])
    p = subprocess.Popen([sys.executable, "-c", ANYTIME, "30", "30"], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    assert out.startswith("interrupted after") and f"| {cost} [0, 0, 0, 0, 0]" in out
    r = subprocess.run([sys.executable, "-c", ANYTIME, "30", "30", "here"], capture_output=True,
                       text=True, timeout=20)
    assert r.stdout.startswith("ready\ninterrupted after"), r.stderr
    r = subprocess.run([sys.executable, "-c", ANYTIME, "0.2", "0.3"], capture_output=True,
                       text=True, timeout=30)
    assert "still searching 0.3 s past the time limit |" in r.stdout, r.stderr


def test_show_summarises_the_costliest_rows_by_what_is_asked(tmp_path, capsys):
    """``autopar show FILE --top N --by operator|module|collective|parameter``: the table's
    head, then the N costliest rows of that grouping (a GPT's table is hundreds of lines)."""
    import autopar as ap
    import models as m
    from autopar import cli
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=8)
    s = ap.plan(m.gpt_sgd_step, p, b, config=ap.ParallelConfig(
        parallel_mode="data_parallel", device_num=4, progress=False))
    path = str(tmp_path / "gpt.json")
    s.save(path)
    outs = {}
    for by in ("operator", "module", "collective", "parameter"):
        assert cli.main(["show", path, "--by", by, "--top", "3"]) == 0
        outs[by] = capsys.readouterr().out
        assert outs[by].startswith("strategy: mode=data_parallel")
        assert len(outs[by].splitlines()) < 30
    assert "the 3 costliest of" in outs["operator"] and "models.py:" in outs["operator"]
    assert "gpt_apply" in outs["module"] and "source functions" in outs["module"]
    assert "all_reduce" in outs["collective"] and "the 3 costliest:" in outs["collective"]
    assert "the 3 largest of 28 parameters" in outs["parameter"]
    assert cli.main(["show", path, "--top", "2"]) == 0
    assert "the 2 costliest of" in capsys.readouterr().out
