"""Run by tests/test_multiprocess.py under ``autopar launch --nprocs 2 --devices-per-process 4``:
every process compiles the same GPT steps (tests/models.py, and a Flax NNX transformer and an
Equinox MLP trained with optax, from test_libraries.py) for JAX's 8 devices of the two
processes, runs them and compares the whole results with the single-device step run in the
process. Prints
``<case> ok`` per case that matched, ``<case> refused: <message>`` where an error is expected.
"""
import sys

import autopar as ap

ap.init_distributed()

import jax                                               # noqa: E402 -- after init_distributed
import numpy as np                                       # noqa: E402

import models as m                                       # noqa: E402


def same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(g, np.ndarray) or np.isscalar(g), type(g)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)


def case(name, step, args, local=None, **kw):
    cfg = ap.ParallelConfig(backend="jax", **kw.pop("config"))
    c = ap.compile(step, *(local or args), config=cfg, **kw)
    want = jax.jit(step)(*args)                          # on this process's first device
    same(c(*(local or args)), want)
    same(c(*(local or args)), want)                      # a second call, compiled once
    print(f"{name} ok", flush=True)
    return c


def main():
    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
    me = jax.process_index()
    p, b = m.gpt_params(layers=2), m.gpt_batch(batch=8)
    rows = tuple(np.asarray(x)[me * 4:(me + 1) * 4] for x in b)
    blk = {k: None for k in p["h0"]}
    blk.update(wqkv=(1, 4), bqkv=(4,), wo=(4, 1), w1=(1, 4), b1=(4,), w2=(4, 1))
    megatron = ({k: (blk if k.startswith("h") else None) for k in p}, ((2, 1), (2, 1)))
    dp = dict(parallel_mode="data_parallel", device_num=8)
    # the global batch (every process passes all rows) is run by semi_auto and auto_parallel;
    # data parallelism and the pipeline run on each process's own rows (process_local) below
    case("semi_auto", m.gpt_sgd_step, (p, b), config=dict(
        parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4)),
        in_strategy=megatron)
    # auto_parallel's searches here are recursive_programming's (a second where the default
    # dynamic programming takes 9-14 s of each process): what is tested is that every process
    # makes the same plan and runs it, which holds for any solver
    auto = dict(parallel_mode="auto_parallel", device_num=8, mesh_shape=(2, 4),
                search_mode="recursive_programming")
    case("auto_parallel", m.gpt_sgd_step, (p, b), config=auto)
    case("parallel_optimizer", m.gpt_adam_step, (p, m.adam_init(p), b), config=dict(
        dp, enable_parallel_optimizer=True))
    case("data_parallel process_local", m.gpt_sgd_step, (p, b), local=(p, rows), config=dp,
         batch_is_process_local=True)
    case("pipeline process_local", m.gpt_pipeline_step, (p, b), local=(p, rows), config=dict(
        dp, pipeline_stages=2, micro_batches=2), batch_is_process_local=True)
    case("replicated batch process_local", m.gpt_sgd_step, (p, b), local=(p, rows), config=dict(
        parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4)),
        in_strategy=(megatron[0], ((1, 1), (1, 1))), batch_is_process_local=True)
    libraries(me, auto)
    try:
        ap.compile(m.gpt_sgd_step, p, b, config=ap.ParallelConfig(backend="native", **dp))
    except ap.ConfigError as e:
        print(f"native refused: {' '.join(str(e).split())}", flush=True)
    other = m.gpt_batch(batch=8 if me == 0 else 16)      # process 1 traces other shapes
    try:
        ap.compile(m.gpt_sgd_step, p, other, config=ap.ParallelConfig(backend="jax", **dp))
    except ap.AutoparError as e:
        print(f"mismatch refused: {' '.join(str(e).split())}", flush=True)
    else:
        print("mismatch accepted", flush=True)
        sys.exit(1)


def libraries(me, auto):
    """Steps written with Flax NNX and Equinox, as their users write them."""
    import equinox as eqx
    import optax
    from flax import nnx

    import test_libraries as tl
    graphdef, state = nnx.split(tl.NNXTransformer(nnx.Rngs(0)))
    opt = optax.sgd(0.1, momentum=0.9)
    r = np.random.default_rng(1)
    batch = tuple(np.asarray(r.integers(0, tl.VOCAB, (tl.B, tl.T)), np.int32) for _ in "xy")
    rows = tuple(x[me * tl.B // 2:(me + 1) * tl.B // 2] for x in batch)
    args = (state, opt.init(state), batch)
    case("flax auto_parallel process_local", tl.nnx_step(graphdef, opt), args,
         local=args[:2] + (rows,), batch_argnums=(2,), batch_is_process_local=True,
         config=auto)
    model = eqx.nn.MLP(tl.D, 8, 2 * tl.D, depth=2, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    opt = optax.adam(1e-2)
    batch = (r.normal(size=(tl.B, tl.D)).astype(np.float32),
             r.normal(size=(tl.B, 8)).astype(np.float32))
    case("equinox data_parallel", tl.eqx_step(static, opt), (params, opt.init(params), batch),
         batch_argnums=(2,), config=dict(parallel_mode="data_parallel", device_num=8))


if __name__ == "__main__":
    main()
