"""Save a searched strategy and reuse it: the second compile loads the layouts instead of
searching, through MindSpore's ``strategy_ckpt_config`` context keys.

Run: python examples/load_strategy.py.
"""
import os
import tempfile

_flags = os.environ.get("XLA_FLAGS", "")
if "device_count" not in _flags:              # 4 fake CPU devices for JAX, beside any flags set
    os.environ["XLA_FLAGS"] = _flags + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax                  # noqa: E402

import autopar as ap        # noqa: E402
import gpt_model as gpt     # noqa: E402


def main():
    params, data = gpt.init(), gpt.batch()
    path = os.path.join(tempfile.mkdtemp(), "gpt_strategy.json")
    ap.set_auto_parallel_context(parallel_mode="auto_parallel", device_num=4, mesh_shape=(2, 2),
                                 search_mode="recursive_programming", backend="jax",
                                 strategy_ckpt_config={"save_file": path})
    searched = ap.compile(gpt.sgd_step, params, data)          # the config comes from the context
    print(f"searched in {searched.timings['search']:.2f} s, saved {path}")

    ap.set_auto_parallel_context(strategy_ckpt_config={"load_file": path, "save_file": None})
    loaded = ap.compile(gpt.sgd_step, params, data)
    print(f"loaded in {loaded.timings['search']:.2f} s (strategy search: {loaded.strategy.search})")
    same = [a.out_layouts for a in loaded.strategy.ops] == [a.out_layouts for a in searched.strategy.ops]
    print(f"the loaded layouts are the searched ones: {same}")
    gpt.check_same(loaded(params, data), jax.jit(gpt.sgd_step)(params, data), "the loaded strategy")
    ap.Strategy.load(path).save(path.replace(".json", ".ckpt"))   # MindSpore protobuf
    print(f"also written as MindSpore's strategy checkpoint: {path.replace('.json', '.ckpt')}")
    ap.reset_auto_parallel_context()
    assert same


if __name__ == "__main__":
    main()
