"""The README's "Coming from jax.jit" block, run as written (8 fake CPU devices), and what it
claims checked on the names it leaves."""
import os
import re
import shutil

import jax
import numpy as np

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_coming_from_jax_jit_runs_as_written():
    text = open(README).read()
    section = text[text.index("## Coming from jax.jit"):text.index("## Coming from MindSpore")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
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
