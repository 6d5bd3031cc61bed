"""Search time and estimated step time of auto_parallel on GPT-style training graphs.

Run: python benchmarks/plan_gpt.py --layers 12 --hidden 768 --devices 8 [--mesh 2x2x2] \
         --solvers sharding_propagation dynamic_programming [--time 60]
Plans (never runs) the SGD training step of a GPT with the given layers and hidden size on
``abstract`` parameters (nothing is allocated), once with data_parallel (the baseline) and once
per auto_parallel solver, and prints one JSON object per line: mode/solver, layers, hidden,
devices, mesh, graph operators, seconds of each compile phase (trace, search = candidates +
problem + solver, lower), estimated step seconds (compute + communication), ratio to data
parallel, and peak memory per device. Up to 8 devices: this machine (``Topology.local``, one
mesh axis); more: ``Topology.cluster`` hosts of 8 GPUs, mesh (devices / 8, 8). The batch is
max(16, devices) sequences, so data parallelism splits it evenly; no memory cap unless
``--max-memory``; ``--stages``/``--micro-batches`` (counts or ``auto``) and
``--parallel-optimizer`` set the pipeline and ZeRO for every plan.
``problem_nodes`` is the size of the (last) SearchProblem the solver saw; ``--no-merge`` builds
it with one node per operator, the ablation of elementwise-follower merging. ``search_gap``
(auto_parallel without a pipeline): how far the plan can be from the best in the search's own
model, from the lower bound the search proved (None: no bound, e.g. recursive_programming).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))     # this checkout's autopar

import autopar as ap          # noqa: E402
import models as m            # noqa: E402
from autopar.strategies import build  # noqa: E402

PROBLEM_NODES = []            # nodes of each SearchProblem the last plan built


def _counting(merge):
    """build_problem, recording each problem's size (and, for the ablation, without merging)."""
    def build_problem(*a, **kw):
        built = _build_problem(*a, **kw, merge=merge)
        PROBLEM_NODES.append(built.problem.num_nodes)
        return built
    return build_problem


_build_problem = build.build_problem


def measure(args, config):
    PROBLEM_NODES.clear()
    p = m.gpt_params(vocab=args.vocab, seq=args.seq, d=args.hidden, layers=args.layers, abstract=True)
    b = m.gpt_batch(batch=max(args.batch, args.devices), seq=args.seq, vocab=args.vocab,
                    abstract=True)
    return ap.plan(m.gpt_sgd_step, p, b, config=config)


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--layers", type=int, default=12)
    ap_.add_argument("--hidden", type=int, default=768)
    ap_.add_argument("--devices", type=int, default=8)
    ap_.add_argument("--mesh", help="logical mesh, e.g. 2x2x2 (default: (devices,) up to 8, "
                                    "else (devices / 8, 8))")
    ap_.add_argument("--batch", type=int, default=16)
    ap_.add_argument("--seq", type=int, default=1024)
    ap_.add_argument("--vocab", type=int, default=50304)
    ap_.add_argument("--time", type=float, default=60.0, help="solver time limit, seconds")
    ap_.add_argument("--solvers", nargs="+", default=["sharding_propagation", "dynamic_programming"])
    count = lambda v: v if v == "auto" else int(v)
    ap_.add_argument("--stages", type=count, default=1, help="pipeline_stages (a count or auto)")
    ap_.add_argument("--micro-batches", type=count, default=1,
                     help="micro_batches (a count or auto)")
    ap_.add_argument("--max-memory", help="max_device_memory, e.g. 80GB (default: no cap)")
    ap_.add_argument("--parallel-optimizer", action="store_true",
                     help="enable_parallel_optimizer (ZeRO, chosen per parameter by the search)")
    ap_.add_argument("--no-merge", action="store_true",
                     help="ablation: one problem node per operator (no elementwise followers merged)")
    args = ap_.parse_args()
    import autopar.compiler.search, autopar.strategies.recursive   # noqa: E401
    autopar.compiler.search.build_problem = autopar.strategies.recursive.build_problem = _counting(not args.no_merge)
    n = args.devices
    topo, mesh = (ap.Topology.local(n), None) if n <= 8 else (ap.Topology.cluster(n // 8, 8), (n // 8, 8))
    if args.mesh:
        mesh = tuple(int(x) for x in args.mesh.split("x"))
    base = ap.ParallelConfig(parallel_mode="data_parallel", device_num=n, mesh_shape=mesh,
                             topology=topo, pipeline_stages=args.stages,
                             micro_batches=args.micro_batches,
                             max_device_memory=args.max_memory,
                             enable_parallel_optimizer=args.parallel_optimizer)
    rows = [("data_parallel", measure(args, base), None)]
    for solver in args.solvers:
        cfg = base.replace(parallel_mode="auto_parallel", search_mode=solver,
                           search_time=args.time, progress=False)
        rows.append((solver, measure(args, cfg), PROBLEM_NODES[-1] if PROBLEM_NODES else None))
    dp = rows[0][1]
    for name, s, nodes in rows:
        phases = {f"{k}_s": round(v, 2) for k, v in s.phase_seconds}
        print(json.dumps({"plan": name, "layers": args.layers, "hidden": args.hidden,
                          "devices": n, "mesh": list(s.mesh_shape), "operators": len(s.ops),
                          "problem_nodes": nodes,
                          **phases, "step_s": round(s.step_time, 6),
                          "vs_data_parallel": round(s.step_time / dp.step_time, 4),
                          **({"stages": len(s.stages), "micro_batches": s.micro_batches,
                              "pipeline_step_s": round(s.pipeline_time, 6)} if s.stages else {}),
                          "peak_gb": round(s.peak_memory / 2 ** 30, 3),
                          **({"search_gap": None if s.search_gap is None
                              else round(s.search_gap, 5)} if s.search_cost is not None else {})}),
              flush=True)


if __name__ == "__main__":
    main()
