"""Pipeline stage assignment from ap.pipeline_stage annotations (pure planning)."""
import jax
import jax.numpy as jnp
import pytest

import autopar as ap
import models as m
from autopar.strategies.stage_assign import assign_stages
from autopar.trace import trace


def two_stage_mlp_step(params, batch, order=(0, 1)):
    def loss(p, b):
        x, y = b
        with ap.pipeline_stage(order[0]):
            h = jax.nn.relu(x @ p["w1"] + p["b1"])
        with ap.pipeline_stage(order[1]):
            out = h @ p["w2"] + p["b2"]
        return jnp.mean((out - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params, batch)
    return value, m.sgd(params, grads)


def staged(fn, *args, count=2):
    g = trace(fn, *args)
    return g, assign_stages(g, count)


def test_blocks_their_derivatives_and_updates_follow_the_annotations():
    p, b = m.mlp_params(), m.mlp_batch()
    g, st = staged(two_stage_mlp_step, p, b)
    by_stage = {s: [g.nodes[k] for k in st.nodes(s)] for s in (0, 1)}
    # the forward matmul of each block and its two derivative matmuls are in the block's stage
    for s in (0, 1):
        dots = [n for n in by_stage[s] if n.prim == "dot_general"]
        assert len(dots) == 2 + s, [n.scope for n in dots]   # stage 0 needs no input gradient
        assert all(f"autopar_stage{s}" in n.scope for n in dots)
    # the loss (outside any block) is in the last stage; each update where its parameter is used
    names = ["w1", "b1", "w2", "b2"]                            # flattened argument order: b1 b2 w1 w2
    leaves = dict(zip(sorted(names), range(4)))
    assert set(st.inputs[0]) >= {leaves["w1"], leaves["b1"], 4}       # x is input 4
    assert set(st.inputs[1]) >= {leaves["w2"], leaves["b2"], 5}       # y is input 5
    for j, o in enumerate(g.outputs[1:]):                           # new b1, b2, w1, w2
        k = next(i for i, n in enumerate(g.nodes) if o in n.outputs)
        assert st.of_node[k] == (0 if sorted(names)[j] in ("w1", "b1") else 1)
    assert str(st).startswith("Stages(0: ")


def test_gpt_blocks_one_stage_each():
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=4)

    def step(params, batch):
        def loss(q, bt):
            tokens, labels = bt
            x = q["wte"][tokens] + q["wpe"][:tokens.shape[1]]
            for s, name in enumerate(("h0", "h1")):
                with ap.pipeline_stage(s):
                    blk = q[name]
                    x = x + m.attention(m.layer_norm(x, blk["ln1_g"], blk["ln1_b"]), blk, 4)
                    h = m.layer_norm(x, blk["ln2_g"], blk["ln2_b"])
                    x = x + (jax.nn.gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"])
            logits = m.layer_norm(x, q["lnf_g"], q["lnf_b"]) @ q["wte"].T
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, m.sgd(params, grads)

    g, st = staged(step, p, b)
    assert len(st.nodes(0)) > 50 and len(st.nodes(1)) > 50
    # the tied embedding is read by the first stage (lookup) and the last (LM head)
    wte = [i for i, path in enumerate(jax.tree_util.tree_flatten_with_path((p, b))[0])
           if "wte" in jax.tree_util.keystr(path[0])]
    assert all(wte[0] in st.inputs[s] for s in (0, 1))


@pytest.mark.parametrize("order,count,match", [
    ((0, 2), 2, "pipeline_stages=2"),
    ((0, 0), 2, r"stages \[1\] have no operator"),
    ((1, 0), 2, "stages must follow the forward order"),
])
def test_bad_annotations_raise_pipeline_error(order, count, match):
    p, b = m.mlp_params(), m.mlp_batch()
    with pytest.raises(ap.PipelineError, match=match):
        staged(lambda q, bt: two_stage_mlp_step(q, bt, order), p, b, count=count)


def test_no_annotation_asks_for_them():
    p, b = m.mlp_params(), m.mlp_batch()
    with pytest.raises(ap.PipelineError, match="ap.pipeline_stage"):
        staged(m.mlp_sgd_step, p, b)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_stage_numbers_are_checked(bad):
    with pytest.raises(ap.ConfigError, match="integer >= 0"):
        ap.pipeline_stage(bad)
