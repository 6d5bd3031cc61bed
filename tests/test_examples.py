"""Every script in examples/ runs to the end and says what it showed (each checks its own
results against the single-device step and raises if they differ)."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
SAYS = {
    "quickstart.py": ["parameters match", "collectives:"],
    "gpt_model.py": ["step 4: loss"],
    "gpt_auto_parallel.py": ["the same as the single-device step", "search=dynamic_programming"],
    "moe.py": ["experts split: expert parallel", "all-to-alls move the routed tokens"],
    "pipeline_gpt.py": ["the same as the single-device step", "stage 1: devices [2, 3]"],
    "load_strategy.py": ["strategy search: loaded", "the loaded layouts are the searched ones: True"],
    "hybrid_parallel.py": ["the same as the single-device step", "all_reduce(y)"],
}
SAYS.setdefault("flax_nnx.py", ["match the single-device step", "collectives"])
SAYS.setdefault("equinox_model.py", ["match the single-device step", "collectives"])


def test_every_example_is_checked():
    assert len(EXAMPLES) >= len(SAYS)
    assert {os.path.basename(p) for p in EXAMPLES} >= set(SAYS)


@pytest.mark.slow
@pytest.mark.native
@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_runs(path):
    """``python examples/NAME.py`` from the repository root, as the README runs it (the
    installed package, the checkout's ``autopar/`` folder in the working directory), with the
    suite's cheap XLA compile flags (conftest.py) but not its device count: each example sets
    its own."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    r = subprocess.run([sys.executable, os.path.relpath(path, ROOT)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{path} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for text in SAYS.get(os.path.basename(path), ["the same as the single-device step"]):
        assert text in r.stdout, f"{os.path.basename(path)} did not print {text!r}:\n{r.stdout[-3000:]}"
