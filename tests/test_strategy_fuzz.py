"""Saved strategy files, mutated (hypothesis): each mutation is either refused with an autopar
error when read or compiled, or compiles to a step that gives the single-device answer.

The mutations are what a hand edit, another version or an attacker makes: a layout replaced by
another (any axes, partial sums, wrong rank), a number, name, dtype or shape changed, a key
deleted, a value of the wrong type, a list cut short. The step is an MLP with Adam on a 2 x 2
mesh (4 fake CPU devices, the jax backend), auto_parallel's own plan saved first."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar as ap
import models as m
from autopar.errors import AutoparError
from test_api import assert_same

AXES = ("x", "y")


@pytest.fixture(scope="module")
def saved():
    p, b = m.mlp_params((8, 16, 8)), m.mlp_batch(8, (8, 16, 8))
    state = m.adam_init(p)
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, mesh_shape=(2, 2),
                            backend="jax", progress=False)
    c = ap.compile(m.mlp_adam_step, p, state, b, config=cfg)
    want = m.mlp_adam_step(p, state, b)
    assert_same(c(p, state, b), want)
    return cfg, (p, state, b), want, c.strategy.to_dict()


def _paths(d, at=()):
    """Every (path, value) in the JSON tree, containers included."""
    yield at, d
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, at + (k,))
    elif isinstance(d, list):
        for k, v in enumerate(d):
            yield from _paths(v, at + (k,))


layouts = st.builds(
    lambda dims, part: "[" + ",".join(dims) + "]" + (" sum{" + ",".join(part) + "}" if part else ""),
    st.lists(st.sampled_from(["_", "x", "y", "(x,y)", "(y,x)", "z"]), max_size=3),
    st.lists(st.sampled_from(AXES + ("z",)), max_size=2, unique=True))
values = st.one_of(
    layouts, st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "float32", "int32", "bfloat16", "nonsense", "w1", "dot_general.3"]),
    st.none(), st.booleans(), st.lists(st.integers(0, 16), max_size=3), st.just({}))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_strategy_is_refused_or_gives_the_single_device_answer(saved, data):
    cfg, args, want, d = saved
    d = json.loads(json.dumps(d))
    # mostly the entries that change the plan: argument and operator layouts
    paths = [p for p, _ in _paths(d) if p]
    plan_paths = [p for p in paths if p[0] in ("inputs", "ops") and len(p) >= 3
                  and p[2] in ("layout", "update", "in", "out", "converted", "shape", "dtype",
                               "name", "in_shapes", "out_shapes")]
    path = data.draw(st.one_of(st.sampled_from(plan_paths), st.sampled_from(paths)))
    kind = data.draw(st.sampled_from(["replace", "replace", "delete", "truncate"]))
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if kind == "delete" and isinstance(parent, dict):
        del parent[last]
    elif kind == "truncate" and isinstance(parent[last], list) and parent[last]:
        parent[last] = parent[last][:-1]
    else:
        parent[last] = data.draw(layouts if isinstance(parent[last], str) and
                                 parent[last].startswith("[") else values)
    text = json.dumps(d)
    try:
        strategy = ap.Strategy.from_json(text)
        with ap.compile(m.mlp_adam_step, *args, config=cfg, strategy=strategy) as c:
            got = c(*args)
    except AutoparError as e:
        assert str(e).strip(), "an autopar error says what is wrong"
        return
    assert_same(got, want)
