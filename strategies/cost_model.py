"""The cost model: compute time, communication time and memory of one operator candidate.

In: a graph ``Node``, one of its ``Candidate``s and the ``LogicalMesh`` (whose ``Topology``
holds every constant: per-device FLOP/s and memory bandwidth, per-level alpha/beta).
Out: seconds and bytes, per device:
- ``flops(node)``: floating-point operations of the whole (unsharded) operator: a contraction
  is 2 x output elements x contracted size, a reduction one op per input element, everything
  else one op per output element;
- ``compute_time``: roofline on the local shapes, ``max(flops / S / F, bytes_moved / BW)`` (F:
  a matmul's rate for its size, ``Topology.matmul_rate``) where
  S is how many ways the candidate splits the work (output splits times split contractions) and
  ``bytes_moved`` the local inputs plus outputs; a ``transpose`` that moves the minor (last)
  dimension moves its bytes at ``Topology.copy_bandwidth(True)``, and a contraction adds the
  copies XLA makes of operands not in the order its dot kernel reads (``dot_copies``);
- ``output_bytes``: the local bytes of each output (what the value occupies on one device).
Operators that only relabel their operand (``FREE``: reshape, squeeze, ap.shard) and
transposes XLA folds into a dot (``Node.folded``) cost nothing.
- ``memory_timeline(program)`` / ``program_memory(program)``: the bytes live on one rank at each
  instruction of a lowered ``Program``, as XLA fuses its segments, and the peak;
- ``call_overhead(program, host_bytes, bucket_bytes)``: what one call of the lowered step costs
  besides its operators and collectives: the topology's ``step_overhead``, ``host_beta`` per
  byte of arguments and results, less the per-call ``launch`` of the all-reduces the native
  runtime fuses into another's bucket (each collective was priced as a call of its own).
Communication time between candidates comes from the redistribution planner.
"""
from __future__ import annotations

import math

import numpy as np
from jax import lax

from autopar.graph import Const, dot_reads_as_is
from autopar.program import Collective, Segment, StepKind, reads, writes

from .rules.elementwise import RULES as ELEMENTWISE
from .rules.primitives import primitives


def _size(shape) -> int:
    return int(math.prod(shape))


def flops(node) -> float:
    out = node.outputs[0]
    if node.prim == lax.dot_general_p.name:
        (lc, _), _ = node.params["dimension_numbers"]
        k = math.prod(node.inputs[0].shape[d] for d in lc)
        return 2.0 * _size(out.shape) * k
    if node.prim.startswith("reduce_") or node.prim in (lax.argmax_p.name, lax.argmin_p.name):
        return float(_size(node.inputs[0].shape))
    return float(sum(_size(v.shape) for v in node.outputs))


def split_factor(cand, mesh) -> int:
    """How many ways a candidate divides the operator's work: every assigned axis divides it."""
    return math.prod(mesh.axis_size(a) for _, axes in cand.assign for a in axes)


def local_bytes(layout, value, mesh) -> int:
    return _size(layout.local_shape(value.shape, mesh)) * np.dtype(value.dtype).itemsize


# operators that only relabel their operand (XLA emits no kernel for them)
FREE = primitives("autopar_shard", "reshape", "squeeze", "stop_gradient")


_TIMES: dict = {}           # (node signature, candidate, mesh) -> seconds
_TIMES_MAX = 1 << 18       # entries (about 50 MB at most)


def compute_time(node, cand, mesh) -> float:
    """Seconds of ``node`` run as ``cand`` on ``mesh`` (module docstring); kept per operator
    signature, as a deep model asks the same few million times."""
    key = (node.signature, cand, mesh)
    t = _TIMES.get(key)
    if t is None:
        if len(_TIMES) >= _TIMES_MAX:
            _TIMES.clear()
        t = _TIMES[key] = _compute_time(node, cand, mesh)
    return t


def _compute_time(node, cand, mesh) -> float:
    if node.primitive in FREE or node.folded:
        return 0.0
    topo = mesh.topology
    moved = sum(local_bytes(l, x, mesh) for x, l in zip(node.inputs, cand.in_layouts)
                if not isinstance(x, Const))
    moved += sum(local_bytes(l, v, mesh) for v, l in zip(node.outputs, cand.out_layouts))
    work = flops(node) / split_factor(cand, mesh)
    if node.prim == lax.transpose_p.name:
        shape = cand.in_layouts[0].local_shape(node.inputs[0].shape, mesh)
        return _copy_time(shape, node.params["permutation"], moved, topo)
    if node.prim != lax.dot_general_p.name:
        return max(work / topo.flops, moved / topo.mem_bandwidth)
    copies = 0.0
    for x, l, perm in zip(node.inputs, cand.in_layouts, dot_copies(node)):
        if perm is not None:
            copies += _copy_time(l.local_shape(x.shape, mesh), perm,
                                 2 * local_bytes(l, x, mesh), topo)
    return max(work / topo.matmul_rate(work), moved / topo.mem_bandwidth) + copies


def refolded_copy(node, producer, layout, mesh) -> float:
    """Seconds a folded transpose ``node`` costs when its operand, made by ``producer``, is
    converted into ``layout`` on the way (a collective between them): XLA can no longer fold it
    into the dot that made the operand, so it copies (0 for any other operator or producer).
    The Strategy's estimate adds it; the search does not see it (priced on the edge, it led
    the search to carry partial sums through such transposes into plans whose lowered memory
    exceeded what the search's model of it said)."""
    if not (node.folded and getattr(producer, "prim", None) == lax.dot_general_p.name):
        return 0.0
    x = node.inputs[0]
    return _copy_time(layout.local_shape(x.shape, mesh), node.params["permutation"],
                      2 * local_bytes(layout, x, mesh), mesh.topology)


def dot_copies(node) -> tuple:
    """Per operand of a ``dot_general``, the dimension order XLA's CPU compiler copies it into
    before the dot kernel reads it, or None when it reads it as it is. The kernel takes batch
    dimensions first and at most one contracting and one free dimension per operand, in either
    order (``graph.dot_reads_as_is``); any other operand is transposed to (batch, free, contracting) for the left one,
    (batch, contracting, free) for the right one, a copy unless it is in that order already.
    No copies when neither operand has a free dimension (XLA multiplies and reduces).
    (Checked against XLA's compiled HLO on random contractions: tests/test_cost_model.py.)"""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    ranks = [len(x.shape) for x in node.inputs]
    free = [[d for d in range(r) if d not in c and d not in b]
            for r, c, b in zip(ranks, (lc, rc), (lb, rb))]
    if not free[0] and not free[1]:
        return (None, None)
    out = []
    for side, (r, c, b, f) in enumerate(zip(ranks, (lc, rc), (lb, rb), free)):
        if dot_reads_as_is(r, b, c):
            out.append(None)
            continue
        want = list(b) + (f + list(c) if side == 0 else list(c) + f)
        out.append(None if want == list(range(r)) else tuple(want))
    return tuple(out)


def _copy_time(shape, perm, moved: int, topo) -> float:
    """Seconds to copy an array of local ``shape`` into the dimension order ``perm``, moving
    ``moved`` bytes: none when only dimensions of one element move (XLA relabels it), at
    ``copy_bandwidth(True)`` when its innermost dimension changes (a strided copy), else at
    the memory's bandwidth (whole rows move)."""
    big = [d for d in perm if shape[d] > 1]
    if big == sorted(big):
        return 0.0
    return moved / topo.copy_bandwidth(big[-1] != max(big))


def output_bytes(node, cand, mesh) -> int:
    return sum(local_bytes(l, v, mesh) for v, l in zip(node.outputs, cand.out_layouts))


# ---------------------------------------------------------------- memory of a lowered Program

# XLA's fusion, as the memory model sees it: values made by these operators and read only by
# ABSORBS operators are fused into their readers and get no buffer of their own
FUSIBLE = primitives(*ELEMENTWISE, "broadcast_in_dim", "reshape", "squeeze", "transpose")
ABSORBS = FUSIBLE | primitives("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                               "argmin", "reduce_and", "reduce_or")


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
    return {r: int(np.prod(shape)) * np.dtype(dt).itemsize
            for r, (shape, dt) in program.avals.items()}


def memory_timeline(program) -> list:
    """``[(instruction, bytes live while it runs)]`` on one rank as the runtimes run it, one
    entry per Compute, Collective or Slice: the arguments for the whole step, every other
    register from its instruction to its last reader, the results to the end. A segment runs
    as one XLA executable: its inputs stay live until it ends and its outputs exist from its
    start (XLA does not write over an argument it does not own). Inside it, as XLA fuses: a
    value made by an elementwise or layout operator and read only by such operators or
    reductions has no buffer; the other values made and dropped inside are counted compute
    by compute, an elementwise operator writing over a dying operand of its size."""
    size = _register_bytes(program)
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
            inner_last, readers = {}, {}
            for i, c in enumerate(ins.computes):
                for r in reads(c):
                    inner_last[r] = i
                    readers.setdefault(r, set()).add(c.node.primitive)
            buffer = {r for c in ins.computes for r in writes(c) if r not in outs and not (
                c.node.primitive in FUSIBLE and readers.get(r, set()) <= ABSORBS)}
            temps = 0                     # buffers made and dropped inside the segment
            for i, c in enumerate(ins.computes):
                new = sum(size[r] for r in writes(c) if r in buffer)
                dying = {r for r in reads(c) + writes(c)
                         if r in buffer and inner_last.get(r, i) <= i}
                reused = new if c.node.primitive in FUSIBLE and any(
                    size[r] == new for r in dying & set(reads(c))) else 0
                timeline.append((c, cur + made + temps + new - reused))
                temps += new - sum(size[r] for r in dying)
        else:
            timeline.append((ins, cur + made))
        cur += made - sum(size[r] for r in set(reads(ins)) | set(writes(ins))
                          if last.get(r, k) <= k)
    return timeline


# ---------------------------------------------------------------- per-call costs of a Program

def fused_all_reduces(program, bucket_bytes: int) -> list:
    """The all-reduces of ``program`` that ride in an earlier one's call: the native runtime
    (``CommScheduler``) fuses consecutive all-reduces over the same axes, dtype and op until
    the bucket holds ``bucket_bytes`` or an instruction reads one of them."""
    fused, bucket, key, size = [], set(), None, 0
    for ins in getattr(program, "instructions", ()):
        if isinstance(ins, Collective) and ins.kind == StepKind.ALL_REDUCE:
            k = (ins.axes, np.dtype(ins.dtype), ins.op)
            if bucket and k == key:
                fused.append(ins)
            else:
                bucket, size = set(), 0
            bucket.add(ins.out)
            key, size = k, size + ins.bytes
            if size >= bucket_bytes:
                bucket, size = set(), 0
        elif bucket and (isinstance(ins, Collective) or set(reads(ins)) & bucket):
            bucket, size = set(), 0
    return fused


def call_overhead(program, host_bytes: int, bucket_bytes: int) -> float:
    """Seconds one call of ``program`` costs besides its operators and collectives (see the
    module docstring); ``host_bytes``: the bytes of its arguments and results."""
    topo = program.mesh.topology
    saved = sum(max(program.mesh.level(a).launch for a in ins.axes)
                for ins in fused_all_reduces(program, bucket_bytes))
    return topo.step_overhead + topo.host_beta * host_bytes - saved
