"""The PipelineProgram: a step cut into pipeline stages that run micro-batches.

In: built by ``redistribution.stage_split.split_stages`` from the step lowered on each stage's
micro-batch mesh. Out: frozen values both runtimes execute:
- ``PipelineProgram``: every device (``mesh``), one ``StageProgram`` per stage, the micro-batch
  count and the scheduler, and where each result is (stage, register, layout);
- ``StageProgram``: the stage's devices and mesh (stages may differ in size), its argument
  registers and layouts (on its micro-batch mesh), and three instruction lists over its mesh:
  ``forward`` and ``backward`` run once per micro-batch (registers are per micro-batch),
  ``post`` once per step after every micro-batch (the accumulated gradients, the update).
  Besides ``program``'s Segment, Collective and Slice they hold:
  - ``Transfer``: send a register to, or receive it from, another stage, tagged so both ends
    name the same message (with the micro-batch, so order across stages never matters); a
    ``block`` transfer joins rank i of two stages of the same mesh and layout, a ``whole``
    one carries a value whole (one micro-batch's block of it) from a stage that gathered it
    to every rank of a stage of another mesh, which slices its own block;
  - ``Accumulate``: after a micro-batch, add a register into a per-step sum (a gradient), or
    keep it to concatenate along ``dim`` in micro-batch order; ``post`` reads the result;
  - ``MicroSlice``: the micro-batch's block of a value the same for all of them (``slice``),
    or the value on the first micro-batch and zeros on the others (``zero``);
- ``schedule(kind, stages, micro, interleave)``: per stage, the order of its (phase,
  micro-batch) tasks (interleaved: Megatron-LM's ``device_schedule``); ``in_flight``: the
  activations a stage holds at once; ``pipeline_seconds``: the estimated step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .config import PipelineScheduler
from .graph import Const, type_str
from .mesh import LogicalMesh

if TYPE_CHECKING:
    from jax.tree_util import PyTreeDef


class TransferKind(enum.StrEnum):
    SEND = "send"
    RECV = "recv"


class Route(enum.StrEnum):
    BLOCK = "block"  # rank i of the sender to rank i of the receiver
    WHOLE = "whole"  # every receiving rank gets the whole value from sender rank
    # (its index mod the sender's size) and slices its block


class AccumulateKind(enum.StrEnum):
    SUM = "sum"  # a per-step sum (a gradient)
    CONCAT = "concat"  # the micro-batches' blocks, joined along ``dim`` in order


class MicroSliceKind(enum.StrEnum):
    SLICE = "slice"  # block m of ``dim``
    ZERO = "zero"  # the value on micro-batch 0, zeros on the others


def _check_kind(record, cls):
    """Turn ``record.kind`` (a member or its value) into a ``cls`` member, or raise naming it."""
    try:
        object.__setattr__(record, "kind", cls(record.kind))
    except ValueError:
        raise ValueError(
            f"{type(record).__name__}: unknown kind {record.kind!r}; the kinds are "
            f"{', '.join(k.value for k in cls)}"
        ) from None


@dataclass(frozen=True)
class Transfer:
    kind: TransferKind
    reg: int  # the register sent, or received into
    peer: int  # the other stage
    shape: tuple  # local shape
    dtype: np.dtype
    bytes: int
    micro: bool  # per micro-batch (True) or once per step
    axes: tuple = ()  # the stage axis (collective records name their axes)
    route: Route = Route.BLOCK
    tag: tuple[str, int, int | None] | None = None  # the message's name at both ends (None: the
    # register): ("whole", value id, its micro-batch dimension or None)

    def __post_init__(self):
        _check_kind(self, TransferKind)
        object.__setattr__(self, "route", Route(self.route))

    @property
    def key(self):
        return self.reg if self.tag is None else self.tag

    @property
    def src(self) -> int | None:
        """The register read (a send's), or None."""
        return self.reg if self.kind == TransferKind.SEND else None

    @property
    def out(self) -> int | None:
        """The register written (a receive's), or None."""
        return self.reg if self.kind == TransferKind.RECV else None

    def __str__(self) -> str:
        way = "to" if self.kind == TransferKind.SEND else "from"
        return (
            f"{self.kind} %r{self.reg} {way} stage {self.peer} "
            f"{type_str(self.shape, np.dtype(self.dtype))} {self.bytes} B"
            + (" per micro-batch" if self.micro else "")
        )


@dataclass(frozen=True)
class Accumulate:
    src: int
    out: int
    kind: AccumulateKind
    dim: int | None = None  # concat: the dimension micro-batches are stacked along

    def __post_init__(self):
        _check_kind(self, AccumulateKind)

    def __str__(self) -> str:
        d = "" if self.dim is None else f", dim={self.dim}"
        op = "+=" if self.kind == AccumulateKind.SUM else "append"
        return f"%r{self.out} {op} %r{self.src}{d}"


@dataclass(frozen=True)
class MicroSlice:
    src: int | Const  # register or graph.Const
    out: int
    kind: MicroSliceKind
    dim: int | None = None

    def __post_init__(self):
        _check_kind(self, MicroSliceKind)

    def __str__(self) -> str:
        src = f"%r{self.src}" if isinstance(self.src, int) else str(self.src)
        return f"%r{self.out} = micro_{self.kind}({src}, dim={self.dim})"


@dataclass(frozen=True, eq=False, kw_only=True)
class StageProgram:
    index: int
    forward: tuple
    backward: tuple
    post: tuple
    inputs: tuple  # graph input positions the stage reads
    micro_inputs: tuple  # of those, the ones split over micro-batches
    keep: tuple  # forward/backward registers read after the micro-batches
    accumulators: tuple  # registers Accumulate writes (reset every step)
    devices: tuple  # global ranks of the stage, in stage-mesh order
    mesh: LogicalMesh | None = None  # the stage's mesh
    micro_mesh: LogicalMesh | None = None  # (mb, *mesh axes): in_layouts are on it
    arg_regs: tuple = ()  # per argument leaf, its register in this stage's lowering
    in_layouts: tuple = ()  # per argument leaf, its layout on micro_mesh
    avals: dict[int, tuple[tuple[int, ...], np.dtype]] | None = None  # register -> (local
    # shape, dtype) of one micro-batch
    seconds: float = 0.0  # estimated time of one micro-batch (forward + backward)
    memory: int = 0  # estimated peak bytes per device
    buckets: tuple[tuple[int, ...], ...] = ()  # the all-reduces fused per call, phase by phase
    # (program.all_reduce_buckets over each phase's body)
    bucket_bytes: int = 0  # the size they were cut at (Program.bucket_bytes)

    def phases(self):
        return (("forward", self.forward), ("backward", self.backward), ("post", self.post))

    def __str__(self) -> str:
        out = [f"stage {self.index} on devices {list(self.devices)}:"]
        for name, body in self.phases():
            out.append(f"  {name}:")
            out += ["    " + line for ins in body for line in str(ins).splitlines()]
        return "\n".join(out)


@dataclass(frozen=True, eq=False)
class PipelineProgram:
    mesh: LogicalMesh  # every device (stage axis first when the stages are equal)
    stages: tuple  # StageProgram per stage
    micro_batches: int
    scheduler: PipelineScheduler
    outputs: tuple  # register (of its stage) or graph.Const per flattened result
    out_layouts: tuple  # per result, on its stage's mesh (never partial)
    out_stages: tuple  # per result, the stage holding it
    node_stages: tuple = ()  # the stage of every graph node
    in_tree: PyTreeDef | None = None
    out_tree: PyTreeDef | None = None
    interleave: int = 1  # stages per device group (stage j on group j mod groups)

    def collectives(self) -> list:
        """Every communication step of every stage, Transfers included."""
        from .program import Collective

        return [
            i
            for st in self.stages
            for _, body in st.phases()
            for i in body
            if isinstance(i, (Collective, Transfer))
        ]

    def __str__(self) -> str:
        return "\n".join(str(s) for s in self.stages)

    def __repr__(self) -> str:
        parts = f" ({self.interleave} per device group)" if self.interleave > 1 else ""
        return (
            f"PipelineProgram({self.mesh}, {len(self.stages)} stages{parts}, "
            f"{self.micro_batches} micro-batches, {PipelineScheduler(self.scheduler).value}, "
            f"{len(self.collectives())} communication steps)"
        )


def schedule(kind: PipelineScheduler, stages: int, micro: int, interleave: int = 1) -> tuple:
    """Per stage, its tasks in order: ("forward", m) and ("backward", m).

    gpipe: every forward, then every backward. 1f1b (PipeDream-flush): stage s runs
    ``min(stages - s - 1, micro)`` forwards, then alternates one forward and one backward, then
    the remaining backwards, so it holds at most ``stages - s`` micro-batches' activations.
    With ``interleave`` v > 1 the stages are virtual: stage j runs on the devices of group
    ``j mod (stages / v)``, and each stage's order is its part of its group's
    ``device_schedule``."""
    kind = PipelineScheduler(kind)  # a name that is no scheduler raises ValueError
    if interleave > 1:
        groups = stages // interleave
        per_stage: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
        for d in range(groups):
            for j, phase, m in device_schedule(groups, interleave, micro, d):
                per_stage[j].append((phase, m))
        return tuple(tuple(t) for t in per_stage)
    out: list[tuple[tuple[str, int], ...]] = []
    for s in range(stages):
        if kind == PipelineScheduler.GPIPE:
            tasks = [("forward", m) for m in range(micro)] + [("backward", m) for m in range(micro)]
        else:
            warm = min(stages - s - 1, micro)
            tasks = [("forward", m) for m in range(warm)]
            for m in range(micro - warm):
                tasks += [("forward", warm + m), ("backward", m)]
            tasks += [("backward", m) for m in range(micro - warm, micro)]
        out.append(tuple(tasks))
    return tuple(out)


def device_schedule(groups: int, interleave: int, micro: int, d: int) -> list:
    """Megatron-LM's interleaved 1F1B on device group ``d`` of ``groups``, each holding
    ``interleave`` (v) model parts (virtual stage ``c x groups + d`` is its part c), for
    ``micro`` micro-batches (a multiple of ``groups``): ``[(virtual stage, phase, m)]`` in
    order. Forward step k runs part ``(k // groups) mod v`` on micro-batch
    ``(k // (groups v)) groups + k mod groups``, backward step k part ``v - 1 -`` that; after
    ``min(2 (groups - d - 1) + (v - 1) groups, v micro)`` forwards of warm-up, one forward and
    one backward alternate, then the remaining backwards."""
    p, v, n = groups, interleave, micro * interleave

    def step(k, forward):
        part = (k // p) % v
        part = part if forward else v - 1 - part
        return part * p + d, (k // (p * v)) * p + k % p

    warm = min(2 * (p - d - 1) + (v - 1) * p, n)
    out = [(*step(k, True), "forward") for k in range(warm)]
    for k in range(n - warm):
        out += [(*step(warm + k, True), "forward"), (*step(k, False), "backward")]
    out += [(*step(k, False), "backward") for k in range(n - warm, n)]
    return [(j, phase, m) for j, m, phase in out]


def in_flight(
    kind: PipelineScheduler, stages: int, micro: int, stage: int, interleave: int = 1
) -> float:
    """The most micro-batches whose forward activations ``stage`` holds at once (with
    ``interleave``: of every part on its device, in parts, divided by v: stage activations)."""
    if interleave > 1:
        groups = stages // interleave
        held = peak = 0
        for _, phase, _ in device_schedule(groups, interleave, micro, stage % groups):
            held += 1 if phase == "forward" else -1
            peak = max(peak, held)
        return peak / interleave
    if PipelineScheduler(kind) == PipelineScheduler.GPIPE:
        return micro
    return min(stages - stage, micro)


def pipeline_seconds(seconds, micro: int, interleave: int = 1) -> float:
    """The estimated step of a pipeline whose stages take ``seconds`` per micro-batch (forward
    and backward): every stage once plus ``micro - 1`` times the slowest; interleaved (v parts
    per device group), ``micro`` times the busiest group's parts plus ``groups - 1`` times the
    slowest part (Megatron-LM's (m v + p - 1) parts' time, its bubble v times shorter)."""
    secs = list(seconds)
    if not secs:
        return 0.0
    if interleave == 1:
        return sum(secs) + (micro - 1) * max(secs)
    groups = len(secs) // interleave
    busiest = max(sum(secs[d::groups]) for d in range(groups))
    return micro * busiest + (groups - 1) * max(secs)
