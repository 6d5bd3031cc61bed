"""The published table as the referee: Megatron-LM's measured weak-scaling runs, priced by autopar.

Run: python benchmarks/published_runs.py [--rows 1.7B 3.6B ...] [--plans megatron auto]
         [--table PATH] [--markdown]

Reads Megatron-LM's SC'21 Table 1 (``../shared/published/megatron_sc21_table1.json``: per row
the GPT's size, its tensor / pipeline / data parallel sizes, micro-batch, interleaving and the
measured seconds per iteration) and plans the row's training step, as Megatron-LM ran it, on
the matching preset: ``dgx-a100`` nodes of 8 A100 80GB (``Topology.machine``), every figure
from datasheets, none fitted to these rows. The step is ``tests/megatron_gpt.py``'s: GPT as
Megatron-LM builds it, bf16 activations and weights from fp32 master weights, fp32 Adam
moments, dropout 0.1, every block recomputed in the backward pass. Per row and plan:
- ``megatron``: Megatron-LM's exact configuration in semi_auto_parallel: mesh (pipeline, data,
  tensor) in Megatron's rank order (tensor innermost, inside a node), its column- and
  row-parallel splits (``megatron_gpt.megatron``) over the tensor axis, the batch over the
  data axis, ``pipeline_stages`` equal stages, 1F1B interleaved as Megatron-LM interleaved it
  (``pipeline_interleave``: its virtual stages per device), micro-batches of its micro-batch
  size (``global batch / (data x micro-batch)`` of them); the estimate against the measured time
  (``ratio``; the goal is within 10% on every row);
- ``auto``: auto_parallel choosing its own plan on the same devices under 80 GB: stages,
  micro-batches, interleaving, layouts, optimizer sharding and recomputation
  (``recompute="auto"``: the blocks recomputed as written, selectively (the attention's
  scores alone) or not at all).
Prints a JSON line per row and plan (the estimate, the measurement, their ratio, the peak
bytes per device with the optimizer state, what the plan is, and the planning wall time on
this machine), or a Markdown table with ``--markdown``.
"""
import argparse
import functools
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))     # this checkout's autopar

import jax                    # noqa: E402

import autopar as ap          # noqa: E402
import megatron_gpt as mg     # noqa: E402

TABLE = os.path.join(HERE, "..", "..", "shared", "published", "megatron_sc21_table1.json")
GPUS_PER_NODE = 8
CAP = "80GB"


def step_args(row):
    """The row's abstract step arguments: master weights, Adam moments, the global batch and
    the dropout key."""
    p = mg.params(row["layers"], row["hidden"], row["vocabulary"], row["sequence"],
                  abstract=True)
    m, v = mg.adam_state(p)
    b = mg.batch(row["global_batch"], row["sequence"], row["vocabulary"], abstract=True)
    return p, m, v, b, jax.random.key(0)


def shape_of(row):
    t, pp, d = row["tensor_parallel"], row["pipeline_parallel"], row["data_parallel"]
    return t, pp, d, row["global_batch"] // (d * row["micro_batch"])


def interleave_of(row) -> int:
    """Megatron-LM's virtual pipeline size: a stage's layers over its layers per virtual
    stage (1 without interleaving)."""
    per = row["layers_per_virtual_stage"]
    return 1 if not per else row["layers"] // row["pipeline_parallel"] // per


def megatron_config(row):
    """semi_auto_parallel with Megatron-LM's configuration of the row, and its in_strategy."""
    t, pp, d, micro = shape_of(row)
    gpus = t * pp * d
    topo = ap.Topology.machine("dgx-a100", gpus // GPUS_PER_NODE, GPUS_PER_NODE)
    shape, names = ((pp, d, t), ("pp", "dp", "tp")) if pp > 1 else ((d, t), ("dp", "tp"))
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=gpus,
                            mesh_shape=shape, mesh_axis_names=names, topology=topo,
                            pipeline_stages=pp, micro_batches=micro,
                            pipeline_stage_devices="equal" if pp > 1 else None,
                            pipeline_scheduler="1f1b", pipeline_interleave=interleave_of(row),
                            max_device_memory=CAP, progress=False)
    return cfg


def auto_config(row):
    """auto_parallel on the row's GPUs as (nodes, GPUs per node): stages, micro-batches,
    interleaving, layouts, the parallel optimizer (ZeRO) and how much of the blocks is
    recomputed chosen by the planner, under the 80 GB cap."""
    t, pp, d, _ = shape_of(row)
    gpus = t * pp * d
    nodes = gpus // GPUS_PER_NODE
    return ap.ParallelConfig(parallel_mode="auto_parallel", device_num=gpus,
                             mesh_shape=(nodes, GPUS_PER_NODE), mesh_axis_names=("node", "gpu"),
                             topology=ap.Topology.machine("dgx-a100", nodes, GPUS_PER_NODE),
                             pipeline_stages="auto", micro_batches="auto",
                             pipeline_interleave="auto", enable_parallel_optimizer=True,
                             recompute="auto",
                             max_device_memory=CAP, progress=False)


def megatron_strategy(row, p):
    split = mg.megatron(p, "tp")
    return (split, split, split, ("[dp,_]", "[dp,_]"), None)


def _share(s, pick) -> float:
    """The share of the parameters' bytes (master weights and moments) ``pick`` selects."""
    size = lambda i: math.prod(i.shape)
    params = [i for i in s.inputs if i.is_param]
    total = sum(size(i) for i in params)
    return sum(size(i) for i in params if pick(i)) / total if total else 0.0


def plan_row(row, plan):
    args = step_args(row)
    step = functools.partial(mg.train_step, heads=row["attention_heads"])
    step.__name__ = f"gpt_{row['name']}"
    if plan == "megatron":
        cfg, in_strategy = megatron_config(row), megatron_strategy(row, args[0])
    elif plan == "auto":
        cfg, in_strategy = auto_config(row), None
    else:
        raise SystemExit(f"unknown plan {plan!r}")
    t0 = time.monotonic()
    s = ap.plan(step, *args, config=cfg, in_strategy=in_strategy, batch_argnums=(3,))
    seconds = time.monotonic() - t0
    est = s.pipeline_time if s.stages else s.step_time
    measured = row["measured_seconds_per_iteration"]
    t, pp, d, micro = shape_of(row)
    return {"row": row["name"], "plan": plan, "gpus": t * pp * d,
            "t": t, "p": pp, "d": d, "micro_batches": s.micro_batches,
            "interleave": s.pipeline_interleave, "recompute": s.recompute,
            "estimate_s": round(est, 3), "measured_s": measured,
            "ratio": round(est / measured, 3),
            "peak_gib": round(s.peak_memory / 2 ** 30, 1), "plan_wall_s": round(seconds, 1),
            "stages": len(s.stages) // s.pipeline_interleave or 1,
            "stage_mesh": list(s.stages[0].mesh_shape) if s.stages else list(s.mesh_shape),
            "sharded_updates": round(_share(s, lambda i: i.update is not None), 2),
            "block0": {i.name.split(".")[-1]: str(i.layout) for i in s.inputs
                       if i.name.startswith("blocks.0.") and len(i.shape) == 2}
            | {"wte": next(str(i.layout) for i in s.inputs if i.name == "wte"),
               "batch": next(str(i.layout) for i in s.inputs if i.name == "arg3.0")},
            **{f"{k}_s": round(v, 1) for k, v in s.phase_seconds}}


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--table", default=TABLE)
    a.add_argument("--rows", nargs="+", help="row names (default: all)")
    a.add_argument("--plans", nargs="+", default=["megatron"])
    a.add_argument("--markdown", action="store_true")
    args = a.parse_args()
    with open(args.table) as f:
        rows = json.load(f)["rows"]
    rows = [r for r in rows if not args.rows or r["name"] in args.rows]
    out = []
    for row in rows:
        for plan in args.plans:
            try:
                got = plan_row(row, plan)
            except ap.AutoparError as e:         # a row that cannot be planned, and why
                got = {"row": row["name"], "plan": plan, "error": f"{type(e).__name__}: {e}"}
            out.append(got)
            if not args.markdown:
                print(json.dumps(got), flush=True)
    if args.markdown:
        print("| row | plan | GPUs | t x p x d | micro-batches | interleave | estimate s | "
              "measured s | ratio | peak GB | plan wall s |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in out:
            if "error" in r:
                print(f"| {r['row']} | {r['plan']} | {r['error'][:200]} |")
                continue
            print(f"| {r['row']} | {r['plan']} | {r['gpus']} | {r['t']} x {r['p']} x {r['d']} | "
                  f"{r['micro_batches']} | {r['interleave']} | {r['estimate_s']} | "
                  f"{r['measured_s']} | "
                  f"{r['ratio']} | {r['peak_gib']} | {r['plan_wall_s']} |")


if __name__ == "__main__":
    main()
