"""The Program: per-rank SPMD instructions, the contract between planning and the runtimes.

In: built by ``autopar.redistribution.lower`` from a Graph and a Strategy. Out: a frozen
``Program`` holding, in execution order,
- ``Segment``: a maximal run of ``Compute`` steps (one primitive each, applied to local
  operands with local shape params) with no communication inside; a runtime compiles it once
  (``segment.jaxpr()`` is its jaxpr with local shapes) and calls it (``segment(*inputs)``);
- ``Collective``: an explicit collective over named mesh axes (kind, axes, local shape, dtype,
  per-device payload bytes, chosen algorithm); ``dim``/``dst_dim`` say which tensor dimensions it
  gathers, scatters or exchanges;
- ``Slice``: a local slice of a replicated dimension along a mesh axis (no communication).
Operands are integer register ids or ``graph.Const``. Every runtime executes exactly this.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .graph import Const, Node, type_str

if TYPE_CHECKING:
    from jax.tree_util import PyTreeDef

    from .mesh import LogicalMesh


class StepKind(enum.StrEnum):
    """What one redistribution step (a planner ``Step``, a ``Collective`` or a ``Slice``) does
    over its mesh axes. Each runtime dispatches on it through one table that names every kind
    (checked when the runtime is imported); a kind outside the enum fails where it is built."""

    SLICE = "slice"  # keep this rank's block of ``dim`` (local)
    PARTIAL_ZERO = "partial_zero"  # make a replicated value a partial sum (local)
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"

    @classmethod
    def of(cls, kind, where) -> StepKind:
        """``kind`` as a StepKind; an unknown one raises a ValueError naming ``where``."""
        try:
            return cls(kind)
        except ValueError:
            raise ValueError(
                f"{where}: unknown step kind {kind!r}; the kinds are "
                f"{', '.join(k.value for k in cls)}"
            ) from None


COLLECTIVE_KINDS = (
    StepKind.ALL_REDUCE,
    StepKind.ALL_GATHER,
    StepKind.REDUCE_SCATTER,
    StepKind.ALL_TO_ALL,
)
LOCAL_KINDS = (StepKind.SLICE, StepKind.PARTIAL_ZERO)

# the C++ collectives reduce 32- and 64-bit numbers: narrower integers and booleans are reduced
# widened and narrowed back (wrapping sums and products agree modulo 2**bits; max / min keep
# their order)
WIDENED: dict[np.dtype, np.dtype] = {
    np.dtype(np.bool_): np.dtype(np.int32),
    np.dtype(np.int8): np.dtype(np.int32),
    np.dtype(np.int16): np.dtype(np.int32),
    np.dtype(np.uint8): np.dtype(np.int32),
    np.dtype(np.uint16): np.dtype(np.int32),
    np.dtype(np.uint32): np.dtype(np.int64),
}
REDUCING = (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER)


def bucket_key(ins, mesh):
    """The all-reduce bucket rule, one for both runtimes and the cost model: all-reduce
    ``ins`` on ``mesh`` shares a bucket with the all-reduces before it of the same key (its
    axes of size > 1, the dtype it is reduced in, its operator); None where no axis has size
    > 1 (nothing is exchanged: no collective runs, nor joins a bucket)."""
    axes = tuple(a for a in ins.axes if mesh.axis_size(a) > 1)
    if not axes:
        return None
    dtype = np.dtype(ins.dtype)
    return axes, WIDENED.get(dtype, dtype), ins.op


def reduced_bytes(ins) -> int:
    """The bytes all-reduce ``ins`` puts in its bucket (in the dtype it is reduced in)."""
    dtype = np.dtype(ins.dtype)
    return ins.bytes // dtype.itemsize * WIDENED.get(dtype, dtype).itemsize


def all_reduce_buckets(instructions, mesh, bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The all-reduce buckets of ``instructions``, decided once when a program is lowered
    (``Program.buckets``; a pipeline stage's ``StageProgram.buckets``): per bucket, in program
    order, the result registers of its all-reduces. Consecutive all-reduces of one
    ``bucket_key`` share a bucket until it holds ``bucket_bytes`` (``reduced_bytes``) or an
    instruction reads one of them, or another collective or a slice runs (every rank issues
    its steps in program order); ``bucket_bytes`` 0 puts each all-reduce in one of its own.
    All-reduces with no axis of size > 1 exchange nothing and are in none. Both native
    runtimes issue each bucket as one call (``Program.bucket_bytes`` says when one is full,
    to be issued at once), and the cost model prices one call per bucket."""
    buckets: list[list[int]] = []
    key, size, held = None, 0, set[int]()
    for ins in instructions:
        if isinstance(ins, Collective) and ins.kind == StepKind.ALL_REDUCE:
            k = bucket_key(ins, mesh)
            if k is None or ins.out is None:  # (lowered all-reduces always write one)
                continue
            if not (buckets and held and k == key):
                buckets.append([])
                size, held = 0, set()
            buckets[-1].append(ins.out)
            held.add(ins.out)
            key, size = k, size + reduced_bytes(ins)
            if size >= bucket_bytes:
                held = set()
        elif held and (isinstance(ins, (Collective, Slice)) or set(reads(ins)) & held):
            held = set()
    return tuple(tuple(b) for b in buckets)


def bucket_index(buckets) -> dict[int, tuple[int, ...]]:
    """Register of each bucketed all-reduce -> its bucket (how the runtimes look one up)."""
    return {r: b for b in buckets for r in b}


def checked_table(table: dict, kinds, where: str) -> dict:
    """A runtime's dispatch table, checked to name exactly ``kinds`` (at import time)."""
    if set(table) != set(kinds):
        raise TypeError(
            f"{where}: the step table names {sorted(table)}, not the kinds "
            f"{sorted(k.value for k in kinds)}"
        )
    return table


@dataclass(frozen=True)
class Collective:
    kind: StepKind  # one of COLLECTIVE_KINDS
    axes: tuple[str, ...]
    shape: tuple[int, ...]  # local shape of the operand
    dtype: np.dtype
    bytes: int  # per-device payload: the larger of the local input and output
    algorithm: str = "ring"
    dim: int | None = None  # all_gather: gathered dim; reduce_scatter: scattered dim;
    dst_dim: int | None = None  # all_to_all: dim = concatenated (gathered) dim, dst_dim = split dim
    src: int | None = None  # register read
    out: int | None = None  # register written
    reason: str = ""  # what needed it, e.g. "dot_general.12 input 0"
    op: str = "sum"  # all_reduce: "sum", "max" or "min"
    prices: tuple = ()  # all_reduce: ((algorithm, seconds at 0 bytes, seconds per
    # byte), ...) over ``axes`` from the cost table, so a runtime
    # picks a fused bucket's algorithm without planning
    node_id: int | None = None  # id of the graph node whose input it prepares (None: a
    # result, or a stage transfer)

    def __post_init__(self):
        kind = self.kind if type(self.kind) is StepKind else StepKind.of(self.kind, "Collective")
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"Collective: {kind.value} is a local step; use Slice")
        object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        d = (
            ""
            if self.dim is None
            else f" dim={self.dim}" + ("" if self.dst_dim is None else f"->{self.dst_dim}")
        )
        d += "" if self.op == "sum" else f" op={self.op}"
        return (
            f"{self.kind}({','.join(self.axes)}){d} {type_str(self.shape, np.dtype(self.dtype))} "
            f"{self.bytes} B [{self.algorithm}]" + (f"  ; {self.reason}" if self.reason else "")
        )


@dataclass(frozen=True)
class Slice:
    """A local step, no communication: ``slice`` keeps this rank's block of dimension ``dim``
    along ``axes``; ``partial_zero`` turns a replicated value into a partial sum over ``axes``
    (the value on the first rank of the axis, zeros elsewhere)."""

    axes: tuple[str, ...]
    dim: int | None
    shape: tuple[int, ...]  # local shape before the step
    src: int | Const | None = None  # register id or graph.Const
    out: int | None = None  # register written
    kind: StepKind = StepKind.SLICE  # one of LOCAL_KINDS
    dst_dim: int | None = None
    node_id: int | None = None  # as Collective.node_id

    def __post_init__(self):
        kind = self.kind if type(self.kind) is StepKind else StepKind.of(self.kind, "Slice")
        if kind not in LOCAL_KINDS:
            raise ValueError(f"Slice: {kind.value} communicates; use Collective")
        object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        src = f"%r{self.src}" if isinstance(self.src, int) else str(self.src)
        return f"%r{self.out} = {self.kind}({src}, dim={self.dim}, axes={','.join(self.axes)})"


@dataclass(frozen=True, eq=False)
class Compute:
    node: Node  # the graph Node (its primitive and global shapes)
    params: dict  # primitive params for local shapes
    inputs: tuple  # register ids or graph.Const
    outputs: tuple[int, ...]
    out_shapes: tuple  # local output shapes

    def __str__(self) -> str:
        ins = ", ".join(f"%r{i}" if isinstance(i, int) else str(i) for i in self.inputs)
        outs = ", ".join(f"%r{o}" for o in self.outputs)
        return f"{outs} = {self.node.prim}({ins})  ; {self.node.name} local {self.out_shapes}"


def _const(c):
    return np.asarray(c.value, dtype=c.dtype)


@dataclass(frozen=True, eq=False)
class Segment:
    computes: tuple  # Compute steps in order
    inputs: tuple[int, ...]  # registers read from before the segment
    outputs: tuple[int, ...]  # registers written here and read later (or results)
    in_avals: tuple  # (local shape, dtype) per input register

    def __call__(self, *xs):
        regs = dict(zip(self.inputs, xs))
        for c in self.computes:
            args = [regs[i] if isinstance(i, int) else _const(i) for i in c.inputs]
            out = c.node.primitive.bind(*args, **c.params)
            regs.update(zip(c.outputs, out if c.node.primitive.multiple_results else [out]))
        return tuple(regs[o] for o in self.outputs)

    def jaxpr(self):
        """The segment as a ClosedJaxpr on local shapes."""
        import jax

        return jax.make_jaxpr(self)(*[jax.ShapeDtypeStruct(s, d) for s, d in self.in_avals])

    def __str__(self) -> str:
        head = (
            f"segment({', '.join(f'%r{i}' for i in self.inputs)}) -> "
            f"{', '.join(f'%r{o}' for o in self.outputs)} {{"
        )
        return "\n".join([head] + [f"  {c}" for c in self.computes] + ["}"])


def reads(ins) -> list:
    """The registers an instruction reads (constants and "no register", None, left out)."""
    rs = ins.inputs if isinstance(ins, (Compute, Segment)) else [ins.src]
    return [r for r in rs if isinstance(r, int)]


def writes(ins) -> list:
    """The registers an instruction writes."""
    if isinstance(ins, (Compute, Segment)):
        return list(ins.outputs)
    return [ins.out] if isinstance(ins.out, int) else []


def defer_all_reduce_readers(instructions) -> list:
    """The same instructions in a valid order where everything that depends (transitively) on
    an all-reduce result runs after everything that does not: the gradient all-reduces of a
    backward pass then stand next to each other (the native runtime fuses them into buckets)
    with the rest of the backward compute between their issue and their first use. What is
    read only by deferred instructions is deferred with them, in its place among them: a value
    made from no all-reduce but read only after one (a layer's mask, made again for its
    backward) is made where the step made it, not hoisted to the start to live through it."""
    tainted: set[int] = set()
    late: list[bool] = []
    readers: dict[int, list[int]] = {}
    for k, ins in enumerate(instructions):
        rs = reads(ins)
        t = any(r in tainted for r in rs)
        late.append(t)
        if t or isinstance(ins, Collective) and ins.kind == StepKind.ALL_REDUCE:
            tainted.update(writes(ins))
        for r in rs:
            readers.setdefault(r, []).append(k)
    for k in reversed(range(len(instructions))):
        ins = instructions[k]
        if late[k] or isinstance(ins, Collective) and ins.kind == StepKind.ALL_REDUCE:
            continue
        read_by = [j for r in writes(ins) for j in readers.get(r, ())]
        late[k] = bool(read_by) and all(late[j] for j in read_by)
    return [ins for ins, d in zip(instructions, late) if not d] + [
        ins for ins, d in zip(instructions, late) if d
    ]


def segment(instructions, avals, final_reads) -> tuple:
    """Group runs of Compute into Segments. ``avals``: register -> (local shape, dtype);
    ``final_reads``: registers read after the last instruction (the results)."""
    last = {r: len(instructions) for r in final_reads}  # register -> index of its last reader
    for i, ins in enumerate(instructions):
        for r in reads(ins):
            last[r] = max(last.get(r, -1), i)
    out, run = [], []
    for i, ins in enumerate(list(instructions) + [None]):
        if isinstance(ins, Compute):
            run.append(ins)
            continue
        if run:
            made = {o for c in run for o in c.outputs}
            ins_regs = tuple(dict.fromkeys(r for c in run for r in reads(c) if r not in made))
            outs = tuple(o for c in run for o in c.outputs if last.get(o, -1) >= i)
            out.append(Segment(tuple(run), ins_regs, outs, tuple(avals[r] for r in ins_regs)))
            run = []
        if ins is not None:
            out.append(ins)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class Program:
    mesh: LogicalMesh
    inputs: tuple[int, ...]  # registers of the flattened arguments (sharded by in_layouts)
    in_layouts: tuple  # Layout per argument leaf
    outputs: tuple  # register id or graph.Const per flattened result
    out_layouts: tuple  # Layout per result leaf (never partial)
    instructions: tuple
    in_tree: PyTreeDef | None = None
    out_tree: PyTreeDef | None = None
    avals: dict[int, tuple[tuple[int, ...], np.dtype]] | None = None  # register -> (local
    # shape, dtype)
    buckets: tuple[tuple[int, ...], ...] = ()  # the all-reduces fused per call (all_reduce_buckets)
    bucket_bytes: int = 0  # the size they were cut at: a full bucket is issued at once, any
    # other when one of its results is read or another collective runs

    def collectives(self) -> list[Collective]:
        return [i for i in self.instructions if isinstance(i, Collective)]

    def segments(self) -> list[Segment]:
        return [i for i in self.instructions if isinstance(i, Segment)]

    def ranks_alike(self) -> bool:
        """True when every rank runs the same computation on the same values: only segments
        (no collective, no local slice), every argument and every result replicated. Any one
        rank's results are then the step's results."""
        return all(isinstance(i, Segment) for i in self.instructions) and all(
            l.is_replicated() for l in self.in_layouts + self.out_layouts
        )

    def __str__(self) -> str:
        return "\n".join(str(i) for i in self.instructions)

    def __repr__(self) -> str:
        return (
            f"Program({self.mesh}, {len(self.inputs)} arguments, {len(self.outputs)} "
            f"results, {len(self.segments())} segments, {len(self.collectives())} "
            "collectives)"
        )
