"""The cost model: compute time, communication time and memory of one operator candidate.

In: a graph ``Node``, one of its ``Candidate``s and the ``LogicalMesh`` (whose ``Topology``
holds every constant: per-device FLOP/s and memory bandwidth, per-level alpha/beta).
Out: seconds and bytes, per device:
- ``flops(node)`` (``strategies.flops``): floating-point operations of the whole operator;
- ``compute_time``: roofline on the local shapes. ``bytes_moved`` is the local inputs plus
  outputs, but for an operator XLA fuses with others (``strategies.fusion``: a chain of
  elementwise operators and reductions between matmuls and other boundaries is one kernel)
  only the operands its kernel reads from memory and the results it writes there. On this
  machine's CPU (no ``Topology.chip``): ``max(flops / S / F, bytes_moved / BW)`` (F: a
  matmul's rate for its size, ``Topology.matmul_rate``, for contractions and convolutions)
  where S is how many ways the candidate splits the work (output splits times split
  contractions). On an accelerator (``autopar.chip``): a contraction is its local GEMM
  (``Chip.matmul_seconds``: the dtype's peak, tile and wave quantization for its shape, the
  bytes it moves), everything else a memory-bound kernel (``Chip.stream_seconds``, its fixed
  launch cost charged once per fusion);
- ``output_bytes``: the local bytes of each output (what the value occupies on one device).
Operators that only relabel their operand (``FREE``: reshape, squeeze, ap.shard) cost nothing.
- ``memory_timeline(program)`` / ``program_memory(program)``: the bytes live on one rank at each
  instruction of a lowered ``Program``, as XLA fuses its segments, and the peak;
- ``call_overhead(program, host_bytes, host_arrays)``: what one call of the
  lowered step costs besides its operators and collectives: the topology's ``step_overhead``,
  ``host_beta`` per byte and ``arg_overhead`` per array of its arguments and results, less the
  per-call ``launch`` of the all-reduces the native runtime fuses into another's bucket (each
  collective was priced as a call of its own).
Communication time between candidates comes from the redistribution planner.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from jax import lax

from autopar.graph import Const
from autopar.program import Segment, reads, writes

from .flops import CONTRACTIONS, flops
from .fusion import touches
from .rules.elementwise import RULES as ELEMENTWISE
from .rules.primitives import primitives

if TYPE_CHECKING:
    from jax.extend.core import Primitive


def _size(shape) -> int:
    return int(math.prod(shape))


def split_factor(cand, mesh) -> int:
    """How many ways a candidate divides the operator's work: every assigned axis divides it."""
    return math.prod(mesh.axis_size(a) for _, axes in cand.assign for a in axes)


def local_bytes(layout, value, mesh) -> int:
    return _size(layout.local_shape(value.shape, mesh)) * np.dtype(value.dtype).itemsize


# operators that only relabel their operand (XLA emits no kernel for them)
FREE = primitives("autopar_shard", "reshape", "squeeze", "stop_gradient")


_TIMES: dict = {}  # (node signature, candidate, mesh, touch) -> seconds
_TIMES_MAX = 1 << 18  # entries (about 50 MB at most)


def fused(graph, mesh) -> dict:
    """node id -> ``fusion.Touch`` of the operators of ``graph`` XLA fuses on ``mesh``'s
    devices (``strategies.fusion``): what ``compute_time`` takes as ``touch``."""
    return touches(graph, mesh.topology.chip is not None)


def compute_time(node, cand, mesh, touch=None) -> float:
    """Seconds of ``node`` run as ``cand`` on ``mesh`` (module docstring); ``touch``: its
    ``fusion.Touch`` when XLA fuses it with others (``fused``; None: it reads and writes all
    its operands and results). Kept per operator signature, as a deep model asks the same few
    million times."""
    key = (node.signature, cand, mesh, touch)
    t = _TIMES.get(key)
    if t is None:
        if len(_TIMES) >= _TIMES_MAX:
            _TIMES.clear()
        t = _TIMES[key] = _compute_time(node, cand, mesh, touch)
    return t


def _compute_time(node, cand, mesh, touch) -> float:
    if node.primitive in FREE:
        return 0.0
    topo = mesh.topology
    ins = [
        0 if isinstance(x, Const) else local_bytes(l, x, mesh)
        for x, l in zip(node.inputs, cand.in_layouts)
    ]
    outs = [local_bytes(l, v, mesh) for v, l in zip(node.outputs, cand.out_layouts)]
    if touch is not None:
        ins = [b for b, r in zip(ins, touch.reads) if r]
        outs = [b for b, w in zip(outs, touch.writes) if w]
    moved = sum(ins) + sum(outs)
    work = flops(node) / split_factor(cand, mesh)
    chip = topo.chip
    if node.prim in CONTRACTIONS and chip is not None:
        m, n, k, batch = _gemm_shape(node, cand, mesh, work)
        return chip.matmul_seconds(m, n, k, batch, node.inputs[0].dtype, moved)
    if chip is None:  # this machine's CPU, at its calibrated rates
        rate, stream, launch = topo.flops, topo.mem_bandwidth, 0.0
        if node.prim in CONTRACTIONS:
            return max(work / topo.matmul_rate(work), moved / stream)
    else:
        rate, stream, launch = chip.vector_flops, chip.stream_rate, chip.launch
    if touch is None:
        return max(work / rate, moved / stream) + launch
    return _fused_seconds(moved, work, touch, rate, stream) + (launch if touch.launch else 0.0)


def _fused_seconds(moved, work, touch, rate, stream) -> float:
    """A fused member's share of its kernel, ``max(F / rate, B / stream)`` for the kernel's
    FLOPs F and bytes B: its own bytes at ``stream``, plus its FLOPs at ``rate`` times the
    share of the kernel's arithmetic that its memory traffic does not hide (the members'
    shares sum to the kernel's time wherever they are split alike)."""
    F, B = touch.group_flops, touch.group_bytes
    excess = max(0.0, F / rate - B / stream) / (F / rate) if F > 0 else 0.0
    return moved / stream + excess * work / rate


def _gemm_shape(node, cand, mesh, work) -> tuple:
    """(m, n, k, batch) of a contraction's local GEMM: a dot_general's free, contracted and
    batch sizes on its local operands; a convolution as its implicit GEMM (rows: output
    positions, columns: output features, depth: the rest of its multiply-adds)."""
    lhs, rhs = (l.local_shape(x.shape, mesh) for x, l in zip(node.inputs, cand.in_layouts))
    if node.prim == lax.dot_general_p.name:
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        k = math.prod(lhs[d] for d in lc)
        batch = math.prod(lhs[d] for d in lb)
        m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
        n = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
        return m, n, k, batch
    out = cand.out_layouts[0].local_shape(node.outputs[0].shape, mesh)
    _, _, out_spec = node.params["dimension_numbers"]
    n = out[out_spec[1]]
    m = _size(out) // max(n, 1)
    return m, n, max(1, round(work / (2 * max(m * n, 1)))), 1


def output_bytes(node, cand, mesh, touch=None) -> int:
    """Local bytes of ``node``'s outputs as ``cand``; with its fusion ``touch``, of those its
    kernel writes to memory only."""
    return sum(
        local_bytes(l, v, mesh)
        for j, (v, l) in enumerate(zip(node.outputs, cand.out_layouts))
        if touch is None or touch.writes[j]
    )


# ---------------------------------------------------------------- memory of a lowered Program

# XLA's fusion, as the memory model sees it: values made by these operators and read only by
# ABSORBS operators are fused into their readers and get no buffer of their own. Not the
# LOOPS: JAX lowers threefry2x32 to a loop on CPU (its rolled rounds), whose counters are its
# state, made in buffers and turned into the bits in place (a dropout mask on a rank: measured
# 48.5 MB, planned 30 with threefry fused, 60 with its bits in buffers of their own, 44 now)
LOOPS = primitives("threefry2x32")
FUSIBLE = primitives(*ELEMENTWISE, "broadcast_in_dim", "reshape", "squeeze", "transpose") - LOOPS
ABSORBS = FUSIBLE | primitives(
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "argmax",
    "argmin",
    "reduce_and",
    "reduce_or",
)
# on an accelerator (``Topology.chip``) random bits are elementwise too: their counters and
# rounds fuse into the operators reading the bits
ON_CHIP = primitives("threefry2x32", "iota", "iota_2x32_shape")
CHIP_FUSIBLE, CHIP_ABSORBS = FUSIBLE | ON_CHIP, ABSORBS | ON_CHIP


def program_memory(program, timeline) -> tuple:
    """``(peak bytes, instruction)`` on one rank: the largest entry of ``timeline`` (the
    program's ``memory_timeline``); the instruction is None when the peak is the arguments
    alone."""
    size = _register_bytes(program)
    peak, at = sum(size[r] for r in set(program.inputs)), None
    for ins, live in timeline:
        if live > peak:
            peak, at = live, ins
    return peak, at


def _register_bytes(program) -> dict:
    return {
        r: int(np.prod(shape)) * np.dtype(dt).itemsize for r, (shape, dt) in program.avals.items()
    }


def memory_timeline(program) -> list:
    """``[(instruction, bytes live while it runs)]`` on one rank as the runtimes run it, one
    entry per Compute, Collective or Slice: the arguments for the whole step, every other
    register from its instruction to its last reader, the results to the end. A segment runs
    as one XLA executable: its inputs stay live until it ends and its outputs exist from its
    start (XLA does not write over an argument it does not own). Inside it, as XLA fuses: a
    value made by an elementwise or layout operator and read only by such operators or
    reductions has no buffer; the other values made and dropped inside are counted compute
    by compute, an elementwise operator writing over a dying operand of its size, a loop
    (``LOOPS``) its results over its dying operands."""
    size = _register_bytes(program)
    chip = program.mesh.topology.chip is not None
    fusible, absorbs, loops = (
        (CHIP_FUSIBLE, CHIP_ABSORBS, frozenset()) if chip else (FUSIBLE, ABSORBS, LOOPS)
    )
    last = {}
    for k, ins in enumerate(program.instructions):
        for r in reads(ins):
            last[r] = k
    for r in list(program.inputs) + [o for o in program.outputs if isinstance(o, int)]:
        last[r] = len(program.instructions)
    cur = sum(size[r] for r in set(program.inputs))
    timeline = []
    for k, ins in enumerate(program.instructions):
        made = sum(size[r] for r in writes(ins))
        if isinstance(ins, Segment):
            outs = set(ins.outputs)
            inner_last: dict[int, int] = {}  # register -> the last compute reading it
            readers: dict[int, set[Primitive]] = {}  # register -> the primitives reading it
            for i, c in enumerate(ins.computes):
                for r in reads(c):
                    inner_last[r] = i
                    readers.setdefault(r, set()).add(c.node.primitive)
            buffer = {
                r
                for c in ins.computes
                for r in writes(c)
                if r not in outs
                and not (c.node.primitive in fusible and readers.get(r, set()) <= absorbs)
            }
            temps = 0  # buffers made and dropped inside the segment
            for i, c in enumerate(ins.computes):
                new = sum(size[r] for r in writes(c) if r in buffer)
                dying = {
                    r for r in reads(c) + writes(c) if r in buffer and inner_last.get(r, i) <= i
                }
                reused = (
                    new
                    if c.node.primitive in fusible
                    and any(size[r] == new for r in dying & set(reads(c)))
                    else 0
                )
                if c.node.primitive in loops:  # its results over its dying state
                    reused = min(new, sum(size[r] for r in dying & set(reads(c))))
                timeline.append((c, cur + made + temps + new - reused))
                temps += new - sum(size[r] for r in dying)
        else:
            timeline.append((ins, cur + made))
        cur += made - sum(
            size[r] for r in set(reads(ins)) | set(writes(ins)) if last.get(r, k) <= k
        )
    return timeline


# ---------------------------------------------------------------- per-call costs of a Program


def fused_all_reduces(program) -> list:
    """The all-reduces of ``program`` that ride in an earlier one's call: every bucket's but
    its first (``Program.buckets``, which the native runtimes fuse by)."""
    riding = {r for bucket in getattr(program, "buckets", ()) for r in bucket[1:]}
    return [ins for ins in program.collectives() if ins.out in riding] if riding else []


def call_overhead(program, host_bytes: int, host_arrays: int = 0) -> float:
    """Seconds one call of ``program`` costs besides its operators and collectives (see the
    module docstring); ``host_bytes``, ``host_arrays``: the bytes and the number of its
    arguments and results."""
    topo = program.mesh.topology
    saved = sum(
        max(program.mesh.level(a).launch for a in ins.axes) for ins in fused_all_reduces(program)
    )
    return (
        topo.step_overhead + topo.host_beta * host_bytes + topo.arg_overhead * host_arrays - saved
    )
