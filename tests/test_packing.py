"""runtime/packing.py: small arrays packed into one uint8 array and back, by numpy on one side
and inside a jitted function on the other, every dtype and shape unchanged."""
import jax
import ml_dtypes
import numpy as np

from autopar.runtime import wire
from autopar.runtime.packing import ArgPacker, Pack, Packing

RNG = np.random.default_rng(0)
ARRAYS = [RNG.normal(size=(3, 5)).astype(np.float32), np.array(7, np.int32),
          RNG.normal(size=(4,)).astype(ml_dtypes.bfloat16), np.array([True, False, True]),
          np.arange(-3, 4, dtype=np.int8), np.zeros((0, 2), np.float32),
          RNG.normal(size=(2, 3)).astype(np.float16)[:, ::2],           # strided
          (RNG.normal(size=(2, 3)) + 1j * RNG.normal(size=(2, 3))).astype(np.complex64),
          np.array(1.5 - 2j, np.complex64)]               # complex: XLA bitcasts no complex


def plan(rep, split=(), results=None, results_split=None):
    """The Packing of a step taking the replicated arguments ``rep`` and split ones ``split``
    ((shape, dtype) each), all packed, and giving ``results`` (all replicated unless
    ``results_split`` says), all packed."""
    results = list(results if results is not None else rep)
    return Packing.plan(list(rep) + list(split), list(range(len(rep) + len(split))), len(rep),
                        results, results_split or (False,) * len(results), range(len(results)))


def test_numpy_pack_unpacks_inside_jit_and_packs_back_to_the_same_bytes():
    pack = Pack.of([(x.shape, x.dtype) for x in ARRAYS])
    assert plan(pack.items).head == pack
    packer = ArgPacker(plan(pack.items), 1)
    ([buffer, tail],), ref = packer.fill(ARRAYS, [[]])
    assert ref is None and tail.size == 0
    assert buffer.dtype == np.uint8 and buffer.size == pack.nbytes and wire.is_aligned(buffer)
    assert all(at % wire.ALIGN == 0 for at in pack.offsets)
    for x, y in zip(pack.views(buffer), ARRAYS):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    unpacked = jax.jit(pack.unpack)(buffer)
    for x, y in zip(unpacked, ARRAYS):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), y)
    again = np.asarray(jax.jit(lambda b: pack.pack_traced(pack.unpack(b)))(buffer))
    assert again.shape == (pack.nbytes,)
    for x, y in zip(pack.views(again), ARRAYS):
        assert np.array_equal(x, y)
    for writeable in (True, False):
        copies, own = pack.copies(again, writeable)
        for x, y in zip(copies, ARRAYS):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
            assert x.base is own and own is not again                 # memory of their own
            assert x.flags.writeable == writeable


def test_arg_packer_fills_every_rank_and_reuses_its_buffers():
    """Replicated arguments in the head, once for all ranks; each rank's split blocks in its
    tail; the same buffers call after call, each call's values in them."""
    rep, split_items = [((2, 3), np.float32), ((), np.int32)], [((2,), np.float32)]
    pk = plan(rep, split_items, results=[((), np.float32)])
    assert pk.run is None and pk.head == Pack.of(rep) and pk.tail == Pack.of(split_items)
    packer = ArgPacker(pk, 3)
    where = []
    for step in range(2):
        values = [np.full((2, 3), step, np.float32), 7 + step]
        split = [[np.array([r, -r], np.float32) + step] for r in range(3)]
        parts, ref = packer.fill(values, split)
        assert ref is None
        where.append([(h.ctypes.data, t.ctypes.data) for h, t in parts])
        assert where[0] == where[-1]
        for r, (h, t) in enumerate(parts):
            x, k = pk.head.views(h)
            (mine,) = pk.tail.views(t)
            assert (x == step).all() and k == 7 + step and np.array_equal(mine, split[r][0])


def test_an_empty_pack_is_an_empty_buffer():
    pack = Pack.of([])
    ([buffer, tail],), _ = ArgPacker(plan([]), 1).fill([], [[]])
    assert pack.nbytes == 0 and buffer.shape == tail.shape == (0,) and pack.views(buffer) == []
    assert pack.copies(buffer)[0] == []
    assert np.asarray(jax.jit(lambda: pack.pack_traced([]))()).shape == (0,)


def test_packing_sorts_results_into_replicated_and_split():
    avals = [((4, 4), np.float32), ((1 << 15,), np.float32), ((2,), np.int32)]
    pk = Packing.plan(avals, [0, 2], 1, [((3,), np.float32), ((5,), np.float32),
                                         ((1 << 15,), np.float32)], (False, True, True), [0, 1])
    assert pk.args == (0, 2) and pk.other_args(3) == [1] and pk.run is None
    assert (pk.replicated, pk.split, pk.other_results(3)) == ((0,), (1,), [2])


def test_arg_packer_takes_the_arrays_its_last_call_returned_as_one_block_or_by_reference():
    """A training loop passes back the very arrays the step returned out of its replicated
    results' pack (after a loss): the head is laid out as that pack, so they are copied as one
    block, in-place changes included, or, when the workers kept that pack (a key; the arrays
    read-only), not at all: each rank's head is its kept pack. Anything else (a new array in
    their place, another order) goes array by array, with the same bytes; a call uses up what
    the last one returned (a second call with the same arrays copies them)."""
    params = [((2, 3), np.float32), ((), np.int32), ((5,), np.float16)]
    results = Pack.of([((), np.float32)] + params)
    pk = plan(params, [((2,), np.float32)], results=results.items)
    assert pk.run == 1 and pk.head.nbytes == results.nbytes
    assert pk.head.offsets == results.offsets[1:] and pk.head.items == results.items[1:]
    packer = ArgPacker(pk, 2)
    answer = wire.zeros((results.nbytes,), np.uint8)
    values = [np.float32(0.5), RNG.normal(size=(2, 3)).astype(np.float32), np.int32(9),
              RNG.normal(size=5).astype(np.float16)]
    for v, x in zip(values, results.views(answer)):
        x[...] = v
    split = [[np.ones(2, np.float32)], [np.zeros(2, np.float32)]]
    for key in (None, -1):
        got, own = results.copies(answer, writeable=key is None)
        if key is None:
            got[1][0, 0] = 42.0                               # written after it was returned
        cases = [got[1:], [got[1].copy(), got[2], got[3]], [got[1], np.int32(9), got[3]]]
        for case, rep in enumerate(cases + [cases[0]]):
            if case < len(cases):
                packer.returned(got, own, key)
            parts, ref = packer.fill(rep, split)
            if case == 0 and key is not None:
                assert ref == key and [len(p) for p in parts] == [1, 1]
            else:
                assert ref is None and [len(p) for p in parts] == [2, 2]
                for head, _ in parts:
                    ps = pk.head.views(head)
                    assert all(np.array_equal(p, x) for p, x in zip(ps, rep))
                    assert ps[0][0, 0] == (42.0 if key is None else values[1][0, 0])
            for r in range(2):
                assert np.array_equal(pk.tail.views(parts[r][-1])[0], split[r][0])
        assert key is None or not any(x.flags.writeable for x in got)
