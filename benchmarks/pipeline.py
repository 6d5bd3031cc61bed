"""Pipeline schedules and the stage planner.

Run: python benchmarks/pipeline.py [--layers 4] [--micro 4 8] [--iters 10] [--plan-layers 96]
     [--markdown]

1. Step time and bubble fraction, GPipe against 1F1B, on both native runners: each rank's
   step as one executable with the transfers inside (``whole``, the default) and the
   interpreter walking the tasks (``interpreted``, AUTOPAR_WHOLE_STEP=0). A GPT with
   ``--layers`` decoder blocks (d=32, 4 heads, sequence 8, vocabulary 64), 4 native ranks as
   2 stages x 2-way data parallel, ``--micro`` micro-batches of 2 rows per rank. Both runners'
   jobs are up together; each runs a warm-up step, then ``--iters`` steps in turns; the step
   time is their median. The bubble is what each rank measured: the seconds its stage waited
   for a peer's transfer over the step's seconds (``stats()["pipeline"]``; the whole step's
   wait is its time in the recv custom call), averaged over the ranks; beside it the ideal
   (S - 1) / (M + S - 1) of equal stages and free transfers. On this machine 4 ranks share 2
   cores, so a waiting stage lends its core to the working one.
2. Stage device counts: a GPT with 2 blocks and a tied LM head over a 4096-word vocabulary
   (d=64, sequence 16, batch 24), data_parallel on 4 native ranks in 2 stages with 4
   micro-batches, as equal stages (2 + 2) and with ``pipeline_stage_devices="auto"``: the
   planner's estimate and the measured median step.
3. Stage planner time: a GPT with ``--plan-layers`` blocks (abstract arguments: nothing is
   allocated) planned with data_parallel on 16 devices in 8 stages, 16 micro-batches: equal
   stages of 2 devices, then stage device counts chosen by the planner ("auto": one layout
   search per stage size it may use, then the DP over cuts and counts); the time of the stage
   DP alone (``strategies.stage_cuts.plan_stages``), of the whole plan, and the DP's step
   estimate (the objective; "auto" can only lower it).
Out: one JSON object per measurement, and with --markdown the tables.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import autopar as ap  # noqa: E402
import models as m  # noqa: E402
from autopar.runtime.native_backend import stats  # noqa: E402
from autopar.compiler import pipeline_plan  # noqa: E402


RUNNERS = (("interpreted", "0"), ("whole", "1"))     # AUTOPAR_WHOLE_STEP per runner


def schedules(layers, micros, iters):
    """Per micro-batch count and schedule, the pipeline on both native runners (each rank's
    step one executable with its transfers inside, the default, and the interpreter walking
    its tasks), compiled side by side and timed step by step in turns."""
    rows = []
    for micro in micros:
        p, b = m.gpt_params(layers=layers), m.gpt_batch(batch=4 * micro)
        for sched in ("gpipe", "1f1b"):
            cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, pipeline_stages=2,
                                    micro_batches=micro, pipeline_scheduler=sched, progress=False)
            steps = {}
            for name, flag in RUNNERS:
                os.environ["AUTOPAR_WHOLE_STEP"] = flag
                steps[name] = ap.compile(m.gpt_pipeline_step, p, b, config=cfg)
                steps[name](p, b)
            os.environ.pop("AUTOPAR_WHOLE_STEP")
            times = {name: [] for name in steps}
            bubbles = {name: [] for name in steps}
            for _ in range(iters):
                for name, c in steps.items():
                    t0 = time.perf_counter()
                    c(p, b)
                    times[name].append(time.perf_counter() - t0)
                    got = c.on_workers(stats)
                    bubbles[name].append(statistics.mean(
                        g["pipeline"]["wait_s"] / g["pipeline"]["step_s"] for g in got))
            for c in steps.values():
                c.close()
            row = {"bench": "schedule", "layers": layers, "stages": 2, "micro_batches": micro,
                   "scheduler": sched, "ideal_bubble": 1 / (micro + 1),
                   "est_peak_kb": c.strategy.peak_memory / 1024}
            for name in steps:
                row[f"{name}_step_ms"] = 1e3 * statistics.median(times[name])
                row[f"{name}_bubble"] = statistics.median(bubbles[name])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def stage_devices(iters):
    """Equal stages against the device counts the planner chooses, on a GPT whose tied LM head
    (vocabulary 4096) outweighs its 2 blocks: estimate and measured step, 4 native ranks."""
    kw = dict(layers=2, d=64, seq=16, vocab=4096)
    p, b = m.gpt_params(**kw), m.gpt_batch(batch=24, seq=16, vocab=4096)
    rows = []
    for devs in ("equal", "auto"):
        cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, pipeline_stages=2,
                                micro_batches=4, pipeline_stage_devices=devs, progress=False)
        c = ap.compile(m.gpt_sgd_step, p, b, config=cfg)
        c(p, b)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            c(p, b)
            times.append(time.perf_counter() - t0)
        c.close()
        row = {"bench": "stage_devices", "stage_devices": str(devs),
               "chosen": [len(st.devices) for st in c.strategy.stages],
               "stage_us": [round(st.seconds * 1e6) for st in c.strategy.stages],
               "estimate_ms": 1e3 * c.strategy.pipeline_time,
               "step_ms": 1e3 * statistics.median(times)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def planner(layers, stage_devices):
    p, b = m.gpt_params(layers=layers, abstract=True), m.gpt_batch(batch=64, abstract=True)
    timed = {}
    real = pipeline_plan.plan_stages

    def clocked(*a, **k):
        t0 = time.perf_counter()
        out = real(*a, **k)
        timed["dp_s"] = time.perf_counter() - t0
        timed["sizes"] = len(a[0].options)
        timed["estimate"] = out.step_time
        return out
    pipeline_plan.plan_stages = clocked
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=16, pipeline_stages=8,
                            micro_batches=16, progress=False, pipeline_stage_devices=stage_devices)
    t0 = time.perf_counter()
    try:
        s = ap.plan(m.gpt_sgd_step, p, b, config=cfg)
    finally:
        pipeline_plan.plan_stages = real
    total = time.perf_counter() - t0
    secs = [st.seconds for st in s.stages]
    row = {"bench": "planner", "layers": layers, "operators": len(s.ops), "stages": 8,
           "micro_batches": 16, "stage_devices": str(stage_devices),
           "sizes_tried": timed["sizes"], "chosen": [len(st.devices) for st in s.stages],
           "stage_dp_s": timed["dp_s"], "plan_s": total, "estimate_ms": 1e3 * timed["estimate"],
           "slowest_over_mean_stage": max(secs) / statistics.mean(secs)}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap_.add_argument("--layers", type=int, default=4)
    ap_.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    ap_.add_argument("--iters", type=int, default=10)
    ap_.add_argument("--plan-layers", type=int, default=96)
    ap_.add_argument("--markdown", action="store_true")
    a = ap_.parse_args()
    rows = schedules(a.layers, a.micro, a.iters)
    devices = stage_devices(a.iters)
    plans = [planner(a.plan_layers, devs) for devs in ("equal", "auto")]
    if a.markdown:
        print("\n| micro-batches | scheduler | interpreted step ms | whole-step ms | "
              "interpreted / whole | bubble (interpreted, whole) | ideal bubble | "
              "est. peak KB/device |\n|---|---|---:|---:|---:|---|---:|---:|")
        for r in rows:
            print(f"| {r['micro_batches']} | {r['scheduler']} | {r['interpreted_step_ms']:.1f} | "
                  f"{r['whole_step_ms']:.1f} | "
                  f"{r['interpreted_step_ms'] / r['whole_step_ms']:.2f} | "
                  f"{r['interpreted_bubble']:.2f}, {r['whole_bubble']:.2f} | "
                  f"{r['ideal_bubble']:.2f} | {r['est_peak_kb']:.0f} |")
        print("\n| stage devices | chosen | stage us per micro-batch | estimated step ms | "
              "measured step ms |\n|---|---|---|---|---|")
        for r in devices:
            print(f"| {r['stage_devices']} | {'+'.join(map(str, r['chosen']))} | "
                  f"{' / '.join(map(str, r['stage_us']))} | {r['estimate_ms']:.2f} | "
                  f"{r['step_ms']:.1f} |")
        print("\n| layers | operators | stage devices | sizes tried | chosen | stage DP s | "
              "whole plan s | estimated step ms | slowest / mean stage |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for p in plans:
            print(f"| {p['layers']} | {p['operators']} | {p['stage_devices']} | "
                  f"{p['sizes_tried']} | {'+'.join(map(str, p['chosen']))} | "
                  f"{p['stage_dp_s']:.2f} | {p['plan_s']:.1f} | {p['estimate_ms']:.2f} | "
                  f"{p['slowest_over_mean_stage']:.2f} |")


if __name__ == "__main__":
    main()
