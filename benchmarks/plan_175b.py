"""GPT-3 175B on paper: autopar's full auto plan against Megatron-LM's published configuration.

Run: python benchmarks/plan_175b.py [--layers 96] [--hidden 12288] [--heads 96] [--seq 2048] \
         [--batch 1536] [--hosts 128] [--gpus 8] [--max-memory 80GB] [--plans auto megatron]
Plans (never runs) the SGD training step of ``tests/user_gpt.py``'s GPT (separate q, k, v
projections, tied embedding; 96 heads) on abstract bfloat16 parameters (``--dtype``; Megatron-LM
trains it in half precision), each block wrapped in ``jax.checkpoint`` (Megatron-LM recomputes
activations too; ``--no-remat`` keeps them all), on
``Topology.cluster(hosts, gpus)`` as mesh (hosts, gpus), with the parallel optimizer on and
the memory cap, twice:
- ``auto``: auto_parallel with ``pipeline_stages="auto"`` and ``micro_batches="auto"``: the
  planner chooses stages, micro-batches, layouts and ZeRO together (``--stages``,
  ``--micro-batches``: fixed counts instead, equal stages);
- ``megatron``: semi_auto_parallel with Megatron-LM's GPT-3 175B configuration (Narayanan et
  al., 2021): tensor parallel 8 (column-parallel q, k, v and fc1, row-parallel out and fc2 over
  the GPU axis), pipeline 8 (stages of (hosts / 8, gpus)), data parallel 16 (the batch over the
  hosts axis of a stage), micro-batches of one sequence per data-parallel rank
  (batch / (hosts / 8) = 96 of them).
Prints one JSON line per plan: wall seconds of the whole plan call, the chosen stages and
micro-batches, the estimated step seconds, peak bytes per device, and for auto the pairs it
considered; then the ratio auto / megatron of the estimated steps.
"""
import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))     # this checkout's autopar

import jax                    # noqa: E402
import jax.numpy as jnp       # noqa: E402

import autopar as ap          # noqa: E402
import user_gpt as ug         # noqa: E402


def abstract_params(layers, d, vocab, dtype):
    """``ug.init``'s tree as ShapeDtypeStructs of ``dtype`` (nothing allocated)."""
    w = lambda *s: jax.ShapeDtypeStruct(s, dtype)
    blk = lambda: {"ln1_g": w(d), "ln1_b": w(d), "wq": w(d, d), "wk": w(d, d), "wv": w(d, d),
                   "wo": w(d, d), "bo": w(d), "ln2_g": w(d), "ln2_b": w(d),
                   "w1": w(d, 4 * d), "b1": w(4 * d), "w2": w(4 * d, d), "b2": w(d)}
    return {"wte": w(vocab, d), "lnf_g": w(d), "lnf_b": w(d),
            "blocks": [blk() for _ in range(layers)]}


def sgd_step(params, batch, heads, remat):
    loss = functools.partial(ug.loss, heads=heads, remat=remat)
    value, grads = jax.value_and_grad(loss)(params, batch)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--layers", type=int, default=96)
    a.add_argument("--hidden", type=int, default=12288)
    a.add_argument("--heads", type=int, default=96)
    a.add_argument("--seq", type=int, default=2048)
    a.add_argument("--batch", type=int, default=1536)
    a.add_argument("--vocab", type=int, default=51200)
    a.add_argument("--hosts", type=int, default=128)
    a.add_argument("--gpus", type=int, default=8)
    a.add_argument("--max-memory", default="80GB")
    a.add_argument("--dtype", default="bfloat16",
                   help="parameters and activations (Megatron-LM trains GPT-3 in half precision)")
    count = lambda v: v if v == "auto" else int(v)
    a.add_argument("--stages", type=count, default="auto", help="auto's pipeline_stages")
    a.add_argument("--micro-batches", type=count, default="auto", help="auto's micro_batches")
    a.add_argument("--plans", nargs="+", default=["auto", "megatron"])
    a.add_argument("--no-remat", dest="remat", action="store_false",
                   help="keep every activation instead of recomputing each block in the backward "
                        "pass (jax.checkpoint, as Megatron-LM recomputes them)")
    args = a.parse_args()
    p = abstract_params(args.layers, args.hidden, args.vocab, jnp.dtype(args.dtype))
    b = (jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32),) * 2
    step = functools.partial(sgd_step, heads=args.heads, remat=args.remat)
    step.__name__ = "gpt_sgd_step"
    base = ap.ParallelConfig(parallel_mode="data_parallel", device_num=args.hosts * args.gpus,
                             mesh_shape=(args.hosts, args.gpus),
                             topology=ap.Topology.cluster(args.hosts, args.gpus),
                             max_device_memory=args.max_memory or None,
                             enable_parallel_optimizer=True,
                             progress=False)
    stages = 8
    configs = {
        "auto": (base.replace(parallel_mode="auto_parallel", pipeline_stages=args.stages,
                              micro_batches=args.micro_batches,
                              pipeline_stage_devices=None if args.stages == "auto" else "equal"),
                 None),
        "megatron": (base.replace(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                  micro_batches=args.batch // (args.hosts // stages)),
                     (ug.megatron(p, "y"), ("[x,_]", "[x,_]"))),
    }
    got = {}
    for name in args.plans:
        cfg, in_strategy = configs[name]
        t = time.monotonic()
        s = ap.plan(step, p, b, config=cfg, in_strategy=in_strategy)
        seconds = time.monotonic() - t
        got[name] = s.pipeline_time if s.stages else s.step_time
        row = {"plan": name, "layers": args.layers, "hidden": args.hidden,
               "devices": args.hosts * args.gpus, "plan_s": round(seconds, 1),
               "stages": len(s.stages) or 1, "micro_batches": s.micro_batches,
               "stage_mesh": list(s.stages[0].mesh_shape) if s.stages else list(s.mesh_shape),
               "dtype": args.dtype, "remat": args.remat, "step_s": round(got[name], 4),
               "peak_gb": round(s.peak_memory / 2 ** 30, 2),
               **dict((f"{k}_s", round(v, 1)) for k, v in s.phase_seconds)}
        if s.pipeline_choices:
            row["considered"] = [str(c) for c in s.pipeline_choices]
        print(json.dumps(row), flush=True)
    if {"auto", "megatron"} <= set(got):
        print(json.dumps({"auto_vs_megatron": round(got["auto"] / got["megatron"], 4)}))


if __name__ == "__main__":
    main()
