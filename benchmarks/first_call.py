"""First call of a compiled step on the native runtime: starting the workers and compiling the
segments, against a later call.

Run: ``python benchmarks/first_call.py`` (prints one JSON object per configuration): the GPT of
examples/gpt_model.py (2 blocks, d 64) under auto_parallel (dynamic programming) on a 2 x 2 mesh,
and the 4-block pipeline of examples/pipeline_gpt.py (2 stages x 2, 4 micro-batches, 1F1B), each
on 4 native worker processes; ``compiled.timings`` gives the runner start and the first call.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import autopar as ap        # noqa: E402
import gpt_model as gpt     # noqa: E402


def measure(name, params, data, cfg):
    compiled = ap.compile(gpt.sgd_step, params, data, config=cfg)
    compiled(params, data)
    t = time.perf_counter()
    compiled(params, data)
    later = time.perf_counter() - t
    segments = len(compiled.program.segments()) if hasattr(compiled.program, "segments") else \
        sum(1 for st in compiled.program.stages for _, b in st.phases() for i in b
            if type(i).__name__ == "Segment")
    print(json.dumps({"config": name, "segments": segments,
                      "start_s": round(compiled.timings["start"], 2),
                      "first_call_s": round(compiled.timings["first_call"], 2),
                      "later_call_s": round(later, 3)}), flush=True)


if __name__ == "__main__":
    measure("gpt auto_parallel 2x2", gpt.init(), gpt.batch(),
            ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, mesh_shape=(2, 2),
                              search_mode="dynamic_programming", progress=False))
    measure("gpt pipeline 2x2 M=4 1f1b", gpt.init(layers=4, d=32, vocab=64, seq=8),
            gpt.batch(size=8, seq=8, vocab=64),
            ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, pipeline_stages=2,
                              micro_batches=4, progress=False))
