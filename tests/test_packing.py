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


def test_numpy_pack_unpacks_inside_jit_and_packs_back_to_the_same_bytes():
    pack = Pack.of([(x.shape, x.dtype) for x in ARRAYS])
    (buffer,) = ArgPacker(pack, len(ARRAYS), 1).fill(ARRAYS, [[]])
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
    copies, own = pack.copies(again)
    for x, y in zip(copies, ARRAYS):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        assert x.base is own and own is not again and x.flags.writeable   # memory of their own


def test_arg_packer_fills_every_rank_and_reuses_its_buffers():
    """Replicated arguments first, once for all ranks; each rank's split blocks after them;
    the same buffers call after call, each call's values in them."""
    items = [((2, 3), np.float32), ((), np.int32), ((2,), np.float32)]   # the last one split
    packer = ArgPacker(Pack.of(items), 2, 3)
    for step in range(2):
        rep = [np.full((2, 3), step, np.float32), 7 + step]
        split = [[np.array([r, -r], np.float32) + step] for r in range(3)]
        bufs = packer.fill(rep, split)
        if step:
            assert all(b is c for b, c in zip(bufs, first))
        first = list(bufs)
        for r, b in enumerate(bufs):
            x, k, mine = Pack.of(items).views(b)
            assert (x == step).all() and k == 7 + step and np.array_equal(mine, split[r][0])


def test_an_empty_pack_is_an_empty_buffer():
    pack = Pack.of([])
    (buffer,) = ArgPacker(pack, 0, 1).fill([], [[]])
    assert pack.nbytes == 0 and buffer.shape == (0,) and pack.views(buffer) == []
    assert pack.copies(buffer)[0] == []
    assert np.asarray(jax.jit(lambda: pack.pack_traced([]))()).shape == (0,)


def test_packing_sorts_results_into_replicated_and_split():
    avals = [((4, 4), np.float32), ((1 << 15,), np.float32), ((2,), np.int32)]
    pk = Packing.plan(avals, [0, 2], [((3,), np.float32), ((5,), np.float32),
                                      ((1 << 15,), np.float32)], (False, True, True), [0, 1])
    assert pk.args == (0, 2) and pk.other_args(3) == [1]
    assert (pk.replicated, pk.split, pk.other_results(3)) == ((0,), (1,), [2])


def test_arg_packer_copies_the_arrays_its_last_call_returned_as_one_block():
    """A training loop passes back the very arrays the step returned out of its replicated
    results' pack (after a loss): packed as one block, in-place changes included; anything
    else (a new array in their place, another order) array by array, with the same bytes."""
    params = [((2, 3), np.float32), ((), np.int32), ((5,), np.float16)]
    arg_pack, results = Pack.of(params + [((2,), np.float32)]), Pack.of([((), np.float32)] + params)
    assert results.runs_of(arg_pack, 3) == (1,) and results.runs_of(arg_pack, 0) == ()
    packer = ArgPacker(arg_pack, 3, 2, results)
    answer = wire.zeros((results.nbytes,), np.uint8)
    values = [np.float32(0.5), RNG.normal(size=(2, 3)).astype(np.float32), np.int32(9),
              RNG.normal(size=5).astype(np.float16)]
    for v, x in zip(values, results.views(answer)):
        x[...] = v
    got, own = results.copies(answer)
    packer.returned(got, own)
    got[1][0, 0] = 42.0                                       # written after it was returned
    cases = [got[1:], [got[1].copy(), got[2], got[3]], [got[1], np.int32(9), got[3]]]
    assert [packer._fill_returned(rep) for rep in cases] == [True, False, False]
    for rep in cases:
        bufs = packer.fill(rep, [[np.ones(2, np.float32)], [np.zeros(2, np.float32)]])
        for r, b in enumerate(bufs):
            *ps, mine = arg_pack.views(b)
            assert all(np.array_equal(p, x) for p, x in zip(ps, rep)) and ps[0][0, 0] == 42.0
            assert np.array_equal(mine, np.full(2, 1 - r, np.float32))
