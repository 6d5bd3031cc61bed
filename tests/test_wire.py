"""runtime/wire.py: messages between the caller and the native workers carry their arrays out of
band, large ones one message each and small ones packed into one, and every array arrives
writable, equal and 64-byte aligned."""
import threading
import time
from multiprocessing import Pipe

import numpy as np

from autopar.runtime import wire


def test_small_large_and_empty_arrays_arrive_equal_aligned_and_writable():
    rng = np.random.default_rng(0)
    obj = {"small": [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(20)],
           "large": rng.normal(size=(wire.PACK // 8 + 3,)),          # one message of its own
           "empty": np.zeros((0, 4), np.int32), "scalar": np.float64(2.5),
           "odd": np.arange(7, dtype=np.int8), "text": "kept"}
    a, b = Pipe()
    sender = threading.Thread(target=wire.send, args=(a, obj))
    sender.start()
    got = wire.recv(b)
    sender.join()
    arrays = got["small"] + [got["large"], got["empty"], got["odd"]]
    for x, y in zip(arrays, obj["small"] + [obj["large"], obj["empty"], obj["odd"]]):
        assert x.dtype == y.dtype and np.array_equal(x, y)
        assert x.flags.writeable and (x.size == 0 or wire.is_aligned(x))
    assert got["scalar"] == 2.5 and got["text"] == "kept"
    got["small"][0][0, 0] = 9.0                   # packed arrays are views of one buffer:
    assert got["small"][1][0, 0] == obj["small"][1][0, 0]      # writing one leaves the others


def test_arrays_through_a_shared_memory_box_arrive_equal_and_own_their_memory():
    rng = np.random.default_rng(1)
    a, b = Pipe()
    out, into = wire.Box(), wire.Box()
    got = []
    for size in (10, wire.PACK // 4 + 1, 3):      # the second message grows the box
        obj = {"large": rng.normal(size=(size,)), "small": [np.arange(5, dtype=np.int16) + size],
               "empty": np.zeros((0,), np.float32), "text": size}
        sender = threading.Thread(target=wire.send, args=(a, obj, out))
        sender.start()
        got.append((obj, wire.recv(b, into)))
        sender.join()
    assert into.size == out.size >= (wire.PACK // 4 + 1) * 8
    for obj, back in got:                          # later messages overwrote the box: each
        assert back["text"] == obj["text"]         # message's arrays are copies of their own
        for x, y in ((back["large"], obj["large"]), (back["small"][0], obj["small"][0]),
                     (back["empty"], obj["empty"])):
            assert x.dtype == y.dtype and np.array_equal(x, y)
            assert x.flags.writeable and (x.size == 0 or wire.is_aligned(x))
    out.close(), into.close()


def test_borrowed_arrays_are_views_of_the_box_and_a_grown_box_leaves_held_ones_readable():
    """``recv(..., borrow=True)`` hands out the box's own memory (no copy, no fresh pages) and
    the box knows while any of them is held (``lent_out``); a message that grows the box while
    such views are still held does not fail, and the old views keep their bytes (the old
    mapping goes when they do)."""
    a, b = Pipe()
    out, into = wire.Box(), wire.Box()

    def exchange(obj):
        sender = threading.Thread(target=wire.send, args=(a, obj, out))
        sender.start()
        got = wire.recv(b, into, borrow=True)
        sender.join()
        return got
    first = {"large": np.arange(wire.PACK // 4, dtype=np.float32), "small": np.arange(3.0)}
    got = exchange(first)
    for k in first:
        assert np.array_equal(got[k], first[k]) and np.shares_memory(got[k], into.array)
        assert wire.is_aligned(got[k])
    held = got["large"]
    bigger = {"large": np.ones(wire.PACK, np.float64)}                # grows the box
    again = exchange(bigger)
    assert np.array_equal(again["large"], bigger["large"])
    assert np.array_equal(held, first["large"]) and not np.shares_memory(held, into.array)
    del held, got
    assert into.lent_out
    view = again["large"][::2]                       # a view of a view holds the box too
    del again
    assert into.lent_out and view[0] == 1.0
    del view
    assert not into.lent_out
    out.close(), into.close()


def test_readable_answers_at_once_when_a_connection_has_data_and_waits_for_none_else():
    """Before ``spin_from`` ``readable`` blocks in the kernel rather than polling, but a
    message that is there, or comes, ends the wait at once; with nothing, it returns after
    ``timeout``."""
    a, b = Pipe()
    far = time.perf_counter() + 5.0
    t = time.perf_counter()
    assert wire.readable([b], 0.05, far + 1e-3, far) == []
    waited = time.perf_counter() - t
    assert 0.04 < waited < 1.0
    a.send_bytes(b"x")
    t = time.perf_counter()
    assert wire.readable([b], 10.0, far + 1e-3, far) == [b]
    assert time.perf_counter() - t < 1.0
    threading.Timer(0.05, a.send_bytes, (b"y",)).start()
    b.recv_bytes()
    assert wire.readable([b], 10.0, far + 1e-3, far) == [b] and b.recv_bytes() == b"y"


def test_a_message_over_box_bytes_streams_through_the_socket(monkeypatch):
    """A first call's parameters go to every rank at once: above BOX_BYTES they stream, so
    shared memory does not hold a copy per rank; smaller messages still use the box, and a
    message of empty arrays needs none."""
    monkeypatch.setattr(wire, "BOX_BYTES", 1 << 16)
    a, b = Pipe()
    out, into = wire.Box(), wire.Box()
    for obj, size in ((np.zeros((0, 3)), 0), (np.arange(1 << 18, dtype=np.float64), 0),
                      (np.arange(10, dtype=np.float64), wire.mmap.PAGESIZE)):
        sender = threading.Thread(target=wire.send, args=(a, obj, out))
        sender.start()
        got = wire.recv(b, into)
        sender.join()
        assert got.dtype == obj.dtype and np.array_equal(got, obj) and got.flags.writeable
        assert out.size == into.size == size
    out.close(), into.close()


def test_an_answer_of_any_size_goes_through_the_box(monkeypatch):
    """A rank's answer (``any_size``) is written into shared memory whatever its size: the
    caller reads it there instead of copying it out of the socket."""
    monkeypatch.setattr(wire, "BOX_BYTES", 1 << 16)
    a, b = Pipe()
    out, into = wire.Box(), wire.Box()
    big = np.arange(1 << 18, dtype=np.float64)
    sender = threading.Thread(target=wire.send, args=(a, big, out), kwargs={"any_size": True})
    sender.start()
    got = wire.recv(b, into, borrow=True)
    sender.join()
    assert np.array_equal(got, big) and into.size >= big.nbytes and into.lent_out
    del got
    out.close(), into.close()


def test_arrays_in_any_layout_dtype_and_place_arrive_equal():
    """Arrays are taken out of tuples, lists and dict values at any depth, whatever their
    layout (strided, Fortran order, 0-d) or dtype (bfloat16, bool, big-endian); the rest of the
    message, arrays of objects and arrays inside other objects included, is pickled as it is."""
    import ml_dtypes
    from fractions import Fraction
    rng = np.random.default_rng(2)
    base = rng.normal(size=(6, 8)).astype(np.float32)
    obj = ("call", {"strided": base[::2, 1::3], "fortran": np.asfortranarray(base),
                    "zero_d": np.array(3, np.int64), "bf16": base.astype(ml_dtypes.bfloat16),
                    "big_endian": base.astype(">f8"), "flags": base > 0},
           [(base, [base]), np.array([Fraction(1, 3), None], dtype=object)],
           Fraction(2, 7), frozenset({1}))
    a, b = Pipe()
    for box in (None, (wire.Box(), wire.Box())):
        sender = threading.Thread(target=wire.send, args=(a, obj, box and box[0]))
        sender.start()
        got = wire.recv(b, box and box[1])
        sender.join()
        assert got[0] == "call" and got[3:] == obj[3:]
        for k, x in obj[1].items():
            y = got[1][k]
            assert y.dtype == x.dtype and y.shape == x.shape and np.array_equal(y, x), k
            assert wire.is_aligned(y) and y.flags.writeable
        assert np.array_equal(got[2][0][0], base) and np.array_equal(got[2][0][1][0], base)
        assert got[2][1].dtype == object and list(got[2][1]) == [Fraction(1, 3), None]


def test_owned_copies_only_arrays_that_view_a_lent_box():
    """What a worker keeps past a call must not be the call's shared memory, which the next
    message overwrites: ``owned`` copies an array viewing a box ``recv`` lent (aligned, equal,
    writable), and returns any other array as it is; ``unborrowed`` does so for a message."""
    import jax.numpy as jnp
    a, b = Pipe()
    out, into = wire.Box(), wire.Box()
    obj = {"large": np.arange(wire.PACK // 4, dtype=np.float32), "small": np.arange(3.0)}
    sender = threading.Thread(target=wire.send, args=(a, obj, out))
    sender.start()
    got = wire.recv(b, into, borrow=True)
    sender.join()
    mine, theirs = np.arange(4.0), jnp.arange(4.0)
    for x in (got["large"], got["small"], got["large"][1::2]):
        own = wire.owned(x)
        assert np.array_equal(own, x) and not np.shares_memory(own, into.array)
        assert wire.is_aligned(own) and own.flags.writeable
    assert wire.owned(mine) is mine and wire.owned(theirs) is theirs
    copied = wire.unborrowed({"x": [got["large"]], "y": (got["small"], mine), "z": 3})
    assert not np.shares_memory(copied["x"][0], into.array)
    assert not np.shares_memory(copied["y"][0], into.array)
    assert copied["y"][1] is mine and copied["z"] == 3
    assert np.array_equal(copied["x"][0], obj["large"])
    del got
    out.close(), into.close()
