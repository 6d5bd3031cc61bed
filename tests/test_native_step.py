"""The native runtime's whole-step executables (AUTOPAR_WHOLE_STEP=1, runtime.native_step):
each rank's segments and collectives compiled into one jitted function, the collectives XLA
custom calls into autopar's C++ (native/src/xla_ffi.cc). Every plan gives the single-device
step; the custom calls check their communicator handle and their buffers."""
import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import models as m
from test_api import assert_same


def whole(comm):
    from autopar.runtime.native_backend import WORKER
    return WORKER.whole is not None


def run_whole(monkeypatch, fn, args, calls=1, **cfg):
    """The step's results on whole-step workers equal ``fn``'s, and every rank runs the same
    executable (its rank an argument: compiled once for the job); the plan's collectives."""
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", "1")
    config = ap.ParallelConfig(backend="native", progress=False, **cfg)
    with ap.compile(fn, *args, config=config) as c:
        for _ in range(calls):                     # again: the compiled executable, reused
            assert_same(c(*args), fn(*args))
        assert all(c.on_workers(whole))
        assert len(set(c.on_workers(schedule))) == 1
        return c.collectives()


@pytest.mark.native
def test_data_parallel_step_is_one_executable(monkeypatch):
    p, b = m.mlp_params(), m.mlp_batch(batch=16)
    kinds = run_whole(monkeypatch, m.mlp_sgd_step, (p, b), calls=2,
                      parallel_mode="data_parallel", device_num=2)
    assert {x.kind.value for x in kinds} == {"all_reduce"}


def narrow_sums(w, b):
    """Sums and maxima of 8- and 16-bit integers and booleans over a split batch: the C++
    collectives reduce 32- and 64-bit numbers, so these go widened and come back narrowed."""
    return (jnp.sum(b, dtype=jnp.int8), jnp.sum(b.astype(jnp.int16) * 300, dtype=jnp.int16),
            jnp.max(b.astype(jnp.uint8)), jnp.sum((b > 0).astype(jnp.uint8), dtype=jnp.uint8),
            jnp.any(b > 60), w + jnp.sum(b, dtype=jnp.int8).astype(w.dtype))


@pytest.mark.native
@pytest.mark.parametrize("whole_step", ["1", "0"])
def test_narrow_integers_and_booleans_reduce_across_ranks(monkeypatch, whole_step):
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", whole_step)
    w = jnp.zeros((4,), jnp.float32)
    b = jnp.asarray(np.random.default_rng(0).integers(-64, 64, (8, 4)), jnp.int8)
    config = ap.ParallelConfig(backend="native", parallel_mode="semi_auto_parallel",
                               device_num=2, dataset_strategy="data_parallel", progress=False)
    with ap.compile(narrow_sums, w, b, config=config) as c:
        got, want = c(w, b), narrow_sums(w, b)
        assert [x.dtype for x in got] == [x.dtype for x in want]
        assert_same(got, want)
        assert any(x.kind.value == "all_reduce" for x in c.collectives())


@pytest.mark.native
def test_a_caller_with_64_bit_values_on_gets_its_dtypes_from_the_ranks():
    """jax_enable_x64 in the caller: the ranks trace with it too (float64 and int64 values,
    and a float32 step's packed arguments, were read as 32-bit values in the ranks)."""
    jax.config.update("jax_enable_x64", True)
    try:
        for dtype in (jnp.float32, jnp.float64):
            p, b = m.mlp_params(), m.mlp_batch(batch=8)
            p, b = jax.tree.map(lambda x: x.astype(dtype), (p, b))
            config = ap.ParallelConfig(backend="native", parallel_mode="data_parallel",
                                       device_num=2, progress=False)
            with ap.compile(m.mlp_sgd_step, p, b, config=config) as c:
                got, want = c(p, b), m.mlp_sgd_step(p, b)
                assert {x.dtype for x in jax.tree.leaves(got)} == {np.dtype(dtype)}
                assert_same(got, want)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.native
def test_every_collective_kind_inside_the_executable(monkeypatch):
    """A GPT block planned by auto_parallel on 2x2 (all-gathers, all-to-alls, slices, partial
    sums; under a cap the replicated plan, 195 KB a device, exceeds) and the parallel
    optimizer's reduce-scatters, on 4 ranks."""
    p, b = m.gpt_params(), m.gpt_batch(batch=4)
    kinds = run_whole(monkeypatch, m.gpt_sgd_step, (p, b), parallel_mode="auto_parallel",
                      device_num=4, mesh_shape=(2, 2), search_mode="dynamic_programming",
                      max_device_memory=150_000)
    sizes = (64, 256, 64)
    p, b = m.mlp_params(sizes), m.mlp_batch(batch=64, sizes=sizes)
    kinds += run_whole(monkeypatch, m.mlp_sgd_step, (p, b), parallel_mode="data_parallel",
                       device_num=4, enable_parallel_optimizer=True, optimizer_level="level2",
                       parallel_optimizer_threshold=0)
    assert {"all_reduce", "all_gather", "reduce_scatter"} <= {x.kind.value for x in kinds}


def test_a_custom_call_refuses_a_communicator_it_does_not_know():
    from autopar import _native
    from autopar.runtime.native_step import register_targets
    register_targets()
    comm = _native.Comm(0, 1, -1)
    token = jax.ShapeDtypeStruct((), jnp.int32)
    x = jnp.ones((4,), jnp.float32)

    def call(handle, ranks, group=1):
        return jax.ffi.ffi_call("autopar_all_reduce", (jax.ShapeDtypeStruct((4,), jnp.float32),
                                                        token), has_side_effect=True)(
            x, jnp.zeros((), jnp.int32), comm=np.int64(handle), ranks=np.asarray(ranks, np.int64),
            group=np.int64(group), op="sum", algorithm="ring")
    y, _ = call(comm.ffi_handle, [0])                 # a group of one: the input itself
    assert np.array_equal(np.asarray(y), np.ones(4))
    with pytest.raises(Exception, match="not a live Comm"):
        call(comm.ffi_handle + 8, [0])
    with pytest.raises(Exception, match="outside"):
        call(comm.ffi_handle, [3])
    with pytest.raises(Exception, match="whole groups"):
        call(comm.ffi_handle, [0], group=2)


@pytest.mark.native
@pytest.mark.parametrize("bucket", [25 << 20, 4 << 10])
def test_a_rank_stopped_during_the_executable_fails_the_call_and_the_next_one_works(monkeypatch,
                                                                                    bucket):
    """Failure behaviour as the interpreted runner's: a rank stopped (SIGSTOP) leaves its peer
    waiting inside a custom call (with 4 KiB buckets, in all_reduce_done while the all-reduce
    waits on the communicator's thread); the call raises CollectiveError within the bound, and
    the next call runs on new workers."""
    from test_native_failures import TIMEOUT, stop_rank_and_call
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", "1")
    p, b = m.mlp_params(), m.mlp_batch(batch=8)
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, progress=False,
                            collective_timeout=TIMEOUT, allreduce_fusion_bytes=bucket)
    c = ap.compile(m.mlp_sgd_step, p, b, config=cfg)
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    assert all(c.on_workers(whole))
    if bucket < 25 << 20:
        assert "autopar_all_reduce_start" in c.on_workers(schedule)[0]
    stop_rank_and_call(c, 1, p, b)
    assert_same(c(p, b), m.mlp_sgd_step(p, b))
    c.close()


def broadcast_send_recv_barrier(comm):
    """In a worker: broadcast from rank 1, rank 0 sends twice that to rank 1 (queued: it
    waits for the send in sends_done), a barrier; all custom calls in one jitted function."""
    from autopar.runtime.native_step import register_targets
    register_targets()
    h, ranks = np.int64(comm.ffi_handle), np.arange(comm.size, dtype=np.int64)
    group = np.int64(comm.size)
    token = jax.ShapeDtypeStruct((), jnp.int32)
    call = lambda name, *results: jax.ffi.ffi_call(f"autopar_{name}", (*results, token),
                                                   has_side_effect=True)

    def f(x):
        like = jax.ShapeDtypeStruct(x.shape, x.dtype)
        y, o = call("broadcast", like)(x, jnp.zeros((), jnp.int32), comm=h, ranks=ranks,
                                       group=group, root=np.int64(1))
        pair = dict(comm=h, **{"from": np.array([0], np.int64)}, to=np.array([1], np.int64))
        if comm.rank == 0:
            (o,) = call("send")(y * 2, o, **pair)
            (o,) = call("sends_done")(o, comm=h)
            z = y
        else:
            z, o = call("recv", like)(y, o, **pair)
        (o,) = call("barrier")(o, comm=h, ranks=ranks, group=group)
        return z, o
    z, _ = jax.jit(f)(jnp.full((4,), float(comm.rank), jnp.float32))
    return np.asarray(z).tolist()


@pytest.mark.native
def test_broadcast_send_recv_and_barrier_as_custom_calls():
    from autopar.runtime.launcher import Job
    with Job(2, timeout=10.0) as j:
        assert j.call(broadcast_send_recv_barrier, [()] * 2) == [[1.0] * 4, [2.0] * 4]


def schedule(comm):
    from autopar.runtime.native_backend import WORKER
    return WORKER.whole.scheduled()


@pytest.mark.native
def test_buckets_overlap_the_compute_after_them_inside_the_executable(monkeypatch):
    """Small buckets (16 KiB) on a GPT block's backward pass: each full bucket is started on the
    communicator's thread and awaited where first read; XLA's schedule keeps compute between
    a start and its done, and the step still equals the single-device one."""
    import re
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", "1")
    p, b = m.gpt_params(), m.gpt_batch(batch=4)
    config = ap.ParallelConfig(backend="native", progress=False, parallel_mode="data_parallel",
                               device_num=2, allreduce_fusion_bytes=16 << 10)
    with ap.compile(m.gpt_sgd_step, p, b, config=config) as c:
        for _ in range(2):
            assert_same(c(p, b), m.gpt_sgd_step(p, b))
        text = c.on_workers(schedule)[0]
    entry = text[text.index("ENTRY"):]
    lines = [ln for ln in entry.splitlines() if "=" in ln]
    starts = [i for i, ln in enumerate(lines) if "autopar_all_reduce_start" in ln]
    dones = [i for i, ln in enumerate(lines) if "autopar_all_reduce_done" in ln]
    assert len(starts) == len(dones) >= 2
    between = [sum(bool(re.search(r"\b(fusion|dot|convolution|call)\(", ln))
                   for ln in lines[s:d]) for s, d in zip(starts, dones)]
    assert max(between) > 0, between


def dispatch(comm):
    """In a worker: the whole step's JAX effects, and its custom calls (all, with a side
    effect in the compiled HLO)."""
    import jax
    from autopar.runtime.native_backend import WORKER
    step = WORKER.whole
    effects = jax.make_jaxpr(step._step)(*step.avals).effects
    calls = [ln for ln in step.scheduled().splitlines() if 'custom_call_target="autopar_' in ln]
    return (len(effects), len(calls),
            sum("custom_call_has_side_effect=true" in ln for ln in calls))


@pytest.mark.native
def test_the_step_has_no_jax_effect_so_jit_dispatches_it_from_cpp_and_xla_keeps_every_call(
        monkeypatch):
    """A JAX effect (jax.ffi.ffi_call's side effect) keeps a jitted function off jit's C++
    dispatch; the collectives' own primitive has none, while XLA still sees each custom call
    as side-effecting (never dropped, merged or moved), so 4 KiB buckets make several."""
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", "1")
    p, b = m.gpt_params(), m.gpt_batch(batch=4)
    config = ap.ParallelConfig(backend="native", progress=False, parallel_mode="data_parallel",
                               device_num=2, allreduce_fusion_bytes=4 << 10)
    with ap.compile(m.gpt_sgd_step, p, b, config=config) as c:
        assert_same(c(p, b), m.gpt_sgd_step(p, b))
        for effects, calls, side_effecting in c.on_workers(dispatch):
            assert effects == 0
            assert calls == side_effecting > 4


@pytest.mark.native
def test_a_reduce_scatter_along_a_later_dimension_gives_each_rank_its_block(monkeypatch):
    """A Megatron MLP whose output bias is split along the features: the second matmul's
    partial sum is reduce-scattered along dim 1 inside the executable (its blocks lined up in
    the value's own order, not transposed there and back), and the step gives the
    single-device values. (Copies into place priced as free: otherwise the planner prefers
    scattering along the rows, whose blocks need none.)"""
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", "1")
    sizes = (64, 256, 64)
    p, b = m.mlp_params(sizes), m.mlp_batch(batch=16, sizes=sizes)
    free_copies = dataclasses.replace(ap.Topology.local(2), mem_bandwidth=1e30)
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=2, backend="native",
                            progress=False, topology=free_copies)
    shard = ({"w1": "[_,x]", "b1": "[x]", "w2": "[x,_]", "b2": "[x]"}, None)
    with ap.compile(m.mlp_sgd_step, p, b, config=cfg, in_strategy=shard) as c:
        assert any(x.kind.value == "reduce_scatter" and x.dim == 1 for x in c.collectives())
        for _ in range(2):
            assert_same(c(p, b), m.mlp_sgd_step(p, b))
        assert all(c.on_workers(whole))
