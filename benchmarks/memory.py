"""The planner's per-device memory estimate against the measured peak of each native rank.

Run: python benchmarks/memory.py [--ranks 4] [--sizes 1024 2048 1024] [--batch 256] [--calls 5]
     [--markdown]

An MLP training step with Adam (parameters, two moments and the step count as arguments; the
batch split over the devices) is compiled in several configurations, and a GPT step (4 blocks,
d 256, sequence 64, SGD) as data parallelism and as pipelines (the pipeline ones cut
into stages by the stage planner; each rank is also compared with its own stage's estimate,
``rank_ratios``) and runs on the native backend. After a first call, the peak of each of the
next ``--calls`` steps is read from every worker (``measure_memory`` turns measuring on): the
bytes resident above the process's level before the step (VmHWM after resetting it through
/proc/self/clear_refs; the worker first lets what the previous step left be freed, see
``peak_memory.PeakMeter``) plus its argument blocks. The workers run with a fixed mmap
threshold (MALLOC_MMAP_THRESHOLD_=65536: every large array is its own mapping, returned when
freed); by default they keep freed memory for reuse (``worker.tune_malloc``), which would hide a
step's allocations from the resident count.
Out: one JSON object per configuration (config, estimate_bytes, measured_bytes: each rank's
median over the steps, worst_bytes: each rank's largest, ratio and worst_ratio: the estimate
over the largest rank's) and with --markdown a table.
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import autopar as ap  # noqa: E402
import models as m  # noqa: E402
from autopar.runtime.native_backend import stats  # noqa: E402
from autopar.runtime.peak_memory import measure_memory  # noqa: E402


CONFIGS = {
    "data_parallel": {},
    "data_parallel + optimizer level1": {"enable_parallel_optimizer": True, "optimizer_level": "level1"},
    "data_parallel + optimizer level2": {"enable_parallel_optimizer": True, "optimizer_level": "level2"},
    "data_parallel + optimizer level3": {"enable_parallel_optimizer": True, "optimizer_level": "level3"},
    "auto_parallel (dynamic_programming)": {"parallel_mode": "auto_parallel",
                                            "search_mode": "dynamic_programming"},
    "pipeline 2 stages x 2, 4 micro-batches, 1f1b": {"pipeline_stages": 2, "micro_batches": 4},
    "pipeline 2 stages x 2, 4 micro-batches, gpipe": {"pipeline_stages": 2, "micro_batches": 4,
                                                      "pipeline_scheduler": "gpipe"},
}


# a GPT whose activations outweigh its parameters: GPipe holds 4 micro-batches of them, 1F1B
# at most 2 (stage 0) and 1 (stage 1)
GPT_CONFIGS = {
    "GPT data_parallel": {},
    "GPT pipeline 2 stages x 2, 4 micro-batches, 1f1b": {"pipeline_stages": 2, "micro_batches": 4},
    "GPT pipeline 2 stages x 2, 4 micro-batches, gpipe": {"pipeline_stages": 2, "micro_batches": 4,
                                                          "pipeline_scheduler": "gpipe"},
}


def mlp(sizes, batch):
    p = m.mlp_params(sizes)
    return m.mlp_adam_step, (p, m.adam_init(p), m.mlp_batch(batch=batch, sizes=sizes)), (2,)


def gpt():
    """4 blocks, d 256, sequence 64, vocabulary 512, batch 32, SGD."""
    p = m.gpt_params(layers=4, d=256, seq=64, vocab=512)
    return m.gpt_sgd_step, (p, m.gpt_batch(batch=32, seq=64, vocab=512)), (1,)


def measure(name, model, extra, ranks, calls=5):
    step, a, batch_argnums = model
    kw = dict({"parallel_mode": "data_parallel", "progress": False}, **extra)
    cfg = ap.ParallelConfig(device_num=ranks, **kw)
    c = ap.compile(step, *a, config=cfg, batch_argnums=batch_argnums)
    c(*a)
    c.on_workers(measure_memory)
    peaks = []                       # per call, per rank
    for _ in range(calls):
        c(*a)
        peaks.append([w["step_peak_bytes"] for w in c.on_workers(stats)])
    c.close()
    got = [int(x) for x in np.median(peaks, axis=0)]
    worst = [int(x) for x in np.max(peaks, axis=0)]
    est = c.strategy.peak_memory
    row = {"config": name, "ranks": ranks, "estimate_bytes": est, "measured_bytes": got,
           "worst_bytes": worst, "ratio": round(est / max(got), 3),
           "worst_ratio": round(est / max(worst), 3)}
    if c.strategy.stages:     # a pipeline: each rank against its own stage's estimate
        k = ranks // len(c.strategy.stages)
        row["rank_ratios"] = [round(c.strategy.stages[r // k].memory / g, 3)
                              for r, g in enumerate(got)]
    return row


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--ranks", type=int, default=4)
    ap_.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 1024])
    ap_.add_argument("--batch", type=int, default=256)
    ap_.add_argument("--calls", type=int, default=5, help="steps measured after the first")
    ap_.add_argument("--markdown", action="store_true")
    args = ap_.parse_args()
    rows = []
    small, big = mlp(tuple(args.sizes), args.batch), gpt()
    runs = [(n, small, e) for n, e in CONFIGS.items()] + [(n, big, e) for n, e in GPT_CONFIGS.items()]
    for name, model, extra in runs:
        r = measure(name, model, extra, args.ranks, args.calls)
        print(json.dumps(r), flush=True)
        rows.append(r)
    if args.markdown:
        mb = lambda x: f"{x / 2 ** 20:.1f}"
        print("\n| configuration | estimate MiB | measured MiB, median step | estimate / measured "
              "| worst step MiB | estimate / worst |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['config']} | {mb(r['estimate_bytes'])} | {mb(max(r['measured_bytes']))} | "
                  f"{r['ratio']:.2f} | {mb(max(r['worst_bytes']))} | {r['worst_ratio']:.2f} |")


if __name__ == "__main__":
    main()
