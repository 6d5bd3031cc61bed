"""runtime.jax_collectives: collectives over several mesh axes act as one combined axis (first
axis major), a plan's steps run in turn, the group index, and the errors for steps that
cannot run (8 fake CPU devices)."""
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from autopar.errors import CollectiveError
from autopar.mesh import LogicalMesh
from autopar.program import Collective, Slice
from autopar.redistribution.planner import Planner, Step
from autopar.runtime.jax_collectives import apply_step, apply_steps, group_index
from layout_cases import F32, L, canonical, enter, jax_mesh, leave, names_of, spec, weights

MESH24 = LogicalMesh.create((2, 4))


def test_multi_axis_steps_match_single_axis_steps():
    """Program collectives may name several axes: they act as one combined axis, first major."""
    mshape, shape = (2, 2, 2), (8, 8)
    names, jm, mesh = names_of(mshape), jax_mesh(mshape), LogicalMesh.create(mshape)
    G = np.arange(64, dtype=F32).reshape(shape)
    w = weights(mshape)
    col = dict(shape=shape, dtype=F32, bytes=0)
    cases = [  # (src, multi-axis step, dst)
        (L("[(x,y),_]"), Collective("all_gather", ("x", "y"), dim=0, **col), L("[_,_]")),
        (L("[(z,x,y),_]"), Collective("all_gather", ("x", "y"), dim=0, **col), L("[z,_]")),
        (L("[_,z]"), Slice(("x", "y"), dim=0, shape=shape), L("[(x,y),z]")),
        (L("[_,_] sum{x,y}"), Collective("all_reduce", ("x", "y"), **col), L("[_,_]")),
        (L("[_,_] sum{x,y}"), Collective("reduce_scatter", ("x", "y"), dim=1, **col),
         L("[_,(x,y)]")),
        (L("[(x,y),_]"), Collective("all_to_all", ("x", "y"), dim=0, dst_dim=1, **col),
         L("[_,(x,y)]")),
        (L("[z,_]"), Step("all_to_all", ("z",), 0, 1), L("[_,z]")),
    ]

    def body(*blocks):
        return tuple(leave(apply_step(enter(b, s), st, mesh), d)
                     for b, (s, st, d) in zip(blocks, cases))

    fn = jax.jit(jax.shard_map(body, mesh=jm, in_specs=tuple(spec(s, names) for s, _, _ in cases),
                               out_specs=tuple(spec(d, names) for _, _, d in cases),
                               check_vma=False))
    outs = fn(*[canonical(G, s, names, w) for s, _, _ in cases])
    for (s, st, d), out in zip(cases, outs):
        np.testing.assert_array_equal(np.asarray(out), canonical(G, d, names, w), err_msg=str(st))


def test_apply_steps_group_index_and_errors():
    mshape = (2, 4)
    names, jm = names_of(mshape), jax_mesh(mshape)
    plan = Planner(MESH24).plan(L("[x,y]"), L("[y,x]"), (8, 8), F32)
    G = np.arange(64, dtype=F32).reshape(8, 8)

    def body(b):
        idx = group_index(("x", "y"), jm).reshape(1, 1)
        return apply_steps(b, plan.steps, jm), idx

    fn = jax.jit(jax.shard_map(body, mesh=jm, in_specs=P("x", "y"),
                               out_specs=(P("y", "x"), P(("x", "y"))), check_vma=False))
    out, idx = fn(G)
    np.testing.assert_array_equal(np.asarray(out), G)
    np.testing.assert_array_equal(np.asarray(idx).ravel(), np.arange(8))

    def bad(b):
        return apply_step(b, Step("slice", ("y",), 0), jm)

    with pytest.raises(CollectiveError, match="does not|cannot split"):
        jax.jit(jax.shard_map(bad, mesh=jm, in_specs=P("x"), out_specs=P(("x", "y")),
                              check_vma=False))(np.zeros((6,), F32))
    with pytest.raises(CollectiveError, match="unknown step kind"):
        odd = SimpleNamespace(kind="teleport", axes=("x",), dim=None, dst_dim=None)
        jax.jit(jax.shard_map(lambda b: apply_step(b, odd, jm), mesh=jm,
                              in_specs=P(), out_specs=P(), check_vma=False))(np.zeros(4, F32))
