"""First call of a compiled step on the native runtime: starting the workers and compiling the
segments, against a later call, in a fresh process and again once workers are warm.

Run: ``python benchmarks/first_call.py`` (prints one JSON object per configuration and round):
the quick start (examples/quickstart.py: an MLP on a 2 x 4 mesh, 8 ranks), the GPT of
examples/gpt_model.py (2 blocks, d 64) under auto_parallel (dynamic programming) on a 2 x 2
mesh, and the 4-block pipeline of examples/pipeline_gpt.py (2 stages x 2, 4 micro-batches,
1F1B), each on native worker processes. Round "fresh" is the first compile of the configuration
in this process: for the quick start, the process's first (its fork server starts then,
runtime/forkserver.py, and no worker is warm); the later configurations find the warm workers
the round before left. Round "warm" compiles it again after the first was closed and the
server's warm workers had ``--settle`` seconds to start (what a user compiling again, or a
notebook, meets). ``compiled.timings`` gives the runner start and the first call.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import autopar as ap        # noqa: E402
import gpt_model as gpt     # noqa: E402
import quickstart as qs     # noqa: E402


def measure(name, round_, step, params, data, cfg, **kw):
    t = time.perf_counter()
    compiled = ap.compile(step, params, data, config=cfg, **kw)
    compiled(params, data)
    first = time.perf_counter() - t
    t = time.perf_counter()
    compiled(params, data)
    later = time.perf_counter() - t
    print(json.dumps({"config": name, "round": round_,
                      "compile_and_first_call_s": round(first, 2),
                      "start_s": round(compiled.timings["start"], 2),
                      "first_call_s": round(compiled.timings["first_call"], 2),
                      "later_call_s": round(later, 3)}), flush=True)
    compiled.close()


def quickstart_args():
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4),
                            progress=False)
    return (qs.step, *qs.inputs(), cfg), {"in_strategy": qs.IN_STRATEGY}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds between the fresh and the warm round")
    args = p.parse_args()
    configs = {
        "quickstart 2x4 semi_auto": quickstart_args(),
        "gpt auto_parallel 2x2": ((gpt.sgd_step, gpt.init(), gpt.batch(),
                                   ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4,
                                                     mesh_shape=(2, 2), progress=False,
                                                     search_mode="dynamic_programming")), {}),
        "gpt pipeline 2x2 M=4 1f1b": ((gpt.sgd_step, gpt.init(layers=4, d=32, vocab=64, seq=8),
                                       gpt.batch(size=8, seq=8, vocab=64),
                                       ap.ParallelConfig(parallel_mode="data_parallel",
                                                         device_num=4, pipeline_stages=2,
                                                         micro_batches=4, progress=False)), {}),
    }
    for name, (pos, kw) in configs.items():
        for round_ in ("fresh", "warm"):
            measure(name, round_, *pos, **kw)
            time.sleep(args.settle)


if __name__ == "__main__":
    main()
