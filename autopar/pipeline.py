"""The PipelineProgram: a step cut into pipeline stages that run micro-batches.

In: built by ``redistribution.pipeline.split`` from a step lowered on the micro-batch mesh.
Out: frozen values both runtimes execute:
- ``PipelineProgram``: the stage mesh (every stage has the same shape: the full mesh without its
  first axis), one ``StageProgram`` per stage, the micro-batch count and the scheduler, the
  argument registers and layouts, and where each result is;
- ``StageProgram``: three instruction lists over the stage mesh: ``forward`` and ``backward``
  run once per micro-batch (registers are per micro-batch), ``post`` once per step after every
  micro-batch (the accumulated gradients, the update). Besides ``program``'s Segment,
  Collective and Slice they hold:
  - ``Transfer``: send a register to, or receive it from, the same-position rank of another
    stage (tagged by register and micro-batch, so order across stages never matters);
  - ``Accumulate``: after a micro-batch, add a register into a per-step sum (a gradient), or
    keep it to concatenate along ``dim`` in micro-batch order; ``post`` reads the result;
  - ``MicroSlice``: the micro-batch's block of a value the same for all of them (``slice``),
    or the value on the first micro-batch and zeros on the others (``zero``);
- ``schedule(kind, stages, micro)``: per stage, the order of its (phase, micro-batch) tasks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .graph import type_str


@dataclass(frozen=True)
class Transfer:
    kind: str                     # "send" or "recv"
    reg: int                      # the register sent, or received into
    peer: int                     # the other stage
    shape: tuple                  # local shape
    dtype: Any
    bytes: int
    micro: bool                   # per micro-batch (True) or once per step
    axes: tuple = ()              # the stage axis (collective records name their axes)

    @property
    def src(self):
        return self.reg if self.kind == "send" else -1

    @property
    def out(self):
        return self.reg if self.kind == "recv" else -1

    def __str__(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return (f"{self.kind} %r{self.reg} {way} stage {self.peer} "
                f"{type_str(self.shape, np.dtype(self.dtype))} {self.bytes} B"
                + (" per micro-batch" if self.micro else ""))


@dataclass(frozen=True)
class Accumulate:
    src: int
    out: int
    kind: str                     # "sum" or "concat"
    dim: Optional[int] = None     # concat: the dimension micro-batches are stacked along

    def __str__(self) -> str:
        d = "" if self.dim is None else f", dim={self.dim}"
        return f"%r{self.out} {'+=' if self.kind == 'sum' else 'append'} %r{self.src}{d}"


@dataclass(frozen=True)
class MicroSlice:
    src: Any                      # register or graph.Const
    out: int
    kind: str                     # "slice" (block m of dim) or "zero" (zeros unless m == 0)
    dim: Optional[int] = None

    def __str__(self) -> str:
        src = f"%r{self.src}" if isinstance(self.src, int) else str(self.src)
        return f"%r{self.out} = micro_{self.kind}({src}, dim={self.dim})"


@dataclass(frozen=True, eq=False)
class StageProgram:
    index: int
    forward: tuple
    backward: tuple
    post: tuple
    inputs: tuple                 # graph input positions the stage reads
    micro_inputs: tuple           # of those, the ones split over micro-batches
    keep: tuple                   # forward/backward registers read after the micro-batches
    accumulators: tuple           # registers Accumulate writes (reset every step)
    devices: tuple                # global ranks of the stage, in stage-mesh order
    seconds: float = 0.0          # estimated time of one micro-batch (forward + backward)
    memory: int = 0               # estimated peak bytes per device

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
    mesh: Any                     # the full LogicalMesh (stage axis first)
    stage_mesh: Any               # one stage's LogicalMesh
    micro_mesh: Any               # (mb, *stage axes): in_layouts are on it
    stages: tuple                 # StageProgram per stage
    micro_batches: int
    scheduler: str
    inputs: tuple                 # registers of the flattened arguments
    in_layouts: tuple             # per argument leaf, on micro_mesh
    outputs: tuple                # register or graph.Const per flattened result
    out_layouts: tuple            # per result, on stage_mesh (never partial)
    out_stages: tuple             # per result, the stage holding it
    avals: dict                   # register -> (local shape, dtype) of one micro-batch
    node_stages: tuple = ()       # the stage of every graph node
    in_tree: Any = None
    out_tree: Any = None

    def collectives(self) -> list:
        """Every communication step of every stage, Transfers included."""
        from .program import Collective
        return [i for st in self.stages for _, body in st.phases() for i in body
                if isinstance(i, (Collective, Transfer))]

    def __str__(self) -> str:
        return "\n".join(str(s) for s in self.stages)


def schedule(kind: str, stages: int, micro: int) -> tuple:
    """Per stage, its tasks in order: ("forward", m) and ("backward", m).

    gpipe: every forward, then every backward. 1f1b (PipeDream-flush): stage s runs
    ``min(stages - s - 1, micro)`` forwards, then alternates one forward and one backward, then
    the remaining backwards, so it holds at most ``stages - s`` micro-batches' activations."""
    out = []
    for s in range(stages):
        if kind == "gpipe":
            tasks = [("forward", m) for m in range(micro)] + [("backward", m) for m in range(micro)]
        else:
            warm = min(stages - s - 1, micro)
            tasks = [("forward", m) for m in range(warm)]
            for m in range(micro - warm):
                tasks += [("forward", warm + m), ("backward", m)]
            tasks += [("backward", m) for m in range(micro - warm, micro)]
        out.append(tuple(tasks))
    return tuple(out)


def in_flight(kind: str, stages: int, micro: int, stage: int) -> int:
    """The most micro-batches whose forward activations ``stage`` holds at once."""
    return micro if kind == "gpipe" else min(stages - stage, micro)
