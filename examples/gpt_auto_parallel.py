"""GPT under auto_parallel: autopar searches a layout for every operator of the training step
on a 2 x 2 mesh and prints the strategy it chose.

Run: python examples/gpt_auto_parallel.py. Also plannable from the command line:
``autopar plan examples/gpt_auto_parallel.py:build --mesh 2x2 --search ilp -o gpt.json``.
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "device_count" not in _flags:              # 4 fake CPU devices for JAX, beside any flags set
    os.environ["XLA_FLAGS"] = _flags + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax                  # noqa: E402

import autopar as ap        # noqa: E402
import gpt_model as gpt     # noqa: E402


def build(abstract=True):
    """(step, example arguments) for ``autopar plan``: shapes only, nothing allocated."""
    return gpt.sgd_step, (gpt.init(abstract=abstract), gpt.batch(abstract=abstract))


def main():
    params, data = gpt.init(), gpt.batch()
    cfg = ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4, mesh_shape=(2, 2),
                            search_mode="dynamic_programming", max_device_memory="64MB")
    compiled = ap.compile(gpt.sgd_step, params, data, config=cfg)
    gpt.check_same(compiled(params, data), jax.jit(gpt.sgd_step)(params, data), "auto_parallel on 4 ranks")
    dp = ap.plan(gpt.sgd_step, params, data,
                 config=ap.ParallelConfig(parallel_mode="data_parallel", device_num=4))
    s = compiled.strategy
    print(f"estimated step {s.step_time * 1e6:.0f} us against data parallel's "
          f"{dp.step_time * 1e6:.0f} us; compile phases: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in compiled.timings.items()) + "\n")
    print(s.table())


if __name__ == "__main__":
    main()
