"""Every script in examples/ runs to the end and says what it showed (each checks its own
results against the single-device step and raises if they differ)."""
import glob
import os
import re
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


def _shape_of(text: str) -> list:
    """The lines of a printed strategy with what depends on the pricing machine left out: every
    decimal number (times, sizes in KB, the loss), the ``priced on:`` line's source, the
    per-call term (a calibrated machine's) and the column padding those change."""
    text = re.sub(r"\d+\.\d+", "#", text)
    text = re.sub(r"(?m)^priced on: .*$", "priced on: #", text)
    text = text.replace(" + per call # us", "")       # a preset prices no per-call overhead
    return [" ".join(line.split()) for line in text.strip().splitlines()]


def readme_quickstart_output() -> str:
    """The README's sample output of ``python examples/quickstart.py`` (the untagged block
    after the quick start)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = text[text.index("## Quick start"):text.index("## What it does")].splitlines()
    fences = [i for i, line in enumerate(lines) if line.startswith("```")]
    return "\n".join(lines[fences[2] + 1:fences[3]])


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
    if os.path.basename(path) == "quickstart.py":      # the README shows what it prints
        want, got = _shape_of(readme_quickstart_output()), _shape_of(r.stdout)
        assert got == want, "README.md's quick-start output is stale; it now prints:\n" + r.stdout
