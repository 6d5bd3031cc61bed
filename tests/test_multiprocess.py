"""JAX's multi-process runtime: ``autopar launch`` and the multi-controller jax backend.

Real processes on this machine: ``autopar launch --nprocs 2 --devices-per-process 4`` runs
``multiprocess_steps.py``, whose two processes of 4 CPU devices each compile and run GPT, Flax NNX and Equinox steps
over the 8 devices and compare them with the single-device step. The launcher's own behaviour
(rank prefixes, the first failure stopping the others) is tested on tiny scripts.
"""
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.xdist_group("multiprocess")


def launch(*args, cwd=HERE, timeout=600):
    env = dict(os.environ)     # the conftest's compile flags, not its device count
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                              env.get("XLA_FLAGS", "")).strip()
    return subprocess.run([sys.executable, "-m", "autopar.cli", "launch", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_two_processes_of_four_devices_run_every_mode_as_the_single_device_step():
    got = launch("--nprocs", "2", "--devices-per-process", "4", "multiprocess_steps.py")
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-6000:]
    lines = got.stdout.splitlines()
    for case in ("semi_auto", "auto_parallel", "parallel_optimizer",
                 "data_parallel process_local", "pipeline process_local",
                 "replicated batch process_local", "flax auto_parallel process_local",
                 "equinox data_parallel"):
        for rank in (0, 1):
            assert f"[{rank}] {case} ok" in lines, (case, rank, got.stdout[-3000:])
    assert sum("native refused: backend='native' in a multi-process JAX runtime" in l
               for l in lines) == 2
    # process 1 traced another batch size: both processes refuse instead of hanging
    refused = [l for l in lines if "mismatch refused" in l]
    assert len(refused) == 2, refused
    assert "[1] mismatch refused: process 1 cannot run process 0's plan" in refused[0] + refused[1]
    assert "[16, 8] int32" in refused[0] + refused[1]


def test_launch_prefixes_output_and_the_first_failure_stops_the_others(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        rank = int(os.environ["AUTOPAR_PROCESS_ID"])
        print("hello from", rank, "of", os.environ["AUTOPAR_NUM_PROCESSES"], flush=True)
        open(f"said{rank}", "w").close()
        if rank == 1:      # fail once the others have spoken (a loaded machine starts them late)
            end = time.monotonic() + 20
            while not (os.path.exists("said0") and os.path.exists("said2")) and time.monotonic() < end:
                time.sleep(0.05)
            print("failing", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(120)
    """))
    t0 = time.monotonic()
    got = launch("--nprocs", "3", str(script), cwd=str(tmp_path), timeout=60)
    took = time.monotonic() - t0
    assert got.returncode == 3 and took < 30, (got.returncode, took)
    for r in range(3):
        assert f"[{r}] hello from {r} of 3" in got.stdout.splitlines()
    assert "[1] failing" in got.stderr.splitlines()
    assert "process 1 exited with status 3; stopping the others" in got.stderr


def test_launch_passes_arguments_and_the_node_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint(os.environ['AUTOPAR_PROCESS_ID'], "
                      "os.environ['AUTOPAR_LOCAL_RANK'], os.environ['AUTOPAR_COORDINATOR'], "
                      "sys.argv[1:])\n")
    got = launch("--nprocs", "2", "--nnodes", "2", "--node-rank", "1", "--coordinator",
                 "10.0.0.1:1234", str(script), "--lr", "3", cwd=str(tmp_path), timeout=60)
    assert got.returncode == 0, got.stderr
    assert sorted(got.stdout.splitlines()) == [
        "[2] 2 0 10.0.0.1:1234 ['--lr', '3']", "[3] 3 1 10.0.0.1:1234 ['--lr', '3']"]


@pytest.mark.parametrize("args, says", [
    (["--nnodes", "2", "x.py"], "--coordinator"),
    (["--nprocs", "0", "x.py"], "--nprocs 0"),
    (["--node-rank", "1", "x.py"], "--node-rank 1"),
    (["missing.py"], "missing.py: no such file"),
    ([], "give the script"),
])
def test_launch_refuses_bad_requests_in_one_line(tmp_path, args, says):
    (tmp_path / "x.py").write_text("")
    got = launch(*args, cwd=str(tmp_path), timeout=60)
    assert got.returncode == 2 and says in got.stderr and "Traceback" not in got.stderr, got.stderr
