"""autopar's strategy JSON, read strictly, and a loaded strategy checked against a function.

In: the text of a strategy file (``read``), or a ``Strategy`` with the traced ``Graph``, the
``LogicalMesh`` and the argument names it is to run on (``check_fits``). Out: the ``Strategy``
the text holds, or ``LayoutError`` naming the first entry that is wrong (``ops[3]
(dot_general.3).in[1]: ...``) and how to fix it: every field present with its type, numbers
finite and non-negative, shapes of non-negative integers, layouts that parse; ``check_fits``
adds what only the function can tell: each argument's name, shape and dtype, its layout on
the mesh's axes, dividing its dimensions and never a partial sum (an argument is a whole value
on each device, so a pending sum would silently change the answer), and the layouts each
operator's outputs are converted to. Which operator layouts exist is the candidates' business
(``compiler.api`` matches each entry against them).
"""

from __future__ import annotations

import json
import math

from autopar.errors import LayoutError
from autopar.layout import Layout

FIX = "; write the file again with autopar (compile or plan), or fix that entry."
_REQUIRED = object()


def _fail(label: str, what: str):
    raise LayoutError(f"strategy file: {label + ': ' if label else ''}{what}{FIX}")


def _field(d, key, label, check, default=_REQUIRED):
    """``check(value, label.key)`` of ``d[key]``; ``default`` when it is absent (else an
    error)."""
    if not isinstance(d, dict):
        _fail(label, f"{'is ' if label else ''}{type(d).__name__} {_short(d)}, not an object")
    if key not in d:
        if default is _REQUIRED:
            _fail(label, f"has no {key!r}")
        return default
    return check(d[key], f"{label}.{key}" if label else key)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _str(v, label):
    if not isinstance(v, str):
        _fail(label, f"is {_short(v)}, not a string")
    return v


def _bool(v, label):
    if not isinstance(v, bool):
        _fail(label, f"is {_short(v)}, not true or false")
    return v


def _num(v, label):
    """A finite number >= 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        _fail(label, f"is {_short(v)}, not a finite number >= 0")
    return v


def _int(v, label):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        _fail(label, f"is {_short(v)}, not an integer >= 0")
    return v


def _opt(check):
    return lambda v, label: None if v is None else check(v, label)


def _list(item):
    def check(v, label):
        if not isinstance(v, list):
            _fail(label, f"is {_short(v)}, not a list")
        return tuple(item(x, f"{label}[{k}]") for k, x in enumerate(v))

    return check


def _dtype(v, label):
    import jax.numpy as jnp  # knows bfloat16 and the other ml_dtypes

    try:
        return str(jnp.dtype(_str(v, label)))
    except TypeError:
        _fail(label, f"{v!r} is not a dtype")


def _layout(v, label):
    try:
        return Layout.parse(_str(v, label))
    except LayoutError as e:
        _fail(label, str(e).rstrip("."))


_shape = _list(_int)
_shapes = _list(_shape)
_layouts = _list(_layout)


def read(text: str):
    """The Strategy in ``text`` (autopar's JSON), every field checked."""
    from .strategy import (
        FORMAT,
        Alternative,
        CommStrategy,
        InputStrategy,
        OpStrategy,
        PipelineChoice,
        StageStrategy,
        Strategy,
    )

    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise LayoutError(f"strategy file: not JSON ({e}); give a file autopar wrote.") from None
    except RecursionError:
        raise LayoutError(
            "strategy file: nested too deeply to be a strategy; give a file autopar wrote."
        ) from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise LayoutError(
            "not an autopar strategy file (no \"format\": \"autopar-strategy\"); "
            "a MindSpore strategy file holds no traced operators to plan with: "
            "read it with autopar.strategies.mindspore_ckpt.read."
        )
    mesh = _field(d, "mesh", "mesh", lambda v, label: v)
    shape = _field(mesh, "shape", "mesh", _shape)
    names = _field(mesh, "axis_names", "mesh", _list(_str))
    if len(shape) != len(names) or len(set(names)) != len(names) or 0 in shape:
        _fail(
            "mesh",
            f"shape {list(shape)} and axis_names {list(names)} must be as long as "
            "each other, with distinct names and sizes >= 1",
        )

    def op(o, label):
        name = _field(o, "name", label, _str)
        label = f"{label} ({name})"
        return OpStrategy(
            name=name,
            prim=_field(o, "prim", label, _str),
            source=_field(o, "source", label, _str),
            in_shapes=_field(o, "in_shapes", label, _shapes),
            out_shapes=_field(o, "out_shapes", label, _shapes),
            in_layouts=_field(o, "in", label, _layouts),
            out_layouts=_field(o, "out", label, _layouts),
            comm_time=_field(o, "comm_time", label, _num),
            compute_time=_field(o, "compute_time", label, _num),
            out_bytes=_field(o, "out_bytes", label, _int),
            stage=_field(o, "stage", label, _int, 0),
            operands=_field(o, "operands", label, _list(_str), ()),
            converted=_field(o, "converted", label, _list(_opt(_layout)), ()),
        )

    def argument(i, label):
        name = _field(i, "name", label, _str)
        label = f"{label} ({name})"
        return InputStrategy(
            name=name,
            shape=_field(i, "shape", label, _shape),
            dtype=_field(i, "dtype", label, _dtype),
            layout=_field(i, "layout", label, _layout),
            is_param=_field(i, "is_param", label, _bool),
            update=_field(i, "update", label, _layout, None),
        )

    def stage(st, label):
        m = _field(st, "mesh", label, lambda v, _: v, {})
        return StageStrategy(
            index=_field(st, "index", label, _int),
            devices=_field(st, "devices", label, _shape),
            seconds=_field(st, "seconds", label, _num),
            memory=_field(st, "memory", label, _int),
            mesh_shape=_field(m, "shape", f"{label}.mesh", _shape, ()),
            axis_names=_field(m, "axis_names", f"{label}.mesh", _list(_str), ()),
        )

    def collective(c, label):
        return CommStrategy(
            kind=_field(c, "kind", label, _str),
            axes=_field(c, "axes", label, _list(_str)),
            shape=_field(c, "shape", label, _shape),
            dtype=_field(c, "dtype", label, _str),
            bytes=_field(c, "bytes", label, _int),
            seconds=_field(c, "seconds", label, _num),
            reason=_field(c, "reason", label, _str, ""),
            stage=_field(c, "stage", label, _int, 0),
            count=_field(c, "count", label, _int, 1),
        )

    def alternative(a, label):
        return Alternative(
            label=_field(a, "label", label, _str),
            seconds=_field(a, "seconds", label, _num),
            compute=_field(a, "compute", label, _num),
            comm=_field(a, "comm", label, _num),
            overhead=_field(a, "overhead", label, _num),
            peak_memory=_field(a, "peak_memory", label, _int),
            chosen=_field(a, "chosen", label, _bool, False),
            fits=_field(a, "fits", label, _bool, True),
        )

    def choice(c, label):
        return PipelineChoice(
            stages=_field(c, "stages", label, _int),
            micro_batches=_field(c, "micro_batches", label, _int),
            seconds=_field(c, "seconds", label, _opt(_num)),
            peak_memory=_field(c, "peak_memory", label, _opt(_int)),
            note=_field(c, "note", label, _str, ""),
            interleave=_field(c, "interleave", label, _int, 1),
        )

    def timeline(e, label):
        if not isinstance(e, list) or len(e) != 2:
            _fail(label, f"is {_short(e)}, not [name, bytes]")
        return _str(e[0], f"{label}[0]"), _int(e[1], f"{label}[1]")

    return Strategy(
        mode=_field(d, "mode", "", _str),
        search=_field(d, "search", "", _str),
        mesh_shape=shape,
        axis_names=names,
        inputs=_field(d, "inputs", "", _list(argument)),
        ops=_field(d, "ops", "", _list(op)),
        output_comm_time=_field(d, "output_comm_time", "", _num),
        overhead_time=_field(d, "overhead_time", "", _num, 0.0),
        peak_memory=_field(d, "peak_memory", "", _int),
        peak_op=_field(d, "peak_op", "", _str),
        memory_limit=_field(d, "memory_limit", "", _opt(_int)),
        search_cost=_field(d, "search_cost", "", _num, None),
        search_bound=_field(d, "search_bound", "", _num, None),
        measured_compute=_field(d, "measured_compute", "", _num, None),
        topology=_field(d, "topology", "", _str, ""),
        alternatives=_field(d, "alternatives", "", _list(alternative), ()),
        stages=_field(d, "stages", "", _list(stage), ()),
        micro_batches=_field(d, "micro_batches", "", _int, 1),
        scheduler=_field(d, "scheduler", "", _str, ""),
        pipeline_interleave=_field(d, "pipeline_interleave", "", _int, 1),
        recompute=_field(d, "recompute", "", _str, "as_written"),
        collectives=_field(d, "collectives", "", _list(collective), ()),
        memory_timeline=_field(d, "memory_timeline", "", _list(timeline), ()),
        pipeline_choices=_field(d, "pipeline_choices", "", _list(choice), ()),
        outputs=_field(d, "outputs", "", _list(_layout), ()),
    )


def check_fits(strategy, graph, mesh, names) -> None:
    """Raise LayoutError unless ``strategy``'s arguments are the traced function's (``names``:
    each argument leaf's name), on ``mesh``, and its conversions fit the values they convert."""
    if len(strategy.inputs) != len(graph.inputs) or len(strategy.ops) != len(graph.nodes):
        raise LayoutError(
            f"the strategy has {len(strategy.ops)} operators and {len(strategy.inputs)} "
            f"arguments; this function traces to {len(graph.nodes)} and {len(graph.inputs)}: "
            "it was saved for a different function or shapes."
        )
    for k, (inp, v, name) in enumerate(zip(strategy.inputs, graph.inputs, names)):
        label = f"strategy argument {k} ({inp.name})"
        if (inp.name, tuple(inp.shape), inp.dtype) != (name, tuple(v.shape), str(v.dtype)):
            raise LayoutError(
                f"{label}: {inp.name} {list(inp.shape)} {inp.dtype} in the strategy, but this "
                f"function's argument {k} is {name} {list(v.shape)} {v.dtype}: "
                "the strategy was saved for a different function or shapes."
            )
        for what, layout in (("layout", inp.layout), ("update layout", inp.update)):
            if layout is None:
                continue
            if layout.partial:
                raise LayoutError(
                    f"{label}: {what} {layout} is a partial sum; an argument is a whole value "
                    "on every device, never a pending sum (it would change the answer): drop "
                    "its sum{...}."
                )
            layout.check(v.shape, mesh, f"{label} {what}")
    stages = max(1, len(strategy.stages))
    for k, (op, node) in enumerate(zip(strategy.ops, graph.nodes)):
        if op.name != node.name:
            raise LayoutError(
                f"strategy entry ops[{k}] is named {op.name!r}, but this "
                f"function's operator {k} is {node.name}: the strategy was saved "
                "for a different function."
            )
        shapes = (tuple(tuple(x.shape) for x in node.inputs), tuple(v.shape for v in node.outputs))
        if (op.in_shapes, op.out_shapes) != shapes:
            raise LayoutError(
                f"strategy entry {op.name}: {op.prim} of {list(op.in_shapes)} -> "
                f"{list(op.out_shapes)}, but this function's operator {node.name} is "
                f"{node.prim} of {list(shapes[0])} -> {list(shapes[1])}: the strategy was "
                "saved for a different function or shapes."
            )
        if op.stage >= stages:
            raise LayoutError(
                f"strategy entry {op.name}: stage {op.stage}, but the strategy "
                f"has {stages} stage(s){FIX}"
            )
        for j, (layout, out) in enumerate(zip(op.converted, node.outputs)):
            if layout is not None:
                layout.check(out.shape, mesh, f"strategy entry {op.name} output {j} conversion")
        if len(op.converted) > len(node.outputs):
            raise LayoutError(
                f"strategy entry {op.name}: {len(op.converted)} conversions for "
                f"{len(node.outputs)} output(s){FIX}"
            )
