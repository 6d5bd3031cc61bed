"""The README's "Coming from jax.jit" block, run as written (8 fake CPU devices), and what it
claims checked on the names it leaves."""
import os
import re
import shutil

import jax
import numpy as np
import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _block(after: str, before: str) -> str:
    text = open(README).read()
    return re.search(r"```python\n(.*?)```", text[text.index(after):text.index(before)],
                     re.S).group(1)


@pytest.mark.native
def test_using_it_runs_as_written(tmp_path, monkeypatch, capsys):
    """The "Using it" block (8 native worker processes): the step's values, both strategy
    files written, and no device computing what another computes (the batch split over x,
    the weights over y)."""
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(compile(_block("## Using it", "### `ap.compile("), "README.md", "exec"), names)
    want_loss, want = jax.jit(names["step"])(names["params"], names["batch"])
    np.testing.assert_allclose(names["loss"], want_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 names["new_params"], want)
    assert (tmp_path / "strategy.json").is_file() and (tmp_path / "strategy.ckpt").is_file()
    layouts = {i.name: str(i.layout) for i in names["compiled"].strategy.inputs}
    assert layouts["w1"] == "[_,y]" and layouts["w2"] == "[y,_]", layouts
    assert [v for k, v in layouts.items() if k not in ("w1", "w2")] == ["[x,_]", "[x,_]"]
    assert "all_reduce(y)" in capsys.readouterr().out


def test_coming_from_jax_jit_runs_as_written():
    code = _block("## Coming from jax.jit", "## Coming from MindSpore")
    shutil.rmtree("/tmp/autopar-readme-ckpt", ignore_errors=True)
    names = {}
    try:
        exec(compile(code, "README.md", "exec"), names)
    finally:
        shutil.rmtree("/tmp/autopar-readme-ckpt", ignore_errors=True)
    params, restored, hand = names["params"], names["restored"], names["hand"]
    host = jax.tree.map(np.asarray, params)             # by_hand takes its own layouts
    np.testing.assert_allclose(names["loss2"], names["by_hand"](host, names["x"])[0],
                               rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored, params)
    assert restored["w1"].sharding.spec == hand.in_shardings[0]["w1"].spec


def test_mindspore_context_block_is_mindspore_and_runs_without_a_warning():
    """The README's MindSpore context call uses only MindSpore 2.10's keys (its dict keys
    complete, as 2.10 requires), and runs as written."""
    import warnings

    import autopar as ap
    from test_context import MINDSPORE_KEYS
    text = open(README).read()
    section = text[text.index("### MindSpore's context API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    call = code[code.index("ap.set_auto_parallel_context("):code.index("ap.get_auto_parallel")]
    keys = re.findall(r"(?:\(|,)\s*(\w+)=", call)
    assert keys and set(keys) <= set(MINDSPORE_KEYS), set(keys) - set(MINDSPORE_KEYS)
    assert re.search(r'pipeline_config=\{"pipeline_interleave": \w+,\s*"pipeline_scheduler"',
                     call)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exec(compile(code.replace("ap.reset_auto_parallel_context()", ""), "README.md",
                         "exec"), {"ap": ap})
            assert ap.get_auto_parallel_context("parallel_mode") == "auto_parallel"
            assert ap.context_config().pipeline_stages == 2
    finally:
        ap.reset_auto_parallel_context()


# Commands the README shows that start programs outside autopar (a cluster's scheduler).
NOT_OURS = {"srun"}


def test_every_readme_command_line_parses():
    """Every command in the README's shell blocks (the quick start's two lines aside: .ci/run
    runs them) is one its program takes: ``autopar ...`` parses with the command line's own
    parser, ``python benchmarks/NAME.py ...`` with that benchmark's; the launch line's
    single-host form runs in tests/test_multiprocess.py."""
    import importlib.util
    import shlex

    from autopar import cli
    blocks = re.findall(r"```bash\n(.*?)```", open(README).read(), re.S)[1:]
    lines = [ln for b in blocks for ln in b.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(lines) >= 7, lines
    seen = set()
    for line in lines:
        words = shlex.split(line, comments=True)
        if words[0] == "autopar":
            cli._parser().parse_args(words[1:])
        elif words[:2] == ["python", words[1]] and words[1].startswith("benchmarks/"):
            spec = importlib.util.spec_from_file_location(
                "readme_bench", os.path.join(os.path.dirname(README), words[1]))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.parser().parse_args(words[2:])
        else:
            assert words[0] in NOT_OURS, f"README command not checked: {line}"
        seen.add(words[0] if words[0] != "python" else words[1])
    assert {"autopar", "benchmarks/netns_hosts.py", "benchmarks/reduction_server.py"} <= seen
