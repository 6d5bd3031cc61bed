"""Activation recomputation as a choice (``autopar.recompute``, ``ParallelConfig.recompute``):
the step without its ``jax.checkpoint`` recomputation is the step written without it, runs to
the single-device step's values, and ``recompute="auto"`` keeps the faster plan within the
cap."""
import functools

import jax
import numpy as np
import pytest

import autopar as ap
import megatron_gpt as mg
import user_gpt as ug
from autopar.recompute import REMAT_SCOPE, recomputes, selective_recompute, without_recompute
from autopar.trace import trace


def _gpt(remat=True, rows=8, seq=32):
    p = mg.params(2, 64, 128, seq)
    m, v = mg.adam_state(p)
    step = functools.partial(mg.train_step, heads=4, remat=remat)
    step.__name__ = "gpt"
    return step, (p, m, v, mg.batch(rows, seq, 128), jax.random.PRNGKey(0))


def test_the_step_without_recomputation_is_the_step_written_without_it():
    step, args = _gpt()
    graph = trace(step, *args)
    plain = trace(_gpt(remat=False)[0], *args)
    dropped = without_recompute(graph)
    dots = lambda g: sum(n.prim == "dot_general" for n in g.nodes)
    assert recomputes(graph) and dots(graph) > dots(dropped)
    assert dots(dropped) == dots(plain)              # every matmul once: 39 of the 49
    assert len(dropped.nodes) <= len(plain.nodes)    # and no other operator twice
    assert [n.id for n in dropped.nodes] == list(range(len(dropped.nodes)))
    assert not recomputes(dropped) and without_recompute(dropped) is dropped
    assert not recomputes(plain) and without_recompute(plain) is plain


def test_a_user_step_is_recomputed_only_where_it_says_so():
    """tests/user_gpt.py, written by hand (its layer norm computes ``x - mean`` twice): without
    jax.checkpoint nothing is recomputed, whatever it repeats; with it, dropping the
    recomputation leaves the matmuls of the step written without it."""
    p, b = ug.init(), ug.batch()
    grad = lambda remat: (lambda p, b: jax.value_and_grad(
        functools.partial(ug.loss, remat=remat))(p, b))
    plain, remat = trace(grad(False), p, b), trace(grad(True), p, b)
    assert not recomputes(plain) and without_recompute(plain) is plain
    dots = lambda g: sum(n.prim == "dot_general" for n in g.nodes)
    assert recomputes(remat) and dots(without_recompute(remat)) == dots(plain) < dots(remat)


@pytest.mark.parametrize("how", ["none", "selective"])
def test_a_step_recomputing_less_runs_as_the_single_device_step(how):
    step, args = _gpt()
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, backend="jax",
                            recompute=how, progress=False)
    c = ap.compile(step, *args, config=cfg)
    assert c.strategy.recompute == how
    assert ap.Strategy.from_json(c.strategy.to_json()).recompute == how
    for got, want in zip(jax.tree.leaves(c(*args)), jax.tree.leaves(step(*args))):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=2e-3, rtol=2e-2)


def test_auto_keeps_the_faster_plan_that_fits():
    step, args = _gpt(rows=64)             # activations outweigh the parameters and Adam state
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, progress=False)
    plan = lambda **kw: ap.plan(step, *abstract, config=cfg.replace(**kw), batch_argnums=(3,))
    written, dropped = plan(recompute="as_written"), plan(recompute="none")
    assert dropped.step_time < written.step_time               # no forward run twice
    assert dropped.peak_memory > written.peak_memory           # every activation held
    assert plan(recompute="auto").recompute == "none"
    cap = (written.peak_memory + dropped.peak_memory) // 2
    fits = []
    for how in ("as_written", "none"):
        try:
            fits.append(plan(recompute=how, max_device_memory=cap))
        except ap.InfeasibleError:
            pass
    assert fits
    auto = plan(recompute="auto", max_device_memory=cap)
    assert auto.peak_memory <= cap
    assert auto.step_time == pytest.approx(min(s.step_time for s in fits))


def test_recompute_is_checked():
    with pytest.raises(ap.ConfigError, match="recompute='full'.*as_written.*selective"):
        ap.ParallelConfig(recompute="full")


def test_selective_recomputes_the_attention_scores_alone():
    """Megatron-LM's selective recomputation: of a block's recomputation only the b x heads x
    s^2 values (scores, softmax, dropout bits) are recomputed, from the stored queries and keys;
    the projections and the MLP read the forward pass's values. Its matmuls lie between the
    two extremes (the queries-times-keys product once more per block), and so do its plan's
    time and memory."""
    seq = 256
    step, args = _gpt(seq=seq)
    graph = trace(step, *args)
    chosen = selective_recompute(graph)
    dots = lambda g: [n for n in g.nodes if n.prim == "dot_general"]
    assert len(dots(without_recompute(graph))) + 2 == len(dots(chosen)) < len(dots(graph))
    recomputed = [n for n in chosen.nodes if REMAT_SCOPE in n.scope and n.prim == "dot_general"]
    assert len(recomputed) == 2 and all(n.outputs[0].shape[-2:] == (seq, seq)
                                        for n in recomputed)     # q k^T, once per block
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, progress=False)
    plan = lambda how: ap.plan(step, *abstract, config=cfg.replace(recompute=how),
                               batch_argnums=(3,))
    full, sel, none = plan("as_written"), plan("selective"), plan("none")
    assert sel.recompute == "selective" and "recomputation: selective" in sel.table()
    assert none.step_time <= sel.step_time < full.step_time
    assert full.peak_memory < sel.peak_memory < none.peak_memory
