"""A strategy summarised for reading: the costliest rows, grouped one way.

In: a ``Strategy``, ``top`` (how many rows) and ``by``: "operator" (each operator's compute
plus the redistribution feeding it), "module" (operators grouped by the function of their
source line: a model's modules and layers), "collective" (the program's communication steps
by kind and mesh axes, then the costliest single ones with what needed them) or "parameter"
(each parameter's layout and bytes per device). Out: text, a screen or so, headed by the
table's summary lines (mesh, estimate, memory, what priced it).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np

from autopar.errors import AutoparError, ConfigError
from autopar.mesh import LogicalMesh

from .strategy import Strategy, format_bytes, short_source

BY = ("operator", "module", "collective", "parameter")


def summary(strategy: Strategy, top: int = 10, by: str = "operator") -> str:
    if by not in BY:
        raise ConfigError(f"by={by!r}: summarise by one of {', '.join(BY)}.")
    head = strategy.table().split("\n\n")[0]
    return head + "\n\n" + "\n".join(_ROWS[by](strategy, max(int(top), 1)))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:10.1f}"


def _operators(s: Strategy, top: int) -> list:
    ops = sorted(s.ops, key=lambda o: -(o.compute_time + o.comm_time))
    total = sum(o.compute_time + o.comm_time for o in s.ops) or 1.0
    rows = [
        f"the {min(top, len(ops))} costliest of {len(ops)} operators "
        f"(compute + the redistribution feeding them):",
        f"{'operator':<24}{'compute us':>11}{'comm us':>11}{'share':>7}  source",
    ]
    rows += [
        f"{o.name:<24}{_us(o.compute_time)} {_us(o.comm_time)}"
        f"{(o.compute_time + o.comm_time) / total:>7.1%}  {short_source(o.source)}"
        for o in ops[:top]
    ]
    return rows


def _module(source: str) -> str:
    """The function a source line is in ("file.py:12:3 (Block.__call__)" -> Block.__call__),
    else its file."""
    m = re.search(r"\(([^()]*)\)\s*$", source or "")
    if m:
        return m.group(1)
    return (source or "(no source)").split(":")[0]


def _modules(s: Strategy, top: int) -> list:
    groups: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for o in s.ops:
        g = groups[_module(o.source)]
        g[0] += 1
        g[1] += o.compute_time
        g[2] += o.comm_time
    ranked = sorted(groups.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    rows = [
        f"the {min(top, len(ranked))} costliest of {len(ranked)} source functions:",
        f"{'function':<40}{'operators':>10}{'compute us':>11}{'comm us':>11}",
    ]
    rows += [f"{name[:39]:<40}{n:>10}{_us(c)} {_us(m)}" for name, (n, c, m) in ranked[:top]]
    return rows


def _collectives(s: Strategy, top: int) -> list:
    groups: defaultdict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for c in s.collectives:
        g = groups[(c.kind, ",".join(c.axes))]
        g[0] += c.count
        g[1] += c.bytes * c.count
        g[2] += c.seconds * c.count
    rows = [
        f"{len(s.collectives)} communication steps, by kind and mesh axes:",
        f"{'kind':<16}{'axes':<12}{'calls':>7}{'bytes':>12}{'seconds us':>12}",
    ]
    rows += [
        f"{k:<16}{a or '-':<12}{n:>7}{format_bytes(b):>12}{_us(t)} "
        for (k, a), (n, b, t) in sorted(groups.items(), key=lambda kv: -kv[1][2])
    ]
    single = sorted(s.collectives, key=lambda c: -c.seconds * c.count)[:top]
    rows += [
        "",
        f"the {len(single)} costliest:",
        f"{'kind':<16}{'axes':<12}{'bytes':>12}{'us':>10}  needed by",
    ]
    rows += [
        f"{c.kind:<16}{','.join(c.axes) or '-':<12}{format_bytes(c.bytes):>12}"
        f"{_us(c.seconds * c.count)}  {c.reason}"
        for c in single
    ]
    return rows


def _parameters(s: Strategy, top: int) -> list:
    mesh = LogicalMesh.create(s.mesh_shape, s.axis_names)
    params = [i for i in s.inputs if i.is_param]

    def local(i) -> int:
        try:
            shape = i.layout.local_shape(i.shape, mesh)
        except AutoparError:  # a layout on axes this mesh lacks (a stage's): whole size
            shape = i.shape
        return math.prod(shape) * np.dtype(i.dtype).itemsize

    size = {i.name: local(i) for i in params}
    ranked = sorted(params, key=lambda i: -size[i.name])
    total = sum(size.values())
    rows = [
        f"the {min(top, len(ranked))} largest of {len(ranked)} parameters "
        f"({format_bytes(total)} per device in all):",
        f"{'parameter':<32}{'shape':<18}{'layout':<14}{'per device':>12}",
    ]
    rows += [
        f"{i.name[:31]:<32}{str(list(i.shape)):<18}{str(i.layout):<14}"
        f"{format_bytes(size[i.name]):>12}"
        for i in ranked[:top]
    ]
    return rows


_ROWS = {
    "operator": _operators,
    "module": _modules,
    "collective": _collectives,
    "parameter": _parameters,
}
