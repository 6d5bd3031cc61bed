"""Cut a step lowered on the micro-batch mesh into pipeline stages and phases.

In: a Graph, its ``Stages`` (strategies.stages), a ``MicroPlan`` (strategies.microbatch), the
full mesh (stage axis first) and one stage's mesh, the scheduler, the result layouts and a Planner on the micro-batch
mesh. Out: a ``PipelineProgram`` (autopar.pipeline).

1. Lower the graph on the micro-batch mesh (``lower_steps``): local shapes are one micro-batch's.
2. Steps over the micro-batch axis ``MB`` become pipeline steps: an all-reduce over ``MB`` is an
   ``Accumulate`` (sum over micro-batches; the rest of its axes reduce after them), an
   all-gather a concatenation, a slice over ``MB`` a ``MicroSlice``. Anything else over ``MB``
   has no pipeline meaning and raises ``PipelineError``.
3. Each step gets a phase: ``forward``, ``backward`` (a derivative's scope, or reading one) or
   ``post`` (reading an accumulated value), the latest of what it reads. A value read in ``post``
   must be the same for every micro-batch; a step reading only arguments that are the same for
   every micro-batch (a parameter's slice or transpose) is placed, as a copy, in each stage and
   earliest phase that reads it. Every other operator runs in its node's stage; a redistribution
   in the stage of the value it starts from.
4. A register read in another stage is sent there: per micro-batch from a forward or backward
   step, once per step in ``post``.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from autopar.errors import PipelineError
from autopar.graph import Const
from autopar.pipeline import Accumulate, MicroSlice, PipelineProgram, StageProgram, Transfer
from autopar.program import (Collective, Compute, Slice, defer_all_reduce_readers, reads,
                             segment, writes)
from autopar.strategies.microbatch import MB

from .lower import lower_steps
from .planner import Plan, Planner, Step


class MicroPlanner(Planner):
    """The Planner of the micro-batch mesh: a partial sum over micro-batches is first summed
    over them (all-reduce over ``MB``: the gradient accumulation), never reduce-scattered over
    them; the rest of the path is the usual cheapest one."""

    FORBIDDEN = 1e6     # seconds charged for moving a micro-batch split to another dimension,
                        # or for a step over MB that neither end needs (a slice over MB and a
                        # gather back around an all-reduce: micro-batches are not devices)
    _no_mb = False

    def step_time(self, kind, axes, nbytes):
        sec, algo = super().step_time(kind, axes, nbytes)
        named = (axes,) if isinstance(axes, str) else tuple(axes)
        return (sec + self.FORBIDDEN if self._no_mb and MB in named else sec), algo

    def plan(self, src, dst, shape, dtype) -> Plan:
        if (MB in src.axes) == (MB in dst.axes) and MB not in src.partial | dst.partial:
            self._no_mb = True
            try:
                got = super().plan(src, dst, shape, dtype)
            finally:
                self._no_mb = False
            return got
        where = lambda lay: [i for i, d in enumerate(lay.dims) if MB in d]
        if where(src) and (MB in dst.partial or where(dst) not in ([], where(src))):
            got = super().plan(src, dst, shape, dtype)     # no pipeline step does this
            return Plan(src, dst, got.shape, got.dtype, got.steps, got.cost + self.FORBIDDEN)
        if MB not in src.partial or MB in dst.partial:
            return super().plan(src, dst, shape, dtype)
        mid = type(src)(src.dims, src.partial - {MB})
        rest = self.plan(mid, dst, shape, dtype)
        nbytes = int(math.prod(src.local_shape(shape, self.mesh))) * np.dtype(dtype).itemsize
        first = self.step_time("all_reduce", (MB,), nbytes)[0]
        return Plan(src, dst, tuple(shape), np.dtype(dtype), (Step("all_reduce", (MB,)),)
                    + rest.steps, first + rest.cost)

IN, FORWARD, BACKWARD, POST = 0, 1, 2, 3
PHASES = {FORWARD: "forward", BACKWARD: "backward", POST: "post"}


def _what(ins, graph, owner):
    if isinstance(ins, Compute):
        return f"{ins.node.name} at {ins.node.source or 'an unknown line'}"
    if owner is not None:
        n = graph.nodes[owner]
        return f"the redistribution feeding {n.name} at {n.source or 'an unknown line'}"
    return "the redistribution of a result"


def _micro_steps(lw, planner, micro):
    """Step 2: (instruction, owner) pairs with no step over MB left."""
    out, avals = [], dict(lw.avals)
    mesh = planner.mesh

    def new(shape, dtype):
        lw.next_reg += 1
        avals[lw.next_reg - 1] = (tuple(shape), np.dtype(dtype))
        return lw.next_reg - 1

    for ins, owner in zip(lw.instructions, lw.owners):
        if isinstance(ins, Compute) or MB not in ins.axes:
            out.append((ins, owner))
            continue
        rest = tuple(a for a in ins.axes if a != MB)
        dtype = avals[ins.out][1]
        if isinstance(ins, Collective) and ins.kind == "all_reduce":
            mid = new(ins.shape, dtype) if rest else ins.out
            out.append((Accumulate(ins.src, mid, "sum"), owner))
            if rest:
                _, algo = planner.step_time("all_reduce", rest, ins.bytes)
                out.append((replace(ins, axes=rest, src=mid, algorithm=algo), owner))
        elif isinstance(ins, Collective) and ins.kind == "all_gather" and ins.axes[0] == MB:
            src = ins.src
            if rest:
                shape = list(ins.shape)
                shape[ins.dim] *= math.prod(mesh.axis_size(a) for a in rest)
                src = new(shape, dtype)
                _, algo = planner.step_time("all_gather", rest, ins.bytes // micro)
                out.append((replace(ins, axes=rest, out=src, algorithm=algo,
                                    bytes=ins.bytes // micro), owner))
            out.append((Accumulate(src, ins.out, "concat", ins.dim), owner))
        elif isinstance(ins, Slice) and ins.axes[0] == MB:
            shape = list(ins.shape)
            if ins.kind == "slice":
                shape[ins.dim] //= micro
            mid = new(shape, dtype) if rest else ins.out
            out.append((MicroSlice(ins.src, mid, "slice" if ins.kind == "slice" else "zero",
                                   ins.dim), owner))
            if rest:
                out.append((replace(ins, axes=rest, shape=tuple(shape), src=mid), owner))
        else:
            raise PipelineError(
                f"the plan needs {ins} across micro-batches, which a pipeline cannot run; "
                f"set micro_batches=1 or choose layouts that keep the batch dimension split.")
    return out, avals


def split(graph, stages, plan, mesh, stage_mesh, planner, scheduler, out_layouts=None, via=None):
    micro = plan.mesh.axis_size(MB)
    lw, outputs, out_lays, _, _ = lower_steps(graph, plan.choice, plan.in_layouts, plan.mesh,
                                              planner, out_layouts, via)
    steps, avals = _micro_steps(lw, planner, micro)
    phase, stage_of, variant = {}, {}, {}
    for r, l in zip(lw.inputs, plan.in_layouts):
        phase[r], variant[r] = IN, MB in l.axes
    info = []                                  # per step: (stage or None, phase)
    for ins, owner in steps:
        got = reads(ins)
        var = any(variant[r] for r in got) or isinstance(ins, MicroSlice)
        ph = max([phase[r] for r in got], default=IN)
        if isinstance(ins, Accumulate):
            if not variant[ins.src]:
                raise PipelineError(f"{_what(ins, graph, owner)} sums a value that is the same "
                                    "for every micro-batch; this plan cannot be pipelined.")
            st, ph_ins = stage_of.get(ins.src), max(ph, FORWARD)
            phase[ins.out], variant[ins.out] = POST, False
            stage_of[ins.out] = st if st is not None else stages.of_node[owner]
            info.append((stage_of[ins.out], ph_ins))
            continue
        if ph == IN and not var:
            st = None                                           # a copy wherever it is read
        else:
            if isinstance(ins, Compute):
                st = stages.of_node[owner]
                if "transpose(" in ins.node.scope:
                    ph = max(ph, BACKWARD)
            else:
                st = stage_of.get(ins.src) if isinstance(ins.src, int) else None
                if st is None:
                    st = stages.of_node[owner] if owner is not None else 0
            ph = max(ph, FORWARD)
            if ph == POST:
                bad = [r for r in got if variant[r]]
                if bad:
                    raise PipelineError(
                        f"{_what(ins, graph, owner)} reads a value of each micro-batch after "
                        "the gradients are accumulated: the step uses the whole batch at once "
                        "(batch statistics, a normalisation by a computed batch size). Set "
                        "micro_batches=1 for this step.")
        for w in writes(ins):
            phase[w], variant[w] = ph if st is not None else IN, var and ph != POST
            if st is not None:
                stage_of[w] = st
        info.append((st, ph))

    # where each register is read: (stage, phase) of readers; results are read in post
    S = stages.count
    out_stage = []
    for o in outputs:
        if isinstance(o, Const):
            out_stage.append(0)
            continue
        if variant[o]:
            raise PipelineError(f"result {outputs.index(o)} differs per micro-batch; return "
                                "values reduced or gathered over the batch.")
        out_stage.append(stage_of.get(o, 0))
    need = {}                                  # register -> {(stage, phase)}
    for o, s in zip(outputs, out_stage):
        if isinstance(o, int):
            need.setdefault(o, set()).add((s, POST))
    place = [None] * len(steps)
    copies_kept = set()                        # (register, stage): a copy post reads too
    for k in reversed(range(len(steps))):
        ins, _ = steps[k]
        st, ph = info[k]
        if st is None:                         # copies: earliest needed phase per stage
            wanted = set().union(*[need.get(w, set()) for w in writes(ins)])
            best = {}
            for s, p in wanted:
                best[s] = min(best.get(s, POST), p)
            place[k] = sorted(best.items())
            copies_kept.update((w, s) for s, p in place[k] if p != POST and (s, POST) in wanted
                               for w in writes(ins))
        else:
            place[k] = [(st, ph)]
        for r in reads(ins):
            for s, p in place[k]:
                need.setdefault(r, set()).add((s, p))

    lists = [{p: [] for p in PHASES} for _ in range(S)]
    received = set()                           # (register, stage, micro?)
    sends_after = {}                           # register -> [(peer, micro?)]
    keep = [set() for _ in range(S)]
    for r, s in copies_kept:
        keep[s].add(r)
    post_sends = [[] for _ in range(S)]
    summed = {ins.out for ins, _ in steps if isinstance(ins, Accumulate)}   # complete in post
    for r, readers in need.items():
        if phase.get(r, IN) == IN and r not in stage_of:
            continue                           # arguments and copies: present where read
        s0 = stage_of[r]
        for s, p in readers:
            if p == POST and phase[r] < POST and s == s0:
                keep[s0].add(r)                # read after the micro-batches in its own stage
            if s == s0:
                continue
            micro_read = p != POST
            if micro_read:
                if phase[r] == POST:
                    raise PipelineError(f"register {r} is needed per micro-batch in stage {s} "
                                        "but only exists after them; this plan cannot be "
                                        "pipelined.")
                if (p == FORWARD and s < s0) or (p == BACKWARD and phase[r] == BACKWARD and s > s0):
                    raise PipelineError(
                        f"stage {s} needs a value of stage {s0} in its {PHASES[p]} pass, which "
                        "would make the stages wait on each other; keep the stages in forward "
                        "order (see ap.pipeline_stage).")
            key = (r, s, micro_read)
            if key in received:
                continue
            received.add(key)
            if micro_read or (phase[r] == POST and r not in summed):
                sends_after.setdefault(r, []).append((s, micro_read))
            else:                              # same for every micro-batch, or a sum over
                if r not in summed:            # them: sent after them
                    keep[s0].add(r)
                post_sends[s0].append(r)
    recv_first = {}                            # (stage, phase) -> {register: peer}
    for r, s, micro_read in received:
        ph = min(p for t, p in need[r] if t == s and (p != POST) == micro_read)
        recv_first.setdefault((s, ph), {})[r] = stage_of[r]

    def transfer(kind, r, peer, micro_read):
        shape, dtype = avals[r]
        return Transfer(kind, r, peer, shape, dtype, int(math.prod(shape)) * dtype.itemsize,
                        micro_read, (mesh.axis_names[0],))

    for s in range(S):
        for r in dict.fromkeys(post_sends[s]):
            for t in sorted({t for rr, t, mr in received if rr == r and not mr}):
                lists[s][POST].append(transfer("send", r, t, False))
    for k, (ins, owner) in enumerate(steps):
        for s, p in place[k]:
            waiting = recv_first.get((s, p), {})
            for r in reads(ins):
                if r in waiting:
                    lists[s][p].append(transfer("recv", r, waiting.pop(r), p != POST))
            lists[s][p].append(ins)
            for w in writes(ins):
                for t, micro_read in sends_after.get(w, []):
                    lists[s][p].append(transfer("send", w, t, micro_read))
    for s in range(S):                         # results received in post but read by none
        for p in PHASES:
            for r, peer in recv_first.get((s, p), {}).items():
                lists[s][p].append(transfer("recv", r, peer, p != POST))

    K = plan.mesh.size // micro
    stage_programs, pos = [], {r: i for i, r in enumerate(lw.inputs)}
    for s in range(S):
        read_later = set(keep[s]) | {o for o, t in zip(outputs, out_stage) if t == s and isinstance(o, int)}
        bodies = {}
        for p in PHASES:
            later = set(read_later)
            for q in PHASES:
                if q != p:
                    later |= {r for ins in lists[s][q] for r in reads(ins)}
            body = lists[s][p]
            if p == POST:
                body = defer_all_reduce_readers(body)
            bodies[p] = segment(body, avals, sorted(later))
        used = sorted({pos[r] for p in PHASES for ins in lists[s][p] for r in reads(ins) if r in pos})
        accs = tuple(sorted({ins.out for p in PHASES for ins in lists[s][p]
                             if isinstance(ins, Accumulate)}))
        stage_programs.append(StageProgram(
            s, bodies[FORWARD], bodies[BACKWARD], bodies[POST], tuple(used),
            tuple(i for i in used if MB in plan.in_layouts[i].axes), tuple(sorted(keep[s])),
            accs, tuple(range(s * K, (s + 1) * K))))
    return PipelineProgram(mesh, stage_mesh, plan.mesh, tuple(stage_programs), micro, scheduler,
                           tuple(lw.inputs), tuple(plan.in_layouts), tuple(outputs),
                           tuple(out_lays), tuple(out_stage), avals, stages.of_node,
                           in_tree=graph.in_tree, out_tree=graph.out_tree)
