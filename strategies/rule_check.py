"""Sharding-rule checker: run every candidate of a node sharded and compare with the unsharded op.

In: graph nodes (or whole graphs), a ``LogicalMesh`` and the ``jax.sharding.Mesh`` with the same
axis names and shape. Out: a ``CheckReport`` (how many node signatures and candidates were run,
and one ``Failure`` per wrong candidate, naming the node, its primitive, the candidate's layouts
and what went wrong).

For one node, ``check_node``:
1. enumerates the candidates of the node's rule (``enumerate_candidates(node, rule.spec(node),
   mesh)``);
2. draws random global inputs of the node's shapes and dtypes: floats are multiples of 1/8 in
   [-2, 2] (positive for ``log``/``sqrt``/..), so sums of them are exact in any order; bools
   random; index operands of gather/scatter/dynamic slices in their valid ranges
   (``indexing.index_bounds``); other ints small; ``Const`` inputs keep their value;
3. per candidate, cuts every input into per-device blocks per its input layout (a partial-sum
   axis gets random per-device addends that sum to the global value), checks the local result
   shapes with the primitive's ``abstract_eval``, then runs ``primitive.bind(*local,
   **rule.params_for(node, local in shapes, local out shapes))`` inside ``jax.shard_map`` (a
   ``Const`` with a split layout is sliced on the device by ``lax.axis_index``);
4. reassembles each result per its output layout (summing over partial axes; replicas are
   compared one by one) and compares with ``primitive.bind(*global, **node.params)``: floats to
   rtol = atol = 1e-5, ints and bools exactly.
``check_graphs`` checks one node of each class once (``node_class``: the primitive, its params,
its operands' dtypes and each dimension's divisibility by the mesh's split sizes, which decide
its candidates and the rule's arithmetic), and runs the candidates of several nodes, with their
unsharded references, in one jitted program (about ``batch`` candidates per compilation;
compiling is what costs time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.sharding import NamedSharding, PartitionSpec

from autopar.errors import ConfigError
from autopar.graph import Const, type_str
from autopar.strategies.candidates import enumerate_candidates
from autopar.strategies.rules import rule_for
from autopar.strategies.rules.indexing import index_bounds

RTOL = ATOL = 1e-5
DEFAULT_BATCH = 96  # candidates compiled together
# the checked programs are tiny and run once: compile them with the cheapest XLA backend settings
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# primitive -> range of its floating inputs (default [-2, 2])
_POS, _UNIT = (0.5, 2.0), (-0.875, 0.875)
_FLOAT_RANGE = {
    "log": _POS,
    "sqrt": _POS,
    "rsqrt": _POS,
    "pow": _POS,
    "log1p": _POS,
    "erf_inv": _UNIT,
    "acos": _UNIT,
    "asin": _UNIT,
    "atanh": _UNIT,
    "acosh": (1.5, 3.0),
}
_NONZERO_DIVISOR = {"div", "rem"}


@dataclass(frozen=True)
class Failure:
    node: str  # node name and source line
    primitive: str
    candidate: str  # "in layouts -> out layouts"
    error: str

    def __str__(self) -> str:
        return f"{self.node} [{self.primitive}] {self.candidate}: {self.error}"


@dataclass(frozen=True)
class CheckReport:
    nodes: int  # distinct node signatures checked
    checked: int  # candidates run and compared
    failures: tuple[Failure, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def merge(self, other: CheckReport) -> CheckReport:
        return CheckReport(
            self.nodes + other.nodes, self.checked + other.checked, self.failures + other.failures
        )

    def __str__(self) -> str:
        head = (
            f"rule check: {self.checked} candidates of {self.nodes} nodes, "
            f"{len(self.failures)} incorrect"
        )
        return "\n".join([head] + [f"  {f}" for f in self.failures])


# ---------------------------------------------------------------- public entry points


def check_graph(graph, mesh, jax_mesh, seed: int = 0, batch: int = DEFAULT_BATCH) -> CheckReport:
    return check_graphs([graph], mesh, jax_mesh, seed, batch)


def check_graphs(graphs, mesh, jax_mesh, seed: int = 0, batch: int = DEFAULT_BATCH) -> CheckReport:
    """Check one node of each ``node_class`` of ``graphs``; ``batch`` candidates (of several
    nodes) share one compiled program."""
    _check_meshes(mesh, jax_mesh)
    rng = np.random.default_rng(seed)
    seen, jobs = set(), []
    for graph in graphs:
        for node in graph.nodes:
            key = node_class(node, mesh)
            if key not in seen:
                seen.add(key)
                jobs.append(_plan(node, rule_for(node), mesh, rng))
    report = CheckReport(0, 0)
    chunk: list[_Job] = []
    for job in jobs + [None]:
        if chunk and (job is None or sum(len(j.runs) for j in chunk) + len(job.runs) > batch):
            for r in _execute(chunk, mesh, jax_mesh):
                report = report.merge(r)
            chunk = []
        if job is not None:
            chunk.append(job)
    return report


def node_signature(node) -> tuple:
    """Nodes with equal signatures have the same candidates and the same local computation
    (scalar literals never split, so their values are left out)."""

    def operand(x):
        if isinstance(x, Const):
            data = np.asarray(x.value).tobytes() if x.shape else b""
            return ("const", x.shape, str(x.dtype), data)
        return ("value", x.shape, str(x.dtype))

    params = tuple(sorted((k, repr(_plain(v))) for k, v in node.params.items()))
    return (
        node.prim,
        tuple(operand(x) for x in node.inputs),
        tuple((v.shape, str(v.dtype)) for v in node.outputs),
        params,
    )


def node_class(node, mesh) -> tuple:
    """``node_signature`` with every dimension of a non-constant operand or result replaced by
    how the mesh can split it (for each product of axis sizes: divides it, equals it; and
    whether it is 1). Nodes of one class have the same candidates and run the same rule code
    (shapes the rule computes are in the params, which stay exact), so checking one checks
    all; a 2 x 2 mesh finds 142 classes among the 268 signatures of the test models."""
    products = {1}
    for n in (mesh.axis_size(a) for a in mesh.axis_names):
        products |= {s * n for s in products}
    sizes = sorted(products - {1})

    def dims(shape):
        return tuple((d == 1,) + tuple((d % s == 0, d == s) for s in sizes) for d in shape)

    prim, operands, results, params = node_signature(node)
    operands = tuple(o if o[0] == "const" else (o[0], dims(o[1]), o[2]) for o in operands)
    return prim, operands, tuple((dims(sh), dt) for sh, dt in results), params


def _plain(v):
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    return int(v) if isinstance(v, np.integer) else v


def check_node(node, mesh, jax_mesh, rng, rule=None) -> CheckReport:
    """Run every candidate of ``node`` (per ``rule``, default the table's) and compare."""
    _check_meshes(mesh, jax_mesh)
    return _execute([_plan(node, rule or rule_for(node), mesh, rng)], mesh, jax_mesh)[0]


@dataclass(frozen=True)
class _Run:
    cand: object
    params: dict
    blocks: tuple  # per input: (ndev, *local) array, or None for a Const
    consts: tuple  # per input: (value, layout, local shape) for a Const, else None


@dataclass(frozen=True)
class _Job:
    """One node's checks: global inputs, the candidates to run, and failures found already."""

    node: object
    where: str
    checked: int
    glob: tuple
    runs: tuple[_Run, ...]
    failures: tuple[Failure, ...]


def _plan(node, rule, mesh, rng) -> _Job:
    cands = enumerate_candidates(node, rule.spec(node), mesh)
    where = (
        f"{node.name} ({', '.join(type_str(x.shape, x.dtype) for x in node.inputs)}) "
        f"at {node.source or '?'}"
    )
    glob = tuple(_global_input(node, i, x, rng) for i, x in enumerate(node.inputs))
    failures, runs = [], []
    for cand in cands:
        run = _prepare(node, rule, cand, glob, mesh, rng)
        if isinstance(run, str):
            failures.append(Failure(where, node.prim, str(cand), run))
        else:
            runs.append(run)
    return _Job(node, where, len(cands), glob, tuple(runs), tuple(failures))


def _execute(jobs, mesh, jax_mesh) -> list[CheckReport]:
    """Run the jobs' candidates (and their unsharded references) in one jitted program."""
    expected, results = _run(jobs, mesh, jax_mesh)
    reports = []
    for job, want, got in zip(jobs, expected, results):
        failures = list(job.failures)
        for run, outs in zip(job.runs, got):
            for k, (dev, layout, ref) in enumerate(zip(outs, run.cand.out_layouts, want)):
                err = _compare(dev, layout, ref, mesh)
                if err:
                    failures.append(
                        Failure(job.where, job.node.prim, str(run.cand), f"output {k}: {err}")
                    )
                    break
        reports.append(CheckReport(1, job.checked, tuple(failures)))
    return reports


# ---------------------------------------------------------------- inputs


def _global_input(node, i, x, rng):
    if isinstance(x, Const):
        return np.asarray(x.value, dtype=x.dtype).reshape(x.shape)
    dtype, shape = np.dtype(x.dtype), x.shape
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        bounds = index_bounds(node).get(i)
        if bounds is not None:
            if len(bounds) == 1 and shape == ():
                return np.asarray(rng.integers(0, bounds[0]), dtype)
            cols = [rng.integers(0, b, shape[:-1] + (1,)) for b in bounds]
            return np.concatenate(cols, axis=-1).astype(dtype)
        v = rng.integers(-3, 9, shape)
        if node.prim in _NONZERO_DIVISOR and i > 0:
            v = np.where(v == 0, 1, v)
        return v.astype(dtype)
    lo, hi = _FLOAT_RANGE.get(node.prim, (-2.0, 2.0))
    v = _dyadic(rng, lo, hi, shape)
    if node.prim in _NONZERO_DIVISOR and i > 0:
        v = np.where(v == 0, 1.0, v)
    return v.astype(dtype)


def _dyadic(rng, lo, hi, shape):
    """Multiples of 1/8 in [lo, hi]: sums and products of a few of them are exact in float32,
    so linear ops agree exactly however their partial sums are split and ordered."""
    return rng.integers(round(lo * 8), round(hi * 8) + 1, shape) / 8.0


def _prepare(node, rule, cand, glob, mesh, rng):
    """Per-device blocks and local params of one candidate, or an error string."""
    in_shapes = [l.local_shape(x.shape, mesh) for l, x in zip(cand.in_layouts, node.inputs)]
    out_shapes = [l.local_shape(v.shape, mesh) for l, v in zip(cand.out_layouts, node.outputs)]
    params = rule.params_for(node, in_shapes, out_shapes)
    blocks, consts = [], []
    for x, g, layout, shape in zip(node.inputs, glob, cand.in_layouts, in_shapes):
        if isinstance(x, Const):
            if layout.partial:
                return f"Const input given the partial layout {layout}"
            blocks.append(None)
            consts.append((g, layout, tuple(shape)))
            continue
        if layout.partial and g.dtype == np.bool_:
            return f"bool input given the partial layout {layout}"
        blocks.append(_device_blocks(g, layout, mesh, rng))
        consts.append(None)
    local_args = [ShapedArray(tuple(sh), x.dtype) for sh, x in zip(in_shapes, node.inputs)]
    try:
        avals, _ = node.primitive.abstract_eval(*local_args, **params)
    except (TypeError, ValueError) as e:
        return f"local bind with params {params} rejected: {e}"
    avals = avals if node.primitive.multiple_results else [avals]
    got = [tuple(a.shape) for a in avals]
    if got != [tuple(s) for s in out_shapes]:
        return f"local results have shapes {got}, the output layouts expect {out_shapes}"
    return _Run(cand, params, tuple(blocks), tuple(consts))


def _partial_index(layout, coords, mesh):
    idx = 0
    for a in sorted(layout.partial, key=mesh.axis_index):
        idx = idx * mesh.axis_size(a) + int(coords[a])
    return idx


def _device_blocks(g, layout, mesh, rng):
    """``(ndev, *local)``: device ``b`` (row-major over the mesh) holds its block of ``g``; over
    partial axes the blocks are random addends summing to ``g``."""
    k = math.prod(mesh.axis_size(a) for a in layout.partial)
    if k > 1:
        parts = [_random_like(g, rng) for _ in range(k - 1)]
        parts.append((g - sum(parts)).astype(g.dtype))
    else:
        parts = [g]
    out = []
    for coords in map(mesh.coords, range(mesh.size)):
        part = parts[_partial_index(layout, coords, mesh)]
        out.append(part[layout.block(g.shape, coords, mesh)])
    return np.stack(out)


def _random_like(g, rng):
    if np.issubdtype(g.dtype, np.integer):
        return rng.integers(-5, 6, g.shape).astype(g.dtype)
    return _dyadic(rng, -2.0, 2.0, g.shape).astype(g.dtype)


# ---------------------------------------------------------------- sharded run


def _run(jobs, mesh, jax_mesh):
    """One jit: per job the unsharded reference outputs, and per job, per run, per output the
    ``(ndev, *local)`` stack of device results of one shard_map over all runs."""
    stacked = NamedSharding(jax_mesh, PartitionSpec(tuple(jax_mesh.axis_names)))
    replicated = NamedSharding(jax_mesh, PartitionSpec())
    glob = [
        jax.device_put(g, replicated)
        for j in jobs
        for g, x in zip(j.glob, j.node.inputs)
        if not isinstance(x, Const)
    ]
    flat = [
        jax.device_put(b, stacked) for j in jobs for r in j.runs for b in r.blocks if b is not None
    ]

    def reference(*arrays):
        it, outs = iter(arrays), []
        for j in jobs:
            args = [g if isinstance(x, Const) else next(it) for g, x in zip(j.glob, j.node.inputs)]
            outs.append(_bind(j.node.primitive, args, j.node.params))
        return outs

    def body(*blocks):
        it, outs = iter(blocks), []
        for j in jobs:
            for r in j.runs:
                args = [next(it)[0] if c is None else _local_const(c, mesh) for c in r.consts]
                outs.append([o[None] for o in _bind(j.node.primitive, args, r.params)])
        return outs

    nruns = sum(len(j.runs) for j in jobs)
    spec = PartitionSpec(tuple(jax_mesh.axis_names))
    sharded = jax.shard_map(
        body,
        mesh=jax_mesh,
        in_specs=(spec,) * len(flat),
        out_specs=[[spec] * len(j.node.outputs) for j in jobs for _ in j.runs],
        check_vma=False,
    )
    program = jax.jit(
        lambda g, b: (reference(*g), sharded(*b) if nruns else []), compiler_options=_FAST_COMPILE
    )
    ref, dev = program(glob, flat)
    assert len(dev) == nruns
    it = iter(dev)
    results = [[[np.asarray(o) for o in next(it)] for _ in j.runs] for j in jobs]
    return [[np.asarray(o) for o in outs] for outs in ref], results


def _bind(prim, args, params):
    out = prim.bind(*args, **params)
    return list(out) if prim.multiple_results else [out]


def _local_const(const, mesh):
    value, layout, local = const
    x = jnp.asarray(value)
    if not layout.axes:
        return x
    starts = []
    for axes, n in zip(layout.dims, local):
        idx = jnp.int32(0)
        for a in axes:
            idx = idx * mesh.axis_size(a) + lax.axis_index(a)
        starts.append(idx * n)
    return lax.dynamic_slice(x, starts, local)


# ---------------------------------------------------------------- comparison


def _compare(got, layout, want, mesh):
    """Reassemble the device results ``got`` per ``layout`` and compare with ``want``; return
    an error string or None. Devices that differ only on partial axes are summed."""
    groups = {}
    for b, coords in enumerate(map(mesh.coords, range(mesh.size))):
        key = tuple(int(coords[a]) for a in mesh.axis_names if a not in layout.partial)
        groups.setdefault(key, []).append((b, coords))
    floating = np.issubdtype(want.dtype, np.inexact)
    wide = np.complex128 if np.issubdtype(want.dtype, np.complexfloating) else np.float64
    for members in groups.values():
        b, coords = members[0]
        if floating:
            total = sum(got[m].astype(wide) for m, _ in members)
        else:
            total = sum(got[m] for m, _ in members) if len(members) > 1 else got[b]
        block = want[layout.block(want.shape, coords, mesh)]
        if total.shape != block.shape:
            return f"device {b} holds shape {total.shape}, its block is {block.shape}"
        if floating:
            ok = np.allclose(total, block, rtol=RTOL, atol=ATOL, equal_nan=True)
        else:
            ok = np.array_equal(total.astype(want.dtype), block)
        if not ok:
            diff = np.abs(np.asarray(total, wide) - np.asarray(block, wide))
            return (
                f"device {b} (coords { {a: int(c) for a, c in coords.items()} }) differs "
                f"from the unsharded result, max abs error {np.nanmax(diff):.3g}"
            )
    return None


def _check_meshes(mesh, jax_mesh):
    if tuple(jax_mesh.axis_names) != tuple(mesh.axis_names) or tuple(
        jax_mesh.devices.shape
    ) != tuple(mesh.shape):
        raise ConfigError(
            f"jax mesh {dict(jax_mesh.shape)} does not match the logical mesh "
            f"{mesh}; build it as jax.sharding.Mesh(devices.reshape(mesh.shape), "
            "mesh.axis_names)."
        )
