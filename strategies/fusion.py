"""XLA's fusion as the cost model sees it: which operators share one kernel, and so which of
their operands and results touch device memory.

In: a Graph, and whether the devices are accelerators (``chip``: random bits fuse there; on
XLA's CPU backend ``threefry2x32`` is a loop of its own). Out: ``touches(graph, chip)``:
node id -> ``Touch`` for every operator XLA fuses with others (the rest, matmuls,
convolutions, gathers, scatters, sorts, loops, touch all their operands and results and
open a kernel each: no entry).

The rule. Memory-bound operators (elementwise arithmetic, comparisons, selects, conversions,
broadcasts, reshapes, transposes, slices, concatenations, pads, iotas and reductions) between
fusion boundaries (every other operator, and the graph's arguments and results) form fusion
groups; a group is one kernel: it reads each value it takes from outside once and writes
each value read outside it (or returned) once; what its members pass each other stays in
registers. Groups are the connected components of fusible operators joined through the
values they pass, where each operator sits at its *depth*: the most boundaries on any path
to it from the arguments; an edge joins a group only between operators of equal depth, so a
group never reads, through a boundary, a value it makes (it could not run as one kernel): the
residual stream's add after a block's output projection starts a new group rather than
joining the one that made its input. A group of layout operators alone (reshape, squeeze,
broadcast, transpose, ap.shard) is no kernel: XLA's layout assignment folds it into its
neighbours. This is XLA's loop and input fusion with its multi-output fusion and its fused
normalisations (a softmax or layer norm as one pass, as Megatron-LM's fused kernels run them);
a reduction's reader that reads the reduced operand again (``x - mean(x)``) is counted in the
same pass. A group computed from the arguments alone (depth 0) whose every reader is another
group's member is fused into those readers, as XLA duplicates cheap producers into their
consumers: a broadcast parameter (a layer norm's scale), an iota-made causal mask, random bits;
it writes nothing, its readers read its inputs instead of its values, and it opens no kernel.

Per member: ``reads[i]``: operand i is taken from outside the group and this is the first
member (in program order) to take it; ``writes[j]``: result j is read outside the group or
returned; ``launch``: the group's first member (the kernel's fixed cost is charged once).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from autopar.graph import Value

from .flops import flops
from .rules.elementwise import RULES as ELEMENTWISE

LAYOUT = frozenset(
    {
        "autopar_shard",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "stop_gradient",
    }
)
REDUCTIONS = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
    }
)
FUSIBLE = (
    frozenset(ELEMENTWISE)
    | LAYOUT
    | REDUCTIONS
    | frozenset(
        {
            "slice",
            "concatenate",
            "pad",
            "rev",
            "iota",
            "iota_2x32_shape",
            "random_bits",
            "random_wrap",
            "random_unwrap",
            "random_fold_in",
            "random_split",
            "random_seed",
            "dynamic_slice",
            "convert_element_type",
            "select_n",
            "clamp",
            "copy",
            "copy_p",
            "reduce_precision",
            "integer_pow",
            "square",
        }
    )
)
# JAX's random bits (threefry2x32 on iota_2x32_shape counters) are elementwise on an
# accelerator; on XLA's CPU backend threefry2x32 is a loop of its own
LOOPS_ON_CPU = frozenset({"threefry2x32"})


@dataclass(frozen=True)
class Touch:
    """What one fused operator moves through device memory (module docstring), and its kernel's
    whole FLOPs and bytes (``group_flops``, ``group_bytes``: on the unsplit shapes, the groups
    fused into it included), by which its arithmetic hides behind its memory traffic."""

    reads: tuple[bool, ...]
    writes: tuple[bool, ...]
    launch: bool
    group_flops: float = 0.0
    group_bytes: float = 0.0

    def __str__(self) -> str:
        bits = lambda xs: "".join("1" if x else "0" for x in xs)
        return f"r{bits(self.reads)}w{bits(self.writes)}{'+' if self.launch else ''}"


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def touches(graph, chip: bool) -> dict:
    """node id -> Touch for the fused operators of ``graph`` (module docstring); computed once
    per graph and backend kind."""
    per = _CACHE.setdefault(graph, {})
    if chip not in per:
        per[chip] = _touches(graph, chip)
    return per[chip]


def fusible(prim: str, chip: bool) -> bool:
    return prim in FUSIBLE and (chip or prim not in LOOPS_ON_CPU)


def groups(graph, chip: bool) -> tuple[dict, dict]:
    """``(group, depth)``: node id -> its group's representative node id, for the fusible
    operators, and node id -> depth (module docstring), for every operator."""
    depth: dict[int, int] = {}
    parent: dict[int, int] = {}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # value id -> (depth of its readers' side, producing node id or None)
    made_at: dict[int, tuple[int, int | None]] = {}
    for n in graph.nodes:
        ins = [x for x in n.inputs if isinstance(x, Value)]
        d = max((made_at[x.id][0] for x in ins if x.id in made_at), default=0)
        fuse = fusible(n.prim, chip)
        depth[n.id] = d
        if fuse:
            parent[n.id] = n.id
            for x in ins:
                src = made_at.get(x.id)
                if src is not None and src[1] is not None and src[0] == d:
                    a, b = find(src[1]), find(n.id)
                    if a != b:
                        parent[b] = a
        for v in n.outputs:  # a boundary's readers are one deeper; a member's, as deep
            made_at[v.id] = (d, n.id) if fuse else (d + 1, None)
    return {i: find(i) for i in parent}, depth


def _touches(graph, chip: bool) -> dict:
    group, depth = groups(graph, chip)
    results = {o.id for o in graph.outputs if isinstance(o, Value)}
    members: dict = {}
    for n in graph.nodes:
        if n.id in group:
            members.setdefault(group[n.id], []).append(n)
    readers = lambda nodes: [
        u for n in nodes for v in n.outputs for u, _ in graph.users.get(v.id, ())
    ]
    # groups computed from the arguments alone (depth 0: no boundary before them) whose every
    # reader is another group's member: XLA fuses them into those readers (a broadcast
    # parameter, an iota mask, random bits), so their values are never in memory
    folded = {
        g
        for g, nodes in members.items()
        if depth[g] == 0
        and not any(v.id in results for n in nodes for v in n.outputs)
        and all(u.id in group for u in readers(nodes))
    }
    totals = _totals(graph, group, members, folded, results)
    out = {}
    for g, nodes in members.items():
        inside = {v.id for n in nodes for v in n.outputs}
        layout = all(n.prim in LAYOUT for n in nodes)
        if layout and g not in folded:  # no kernel: folded into its readers' layouts
            for n in nodes:
                out[n.id] = Touch((False,) * len(n.inputs), (False,) * len(n.outputs), False)
            continue
        taken = set()
        for k, n in enumerate(nodes):
            reads = []
            for x in n.inputs:
                first = (
                    isinstance(x, Value)
                    and x.id not in taken
                    and x.id not in inside
                    and not _folded_value(graph, group, folded, x)
                )
                if isinstance(x, Value):
                    taken.add(x.id)
                reads.append(first)
            writes = tuple(
                g not in folded
                and (
                    v.id in results
                    or any(group.get(u.id) != g for u, _ in graph.users.get(v.id, ()))
                )
                for v in n.outputs
            )
            out[n.id] = Touch(tuple(reads), writes, k == 0 and g not in folded, *totals[g])
    return out


def _folded_value(graph, group, folded, x) -> bool:
    made = graph.producer.get(x.id) if isinstance(x, Value) else None
    return made is not None and group.get(made.id) in folded


def _totals(graph, group, members, folded, results) -> dict:
    """group -> (FLOPs, bytes) of its kernel on the unsplit shapes: its members' FLOPs and
    those of the folded groups it reads (recomputed inside it), the bytes it reads and writes;
    a folded group takes the totals of the first kernel reading it."""
    own = {}
    for g, nodes in members.items():
        inside = {v.id for n in nodes for v in n.outputs}
        read = {
            x.id: x.nbytes
            for n in nodes
            for x in n.inputs
            if isinstance(x, Value)
            and x.id not in inside
            and not _folded_value(graph, group, folded, x)
        }
        wrote = sum(
            v.nbytes
            for n in nodes
            for v in n.outputs
            if v.id in results or any(group.get(u.id) != g for u, _ in graph.users.get(v.id, ()))
        )
        own[g] = (sum(flops(n) for n in nodes), float(sum(read.values()) + wrote))
    total = {}
    for g, nodes in members.items():
        if g in folded:
            continue
        f, b = own[g]
        seen, todo = set(), [x for n in nodes for x in n.inputs]
        while todo:  # the folded groups it recomputes
            x = todo.pop()
            if not _folded_value(graph, group, folded, x):
                continue
            src = group[graph.producer[x.id].id]
            if src not in seen:
                seen.add(src)
                f += own[src][0]
                todo += [y for n in members[src] for y in n.inputs]
        total[g] = (f, b)
        for src in seen:
            total.setdefault(src, (f, b))
    for g in members:  # a folded group read by no kernel (only by layouts)
        total.setdefault(g, own[g])
    return total
