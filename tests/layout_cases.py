"""Layouts and their values on JAX's fake CPU devices, for the redistribution and collective
tests: mesh axis names, a jax Mesh, the global value of a layout's blocks (one leading
dimension per partial axis) and its canonical addends."""
import math

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from autopar.layout import Layout

F32 = np.float32


def names_of(mshape):
    return ("x", "y", "z")[:len(mshape)]


def jax_mesh(mshape):
    n = math.prod(mshape)
    return Mesh(np.array(jax.devices()[:n]).reshape(mshape), names_of(mshape))


def spec(layout: Layout, names):
    """Global representation: one leading dim per partial axis (mesh order), then the tensor."""
    part = sorted(layout.partial, key=names.index)
    return P(*part, *[None if not d else (d[0] if len(d) == 1 else d) for d in layout.dims])


def weights(mshape):
    """Per axis, integer weights summing to 1 (distinct per axis), for canonical addends."""
    out = {}
    for k, (a, n) in enumerate(zip(names_of(mshape), mshape)):
        u = np.arange(n) * (k + 2) - (k + 1)
        u[-1] += 1 - u.sum()
        out[a] = u.astype(F32)
    return out


def canonical(G, layout, names, w):
    part = sorted(layout.partial, key=names.index)
    arr = G
    for a in reversed(part):
        arr = w[a].reshape((-1,) + (1,) * arr.ndim) * arr[None]
    return arr


def enter(block, layout):
    return block.reshape(block.shape[len(layout.partial):])


def leave(block, layout):
    return block.reshape((1,) * len(layout.partial) + block.shape)


def L(text):
    return Layout.parse(text)
