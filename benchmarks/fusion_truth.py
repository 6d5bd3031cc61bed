"""XLA's fusion in the cost model, checked against one rank's measured compute on this machine.

Run: python benchmarks/fusion_truth.py [--models gpt-user gpt-flax mlp-eqx cnn-flax]
         [--devices 2]

Each model, written the way its authors' libraries write it (``tests/user_gpt.py``'s GPT;
``benchmarks/user_models``' Flax GPT, Equinox MLP with optax Adam and Flax CNN), is planned
data parallel on this machine's calibrated native topology with ``profile_plans``: one rank's
step compiled as the workers compile it and timed alone on a core (``tools/profile.py``),
beside the plan's priced compute. It is priced twice in the same run: with the fusion rule
(``strategies.fusion``: a chain of elementwise operators and reductions between matmuls is
one kernel reading its inputs once and writing its outputs once) and without it (every
operator reading and writing all its operands, the rule before). Out: per model and rule,
priced / measured compute; a rule that prices XLA's kernels right gives the same ratio on
every model (the calibration absorbs one common factor), so the spread of the ratios
(largest / smallest) is the figure to compare.
"""
import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "user_models"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("GPT_BIG", "1")

import jax  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.strategies import fusion  # noqa: E402


def gpt_user():
    import user_gpt as ug
    p, b = ug.init(4, 256, 1024), ug.batch(16, 64, 1024)
    return ug.step, (p, b), None


def library(module):
    def load():
        m = __import__(module)
        return m.step, (m.params, m.opt_state, m.batch), (2,)
    return load


MODELS = {"gpt-user": gpt_user, "gpt-flax": library("m1_gpt_flax"),
          "mlp-eqx": library("m2_mlp_eqx"), "cnn-flax": library("m3_cnn_flax")}


@contextlib.contextmanager
def unfused():
    """The cost model without the fusion rule: every operator touches all its operands."""
    keep, cache = fusion._touches, dict(fusion._CACHE)
    fusion._touches = lambda graph, chip: {}
    fusion._CACHE.clear()
    try:
        yield
    finally:
        fusion._touches = keep
        fusion._CACHE.clear()
        fusion._CACHE.update(cache)


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--models", nargs="+", default=list(MODELS))
    a.add_argument("--devices", type=int, default=2)
    args = a.parse_args()
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=args.devices,
                            backend="native", profile_plans=True, progress=False)
    rows = []
    for name in args.models:
        step, step_args, batch = MODELS[name]()
        got = {"model": name}
        for rule, ctx in (("fused", contextlib.nullcontext), ("unfused", unfused)):
            with ctx():
                s = ap.plan(step, *step_args, config=cfg, batch_argnums=batch)
            priced = sum(o.compute_time for o in s.ops)
            got[f"{rule}_priced_ms"] = round(priced * 1e3, 3)
            got["measured_ms"] = round(s.measured_compute * 1e3, 3)
            got[f"{rule}_ratio"] = round(priced / s.measured_compute, 3)
        rows.append(got)
        print(json.dumps(got), flush=True)
    for rule in ("fused", "unfused"):
        ratios = [r[f"{rule}_ratio"] for r in rows]
        print(json.dumps({"rule": rule, "spread": round(max(ratios) / min(ratios), 3),
                          "ratios": ratios}))


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
