"""Bad inputs, as users and attackers give them: every case raises a typed autopar error whose
message names the offending thing (a field, an entry, a file, a rank).

One table per surface: ParallelConfig fields, the compile API, the MindSpore-style context
API, strategy files, IOPDDL problem files, the CLI (in process: one line on stderr, exit
status 2, no traceback) and the native runtime's launcher. Each row: an id, a thunk, the
error class and a regular expression the message must match."""
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import models as m
from autopar import cli
from autopar.errors import (AutoparError, ConfigError, InfeasibleError,
                            LayoutError)
from autopar.strategies.problem import SearchProblem

P, B = m.mlp_params(), m.mlp_batch(batch=8)


def cfg(**kw):
    return lambda: ap.ParallelConfig(**{"parallel_mode": "data_parallel", **kw})


def check(thunk, error, pattern):
    with pytest.raises(error) as got:
        thunk()
    assert isinstance(got.value, AutoparError)
    assert re.search(pattern, str(got.value)), str(got.value)


# ---------------------------------------------------------------- ParallelConfig fields
CONFIG = [
    ("mode-unknown", cfg(parallel_mode="fast"), "parallel_mode='fast'.*choose one of"),
    ("mode-int", cfg(parallel_mode=3), "parallel_mode=3"),
    ("mode-none", cfg(parallel_mode=None), "parallel_mode=None"),
    ("mode-standalone-8", cfg(parallel_mode="stand_alone", device_num=8), "device_num=8"),
    ("devices-0", cfg(device_num=0), "device_num=0"),
    ("devices-negative", cfg(device_num=-2), "device_num=-2"),
    ("devices-str", cfg(device_num="8"), "device_num='8'"),
    ("devices-float", cfg(device_num=2.5), "device_num=2.5"),
    ("devices-bool", cfg(device_num=True), "device_num=True"),
    ("mesh-str", cfg(mesh_shape="2x4"), "mesh_shape='2x4'"),
    ("mesh-letters", cfg(mesh_shape=(2, "x")), r"mesh_shape=\(2, 'x'\)"),
    ("mesh-zero", cfg(mesh_shape=(0, 2)), r"mesh_shape=\(0, 2\)"),
    ("mesh-negative", cfg(mesh_shape=(-2, -2)), r"mesh_shape=\(-2, -2\)"),
    ("mesh-empty", cfg(mesh_shape=()), r"mesh_shape=\(\)"),
    ("mesh-int", cfg(mesh_shape=4), "mesh_shape=4"),
    ("mesh-disagrees", cfg(device_num=8, mesh_shape=(2, 3)), r"mesh_shape=\(2, 3\)"),
    ("mesh-float", cfg(mesh_shape=(2.5, 2)), r"mesh_shape=\(2.5, 2\)"),
    ("axis-names-length", cfg(mesh_shape=(2, 2), mesh_axis_names=("x",)), "mesh_axis_names"),
    ("axis-names-twice", cfg(mesh_shape=(2, 2), mesh_axis_names=("x", "x")), "mesh_axis_names"),
    ("axis-names-int", cfg(mesh_shape=(2, 2), mesh_axis_names=(1, 2)), "mesh_axis_names"),
    ("axis-names-str", cfg(mesh_shape=(2,), mesh_axis_names="x"), "mesh_axis_names"),
    ("search-unknown", cfg(search_mode="genetic"), "search_mode='genetic'"),
    ("search-time-negative", cfg(search_time=-1), "search_time=-1"),
    ("search-time-str", cfg(search_time="fast"), "search_time='fast'"),
    ("search-time-nan", cfg(search_time=float("nan")), "search_time=nan"),
    ("search-time-inf", cfg(search_time=float("inf")), "search_time=inf"),
    ("memory-words", cfg(max_device_memory="lots"), "max_device_memory='lots'"),
    ("memory-negative", cfg(max_device_memory=-5), "max_device_memory=-5"),
    ("memory-unit", cfg(max_device_memory="16XB"), "max_device_memory='16XB'"),
    ("memory-list", cfg(max_device_memory=[16]), r"max_device_memory=\[16\]"),
    ("memory-nan", cfg(max_device_memory=float("nan")), "max_device_memory=nan"),
    ("memory-bool", cfg(max_device_memory=True), "max_device_memory=True"),
    ("progress-str", cfg(progress="yes"), "progress='yes'"),
    ("timeout-zero", cfg(collective_timeout=0), "collective_timeout=0"),
    ("timeout-negative", cfg(collective_timeout=-1), "collective_timeout=-1"),
    ("timeout-str", cfg(collective_timeout="x"), "collective_timeout='x'"),
    ("timeout-nan", cfg(collective_timeout=float("nan")), "collective_timeout=nan"),
    ("timeout-inf", cfg(collective_timeout=float("inf")), "collective_timeout=inf"),
    ("fusion-negative", cfg(allreduce_fusion_bytes=-1), "allreduce_fusion_bytes=-1"),
    ("fusion-words", cfg(allreduce_fusion_bytes="big"), "allreduce_fusion_bytes='big'"),
    ("backend-unknown", cfg(backend="gpu"), "backend='gpu'.*choose one of"),
    ("gradients-mean-str", cfg(gradients_mean="yes"), "gradients_mean='yes'"),
    ("dataset-int", cfg(dataset_strategy=5), "dataset_strategy=5"),
    ("dataset-zero-split", cfg(dataset_strategy=((0, 1),)), "dataset_strategy"),
    ("dataset-words", cfg(dataset_strategy="batch"), "dataset_strategy='batch'"),
    ("optimizer-str", cfg(enable_parallel_optimizer="yes"), "enable_parallel_optimizer='yes'"),
    ("optimizer-level", cfg(optimizer_level="level9"), "optimizer_level='level9'"),
    ("optimizer-level-int", cfg(optimizer_level=4), "optimizer_level=4"),
    ("threshold-negative", cfg(parallel_optimizer_threshold=-1), "parallel_optimizer_threshold"),
    ("threshold-str", cfg(parallel_optimizer_threshold="x"), "parallel_optimizer_threshold"),
    ("stages-zero", cfg(pipeline_stages=0), "pipeline_stages=0"),
    ("stages-words", cfg(pipeline_stages="two"), "pipeline_stages='two'"),
    ("stages-float", cfg(pipeline_stages=2.0), "pipeline_stages=2.0"),
    ("stages-too-many", cfg(device_num=2, pipeline_stages=4), "pipeline_stages=4"),
    ("micro-zero", cfg(micro_batches=0), "micro_batches=0"),
    ("micro-negative", cfg(micro_batches=-3), "micro_batches=-3"),
    ("scheduler", cfg(pipeline_scheduler="zigzag"), "pipeline_scheduler='zigzag'"),
    ("stage-devices-words", cfg(pipeline_stage_devices="some"), "pipeline_stage_devices='some'"),
    ("stage-devices-count", cfg(device_num=4, pipeline_stages=2, pipeline_stage_devices=(1,)),
     "pipeline_stage_devices"),
    ("stage-devices-sum", cfg(device_num=4, pipeline_stages=2, pipeline_stage_devices=(1, 1)),
     "pipeline_stage_devices"),
    ("stage-devices-auto-stages", cfg(device_num=4, pipeline_stages="auto",
                                      pipeline_stage_devices=(2, 2)), "pipeline_stage_devices"),
    ("topology-str", cfg(device_num=2, topology="fast"), "topology 'fast'"),
    ("topology-devices", cfg(device_num=2, topology=ap.Topology.local(4)), "topology"),
    ("load-file-int", cfg(strategy_ckpt_load_file=5), "strategy_ckpt_load_file=5"),
    ("save-file-int", cfg(strategy_ckpt_save_file=[]), r"strategy_ckpt_save_file=\[\]"),
    ("unknown-field", lambda: ap.ParallelConfig(device_count=2), "device_count"),
]


@pytest.mark.parametrize("thunk,pattern", [c[1:] for c in CONFIG], ids=[c[0] for c in CONFIG])
def test_config_field(thunk, pattern):
    check(thunk, ConfigError, pattern)


# ---------------------------------------------------------------- the compile API
def jax_cfg(**kw):
    return ap.ParallelConfig(**{"backend": "jax", "progress": False, **kw})


def compile_(*args, **kw):
    return lambda: ap.compile(*args, **kw).close()


DP2 = dict(parallel_mode="data_parallel", device_num=2)


def _w1(spec):
    """An in_strategy entry for the MLP's parameters: ``spec`` on w1, the rest free."""
    return {"w1": spec, "b1": None, "w2": None, "b2": None}
SEMI = dict(parallel_mode="semi_auto_parallel", device_num=2)


def _called(bad_p, bad_b):
    c = ap.compile(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2))
    try:
        c(bad_p, bad_b)
    finally:
        c.close()


API = [
    ("fn-not-callable", compile_(5, P, B, config=jax_cfg()), ConfigError, "callable"),
    ("config-not-config", compile_(m.mlp_sgd_step, P, B, config={"device_num": 2}),
     ConfigError, "config"),
    ("arg-string", compile_(m.mlp_sgd_step, "weights", B, config=jax_cfg()), ConfigError,
     "argument"),
    ("arg-object", compile_(m.mlp_sgd_step, P, object(), config=jax_cfg()), ConfigError,
     "argument"),
    ("batch-argnums-str", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2),
                                   batch_argnums="1"), ConfigError, "batch_argnums='1'"),
    ("batch-argnums-range", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2),
                                     batch_argnums=(5,)), ConfigError, "batch_argnums"),
    ("batch-argnums-negative", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2),
                                        batch_argnums=(-7,)), ConfigError, "batch_argnums"),
    ("batch-argnums-float", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2),
                                     batch_argnums=(1.0,)), ConfigError, "batch_argnums"),
    ("batch-indivisible", compile_(m.mlp_sgd_step, P, m.mlp_batch(batch=7),
                                   config=jax_cfg(**DP2)), AutoparError, "7"),
    ("in-strategy-length", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**SEMI),
                                    in_strategy=(None, None, None)), LayoutError, "in_strategy"),
    ("in-strategy-text", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**SEMI),
                                  in_strategy=({"w1": "[q,"}, None)), LayoutError, r"\[q,"),
    ("in-strategy-axis", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**SEMI),
                                  in_strategy=(_w1("[_,z]"), None)), LayoutError, "'z'"),
    ("in-strategy-divides", compile_(m.mlp_sgd_step, m.mlp_params((16, 31, 16)), B,
                                     config=jax_cfg(**SEMI), in_strategy=(_w1("[_,x]"), None)),
     LayoutError, "31"),
    ("in-strategy-rank", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**SEMI),
                                  in_strategy=(_w1("[x]"), None)), LayoutError, r"\[x\]"),
    ("in-strategy-partial", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**SEMI),
                                     in_strategy=(_w1("[_,_] sum{x}"), None)), LayoutError,
     "sum"),
    ("in-strategy-key", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**SEMI),
                                 in_strategy=({"w9": "[_,x]"}, None)), LayoutError, "in_strategy entry"),
    ("in-strategy-tuple", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**SEMI),
                                   in_strategy=(_w1((3, 1)), None)), LayoutError, r"\(3, 1\)"),
    ("strategy-wrong-type", compile_(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2),
                                     strategy="plan.json"), ConfigError, "strategy"),
    ("native-257", compile_(m.mlp_sgd_step, P, m.mlp_batch(batch=257 * 2),
                            config=ap.ParallelConfig(parallel_mode="data_parallel",
                                                     device_num=257, progress=False)),
     ConfigError, "257"),
    ("jax-too-many-devices", compile_(m.mlp_sgd_step, P, m.mlp_batch(batch=64),
                                      config=jax_cfg(parallel_mode="data_parallel",
                                                     device_num=64)), ConfigError, "64"),
    ("call-shape", lambda: _called(P, m.mlp_batch(batch=16)), ConfigError, "shape"),
    ("call-dtype", lambda: _called(P, jax.tree.map(lambda x: x.astype(jnp.int32), B)),
     ConfigError, "i32"),
    ("call-structure", lambda: _called(P, (B[0],)), ConfigError, "structure|argument"),
    ("hybrid-with-strategy", lambda: ap.compile(
        m.mlp_sgd_step, P, B, config=jax_cfg(parallel_mode="hybrid_parallel", device_num=2),
        strategy=ap.plan(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2))), ConfigError,
     "hybrid_parallel"),
    ("load-missing-file", compile_(m.mlp_sgd_step, P, B,
                                   config=jax_cfg(**DP2, strategy_ckpt_load_file="/no/such.json")),
     LayoutError, "/no/such.json"),
    ("memory-too-small", compile_(m.mlp_sgd_step, P, B,
                                  config=jax_cfg(parallel_mode="auto_parallel", device_num=2,
                                                 max_device_memory=64)),
     InfeasibleError, "64 bytes"),
]


@pytest.mark.parametrize("thunk,error,pattern", [c[1:] for c in API], ids=[c[0] for c in API])
def test_compile_api(thunk, error, pattern):
    check(thunk, error, pattern)


# ---------------------------------------------------------------- the context API
@pytest.fixture
def clean_context():
    ap.reset_auto_parallel_context()
    yield
    ap.reset_auto_parallel_context()


def ctx(**kw):
    return lambda: ap.set_auto_parallel_context(**kw)


CONTEXT = [
    ("ctx-unknown-key", ctx(parallel_modes="auto_parallel"), "parallel_modes"),
    ("ctx-mode", ctx(parallel_mode="auto"), "parallel_mode='auto'"),
    ("ctx-devices", ctx(device_num=0), "device_num=0"),
    ("ctx-devices-str", ctx(device_num="two"), "device_num='two'"),
    ("ctx-search", ctx(search_mode="random"), "search_mode='random'"),
    ("ctx-memory", ctx(max_device_memory="many"), "max_device_memory='many'"),
    ("ctx-gradients-mean", ctx(gradients_mean="no"), "gradients_mean='no'"),
    ("ctx-optimizer-not-dict", ctx(parallel_optimizer_config="level2"),
     "parallel_optimizer_config"),
    ("ctx-optimizer-key", ctx(parallel_optimizer_config={"level": "level2"}), "'level'"),
    ("ctx-optimizer-level", ctx(parallel_optimizer_config={"optimizer_level": "level7"}),
     "optimizer_level='level7'"),
    ("ctx-pipeline-not-dict", ctx(pipeline_config=3), "pipeline_config"),
    ("ctx-pipeline-scheduler", ctx(pipeline_config={"pipeline_scheduler": "fast"}),
     "pipeline_scheduler='fast'"),
    ("ctx-ckpt-key", ctx(strategy_ckpt_config={"file": "a.json"}), "'file'"),
    ("ctx-ckpt-path", ctx(strategy_ckpt_config={"load_file": 3}), "strategy_ckpt_load_file=3"),
    ("ctx-stages", ctx(pipeline_stages=-1), "pipeline_stages=-1"),
    ("ctx-dataset", ctx(dataset_strategy=((2, "x"),)), "dataset_strategy"),
    ("ctx-timeout", ctx(collective_timeout="soon"), "collective_timeout='soon'"),
    ("ctx-get-unknown", lambda: ap.get_auto_parallel_context("speed"), "'speed'"),
    ("ctx-disagree", lambda: (ap.set_auto_parallel_context(device_num=8, mesh_shape=(2, 2)),
                              ap.context_config()), "device_num=8"),
]


@pytest.mark.parametrize("thunk,pattern", [c[1:] for c in CONTEXT], ids=[c[0] for c in CONTEXT])
def test_context_api(clean_context, thunk, pattern):
    check(thunk, ConfigError, pattern)


# ---------------------------------------------------------------- strategy files
@pytest.fixture(scope="module")
def saved_strategy():
    s = ap.plan(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2))
    return s.to_dict()


def edit(change):
    """A thunk: the saved strategy's JSON changed by ``change(d)`` (which may return a text to
    use instead), loaded and compiled."""
    def run(d):
        d = json.loads(json.dumps(d))
        text = change(d)
        text = json.dumps(d) if text is None else text
        ap.compile(m.mlp_sgd_step, P, B, config=jax_cfg(**DP2),
                   strategy=ap.Strategy.from_json(text)).close()
    return run


def setter(*path_value):
    *path, value = path_value

    def change(d):
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return change


def deleter(*path):
    def change(d):
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return change


STRATEGY = [
    ("st-not-json", edit(lambda d: "{not json"), "not JSON"),
    ("st-not-object", edit(lambda d: "[1, 2]"), "not an autopar strategy file"),
    ("st-format", edit(setter("format", "mindspore")), "not an autopar strategy file"),
    ("st-deep", edit(lambda d: "[" * 100000 + "]" * 100000), "nested too deeply|not an autopar"),
    ("st-no-ops", edit(deleter("ops")), "has no 'ops'"),
    ("st-ops-not-list", edit(setter("ops", {"a": 1})), "ops: is .*not a list"),
    ("st-op-not-object", edit(setter("ops", 0, 7)), r"ops\[0\]: is int"),
    ("st-op-no-in", edit(deleter("ops", 0, "in")), r"ops\[0\] .*has no 'in'"),
    ("st-op-layout-text", edit(setter("ops", 0, "in", 0, "[x,")), r"ops\[0\] .*\.in\[0\]"),
    ("st-op-layout-int", edit(setter("ops", 0, "out", 0, 5)), r"ops\[0\] .*\.out\[0\]: is 5"),
    ("st-op-layout-axis", edit(setter("ops", 0, "out", 0, "[z,_]")), "'z'"),
    ("st-op-layout-twice", edit(setter("ops", 0, "out", 0, "[x,x]")), "axis twice"),
    ("st-op-prim", edit(setter("ops", 0, "prim", "cos")), "cos"),
    ("st-op-name", edit(setter("ops", 0, "name", "cos.0")), "cos.0"),
    ("st-op-shape", edit(setter("ops", 0, "out_shapes", [[3, 3]])), r"\(3, 3\)"),
    ("st-op-shape-str", edit(setter("ops", 0, "out_shapes", [["8"]])), r"out_shapes\[0\]\[0\]"),
    ("st-op-compute-str", edit(setter("ops", 0, "compute_time", "fast")), "compute_time"),
    ("st-op-compute-negative", edit(setter("ops", 0, "compute_time", -1)), "compute_time"),
    ("st-op-stage", edit(setter("ops", 0, "stage", 3)), "stage 3"),
    ("st-op-converted", edit(setter("ops", 0, "converted", ["[_,_,_,_]"])), "conversion"),
    ("st-peak-str", edit(setter("peak_memory", "12")), "peak_memory: is '12'"),
    ("st-peak-nan", edit(lambda d: json.dumps(d).replace('"peak_memory": ', '"peak_memory": NaN, "x": ')),
     "peak_memory"),
    ("st-mesh-shape", edit(setter("mesh", "shape", [4])), r"\(4,\)|mesh"),
    ("st-mesh-names", edit(setter("mesh", "axis_names", ["x", "x"])), "axis_names"),
    ("st-mesh-missing", edit(deleter("mesh")), "has no 'mesh'"),
    ("st-input-layout-partial", edit(setter("inputs", 2, "layout", "[_,_] sum{x}")),
     r"argument 2 \(w1\).*partial sum"),
    ("st-input-update-partial", edit(setter("inputs", 2, "update", "[_,_] sum{x}")),
     r"argument 2 \(w1\).*partial sum"),
    ("st-input-layout-axis", edit(setter("inputs", 2, "layout", "[_,q]")), "'q'"),
    ("st-input-layout-divides", edit(lambda d: d["inputs"].__setitem__(
        0, {**d["inputs"][0], "layout": "[x]", "shape": [31]})), r"argument 0 \(b1\)"),
    ("st-input-shape", edit(setter("inputs", 2, "shape", [32, 16])), r"argument 2 \(w1\)"),
    ("st-input-dtype", edit(setter("inputs", 2, "dtype", "int32")), r"argument 2 \(w1\)"),
    ("st-input-dtype-bogus", edit(setter("inputs", 2, "dtype", "float99")), "float99"),
    ("st-input-name", edit(setter("inputs", 2, "name", "w7")), "w7"),
    ("st-input-missing", edit(lambda d: d["inputs"].pop() and None), "arguments"),
    ("st-input-param-str", edit(setter("inputs", 2, "is_param", "yes")), "is_param"),
    ("st-stage-devices", edit(setter("stages", [{"index": 0, "devices": "all", "seconds": 1,
                                                 "memory": 1}])), r"stages\[0\]\.devices"),
]


@pytest.mark.parametrize("change,pattern", [c[1:] for c in STRATEGY], ids=[c[0] for c in STRATEGY])
def test_strategy_file(saved_strategy, change, pattern):
    check(lambda: change(saved_strategy), LayoutError, pattern)


def test_a_partial_sum_argument_is_refused_on_the_native_backend_too(saved_strategy):
    """The case that ran: a partial-sum argument layout loaded and compiled on the native
    backend and returned a wrong loss; now it is refused before anything runs."""
    d = json.loads(json.dumps(saved_strategy))
    d["inputs"][2]["layout"] = "[_,_] sum{x}"
    with pytest.raises(LayoutError, match=r"w1.*partial sum"):
        ap.compile(m.mlp_sgd_step, P, B, strategy=ap.Strategy.from_json(json.dumps(d)),
                   config=ap.ParallelConfig(**DP2, progress=False))


# ---------------------------------------------------------------- IOPDDL problem files
def problem(nodes=None, edges=None, **top):
    p = {"nodes": {"intervals": [[0, 2], [1, 3]], "costs": [[1, 2], [3]],
                   "usages": [[1, 1], [2]], **(nodes or {})},
         "edges": {"nodes": [[0, 1]], "costs": [[0, 1]], **(edges or {})}, **top}
    return lambda: SearchProblem.from_dict({"problem": p})


PROBLEM = [
    ("pb-nan-cost", problem({"costs": [[1, math.nan], [3]]}), "node 0, strategy 1: cost nan"),
    ("pb-inf-cost", problem({"costs": [[1, 2], [math.inf]]}), "node 1, strategy 0: cost inf"),
    ("pb-negative-cost", problem({"costs": [[1, -2], [3]]}), "node 0, strategy 1: cost -2"),
    ("pb-negative-edge", problem(edges={"costs": [[0, -1]]}), r"edge 0, strategy pair \[1, 0\]"),
    ("pb-nan-edge", problem(edges={"costs": [[math.nan, 1]]}), "edge 0.*nan"),
    ("pb-negative-usage", problem({"usages": [[1, -1], [2]]}), "node 0, strategy 1: usage -1"),
    ("pb-fractional-usage", problem({"usages": [[1, 1.5], [2]]}), "usages.*not integers"),
    ("pb-string-cost", problem({"costs": [[1, "2"], [3]]}), "costs.*not numbers"),
    ("pb-no-costs", problem({"costs": None}), "costs"),
    ("pb-missing-nodes", lambda: SearchProblem.from_dict({"problem": {}}), "has no 'nodes'"),
    ("pb-not-object", lambda: SearchProblem.from_dict([1, 2]), "problem"),
    ("pb-empty-strategies", problem({"costs": [[], [3]], "usages": [[], [2]]}), "node 0"),
    ("pb-costs-usages", problem({"usages": [[1], [2]]}), "node 0"),
    ("pb-interval-backwards", problem({"intervals": [[2, 0], [1, 3]]}), r"node 0 lives in \[2, 0\]"),
    ("pb-interval-negative", problem({"intervals": [[-1, 2], [1, 3]]}), "node 0"),
    ("pb-interval-shape", problem({"intervals": [[0, 1, 2], [1, 3]]}), "intervals"),
    ("pb-edge-node", problem(edges={"nodes": [[0, 7]]}), r"edge 0 joins \[0, 7\]"),
    ("pb-edge-negative-node", problem(edges={"nodes": [[-1, 0]]}), r"edge 0 joins \[-1, 0\]"),
    ("pb-edge-matrix-size", problem(edges={"costs": [[0, 1, 2]]}), "edge 0"),
    ("pb-edge-count", problem(edges={"costs": []}), "0 matrices for 1 edges"),
    ("pb-limit-str", problem(usage_limit="lots"), "usage_limit"),
    ("pb-limit-negative", problem(usage_limit=-1), "usage_limit -1"),
    ("pb-limit-fraction", problem(usage_limit=2.5), "usage_limit"),
    ("pb-json", lambda: SearchProblem.from_json("{"), "not an IOPDDL problem"),
    ("pb-deep", lambda: SearchProblem.from_json("[" * 100000 + "]" * 100000),
     "not an IOPDDL problem|problem"),
    ("pb-missing-file", lambda: SearchProblem.load("/no/such/problem.json"), "/no/such/problem.json"),
]


@pytest.mark.parametrize("thunk,pattern", [c[1:] for c in PROBLEM], ids=[c[0] for c in PROBLEM])
def test_problem_file(thunk, pattern):
    check(thunk, ConfigError, pattern)


@pytest.mark.parametrize("solver", ["best", "ilp", "dynamic_programming", "sharding_propagation",
                                    "local_search", "brute_force"])
def test_every_solver_answers_feasibly_or_raises_infeasible(solver):
    from autopar.strategies.solvers import get
    fits = SearchProblem.from_dict({"problem": {
        "nodes": {"intervals": [[0, 2], [1, 3], [2, 4]], "costs": [[5, 1], [1, 7], [2, 2]],
                  "usages": [[1, 9], [9, 1], [4, 5]]},
        "edges": {"nodes": [[0, 1], [1, 2]], "costs": [[0, 3, 3, 0], [1, 0, 0, 1]]},
        "usage_limit": 11}})
    sol = get(solver)(fits, time_limit=5)
    assert fits.feasible(sol.choice) and sol.cost == pytest.approx(fits.cost(sol.choice))
    tight = SearchProblem(fits.node_costs, fits.node_usages, fits.intervals, fits.edges,
                          fits.edge_costs, 4)
    with pytest.raises(InfeasibleError, match="limit of 4 bytes"):
        get(solver)(tight, time_limit=5)


# ---------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def files(tmp_path_factory, saved_strategy):
    """Bad files for the CLI, by name."""
    root = tmp_path_factory.mktemp("cli")
    good = json.dumps(saved_strategy)
    texts = {
        "not_json.json": "{oops",
        "no_ops.json": json.dumps({k: v for k, v in saved_strategy.items() if k != "ops"}),
        "ops_dict.json": json.dumps({**saved_strategy, "ops": {"a": 1}}),
        "peak_str.json": json.dumps({**saved_strategy, "peak_memory": "12"}),
        "deep.json": "[" * 200000 + "]" * 200000,
        "good.json": good,
        "nan_problem.json": json.dumps({"problem": {"nodes": {
            "intervals": [[0, 1]], "costs": [[1, float("nan")]], "usages": [[1, 1]]}}}),
        "inf_problem.json": json.dumps({"problem": {"nodes": {
            "intervals": [[0, 1]], "costs": [[float("inf")]], "usages": [[1]]}}}),
        "negative_edge.json": json.dumps({"problem": {
            "nodes": {"intervals": [[0, 1], [0, 1]], "costs": [[1], [1]], "usages": [[1], [1]]},
            "edges": {"nodes": [[0, 1]], "costs": [[-4]]}}}),
        "problem.json": json.dumps({"problem": {
            "nodes": {"intervals": [[0, 1]], "costs": [[2, 1]], "usages": [[1, 1]]}}}),
        "raises.py": "def build():\n    raise RuntimeError('dataset not found')\n",
        "returns_int.py": "def build():\n    return 3\n",
        "syntax.py": "def build(:\n",
    }
    for name, text in texts.items():
        (root / name).write_text(text)
    (root / "a_dir").mkdir()
    return root


def cli_case(*argv):
    return lambda root: [str(root / a[1:]) if a.startswith("@") else a for a in argv]


CLI = [
    ("cli-show-missing", cli_case("show", "@missing.json"), "missing.json"),
    ("cli-show-dir", cli_case("show", "@a_dir"), "a_dir"),
    ("cli-show-not-json", cli_case("show", "@not_json.json"), "not JSON"),
    ("cli-show-no-ops", cli_case("show", "@no_ops.json"), "has no 'ops'"),
    ("cli-show-ops-dict", cli_case("show", "@ops_dict.json"), "ops: is .*not a list"),
    ("cli-show-peak-str", cli_case("show", "@peak_str.json"), "peak_memory"),
    ("cli-show-deep", cli_case("show", "@deep.json"), "nested too deeply"),
    ("cli-report-missing", cli_case("report", "@missing.json"), "missing.json"),
    ("cli-report-out-missing-dir", cli_case("report", "@good.json", "-o", "@no/dir/r.html"),
     "no/dir"),
    ("cli-report-out-dir", cli_case("report", "@good.json", "-o", "@a_dir"), "a_dir"),
    ("cli-plan-no-colon", cli_case("plan", "examples/quickstart.py"), "MODULE:FUNCTION"),
    ("cli-plan-missing-file", cli_case("plan", "@nothere.py:build"), "nothere.py"),
    ("cli-plan-missing-module", cli_case("plan", "no_such_module_x:build"), "no_such_module_x"),
    ("cli-plan-no-function", cli_case("plan", "@raises.py:make"), "make"),
    ("cli-plan-raises", cli_case("plan", "@raises.py:build"), "dataset not found"),
    ("cli-plan-syntax", cli_case("plan", "@syntax.py:build"), "syntax.py"),
    ("cli-plan-returns-int", cli_case("plan", "@returns_int.py:build"), "returns_int.py:build"),
    ("cli-plan-out-missing-dir", cli_case("plan", "@raises.py:build", "-o", "@no/dir/s.json"),
     "no/dir"),
    ("cli-plan-out-dir", cli_case("plan", "@raises.py:build", "-o", "@a_dir"), "a_dir"),
    ("cli-plan-memory", cli_case("plan", "@raises.py:build", "--max-memory", "lots"),
     "max_device_memory='lots'"),
    ("cli-plan-search-time", cli_case("plan", "@raises.py:build", "--search-time", "-3"),
     "search_time=-3"),
    ("cli-plan-topology", cli_case("plan", "@raises.py:build", "--topology", "fast"), "'fast'"),
    ("cli-solve-missing", cli_case("solve", "@missing.json", "5"), "missing.json"),
    ("cli-solve-not-json", cli_case("solve", "@not_json.json", "5"), "not an IOPDDL problem"),
    ("cli-solve-nan", cli_case("solve", "@nan_problem.json", "5"), "cost nan"),
    ("cli-solve-inf", cli_case("solve", "@inf_problem.json", "5"), "cost inf"),
    ("cli-solve-negative-edge", cli_case("solve", "@negative_edge.json", "5"), "cost -4"),
    ("cli-solve-timeout-negative", cli_case("solve", "@problem.json", "-1"), "timeout"),
    ("cli-solve-timeout-nan", cli_case("solve", "@problem.json", "nan"), "timeout"),
    ("cli-solve-solver", cli_case("solve", "@problem.json", "5", "--solver", "magic"), "'magic'"),
    ("cli-calibrate-devices", cli_case("calibrate", "--devices", "1"), "2 devices"),
    ("cli-calibrate-out-dir", cli_case("calibrate", "-o", "@a_dir"), "a_dir"),
    ("cli-bench-size", cli_case("bench", "--size", "16XB"), "cannot read the size '16XB'"),
    ("cli-bench-size-zero", cli_case("bench", "--size", "0KB"), "at least 1"),
]


@pytest.mark.parametrize("argv,pattern", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli_user_error_is_one_line_and_exit_2(files, capsys, argv, pattern):
    rc = cli.main(argv(files))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("autopar: ") and re.search(pattern, lines[0]), err


@pytest.mark.parametrize("argv", [["plan"], ["solve", "x.json", "soon"], ["frobnicate"],
                                  ["plan", "a:b", "--mesh", "2xq"], ["plan", "a:b", "--stages", "x"],
                                  ["bench", "--ranks", "0"], ["bench", "--ranks", "two"]])
def test_cli_usage_errors_exit_2_without_a_traceback(capsys, argv):
    with pytest.raises(SystemExit) as got:
        cli.main(argv)
    err = capsys.readouterr().err
    assert got.value.code == 2 and "Traceback" not in err and "error:" in err


def test_cli_version_says_the_installed_version(capsys):
    from importlib.metadata import version
    with pytest.raises(SystemExit) as got:
        cli.main(["--version"])
    assert got.value.code == 0 and capsys.readouterr().out.strip() == f"autopar {version('autopar')}"


def test_cli_debug_shows_the_traceback(files, capsys):
    assert cli.main(["--debug", "show", str(files / "not_json.json")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "not JSON" in err


def test_cli_internal_error_says_to_report_it(monkeypatch, files, capsys):
    from autopar.strategies import strategy
    monkeypatch.setattr(strategy.Strategy, "table", lambda self: 1 / 0)
    assert cli.main(["show", str(files / "good.json")]) == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError" in err and "bug in autopar" in err and "report" in err


# ---------------------------------------------------------------- the native launcher
def job(*args, **kw):
    from autopar.runtime.launcher import Job
    return lambda: Job(*args, **kw).close()


RUNTIME = [
    ("job-no-ranks", job(0), "not 0"),
    ("job-too-many", job(257), "not 257"),
    ("job-ranks-str", job("2"), "not '2'"),
    ("job-hosts", job(2, hosts=[0]), "hosts"),
    ("job-transport", job(2, inter_host="udp"), "inter_host"),
]


@pytest.mark.native              # refused before any process starts; Job is still constructed
@pytest.mark.parametrize("thunk,pattern", [c[1:] for c in RUNTIME], ids=[c[0] for c in RUNTIME])
def test_native_job_arguments(thunk, pattern):
    check(thunk, ConfigError, pattern)


def worker_rank(comm):
    return comm.rank


@pytest.mark.native
def test_native_job_calls():
    from autopar.runtime.launcher import Job
    with Job(2, timeout=5.0) as j:
        check(lambda: j.call(lambda comm: 0, [(), ()]), ConfigError, "lambda")
        check(lambda: j.call(worker_rank, [()]), ConfigError, "one argument tuple per rank")
        check(lambda: j.call(worker_rank, "ab"), ConfigError, "per_rank_args")
        assert j.call(worker_rank, [(), ()]) == [0, 1]          # the job is still good


def test_a_python_number_used_as_one_says_to_bind_it():
    """A loop count passed as an argument is traced like every argument (as jax.jit does):
    the error says so and how to bind it, JAX's own message after it."""
    def step(w, x, n):
        for _ in range(n):
            x = x @ w
        return x.sum()
    w, x = jnp.ones((4, 4)), jnp.ones((8, 4))
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="jax")
    with pytest.raises(ap.ConfigError, match="functools.partial") as e:
        ap.compile(step, w, x, 3, config=cfg)
    assert "TracerIntegerConversionError" in str(e.value)


def test_a_pmap_ported_pmean_says_data_parallel_already_averages():
    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(x @ w))(w)
        return w - 0.1 * jax.lax.pmean(g, "batch")
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="jax")
    with pytest.raises(ap.ConfigError, match="data_parallel already averages.*hybrid_parallel"):
        ap.compile(step, np.ones((4, 4), np.float32), np.ones((2, 4), np.float32), config=cfg)


def test_a_python_value_argument_names_static_argnums():
    def step(w, opt):
        return w * 2
    with pytest.raises(ap.ConfigError, match="static_argnums.*functools.partial"):
        ap.plan(step, np.ones((4, 4), np.float32), object())
