"""The ``xla`` backend: the plan run by XLA's own SPMD partitioner.

In: the traced Graph, the Program's argument and result layouts, each operator's output
layouts as planned (one tuple per graph node, graph order) and the jax Mesh. Out: ``build``:
a callable, flat global arguments -> flat global results, that is one ``jax.jit`` of the step's
operators re-bound in graph order with the plan's ``in_shardings`` / ``out_shardings`` and a
``jax.lax.with_sharding_constraint`` on every operator output the plan lays out (a planned
partial sum is left to XLA, which has no sharding for it). XLA (GSPMD / Shardy) then inserts the collectives
itself, with its own scheduler, async collectives and fusions, as Alpa ran its plans;
``collectives`` reads what it inserted from the compiled module's text.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from autopar.graph import Const

from .jax_backend import _explicit, _moved, _with_consts, const


def step_function(graph, op_layouts, mesh):
    """The step on flat global arguments, every operator bound as traced and each of its
    outputs constrained to its layout in ``op_layouts`` (per node, a Layout per output),
    except planned partial sums. Constraining only where an output's layout differs from its
    first operand's left XLA free to gather elsewhere: on the test GPT planned by
    auto_parallel on 2 devices it then moved 38 all-gathers (4.1 MB per device) for the plan's
    11 (2.75 MB), against 16 (3.0 MB) with every output constrained."""

    def run(*flat):
        env = {v.id: x for v, x in zip(graph.inputs, flat)}
        get = lambda a: const(a) if isinstance(a, Const) else env[a.id]
        for node, layouts in zip(graph.nodes, op_layouts):
            out = node.primitive.bind(*[get(a) for a in node.inputs], **node.params)
            outs = out if node.primitive.multiple_results else [out]
            for v, o, l in zip(node.outputs, outs, layouts):
                env[v.id] = (
                    o
                    if l.partial
                    else jax.lax.with_sharding_constraint(
                        o, NamedSharding(mesh, l.to_partition_spec())
                    )
                )
        return [get(o) for o in graph.outputs]

    return run


def build(graph, in_layouts, out_layouts, op_layouts, mesh, donate=()):
    """``(call, jitted)``: ``call(flat_args) -> flat results`` (constant results put back as
    the step returned them) and the ``jax.jit`` of the step, for ``lower``/``collectives``.
    A mesh with Explicit axes (``jax.make_mesh``'s default) runs as its Auto twin: the plan's
    constraints, not sharding-in-types rules, say where each value lives."""
    if _explicit(mesh):
        mesh = Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
    ins = [NamedSharding(mesh, l.to_partition_spec()) for l in in_layouts]
    outs = [
        NamedSharding(mesh, l.to_partition_spec())
        for o, l in zip(graph.outputs, out_layouts)
        if not isinstance(o, Const)
    ]
    body = step_function(graph, op_layouts, mesh)
    live = [k for k, o in enumerate(graph.outputs) if not isinstance(o, Const)]

    def traced(*flat):
        got = body(*flat)
        return [got[k] for k in live]

    jitted = jax.jit(traced, in_shardings=ins, out_shardings=outs, donate_argnums=tuple(donate))

    call = lambda flat: _with_consts(graph, jitted(*[_moved(x, s) for x, s in zip(flat, ins)]))
    return call, jitted


# an HLO instruction line: "%name = type[shape]{layout} kind(...)", kind maybe -start
_OP = re.compile(
    r"=\s*(?:\(([^)]*)\)|(\S+))\s+(all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute)(?:-start)?\("
)
_TYPE = re.compile(r"([a-z]+\d*)\[([0-9,]*)\]")
_BYTES = {
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "f64": 8,
    "s32": 4,
    "u32": 4,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "s64": 8,
    "u64": 8,
}


def collectives(hlo_text: str) -> Counter[tuple[str, int]]:
    """``Counter((kind, result bytes per device) -> count)`` of the collectives in a compiled
    module's text (an async pair counted once, by its start)."""
    out: Counter[tuple[str, int]] = Counter()
    for m in _OP.finditer(hlo_text):
        types = m.group(1) or m.group(2)
        size = 0
        for dt, dims in _TYPE.findall(types):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size += n * _BYTES.get(dt, 4)
        out[(m.group(3).replace("-", "_"), size)] += 1
    return out


def differences(planned, inserted: Counter[tuple[str, int]]) -> list:
    """Per collective kind where the plan's communication (``planned``: records with ``kind``,
    ``bytes`` per device and ``count``, as ``Strategy.collectives``) and what XLA inserted
    (``collectives``) differ, a line saying how: XLA combining several into fewer of the same
    bytes (its all-reduce combiner), or moving other bytes (another choice of where to
    reduce or gather). Empty when both match kind by kind, count and bytes."""
    mine: Counter[str] = Counter()  # kind -> bytes per device
    xla: Counter[str] = Counter()
    n_mine: Counter[str] = Counter()  # kind -> count
    n_xla: Counter[str] = Counter()
    for c in planned:
        mine[c.kind] += c.bytes * c.count
        n_mine[c.kind] += c.count
    for (kind, size), k in inserted.items():
        xla[kind] += size * k
        n_xla[kind] += k
    out = []
    for kind in sorted(set(n_mine) | set(n_xla)):
        a, b, na, nb = mine[kind], xla[kind], n_mine[kind], n_xla[kind]
        if a == b and na == nb:
            continue
        if a == b:
            out.append(
                f"{kind}: XLA combined the plan's {na} into {nb} ({a} bytes per device, the same)"
            )
        else:
            out.append(
                f"{kind}: the plan moves {a} bytes per device in {na}, XLA {b} in {nb} "
                f"({'more' if b > a else 'less'}: XLA placed the reduction or gather "
                "elsewhere than the plan)"
            )
    return out
