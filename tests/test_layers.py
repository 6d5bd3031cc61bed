"""The layering contract (pyproject.toml's [tool.importlinter]): entry > runtime >
redistribution > strategies > core, a runtime that imports no planning and no new import
cycle between sibling modules, checked by
import-linter on the source tree (lazy imports inside functions count); and the package's
init, which imports each public name on first use; and the packages' lint and format
(ruff, pyproject.toml's [tool.ruff]) and types (mypy, [tool.mypy])."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    return shutil.which(name, path=str(Path(sys.executable).parent)) or name


def test_import_linter_contracts_are_kept():
    r = subprocess.run([_tool("lint-imports"), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "3 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_ruff_lint_and_format_are_clean():
    """pyproject.toml's [tool.ruff]: the packages pass ``ruff check`` and are as
    ``ruff format`` writes them (run ``ruff format`` and ``ruff check --fix`` to make them so)."""
    for args in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        r = subprocess.run([_tool("ruff"), *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"


def test_mypy_finds_no_type_errors():
    """pyproject.toml's [tool.mypy] over the package: every annotated function and contract
    type checks (run ``mypy`` from the checkout to see what it finds)."""
    r = subprocess.run([_tool("mypy"), "--no-incremental", "--cache-dir", os.devnull], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Success: no issues found" in r.stdout, r.stdout[-2000:]


def test_the_package_imports_a_public_name_when_first_asked():
    """``import autopar`` loads nothing heavy (the command line's start); each public name and
    submodule imports on first use, unknown names raise AttributeError, and ``__version__`` is
    the installed distribution's."""
    import tomllib
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    code = (
        "import sys, autopar as ap\n"
        "assert 'jax' not in sys.modules, 'import autopar imported jax'\n"
        "assert ap.Layout.__module__ == 'autopar.layout' and 'jax' not in sys.modules\n"
        "assert ap.comm.__name__ == 'autopar.comm' and ap.runtime.__name__ == 'autopar.runtime'\n"
        "assert all(getattr(ap, n) is not None for n in ap.__all__)\n"
        "assert set(ap.__all__) <= set(dir(ap))\n"
        "try:\n    ap.no_such_name\nexcept AttributeError as e:\n    print('refused', e)\n"
        "print('version', ap.__version__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused module 'autopar' has no attribute 'no_such_name'" in r.stdout
    assert f"version {version}" in r.stdout


def test_a_checkout_folder_named_autopar_does_not_shadow_the_package(tmp_path):
    """git clones into a folder named autopar; Python run from its parent must still import
    the installed package (scripts/test installs it editable in compat mode for this)."""
    import os
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "autopar").symlink_to(root)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([sys.executable, "-c", "import autopar; print(autopar.Layout)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and "autopar.layout.Layout" in got.stdout, got.stderr


def test_every_module_is_in_a_layer():
    """A module added to autopar/ is in the layering contract's layers (else import-linter
    would not check what it imports, nor what imports it)."""
    import tomllib
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in conf["contracts"] if c["type"] == "layers"]
    named = {m.strip() for layer in layers for m in layer.split(":")}
    here = {f"autopar.{p.stem}" for p in (ROOT / "autopar").glob("*.py") if p.stem != "__init__"}
    here |= {f"autopar.{p.name}" for p in (ROOT / "autopar").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    assert here <= named, f"not in a layer of pyproject.toml's contract: {sorted(here - named)}"
