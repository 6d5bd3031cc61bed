"""Test set-up: 8 fake CPU devices for JAX, set before jax is imported anywhere; the test tiers.

Tiers are pytest markers (registered in pyproject.toml): ``native`` (starts worker processes of
the native runtime), ``slow`` (over ~10 s: examples, installs, long searches), ``browser``
(renders in headless Chromium) and ``benchmark`` (reads the public IOPDDL problems from the
folder named by ``AUTOPAR_IOPDDL``). A plain run covers every tier but ``benchmark``, which
runs only when ``-m`` names it (``-m benchmark``); ``-m "not slow"`` is the quick subset.
A test that starts a native job without the ``native`` marker fails, so the marker stays true.
"""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the tests' programs are tiny and run a few times each: XLA's CPU backend compiles them with
# LLVM's cheapest settings and its older elemental emitters rather than the MLIR fusion emitters
# (compiling is most of the suite's time: the examples' 4-block GPT step compiles in 1.8 s so,
# 5 s with the cheap LLVM settings alone, 9 s with none), the same operations; the native
# workers and the examples (tests/test_examples.py) inherit them
CHEAP_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false")
for _flag in ("--xla_force_host_platform_device_count=8",) + CHEAP_COMPILE:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_ENABLE_X64", "0")
# plans in tests are priced on the fixed ``local`` preset, not on this machine's calibration
# (tools/calibrate.py), so they are the same on every machine; tests of the calibration unset it
os.environ.setdefault("AUTOPAR_TOPOLOGY", "local")
# one JAX compilation cache for the run, made by the first process that loads this file (pytest,
# or xdist's controller, whose workers inherit it) and removed when that process exits: the
# tests, their native workers and the examples compile the same steps and segments again and
# again (a fifth of the suite's time). Every run starts with an empty cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="autopar-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

sys.path.insert(0, os.path.dirname(__file__))   # tests/models.py


# test modules whose tests start processes of their own (native workers, examples, installs):
# under pytest-xdist (``-n``) they run one at a time in one group, beside the in-process tests
# (a test elsewhere that starts native workers in a subprocess, or times this machine, joins the
# group with ``pytest.mark.xdist_group("processes")``; the command line's other tests, each
# one single-threaded process at a time, run beside the group as in-process tests do)
_PROCESS_MODULES = {"test_examples.py"}


def pytest_collection_modifyitems(config, items):
    """Put the tests that start processes into one xdist group; leave the benchmark tier out
    unless the marker expression names it."""
    for item in items:
        if item.get_closest_marker("native") or item.path.name in _PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))
    if "benchmark" in (config.getoption("markexpr") or ""):
        return
    keep = [i for i in items if i.get_closest_marker("benchmark") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


@pytest.fixture
def iopddl() -> Path:
    """The folder of the public IOPDDL problems, from ``AUTOPAR_IOPDDL``; a benchmark-tier
    test run without it fails (never skips) and says how to point at them."""
    folder = os.environ.get("AUTOPAR_IOPDDL")
    if not folder or not Path(folder, "asplos-2025-iopddl-G.json.gz").is_file():
        pytest.fail("benchmark-tier tests read the public IOPDDL problems (asplos-2025-iopddl-*."
                    "json.gz) from the folder named by AUTOPAR_IOPDDL, which is "
                    f"{'unset' if not folder else repr(folder) + ' without them'}: "
                    "AUTOPAR_IOPDDL=/path/to/iopddl python -m pytest tests -m benchmark")
    return Path(folder)


@pytest.fixture(autouse=True)
def _native_marker_is_true(request, monkeypatch):
    """Fail a test that starts a native job but is not marked ``native``."""
    if request.node.get_closest_marker("native") is not None:
        yield
        return
    from autopar.runtime import launcher
    started = []
    real = launcher.Job.__init__

    def init(self, *args, **kwargs):
        started.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(launcher.Job, "__init__", init)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts native worker processes: mark it "
                    "@pytest.mark.native (or its module: pytestmark = pytest.mark.native)")
