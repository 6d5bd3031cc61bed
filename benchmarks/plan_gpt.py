"""Search time and estimated step time of auto_parallel on GPT-style training graphs.

Run: python benchmarks/plan_gpt.py --layers 12 --hidden 768 --devices 8 \
         --solvers sharding_propagation dynamic_programming [--time 60]
Plans (never runs) the SGD training step of a GPT with the given layers and hidden size on
``abstract`` parameters (nothing is allocated), once with data_parallel (the baseline) and once
per auto_parallel solver, and prints one JSON object per line: mode/solver, layers, hidden,
devices, mesh, graph operators, seconds of each compile phase (trace, search = candidates +
problem + solver, lower), estimated step seconds (compute + communication), ratio to data
parallel, and peak memory per device. Up to 8 devices: this machine (``Topology.local``, one
mesh axis); more: ``Topology.cluster`` hosts of 8 GPUs, mesh (devices / 8, 8). The batch is
max(16, devices) sequences, so data parallelism splits it evenly; no memory cap.
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


def measure(args, config):
    p = m.gpt_params(vocab=args.vocab, seq=args.seq, d=args.hidden, layers=args.layers, abstract=True)
    b = m.gpt_batch(batch=max(args.batch, args.devices), seq=args.seq, vocab=args.vocab,
                    abstract=True)
    return ap.plan(m.gpt_sgd_step, p, b, config=config)


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--layers", type=int, default=12)
    ap_.add_argument("--hidden", type=int, default=768)
    ap_.add_argument("--devices", type=int, default=8)
    ap_.add_argument("--batch", type=int, default=16)
    ap_.add_argument("--seq", type=int, default=1024)
    ap_.add_argument("--vocab", type=int, default=50304)
    ap_.add_argument("--time", type=float, default=60.0, help="solver time limit, seconds")
    ap_.add_argument("--solvers", nargs="+", default=["sharding_propagation", "dynamic_programming"])
    args = ap_.parse_args()
    n = args.devices
    topo, mesh = (ap.Topology.local(n), None) if n <= 8 else (ap.Topology.cluster(n // 8, 8), (n // 8, 8))
    base = ap.ParallelConfig(parallel_mode="data_parallel", device_num=n, mesh_shape=mesh,
                             topology=topo)
    rows = [("data_parallel", measure(args, base))]
    for solver in args.solvers:
        cfg = base.replace(parallel_mode="auto_parallel", search_mode=solver,
                           search_time=args.time, progress=False)
        rows.append((solver, measure(args, cfg)))
    dp = rows[0][1]
    for name, s in rows:
        phases = {f"{k}_s": round(v, 2) for k, v in s.phase_seconds}
        print(json.dumps({"plan": name, "layers": args.layers, "hidden": args.hidden,
                          "devices": n, "mesh": list(s.mesh_shape), "operators": len(s.ops),
                          **phases, "step_s": round(s.step_time, 6),
                          "vs_data_parallel": round(s.step_time / dp.step_time, 4),
                          "peak_gb": round(s.peak_memory / 2 ** 30, 3)}), flush=True)


if __name__ == "__main__":
    main()
