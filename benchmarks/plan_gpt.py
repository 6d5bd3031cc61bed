"""Search time and estimated step time of auto_parallel on GPT-style training graphs.

Run: python benchmarks/plan_gpt.py --layers 12 --hidden 768 --devices 8 \
         --solvers sharding_propagation dynamic_programming [--time 60]
Plans (never runs) the SGD training step of a GPT with the given layers and hidden size on
``abstract`` parameters (nothing is allocated), once with data_parallel (the baseline) and once
per auto_parallel solver, on ``Topology.local(devices)``, and prints one JSON object per line:
mode/solver, layers, hidden, devices, graph operators, search seconds, estimated step seconds
(compute + communication), ratio to data parallel, and peak memory per device.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autopar as ap          # noqa: E402
import models as m            # noqa: E402


def measure(args, config):
    p = m.gpt_params(vocab=args.vocab, seq=args.seq, d=args.hidden, layers=args.layers, abstract=True)
    b = m.gpt_batch(batch=args.batch, seq=args.seq, vocab=args.vocab, abstract=True)
    t = time.monotonic()
    s = ap.plan(m.gpt_sgd_step, p, b, config=config)
    return s, time.monotonic() - t


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
    base, secs = measure(args, ap.ParallelConfig(parallel_mode="data_parallel", device_num=args.devices))
    rows = [("data_parallel", base, secs)]
    for solver in args.solvers:
        cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=args.devices,
                                search_mode=solver, search_time=args.time, progress=False)
        s, secs = measure(args, cfg)
        rows.append((solver, s, secs))
    for name, s, secs in rows:
        print(json.dumps({"plan": name, "layers": args.layers, "hidden": args.hidden,
                          "devices": args.devices, "operators": len(s.ops),
                          "search_s": round(secs, 2), "step_s": round(s.step_time, 4),
                          "vs_data_parallel": round(s.step_time / base.step_time, 4),
                          "peak_gb": round(s.peak_memory / 2 ** 30, 3)}), flush=True)


if __name__ == "__main__":
    main()
