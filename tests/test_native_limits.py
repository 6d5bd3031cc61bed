"""The native runtime at the machine's limits, each case a user's process (tests/fault_child.py)
compiling and calling a 2-device step: too few file descriptors, a full /dev/shm, a worker out
of memory. Every case is a correct run or a typed autopar error that names the cause, and
nothing is left behind: no process that inherited the case's environment outlives it, and the
host's /dev/shm is as it was."""
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.native

CHILD = Path(__file__).with_name("fault_child.py")


def processes_marked(mark: str) -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def run_case(*args, wrap=()):
    """The child's (outcome line, stdout and stderr), once no process of its remains."""
    mark = f"AUTOPAR_FAULT_CASE={uuid.uuid4().hex}"
    env = dict(os.environ, AUTOPAR_FAULT_CASE=mark.split("=")[1])
    shm = set(os.listdir("/dev/shm"))
    r = subprocess.run([*wrap, sys.executable, str(CHILD), *args], capture_output=True,
                       text=True, timeout=300, env=env, cwd=CHILD.parent)
    deadline = time.monotonic() + 10
    while processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_marked(mark) == [], "processes of the case outlived it"
    assert set(os.listdir("/dev/shm")) == shm
    out = [line for line in r.stdout.splitlines() if line.startswith(("OK", "ERR"))]
    assert len(out) == 1, r.stdout[-2000:] + r.stderr[-4000:]
    return out[0], r.stdout + r.stderr


@pytest.mark.parametrize("limit", [8, 10, 16])
def test_too_few_file_descriptors_fail_typed_and_named_or_run(limit):
    """Under 9 descriptors the job cannot start (its sockets, pipes and shared memory); at 10
    a worker cannot take in a call's shared memory, which it says on its stderr, failing the
    job; from 12 the step runs."""
    line, text = run_case("nofile", str(limit))
    if line.startswith("OK"):
        return
    assert line.split()[1:3] in (["autopar.errors", "CollectiveError"],
                                 ["autopar.errors", "WorkerError"]), line
    assert "RLIMIT_NOFILE" in text and "ulimit -n" in text


def test_a_full_dev_shm_does_not_stop_a_job():
    """Nothing of a job is named in /dev/shm (its shared memory is memfd), so a /dev/shm of
    64 KB, full, leaves it running (the case gets a /dev/shm of its own: a mount namespace,
    unshare(1), as root)."""
    mount = "mount -t tmpfs -o size=64k tmpfs /dev/shm && dd if=/dev/zero of=/dev/shm/fill " \
            "bs=4k 2>/dev/null; exec \"$@\""
    line, _ = run_case("plain", wrap=("unshare", "-m", "sh", "-c", mount, "sh"))
    assert line.startswith("OK"), line


def test_a_worker_out_of_memory_is_a_worker_error_naming_it():
    line, _ = run_case("oom")
    assert line.split()[1:3] == ["autopar.errors", "WorkerError"], line
    assert "RESOURCE_EXHAUSTED" in line and "Out of memory" in line
