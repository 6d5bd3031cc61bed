"""Tests of the redistribution planner (pure) and of its steps run by JAX (8 fake CPU devices).

Exhaustive over meshes (8,), (2,4), (3,2) and (2,2,2) and tensors of rank 1-3: every valid
layout (each mesh axis unused, partial, or splitting one dimension, in every order) and every
(src, dst) pair with dst.partial <= src.partial.
- pure tier: each plan follows the step semantics through valid states to dst, its cost is the
  sum of its step costs and equals an independent Bellman-Ford optimum; pairs that would create
  a partial sum raise RedistributionError;
- JAX tier 1 (every config): every distinct (state, step) edge used by any plan runs in one
  jitted shard_map per (mesh, shape) on canonical data. The canonical data of a state is the
  global value with, per partial axis a, the addend on index i scaled by u_a[i] (sum of u_a = 1),
  a form every step keeps; so running a plan on canonical data is exactly the chain of these
  verified computations, i.e. every plan is executed;
- JAX tier 2: plans run whole, with fully random partial addends, one jit per source layout (all
  its destinations share the plan-prefix tree): every pair where that is cheap, and the longest
  plans of the larger configs.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import jax
import numpy as np
import pytest

from autopar.errors import RedistributionError
from autopar.layout import Layout
from autopar.mesh import LogicalMesh
from autopar.program import StepKind
from autopar.redistribution.planner import Plan, Planner, Step
from autopar.runtime.jax_collectives import apply_step
from autopar.strategies.comm_cost import collective_time
from autopar.topology import Level, Topology
from layout_cases import F32, L, canonical, enter, jax_mesh, leave, names_of, spec, weights

CONFIGS = [((8,), (16,)), ((8,), (8, 8)), ((8,), (8, 2, 8)),
           ((2, 4), (16,)), ((2, 4), (8, 12)), ((2, 4), (4, 8, 4)),
           ((3, 2), (12,)), ((3, 2), (12, 6)), ((3, 2), (6, 4, 6)),
           ((2, 2, 2), (8,)), ((2, 2, 2), (4, 6)), ((2, 2, 2), (4, 6, 4))]
IDS = ["mesh" + "x".join(map(str, m)) + "-shape" + "x".join(map(str, s)) for m, s in CONFIGS]
WHOLE_PLANS_ALL = 800        # run every pair whole when the plan-prefix trees are this small
WHOLE_PLANS_LONGEST = 40     # else the plans from the all-partial layout and the longest ones
COMPILE_OPTS = {"xla_backend_optimization_level": 0}   # tiny arrays: compile time dominates


# ---------------------------------------------------------------------------- helpers
def all_layouts(mshape, shape):
    """Every layout of ``shape`` on the mesh whose splits divide the shape."""
    names, sizes, r = names_of(mshape), dict(zip(names_of(mshape), mshape)), len(shape)
    out = []
    for pick in itertools.product(["unused", "partial", *range(r)], repeat=len(names)):
        groups = [[a for a, c in zip(names, pick) if c == d] for d in range(r)]
        partial = frozenset(a for a, c in zip(names, pick) if c == "partial")
        for dims in itertools.product(*[itertools.permutations(g) for g in groups]):
            if all(shape[d] % math.prod(sizes[a] for a in dims[d]) == 0 for d in range(r)):
                out.append(Layout(dims, partial))
    return out


def step_after(layout: Layout, st: Step, sizes, shape) -> Layout:
    """The brief's step semantics, written independently of the planner; raises AssertionError
    on an illegal step or an intermediate layout whose splits do not divide the shape."""
    if st.kind == "all_reduce":                       # one or several partial axes at once
        assert set(st.axes) <= layout.partial and len(set(st.axes)) == len(st.axes)
        return Layout(layout.dims, layout.partial - set(st.axes))
    g = list(st.axes)                                  # one axis, or a group acting as one
    k = len(g)
    dims, partial = [list(d) for d in layout.dims], set(layout.partial)
    used = {x for d in dims for x in d}
    if st.kind == "slice":
        assert k == 1 and g[0] not in used and g[0] not in partial
        dims[st.dim] += g
    elif st.kind == "all_gather":
        assert dims[st.dim][-k:] == g
        del dims[st.dim][-k:]
    elif st.kind == "reduce_scatter":
        assert set(g) <= partial and len(set(g)) == k
        partial -= set(g)
        dims[st.dim] += g
    elif st.kind == "all_to_all":
        assert st.dim != st.dst_dim and dims[st.dim][-k:] == g
        del dims[st.dim][-k:]
        dims[st.dst_dim] += g
    else:
        raise AssertionError(st.kind)
    out = Layout(tuple(map(tuple, dims)), frozenset(partial))
    assert all(s % math.prod(sizes[x] for x in d) == 0 for s, d in zip(shape, out.dims)), out
    return out


def step_seconds(mesh, layout, st, shape, itemsize):
    if st.kind == "slice":
        return 0.0
    alpha = max(mesh.level(a).alpha for a in st.axes)
    beta = max(mesh.level(a).beta for a in st.axes)
    nbytes = itemsize * math.prod(layout.local_shape(shape, mesh))
    n = math.prod(mesh.axis_size(a) for a in st.axes)
    gamma = 1 / mesh.topology.mem_bandwidth            # seconds per reduced byte
    return collective_time(st.kind, nbytes, n, alpha, beta, gamma=gamma)[0] + max(
        mesh.level(a).launch for a in st.axes) + relayout(layout.local_shape(shape, mesh), st,
                                                          nbytes, n, gamma)


def relayout(local, st, nbytes, n, gamma):
    """The copies into place of a step whose pieces are strided in the local block (a dim
    before the one gathered, scattered or split holds more than one element): each reads and
    writes the step's larger side."""
    strided = lambda d: math.prod(local[:d]) > 1
    if st.kind == "all_gather":
        return 2 * n * nbytes * gamma * strided(st.dim)
    if st.kind == "reduce_scatter":
        return 2 * nbytes * gamma * strided(st.dim)
    if st.kind == "all_to_all":
        return 2 * nbytes * gamma * (strided(st.dim) + strided(st.dst_dim))
    return 0.0


def moves(layout, names, sizes, shape, keep):
    """All legal steps (independent generator) except reducing an axis in ``keep``."""
    r = len(shape)
    for a in names:
        if a in layout.partial:
            if a not in keep:
                yield Step("all_reduce", (a,))
                yield from (Step("reduce_scatter", (a,), d) for d in range(r))
        elif a not in layout.axes:
            yield from (Step("slice", (a,), d) for d in range(r))
    for i, d in enumerate(layout.dims):
        if d:
            yield Step("all_gather", (d[-1],), i)
            yield from (Step("all_to_all", (d[-1],), i, j) for j in range(r) if j != i)
    free = [a for a in names if a in layout.partial and a not in keep]
    for k in range(2, len(free) + 1):
        for g in itertools.combinations(free, k):
            yield Step("all_reduce", g)
            yield from (Step("reduce_scatter", g, d) for d in range(r))
    for i, d in enumerate(layout.dims):
        for k in range(2, len(d) + 1):
            yield Step("all_gather", d[-k:], i)
            yield from (Step("all_to_all", d[-k:], i, j) for j in range(r) if j != i)


def bellman_ford(mesh, src, shape, keep):
    """Cheapest seconds from ``src`` to every reachable layout, by label correcting."""
    names, sizes = mesh.axis_names, dict(zip(mesh.axis_names, mesh.shape))
    dist, todo = {src: 0.0}, [src]
    while todo:
        nxt = []
        for lay in todo:
            for st in moves(lay, names, sizes, shape, keep):
                try:
                    new = step_after(lay, st, sizes, shape)
                except AssertionError:
                    continue
                c = dist[lay] + step_seconds(mesh, lay, st, shape, 4)
                if c < dist.get(new, math.inf) - 1e-18:
                    dist[new] = c
                    nxt.append(new)
        todo = nxt
    return dist


def random_addends(G, layout, names, sizes, rng):
    part = sorted(layout.partial, key=names.index)
    if not part:
        return G
    flat = rng.integers(-4, 5, size=(math.prod(sizes[a] for a in part),) + G.shape).astype(F32)
    flat[-1] = G - flat[:-1].sum(0)
    return flat.reshape(tuple(sizes[a] for a in part) + G.shape)


@dataclass(frozen=True)
class Case:
    """All plans of one (mesh, shape)."""
    mesh: LogicalMesh
    shape: tuple
    layouts: tuple
    plans: dict          # (src, dst) -> Plan


def make_case(mshape, shape) -> Case:
    mesh = LogicalMesh.create(mshape, names_of(mshape))
    planner = Planner(mesh)
    lays = tuple(all_layouts(mshape, shape))
    plans = {(s, d): planner.plan(s, d, shape, F32)
             for s in lays for d in lays if d.partial <= s.partial}
    return Case(mesh, shape, lays, plans)


@pytest.fixture(scope="module")
def case():
    """``case(mesh_shape, shape)``: the Case, planned once per module run."""
    made = {}

    def get(mshape, shape):
        if (mshape, shape) not in made:
            made[(mshape, shape)] = make_case(mshape, shape)
        return made[(mshape, shape)]
    return get


# ---------------------------------------------------------------------------- pure tier
@pytest.mark.parametrize("mshape,shape", CONFIGS, ids=IDS)
def test_every_plan_is_valid_and_optimal(mshape, shape, case):
    c = case(mshape, shape)
    sizes = dict(zip(c.mesh.axis_names, mshape))
    optimum = {}
    for (src, dst), plan in c.plans.items():
        assert isinstance(plan, Plan) and plan.src == src and plan.dst == dst
        lay, total = src, 0.0
        for st in plan.steps:
            total += step_seconds(c.mesh, lay, st, shape, 4)
            lay = step_after(lay, st, sizes, shape)
        assert lay == dst, f"{plan} ends at {lay}"
        assert plan.cost == pytest.approx(total, rel=1e-12, abs=1e-18)
        key = (src, dst.partial)
        if key not in optimum:
            optimum[key] = bellman_ford(c.mesh, src, shape, dst.partial)
        assert plan.cost == pytest.approx(optimum[key][dst], rel=1e-9, abs=1e-15), str(plan)
        if src == dst:
            assert plan.steps == () and plan.cost == 0.0
    planner = Planner(c.mesh)
    for src in c.layouts:
        for dst in c.layouts:
            if not dst.partial <= src.partial:
                with pytest.raises(RedistributionError, match="partial sum cannot be created"):
                    planner.plan(src, dst, shape, F32)


def test_plan_cost_matches_fresh_planner_and_is_memoised(case):
    c = case((2, 2, 2), (4, 6))
    fresh = Planner(c.mesh)
    for (src, dst), plan in list(c.plans.items())[::7]:
        again = fresh.plan(src, dst, c.shape, F32)
        assert again == plan
        assert fresh.plan(src, dst, c.shape, "float32") is again
        assert fresh.cost(src, dst, c.shape, F32) == plan.cost


# ---------------------------------------------------------------------------- unit tests
MESH8 = LogicalMesh.create((8,))
MESH24 = LogicalMesh.create((2, 4))


def test_gather_cost_is_all_gather_time():
    lv = MESH8.level("x")
    plan = Planner(MESH8).plan(L("[x]"), L("[_]"), (64,), F32)
    assert plan.steps == (Step("all_gather", ("x",), 0),)
    assert plan.cost == collective_time("all_gather", 8 * 4, 8, lv.alpha, lv.beta)[0]


def test_partial_to_shard_is_one_reduce_scatter():
    pl, lv = Planner(MESH8), MESH8.level("x")
    n = 1 << 16
    plan = pl.plan(L("[_] sum{x}"), L("[x]"), (n,), F32)
    g = 1 / MESH8.topology.mem_bandwidth
    rs = collective_time("reduce_scatter", n * 4, 8, lv.alpha, lv.beta, gamma=g)[0]
    ar = collective_time("all_reduce", n * 4, 8, lv.alpha, lv.beta, gamma=g)[0]
    assert plan.cost == min(rs, ar) == rs
    assert plan.steps == (Step("reduce_scatter", ("x",), 0),) and rs < ar
    # 64 floats: recursive doubling's log2(8) = 3 messages beat the ring reduce-scatter's 7
    plan = pl.plan(L("[_] sum{x}"), L("[x]"), (64,), F32)
    assert plan.steps == (Step("all_reduce", ("x",)), Step("slice", ("x",), 0))
    assert pl.step_costs(plan)[0].algorithm == "recursive_doubling"
    plan = pl.plan(L("[_] sum{x}"), L("[_]"), (64,), F32)
    assert plan.steps == (Step("all_reduce", ("x",)),)
    two = Planner(MESH24).plan(L("[_,_] sum{y}"), L("[_,y]"), (8, 8), F32)
    assert two.steps == (Step("all_reduce", ("y",)), Step("slice", ("y",), 1))


def test_shard_to_shard_is_all_to_all():
    plan = Planner(MESH8).plan(L("[x,_]"), L("[_,x]"), (16, 16), F32)
    assert plan.steps == (Step("all_to_all", ("x",), 0, 1),)
    assert str(plan.steps[0]) == "all_to_all(x, 0->1)"


def test_swap_goes_through_intermediate_layouts():
    pl = Planner(MESH24)
    plan = pl.plan(L("[x,y]"), L("[y,x]"), (8, 8), F32)
    assert len(plan.steps) >= 2 and plan.cost > 0
    lay = L("[x,y]")
    for st in plan.steps:
        lay = step_after(lay, st, {"x": 2, "y": 4}, (8, 8))
    assert lay == L("[y,x]")
    costs = pl.step_costs(plan)
    assert sum(sc.seconds for sc in costs) == pytest.approx(plan.cost)
    assert costs[0].in_shape == (4, 2) and costs[-1].out_shape == (2, 4)
    for a, b in zip(costs, costs[1:]):
        assert a.out_shape == b.in_shape


def test_never_visits_a_split_that_does_not_divide():
    # copies into place priced as free (memory that streams without limit), so parking an
    # axis on another dimension costs only its all-to-all
    fast = dataclasses.replace(Topology.local(8), mem_bandwidth=1e30)
    pl, sizes = Planner(LogicalMesh.create((2, 2, 2), topology=fast)), {"x": 2, "y": 2, "z": 2}
    src, dst = L("[y,z,_]"), L("[(x,y),z,_]")
    # with room on dim 1, y parks there ([_,(z,y),_]) while x is sliced in ...
    wide = pl.plan(src, dst, (64, 32, 64), F32)
    assert wide.steps[0] == Step("all_to_all", ("y",), 0, 1)
    # ... but dim 1 of size 30 cannot be split 4 ways, so y must park on dim 2 instead.
    narrow = pl.plan(src, dst, (64, 30, 64), F32)
    assert narrow.steps[0] == Step("all_to_all", ("y",), 0, 2)
    lay = src
    for st in narrow.steps:
        lay = step_after(lay, st, sizes, (64, 30, 64))
    assert lay == dst
    # priced as this machine copies, gathering y back along dim 0 (contiguous) beats parking
    # it on a dimension whose pieces are strided
    priced = Planner(LogicalMesh.create((2, 2, 2))).plan(src, dst, (64, 32, 64), F32)
    assert priced.steps[0] == Step("all_gather", ("y",), 0)


def test_strided_pieces_pay_their_copy_into_place():
    """A gather or scatter along a dimension with a longer one before it (locally) pays a
    read and a write of its larger side at memory speed; along the first, or after
    dimensions of one element, nothing more."""
    pl = Planner(MESH24)
    gamma = 1 / MESH24.topology.mem_bandwidth
    for kind, big in (("all_gather", 4 * 8 * 4 * 4), ("reduce_scatter", 4 * 8 * 4)):
        assert pl.relayout_seconds(StepKind(kind), (4, 8), 1, None, big) == \
            pytest.approx(2 * big * gamma)
        assert pl.relayout_seconds(StepKind(kind), (4, 8), 0, None, big) == 0.0
        assert pl.relayout_seconds(StepKind(kind), (1, 8), 1, None, big) == 0.0
    assert pl.relayout_seconds(StepKind.ALL_TO_ALL, (4, 8), 0, 1, 128) == \
        pytest.approx(2 * 128 * gamma)                     # split along 1: one copy
    assert pl.relayout_seconds(StepKind.ALL_TO_ALL, (4, 8), 1, 0, 128) == \
        pytest.approx(2 * 128 * gamma)                     # concatenated along 1: one copy
    assert pl.relayout_seconds(StepKind.ALL_REDUCE, (4, 8), None, None, 128) == 0.0
    line = Planner(LogicalMesh.create((4,)))
    rows = line.plan(L("[_,_] sum{x}"), L("[x,_]"), (1024, 1024), F32)
    assert rows.steps == (Step("reduce_scatter", ("x",), 0),)
    # scattered along the columns: that step and its copy, or a cheaper way round
    cols = Plan(L("[_,_] sum{x}"), L("[_,x]"), (1024, 1024), np.dtype(F32),
                (Step("reduce_scatter", ("x",), 1),), 0.0)
    (step,) = line.step_costs(cols)
    assert step.seconds == pytest.approx(rows.cost + 2 * 1024 * 1024 * 4 * gamma)
    assert rows.cost < line.plan(cols.src, cols.dst, (1024, 1024), F32).cost <= step.seconds


def test_equal_layouts_need_nothing():
    pl = Planner(MESH24)
    for text in ("[_,_]", "[x,y]", "[_,(y,x)] ", "[_,_] sum{x,y}", "[y,_] sum{x}"):
        plan = pl.plan(L(text), L(text), (8, 8), F32)
        assert plan.steps == () and plan.cost == 0.0
        assert "nothing" in str(plan)


def test_keeps_destination_partial_axes():
    plan = Planner(MESH24).plan(L("[_,_] sum{x,y}"), L("[y,_] sum{x}"), (8, 8), F32)
    assert plan.steps == (Step("all_reduce", ("y",)), Step("slice", ("y",), 0))    # 256 B
    plan = Planner(MESH24).plan(L("[_,_] sum{x,y}"), L("[y,_] sum{x}"), (1024, 8), F32)
    assert plan.steps == (Step("reduce_scatter", ("y",), 0),)


@pytest.mark.parametrize("src,dst,shape,match", [
    ("[y]", "[_]", (6,), "does not divide"),
    ("[_]", "[(x,y)]", (4,), "does not divide"),
    ("[q]", "[_]", (8,), "not on the mesh"),
    ("[_]", "[_] sum{w}", (8,), "not on the mesh"),
    ("[_,_]", "[_]", (8, 8), "dimensions"),
    ("[x]", "[_] sum{y}", (8,), "partial sum cannot be created"),
])
def test_errors_name_layouts_shape_and_mesh(src, dst, shape, match):
    with pytest.raises(RedistributionError, match=match) as e:
        Planner(MESH24).plan(L(src), L(dst), shape, F32)
    msg = str(e.value)
    assert str(L(src)) in msg and str(L(dst)) in msg and str(shape) in msg and str(MESH24) in msg


def test_step_and_plan_text():
    assert str(Step("slice", ("y",), 1)) == "slice(y, dim=1)"
    assert str(Step("all_reduce", ("x",))) == "all_reduce(x)"
    plan = Planner(MESH8).plan(L("[_] sum{x}"), L("[x]"), (1 << 16,), F32)
    assert str(plan).startswith("[_] sum{x} -> [x]: reduce_scatter(x, dim=0) (")
    plan = Planner(MESH24).plan(L("[x,y]"), L("[y,x]"), (8, 8), F32)
    assert str(plan).startswith("[x,y] -> [y,x]: ") and "; " in str(plan)


def test_planners_share_nothing():
    a, b = Planner(MESH24), Planner(MESH24)
    a.plan(L("[x,y]"), L("[y,x]"), (8, 8), F32)
    assert not b._memo and not b._searches


# ---------------------------------------------------------------------------- JAX tier 1
def compile_run(fn, *args):
    return fn.lower(*args).compile(COMPILE_OPTS)(*args)


@pytest.mark.parametrize("mshape,shape", CONFIGS, ids=IDS)
def test_every_step_runs_on_jax(mshape, shape, case):
    c = case(mshape, shape)
    names, sizes, w = c.mesh.axis_names, dict(zip(c.mesh.axis_names, mshape)), weights(mshape)
    edges = {}
    for (src, _), plan in c.plans.items():
        lay = src
        for st in plan.steps:
            nxt = step_after(lay, st, sizes, shape)
            edges[(lay, st)] = nxt
            lay = nxt
    states = sorted({s for s, _ in edges}, key=str)
    index = {s: i for i, s in enumerate(states)}
    edge_list = sorted(edges.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))
    G = np.random.default_rng(1).integers(-4, 5, size=shape).astype(F32)
    jm = jax_mesh(mshape)

    def body(*blocks):
        outs = []
        for (lay, st), nxt in edge_list:
            y = apply_step(enter(blocks[index[lay]], lay), st, jm)
            outs.append(leave(y, nxt))
        return tuple(outs)

    fn = jax.jit(jax.shard_map(body, mesh=jm, in_specs=tuple(spec(s, names) for s in states),
                               out_specs=tuple(spec(n, names) for _, n in edge_list),
                               check_vma=False))
    outs = compile_run(fn, *[canonical(G, s, names, w) for s in states])
    for ((lay, st), nxt), out in zip(edge_list, outs):
        np.testing.assert_array_equal(np.asarray(out), canonical(G, nxt, names, w),
                                      err_msg=f"{st} from {lay} to {nxt} on {c.mesh}")


# ---------------------------------------------------------------------------- JAX tier 2
def run_whole(c: Case, pairs, rng):
    """Run the plans of ``pairs`` whole in one jit (plans from one source share their prefix
    tree), each source with its own random partial addends; check every result."""
    names, sizes = c.mesh.axis_names, dict(zip(c.mesh.axis_names, c.mesh.shape))
    jm = jax_mesh(c.mesh.shape)
    G = rng.integers(-4, 5, size=c.shape).astype(F32)
    by_src = {}
    for src, dst in pairs:
        by_src.setdefault(src, []).append(c.plans[(src, dst)])
    srcs = list(by_src)

    def body(*blocks):
        outs = []
        for src, block in zip(srcs, blocks):
            memo = {(): enter(block, src)}
            for plan in by_src[src]:
                for k in range(1, len(plan.steps) + 1):
                    if plan.steps[:k] not in memo:
                        memo[plan.steps[:k]] = apply_step(memo[plan.steps[:k - 1]],
                                                          plan.steps[k - 1], jm)
                outs.append(leave(memo[plan.steps], plan.dst))
        return tuple(outs)

    plans = [p for s in srcs for p in by_src[s]]
    fn = jax.jit(jax.shard_map(body, mesh=jm, in_specs=tuple(spec(s, names) for s in srcs),
                               out_specs=tuple(spec(p.dst, names) for p in plans),
                               check_vma=False))
    outs = compile_run(fn, *[random_addends(G, s, names, sizes, rng) for s in srcs])
    for plan, out in zip(plans, outs):
        got = np.asarray(out)
        got = got.reshape((-1,) + c.shape).sum(0) if plan.dst.partial else got
        np.testing.assert_array_equal(got, G, err_msg=f"{plan} on {c.mesh}")


def prefix_count(plans):
    """Distinct (source, step prefix) pairs: the collectives a whole-plan run compiles."""
    return len({(p.src, p.steps[:k]) for p in plans for k in range(1, len(p.steps) + 1)})


@pytest.mark.parametrize("mshape,shape", CONFIGS, ids=IDS)
def test_plans_run_whole_on_jax(mshape, shape, case):
    c = case(mshape, shape)
    pairs = sorted(c.plans, key=lambda p: (-len(c.plans[p].steps), str(p[0]), str(p[1])))
    if prefix_count(c.plans.values()) > WHOLE_PLANS_ALL:
        # every plan out of the all-partial layout (each partial subset kept, every target
        # layout), plus the longest plans overall
        every = frozenset(c.mesh.axis_names)
        pairs = pairs[:WHOLE_PLANS_LONGEST] + [p for p in pairs[WHOLE_PLANS_LONGEST:]
                                               if p[0].partial == every]
    run_whole(c, pairs, np.random.default_rng(2))


def test_plans_are_memoised(case):
    """The propagation search calls the planner thousands of times: a repeated query returns the
    very same Plan object instead of searching again (planning speed is in benchmarks)."""
    c = case((2, 2, 2), (4, 6, 4))
    pl = Planner(c.mesh)
    first = [pl.plan(src, dst, c.shape, F32) for src, dst in c.plans]
    assert len(c.plans) > 10000
    assert all(pl.plan(src, dst, c.shape, F32) is p for (src, dst), p in zip(c.plans, first))


def test_grouped_axes_move_as_one_collective():
    # without a per-call cost, two ring all-gathers (3 + 1 hand-offs) beat one of 8 ranks (7)
    plan = Planner(MESH24).plan(L("[(x,y),_]"), L("[_,_]"), (1024, 1024), F32)
    assert plan.steps == (Step("all_gather", ("y",), 0), Step("all_gather", ("x",), 0))
    host = Topology((Level("host", 8, alpha=5e-6, beta=1 / 4e9, launch=25e-6),))
    pl = Planner(LogicalMesh.create((2, 4), topology=host))
    plan = pl.plan(L("[(x,y),_]"), L("[_,(x,y)]"), (1024, 1024), F32)
    assert plan.steps == (Step("all_to_all", ("x", "y"), 0, 1),)
    plan = pl.plan(L("[(x,y),_]"), L("[_,_]"), (1024, 1024), F32)
    assert plan.steps == (Step("all_gather", ("x", "y"), 0),)
    plan = pl.plan(L("[_,_] sum{x,y}"), L("[(x,y),_]"), (1024, 1024), F32)
    assert plan.steps == (Step("reduce_scatter", ("x", "y"), 0),)
