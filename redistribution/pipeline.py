"""Cut a step lowered on each stage's micro-batch mesh into pipeline stages and phases.

In: a Graph, its ``Stages`` (strategies.stages), one ``StageLowering`` per stage mesh (the
stages on it, its ``MicroPlan`` from strategies.microbatch, a ``MicroPlanner``, the result
layouts), every stage's devices and the scheduler. Out: a ``PipelineProgram``
(autopar.pipeline).

For each stage mesh:
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
   step, once per step in ``post``. Between two stages of this mesh it goes rank to rank as it
   is (``block``); to a stage of another mesh the value goes ``whole``: the sender gathers it
   over its stage (one micro-batch's block), sends it once per value, and the receiver slices
   every layout it reads from it. Both lowerings name such a message by the value (and the
   dimension split over micro-batches), which ``split_stages`` checks end to end.
The stages of each mesh keep their lowering's programs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from autopar.errors import PipelineError
from autopar.graph import Const
from autopar.layout import Layout
from autopar.pipeline import Accumulate, MicroSlice, PipelineProgram, StageProgram, Transfer
from autopar.program import (Collective, Compute, Slice, defer_all_reduce_readers, reads,
                             segment, writes)
from autopar.strategies.microbatch import MB

from .lower import emit_steps, lower_steps, plan_steps
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
                out.append((replace(ins, axes=rest, src=mid, algorithm=algo,
                                    prices=planner.all_reduce_prices(rest)), owner))
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


@dataclass(frozen=True)
class StageLowering:
    """The stages that run on one stage mesh, and how that mesh lowers the step."""
    stages: tuple                 # stage indices
    mesh: object                  # their stage LogicalMesh
    plan: object                  # MicroPlan: choice and argument layouts on micro_mesh(mesh)
    planner: object               # MicroPlanner on plan.mesh
    out_layouts: tuple = None     # per result (None: replicated), on plan.mesh
    via: dict = None              # optimizer level1: value id -> layout read through


def split_stages(graph, stages, lowerings, devices, scheduler, mesh, stage_axis="stage"):
    """The PipelineProgram: each stage from the lowering of its mesh (``devices[s]``: its global
    ranks), each result from its stage's lowering."""
    programs, results = {}, []
    for low in lowerings:
        progs, outs = _split_one(graph, stages, low, devices, scheduler, stage_axis)
        programs.update((s, progs[s]) for s in low.stages)
        results.append((set(low.stages), outs))
    out_stage = results[0][1][2]
    outputs, out_lays = [], []
    for k, s in enumerate(out_stage):
        _, (regs, lays, where) = next(r for r in results if s in r[0])
        if where[k] != s:
            raise PipelineError(f"result {k} is made in stage {s} on one stage mesh and in stage "
                                f"{where[k]} on another; an autopar bug, please report it.")
        outputs.append(regs[k])
        out_lays.append(lays[k])
    ordered = tuple(programs[s] for s in range(stages.count))
    _check_messages(ordered)
    return PipelineProgram(mesh, ordered, lowerings[0].plan.mesh.axis_size(MB), scheduler,
                           tuple(outputs), tuple(out_lays), tuple(out_stage), stages.of_node,
                           in_tree=graph.in_tree, out_tree=graph.out_tree)


def _check_messages(stage_programs):
    """Every message sent is received and every one received is sent (same tag, same shape)."""
    sent, got = {}, {}
    for st in stage_programs:
        for _, body in st.phases():
            for t in body:
                if isinstance(t, Transfer):
                    ends = (st.index, t.peer) if t.kind == "send" else (t.peer, st.index)
                    (sent if t.kind == "send" else got)[ends + (t.key, t.micro)] = (t.shape, t.route)
    if sent != got:
        odd = sorted(set(sent.items()) ^ set(got.items()), key=str)[:3]
        raise PipelineError(f"the stages' lowerings disagree on what crosses between them {odd}; "
                            "give the stages the same mesh (pipeline_stage_devices) or report "
                            "this autopar bug.")


def _split_one(graph, stages, low, devices, scheduler, stage_axis):
    plan, planner, mine = low.plan, low.planner, set(low.stages)
    micro = plan.mesh.axis_size(MB)
    lw, outputs, out_lays, _, _ = lower_steps(graph, plan.choice, plan.in_layouts, plan.mesh,
                                              planner, low.out_layouts, low.via)
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

    values = {v.id: v for v in graph.inputs}
    values.update((o.id, o) for n in graph.nodes for o in n.outputs)
    named = {reg: (vid, lay) for vid, held in lw.where.items() for lay, reg in held.items()}

    def new_reg():
        lw.next_reg += 1
        return lw.next_reg - 1

    def transfer(kind, r, peer, micro_read, route="block", tag=None):
        shape, dtype = avals[r]
        return Transfer(kind, r, peer, shape, dtype, int(math.prod(shape)) * dtype.itemsize,
                        micro_read, (stage_axis,), route, tag)

    def whole(r):
        """(value, its layout in r, the layout holding it whole, the message's tag)."""
        if r not in named:
            raise PipelineError(f"register {r} crosses between stage meshes but holds no value "
                                "of the step; an autopar bug, please report it.")
        vid, lay = named[r]
        if MB in lay.partial:
            raise PipelineError(f"a partial sum over micro-batches of {values[vid]} would cross "
                                "between stage meshes; give the stages the same mesh.")
        full = Layout(tuple(tuple(a for a in d if a == MB) for d in lay.dims), frozenset())
        mb = next((i for i, d in enumerate(lay.dims) if MB in d), None)
        return values[vid], lay, full, ("whole", vid, mb)

    foreign = lambda s, t: (s in mine) != (t in mine)
    target, first = {}, {}        # (stage, tag, per micro-batch) -> register received / phase
    for (s, ph), waiting in recv_first.items():
        for r, peer in waiting.items():
            if foreign(s, peer):
                v, lay, full, tag = whole(r)
                key = (s, tag, ph != POST)
                first[key] = min(first.get(key, POST), ph)
                if lay == full or key not in target:
                    target[key] = r if lay == full else target.get(key)
    done_recv, gathered, done_send = set(), {}, set()

    def recv(s, r, peer, p):
        micro_read = p != POST
        if not foreign(s, peer):
            return [transfer("recv", r, peer, micro_read)]
        v, lay, full, tag = whole(r)
        key, out = (s, tag, micro_read), []
        if target.get(key) is None:
            target[key] = new_reg()
            avals[target[key]] = (full.local_shape(v.shape, plan.mesh), np.dtype(v.dtype))
        src = target[key]
        if key not in done_recv and p == first[key]:
            done_recv.add(key)
            out.append(transfer("recv", src, peer, micro_read, "whole", tag))
        if r != src:
            steps_, _ = plan_steps(planner, full, lay, v.shape, v.dtype)
            out += [ins for ins, _ in emit_steps(steps_, src, full, v.shape, v.dtype, planner,
                                                 new_reg, avals, last=r)]
        return out

    def send(s, r, peer, micro_read):
        if not foreign(s, peer):
            return [transfer("send", r, peer, micro_read)]
        v, lay, full, tag = whole(r)
        out, key = [], (s, tag, micro_read)
        if key not in gathered:
            steps_, _ = plan_steps(planner, lay, full, v.shape, v.dtype)
            made = emit_steps(steps_, r, lay, v.shape, v.dtype, planner, new_reg, avals,
                              f"{v} sent whole to stage {peer}")
            out += [ins for ins, _ in made]
            gathered[key] = made[-1][0].out if made else r
        if key + (peer,) not in done_send:
            done_send.add(key + (peer,))
            out.append(transfer("send", gathered[key], peer, micro_read, "whole", tag))
        return out

    for s in range(S):
        for r in dict.fromkeys(post_sends[s]):
            for t in sorted({t for rr, t, mr in received if rr == r and not mr}):
                lists[s][POST] += send(s, r, t, False)
    for k, (ins, owner) in enumerate(steps):
        for s, p in place[k]:
            waiting = recv_first.get((s, p), {})
            for r in reads(ins):
                if r in waiting:
                    lists[s][p] += recv(s, r, waiting.pop(r), p)
            lists[s][p].append(ins)
            for w in writes(ins):
                for t, micro_read in sends_after.get(w, []):
                    lists[s][p] += send(s, w, t, micro_read)
    for s in range(S):                         # results received in post but read by none
        for p in PHASES:
            for r, peer in recv_first.get((s, p), {}).items():
                lists[s][p] += recv(s, r, peer, p)

    stage_programs, pos = {}, {r: i for i, r in enumerate(lw.inputs)}
    for s in sorted(mine):
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
        stage_programs[s] = StageProgram(
            s, bodies[FORWARD], bodies[BACKWARD], bodies[POST], tuple(used),
            tuple(i for i in used if MB in plan.in_layouts[i].axes), tuple(sorted(keep[s])),
            accs, tuple(devices[s]), low.mesh, plan.mesh, tuple(lw.inputs),
            tuple(plan.in_layouts), avals)
    return stage_programs, (tuple(outputs), tuple(out_lays), tuple(out_stage))
