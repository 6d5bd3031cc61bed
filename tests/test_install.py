"""A non-editable install runs the quick start from a directory that holds a stale ``autopar/``
folder: the caller and every native worker import the installed package, never the folder in
the working directory (the README's first line, run from a checkout, is this case)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.native]


def test_quick_start_from_an_installed_package_beside_a_stale_source_folder(tmp_path):
    site = tmp_path / "site"
    # built with this environment's build requirements (scripts/test installs them): an isolated
    # build environment would install jaxlib again (half a minute); the isolated build a user
    # meets is the README's first line, which .ci/run runs in a fresh clone and venv
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation",
                        "--disable-pip-version-check", "--target", str(site), ROOT],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip install --target failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert list((site / "autopar").glob("_native*.so")), "the install has no autopar._native"
    assert not (site / "autopar" / "__editable__").exists()

    work = tmp_path / "checkout"                       # what a user's working directory holds
    (work / "autopar").mkdir(parents=True)
    (work / "autopar" / "__init__.py").write_text(
        "raise ImportError('the stale ./autopar folder was imported, not the installed package')\n")
    (work / "examples").mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "quickstart.py"), work / "examples")

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)                      # the install, ahead of the dev checkout
    r = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"the quick start failed:\n{out[-4000:]}"
    assert "parameters match" in r.stdout and "stale" not in out
