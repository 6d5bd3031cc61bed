"""ap.plan: strategies without running, on abstract (ShapeDtypeStruct) arguments."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import models as m


def test_plan_is_data_parallel_from_abstract_arguments():
    """Planned without running, data_parallel on 8 devices is what data parallelism is, by its
    definition: parameters replicated, each batch leaf split on its first dimension over all 8
    devices, and one all-reduce over them per gradient (the parameter's bytes) and for the
    scalar loss. Abstract arguments give the same plan as concrete ones."""
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=8)
    planned = ap.plan(m.mlp_sgd_step, p, b, config=cfg)
    (axis,) = planned.axis_names
    assert planned.mesh_shape == (8,)
    params = [i for i in planned.inputs if i.is_param]
    assert len(params) == len(jax.tree.leaves(p)) and all(i.layout.is_replicated() for i in params)
    assert [str(i.layout) for i in planned.inputs if not i.is_param] == [f"[{axis},_]"] * 2
    assert {(c.kind, c.axes) for c in planned.collectives} == {("all_reduce", (axis,))}
    assert sorted(c.bytes for c in planned.collectives) == sorted(
        [4] + [x.nbytes for x in jax.tree.leaves(p)])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (p, b))
    assert ap.plan(m.mlp_sgd_step, *abstract, config=cfg).to_json() == planned.to_json()


def test_plan_gpt3_width_without_allocating():
    # two GPT-3 blocks (d=12288, vocab 50304): ~4.2e9 parameters, 17 GB of float32 that this
    # 24 GB machine could not hold alongside gradients; planning allocates none of it
    p = m.gpt_params(vocab=50304, seq=2048, d=12288, heads=96, layers=2, abstract=True)
    b = m.gpt_batch(batch=8, seq=2048, vocab=50304, abstract=True)
    n_params = sum(x.size for x in jax.tree.leaves(p))
    assert n_params > 4e9
    s = ap.plan(m.gpt_sgd_step, p, b, config=ap.ParallelConfig(parallel_mode="data_parallel",
                                                               device_num=8))
    assert s.peak_memory > 4 * n_params          # parameters alone, replicated per device
    assert s.step_time > 0 and s.comm_time > 0
    assert all(i.layout.is_replicated() for i in s.inputs if i.is_param)
    assert "peak memory" in s.table()


def _accumulating_step(chunks_of_rows):
    """Gradient accumulation over K=2 chunks of the batch, the chunks made by ``chunks_of_rows``."""
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def step(w, x):
        def body(acc, xk):
            return acc + jax.grad(loss)(w, xk), None
        g, _ = jax.lax.scan(body, jnp.zeros_like(w), chunks_of_rows(x))
        return w - 0.1 * g / 2
    return step


def test_data_parallel_warns_where_a_reshape_ends_the_batch_split():
    """x.reshape(2, -1, D) on 4 devices puts every chunk's rows on two devices: data_parallel
    all-gathers the batch and computes it whole on every device, and says where and what to
    do; chunks of every device's rows (reshape(-1, 2, D).swapaxes(0, 1)) stay split, silently."""
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4)
    with pytest.warns(UserWarning, match=r"row split ends at reshape.*100% of the batch's work"):
        lost = ap.plan(_accumulating_step(lambda x: x.reshape(2, -1, 64)), w, x, config=cfg)
    assert {c.kind for c in lost.collectives} == {"all_gather"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = ap.plan(_accumulating_step(lambda x: x.reshape(-1, 2, 64).swapaxes(0, 1)), w, x,
                       config=cfg)
    assert {c.kind for c in kept.collectives} == {"all_reduce"}


def test_data_parallel_says_how_to_accumulate_where_slicing_ends_the_batch_split():
    """Gradient accumulation by slicing the batch (x[:n], x[n:], as vit_jax writes it) takes
    each part's rows from some devices only: the warning (data_parallel's, and
    semi_auto_parallel's with the batch split by dataset_strategy) says to set micro_batches (or slice
    strided rows), and the step as advised, on the whole batch with micro_batches=2, keeps the
    rows split and gives the sliced step's values."""
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def sliced(w, x):
        n = x.shape[0] // 2
        g = jax.grad(loss)(w, x[:n]) + jax.grad(loss)(w, x[n:])
        return w - 0.1 * g / 2

    def whole(w, x):
        return w - 0.1 * jax.grad(loss)(w, x)
    w = np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
    x = np.linspace(-2, 2, 32 * 64, dtype=np.float32).reshape(32, 64)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, backend="jax")
    with pytest.warns(UserWarning, match=r"row split ends at slice.*micro_batches=K.*strided"):
        ap.plan(sliced, w, x, config=cfg)
    semi = cfg.replace(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")
    with pytest.warns(UserWarning, match=r"semi_auto_parallel: the batch's row split ends at "
                                         r"slice.*micro_batches=K"):
        ap.plan(sliced, w, x, config=semi)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = ap.compile(whole, w, x, config=cfg.replace(micro_batches=2))
    assert {k.kind for k in c.strategy.collectives} <= {"all_reduce", "reduce_scatter"}
    np.testing.assert_allclose(c(w, x), sliced(w, x), rtol=1e-5, atol=1e-6)


def test_auto_parallel_says_which_plans_it_compared_and_why_the_winner_won():
    """Strategy.alternatives / explain(): every plan auto_parallel lowered and priced (its
    search's, data parallelism's, every operator replicated), by term; the chosen one is the
    cheapest within the cap and is the Strategy's own estimate; they round-trip in the JSON."""
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=8)
    s = ap.plan(m.gpt_sgd_step, p, b, config=ap.ParallelConfig(
        parallel_mode="auto_parallel", device_num=4, progress=False))
    labels = [a.label for a in s.alternatives]
    assert any("data parallelism's plan" in label for label in labels)
    assert any(label.startswith("dynamic_programming's plan") for label in labels)
    (chosen,) = [a for a in s.alternatives if a.chosen]
    assert chosen.seconds == pytest.approx(s.step_time)
    assert chosen.seconds == min(a.seconds for a in s.alternatives if a.fits)
    for a in s.alternatives:
        assert a.seconds == pytest.approx(a.compute + a.comm + a.overhead)
    text = s.explain()
    assert "plans compared" in text and f"-> {chosen.label}" in text and "against " in text
    assert len(text.splitlines()) < 25
    assert ap.Strategy.from_json(s.to_json()).alternatives == s.alternatives
    from autopar import report                  # the report's header shows them too
    page = report.render(s)
    assert "plans compared" in page and f"&rarr; {chosen.label.replace(chr(39), '&#x27;')}" in page
    assert f"priced on {s.topology}" in page
    dp = ap.plan(m.gpt_sgd_step, p, b, config=ap.ParallelConfig(
        parallel_mode="data_parallel", device_num=4, progress=False))
    assert dp.alternatives == () and "no alternatives were compared" in dp.explain()


def test_the_progress_bar_keeps_the_clock_running_between_messages():
    """On a terminal the bar is redrawn by a timer while a phase runs (a solver that reports
    once a minute does not freeze it at its last frame), and stops with the phase."""
    import io
    import time
    from autopar import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    out = Terminal()
    bar = progress.Progress("autopar [test]", total=10.0, after=0.0, stream=out)
    bar("searching")
    time.sleep(6 * progress.TICK)
    bar.close()
    frames = [f for f in out.getvalue().split("\r") if f.strip()]
    import re
    clock = [float(re.search(r"([\d.]+)/10s", f).group(1)) for f in frames]
    assert len(frames) >= 3 and clock == sorted(clock) and clock[-1] > clock[0]
    assert all("searching" in f for f in frames) and out.getvalue().endswith("\n")
    settled = out.getvalue()
    time.sleep(2 * progress.TICK)
    assert out.getvalue() == settled                       # nothing after close
    quiet = progress.Progress("autopar [test]", stream=io.StringIO())   # not a terminal
    quiet("x")
    quiet.close()
    assert quiet._timer is None
