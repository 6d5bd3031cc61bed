"""GPT in a pipeline: 4 decoder blocks in 2 stages of 2 data-parallel devices each, 4
micro-batches under the 1F1B schedule, on autopar's native multi-process runtime.

Run: python examples/pipeline_gpt.py. The stages are cut automatically (a dynamic program over
the layers, under the memory cap); wrap blocks in ``ap.pipeline_stage(i)`` to choose them.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time                 # noqa: E402

import jax                  # noqa: E402

import autopar as ap        # noqa: E402
import gpt_model as gpt     # noqa: E402


def main():
    params, data = gpt.init(layers=4, d=32, vocab=64, seq=8), gpt.batch(size=8, seq=8, vocab=64)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=4, pipeline_stages=2,
                            micro_batches=4, pipeline_scheduler="1f1b",
                            max_device_memory="32MB")
    compiled = ap.compile(gpt.sgd_step, params, data, config=cfg)
    t = time.monotonic()
    got = compiled(params, data)
    first = time.monotonic() - t
    gpt.check_same(got, jax.jit(gpt.sgd_step)(params, data), "2 stages x 2 devices, 4 micro-batches")
    t = time.monotonic()
    compiled(params, data)
    print(f"first call {first:.1f} s (workers start, segments compile), then "
          f"{(time.monotonic() - t) * 1e3:.0f} ms per step\n")
    print("\n".join(compiled.strategy.table().splitlines()[:6]))    # the head, the stages
    sends = [c for c in compiled.strategy.collectives if c.kind == "send"]
    print(f"\n{len(sends)} sends between stages per micro-batch or step, e.g. {sends[0].reason}: "
          f"{sends[0].bytes} B x {sends[0].count}")


if __name__ == "__main__":
    main()
