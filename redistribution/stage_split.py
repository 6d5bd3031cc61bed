"""Cut a step lowered on each stage's micro-batch mesh into pipeline stages and phases.

In: a Graph, its ``Stages`` (strategies.stage_assign), one ``StageLowering`` per stage mesh (the
stages on it, its ``MicroPlan`` from strategies.microbatch, a ``MicroPlanner``, the result
layouts), every stage's devices and the scheduler. Out: a ``PipelineProgram``
(autopar.pipeline_program).

For each stage mesh:
1. Lower the graph on the micro-batch mesh (``lower_steps``): local shapes are one
   micro-batch's.
2. Steps over the micro-batch axis ``MB`` become pipeline steps (``_micro_steps``): an
   all-reduce over ``MB`` is an ``Accumulate`` (sum over micro-batches; the rest of its axes
   reduce after them), an all-gather a concatenation, a slice over ``MB`` a ``MicroSlice``.
   Anything else over ``MB`` has no pipeline meaning and raises ``PipelineError``.
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
5. Each stage's phases are ordered with their messages (``_stage_lists``) and segmented
   (``_stage_program``). The stages of each mesh keep their lowering's programs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from autopar.errors import PipelineError
from autopar.graph import Const
from autopar.layout import Layout
from autopar.mesh import LogicalMesh
from autopar.pipeline_program import (
    Accumulate,
    AccumulateKind,
    MicroSlice,
    MicroSliceKind,
    PipelineProgram,
    Route,
    StageProgram,
    Transfer,
    TransferKind,
)
from autopar.program import (
    Collective,
    Compute,
    Slice,
    StepKind,
    defer_all_reduce_readers,
    reads,
    segment,
    writes,
)
from autopar.strategies.microbatch import MB, MicroPlan

from .lower import emit_steps, lower_steps, plan_steps
from .planner import Plan, Planner, Step


class MicroPlanner(Planner):
    """The Planner of the micro-batch mesh: a partial sum over micro-batches is first summed
    over them (all-reduce over ``MB``: the gradient accumulation), never reduce-scattered over
    them; the rest of the path is the usual cheapest one."""

    FORBIDDEN = 1e6  # seconds charged for moving a micro-batch split to another dimension,
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
            got = super().plan(src, dst, shape, dtype)  # no pipeline step does this
            return Plan(src, dst, got.shape, got.dtype, got.steps, got.cost + self.FORBIDDEN)
        if MB not in src.partial or MB in dst.partial:
            return super().plan(src, dst, shape, dtype)
        mid = type(src)(src.dims, src.partial - {MB})
        rest = self.plan(mid, dst, shape, dtype)
        nbytes = int(math.prod(src.local_shape(shape, self.mesh))) * np.dtype(dtype).itemsize
        first = self.step_time(StepKind.ALL_REDUCE, (MB,), nbytes)[0]
        return Plan(
            src,
            dst,
            tuple(shape),
            np.dtype(dtype),
            (Step(StepKind.ALL_REDUCE, (MB,)),) + rest.steps,
            first + rest.cost,
        )


IN, FORWARD, BACKWARD, POST = 0, 1, 2, 3
PHASES = {FORWARD: "forward", BACKWARD: "backward", POST: "post"}


def _what(ins, graph, owner):
    if isinstance(ins, Compute):
        return f"{ins.node.name} at {ins.node.source or 'an unknown line'}"
    if owner is not None:
        n = graph.nodes[owner]
        return f"the redistribution feeding {n.name} at {n.source or 'an unknown line'}"
    return "the redistribution of a result"


def _micro_steps(lowering, planner, micro):
    """Step 2: (instruction, owner) pairs with no step over MB left."""
    out, avals = [], dict(lowering.avals)
    mesh = planner.mesh

    def new(shape, dtype):
        r = lowering.new_reg()
        avals[r] = (tuple(shape), np.dtype(dtype))
        return r

    for ins, owner in zip(lowering.instructions, lowering.owners):
        if isinstance(ins, Compute) or MB not in ins.axes:
            out.append((ins, owner))
            continue
        rest = tuple(a for a in ins.axes if a != MB)
        dtype = avals[ins.out][1]
        if isinstance(ins, Collective) and ins.kind == StepKind.ALL_REDUCE:
            mid = new(ins.shape, dtype) if rest else ins.out
            out.append((Accumulate(ins.src, mid, AccumulateKind.SUM), owner))
            if rest:
                _, algo = planner.step_time(StepKind.ALL_REDUCE, rest, ins.bytes)
                out.append(
                    (
                        replace(
                            ins,
                            axes=rest,
                            src=mid,
                            algorithm=algo,
                            prices=planner.all_reduce_prices(rest),
                        ),
                        owner,
                    )
                )
        elif isinstance(ins, Collective) and ins.kind == StepKind.ALL_GATHER and ins.axes[0] == MB:
            src = ins.src
            if rest:
                shape = list(ins.shape)
                shape[ins.dim] *= math.prod(mesh.axis_size(a) for a in rest)
                src = new(shape, dtype)
                _, algo = planner.step_time(StepKind.ALL_GATHER, rest, ins.bytes // micro)
                out.append(
                    (
                        replace(ins, axes=rest, out=src, algorithm=algo, bytes=ins.bytes // micro),
                        owner,
                    )
                )
            out.append((Accumulate(src, ins.out, AccumulateKind.CONCAT, ins.dim), owner))
        elif isinstance(ins, Slice) and ins.axes[0] == MB:
            shape = list(ins.shape)
            if ins.kind == StepKind.SLICE:
                shape[ins.dim] //= micro
            mid = new(shape, dtype) if rest else ins.out
            kind = MicroSliceKind.SLICE if ins.kind == StepKind.SLICE else MicroSliceKind.ZERO
            out.append((MicroSlice(ins.src, mid, kind, ins.dim), owner))
            if rest:
                out.append((replace(ins, axes=rest, shape=tuple(shape), src=mid), owner))
        else:
            raise PipelineError(
                f"the plan needs {ins} across micro-batches, which a pipeline cannot run; "
                f"set micro_batches=1 or choose layouts that keep the batch dimension split."
            )
    return out, avals


@dataclass(frozen=True)
class StageLowering:
    """The stages that run on one stage mesh, and how that mesh lowers the step."""

    stages: tuple  # stage indices
    mesh: LogicalMesh  # their stage mesh
    plan: MicroPlan  # choice and argument layouts on micro_mesh(mesh)
    planner: MicroPlanner  # on plan.mesh
    out_layouts: tuple | None = None  # per result (None: replicated), on plan.mesh


def split_stages(
    graph, stages, lowerings, devices, scheduler, mesh, stage_axis="stage", interleave=1
):
    """The PipelineProgram: each stage from the lowering of its mesh (``devices[s]``: its global
    ranks; interleaved, stage j on the ranks of group j mod groups), each result from its
    stage's lowering."""
    programs, results = {}, []
    for low in lowerings:
        progs, outs = _split_one(graph, stages, low, devices, stage_axis)
        programs.update((s, progs[s]) for s in low.stages)
        results.append((set(low.stages), outs))
    out_stage = results[0][1][2]
    outputs, out_lays = [], []
    for k, s in enumerate(out_stage):
        _, (regs, lays, where) = next(r for r in results if s in r[0])
        if where[k] != s:
            raise PipelineError(
                f"result {k} is made in stage {s} on one stage mesh and in stage "
                f"{where[k]} on another; an autopar bug, please report it."
            )
        outputs.append(regs[k])
        out_lays.append(lays[k])
    ordered = tuple(programs[s] for s in range(stages.count))
    _check_messages(ordered)
    return PipelineProgram(
        mesh,
        ordered,
        lowerings[0].plan.mesh.axis_size(MB),
        scheduler,
        tuple(outputs),
        tuple(out_lays),
        tuple(out_stage),
        stages.of_node,
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
        interleave=interleave,
    )


def _check_messages(stage_programs):
    """Every message sent is received and every one received is sent (same tag, same shape)."""
    sent, got = {}, {}
    for st in stage_programs:
        for _, body in st.phases():
            for t in body:
                if isinstance(t, Transfer):
                    send = t.kind == TransferKind.SEND
                    ends = (st.index, t.peer) if send else (t.peer, st.index)
                    (sent if send else got)[ends + (t.key, t.micro)] = (t.shape, t.route)
    if sent != got:
        odd = sorted(set(sent.items()) ^ set(got.items()), key=str)[:3]
        raise PipelineError(
            f"the stages' lowerings disagree on what crosses between them {odd}; "
            "give the stages the same mesh (pipeline_stage_devices) or report "
            "this autopar bug."
        )


def _split_one(graph, stages, low, devices, stage_axis):
    """One stage mesh's stages: ``({stage: StageProgram}, (outputs, out layouts, out stages))``,
    in the passes of the module docstring."""
    plan, planner = low.plan, low.planner
    lowered = lower_steps(graph, plan.choice, plan.in_layouts, plan.mesh, planner, low.out_layouts)
    lowering, outputs, out_lays = lowered.lowering, lowered.outputs, lowered.out_layouts
    steps, avals = _micro_steps(lowering, planner, plan.mesh.axis_size(MB))
    flow = _flow(graph, stages, steps, lowering.inputs, plan.in_layouts)
    out_stage = _result_stages(outputs, flow)
    readers = _readers(steps, flow, outputs, out_stage)
    messages = _messages(readers, flow, stages.count)
    wires = _Wires(
        graph, lowering, avals, plan.mesh, planner, set(low.stages), messages.recv_first, stage_axis
    )
    lists = _stage_lists(steps, readers, messages, wires, stages.count)
    programs = {
        s: _stage_program(
            s,
            lists[s],
            messages.keep[s],
            outputs,
            out_stage,
            lowering.inputs,
            avals,
            plan,
            low.mesh,
            devices[s],
        )
        for s in sorted(low.stages)
    }
    return programs, (tuple(outputs), tuple(out_lays), tuple(out_stage))


@dataclass
class _Flow:
    """Step 3 (``_flow``): per register its phase, its stage (absent: an argument, or a copy
    placed wherever it is read) and whether it differs per micro-batch; per step its stage
    (None: a copy) and phase."""

    phase: dict
    stage_of: dict
    variant: dict
    info: list
    accumulated: set  # registers written by an Accumulate


def _flow(graph, stages, steps, inputs, in_layouts) -> _Flow:
    phase: dict[int, int] = {}
    stage_of: dict[int, int] = {}
    variant: dict[int, bool] = {}
    for r, l in zip(inputs, in_layouts):
        phase[r], variant[r] = IN, MB in l.axes
    info: list[tuple[int | None, int]] = []  # per step: (stage, phase)
    for ins, owner in steps:
        got = reads(ins)
        var = any(variant[r] for r in got) or isinstance(ins, MicroSlice)
        ph = max([phase[r] for r in got], default=IN)
        if isinstance(ins, Accumulate):
            if not variant[ins.src]:
                raise PipelineError(
                    f"{_what(ins, graph, owner)} sums a value that is the same "
                    "for every micro-batch; this plan cannot be pipelined."
                )
            st, ph_ins = stage_of.get(ins.src), max(ph, FORWARD)
            phase[ins.out], variant[ins.out] = POST, False
            stage_of[ins.out] = st if st is not None else stages.of_node[owner]
            info.append((stage_of[ins.out], ph_ins))
            continue
        if ph == IN and not var:
            st = None  # a copy wherever it is read
        else:
            if isinstance(ins, Compute):
                st = stages.of_node[owner]
                if ins.node.backward:
                    ph = max(ph, BACKWARD)
            else:
                st = stage_of.get(ins.src) if isinstance(ins.src, int) else None
                if st is None:
                    st = stages.of_node[owner] if owner is not None else 0
            ph = max(ph, FORWARD)
            if ph == POST and any(variant[r] for r in got):
                raise PipelineError(
                    f"{_what(ins, graph, owner)} reads a value of each micro-batch after "
                    "the gradients are accumulated: the step uses the whole batch at once "
                    "(batch statistics, a normalisation by a computed batch size). Set "
                    "micro_batches=1 for this step."
                )
        for w in writes(ins):
            phase[w], variant[w] = ph if st is not None else IN, var and ph != POST
            if st is not None:
                stage_of[w] = st
        info.append((st, ph))
    return _Flow(
        phase, stage_of, variant, info, {ins.out for ins, _ in steps if isinstance(ins, Accumulate)}
    )


def _result_stages(outputs, flow: _Flow) -> list:
    """The stage holding each result (a literal: stage 0); a result must not differ per
    micro-batch."""
    out_stage = []
    for k, o in enumerate(outputs):
        if isinstance(o, Const):
            out_stage.append(0)
            continue
        if flow.variant[o]:
            raise PipelineError(
                f"result {k} differs per micro-batch; return "
                "values reduced or gathered over the batch."
            )
        out_stage.append(flow.stage_of.get(o, 0))
    return out_stage


@dataclass
class _Readers:
    """Step 4, where values are read (``_readers``, backwards over the steps): ``need``,
    register -> the (stage, phase) pairs reading it (results are read in post); ``place``, per
    step the (stage, phase) pairs it runs in (a copy: each stage's earliest reading phase);
    ``copies_kept``, the (register, stage) pairs of copies that post reads too."""

    need: dict
    place: list
    copies_kept: set


def _readers(steps, flow: _Flow, outputs, out_stage) -> _Readers:
    need: dict[int, set[tuple[int, int]]] = {}
    for o, s in zip(outputs, out_stage):
        if isinstance(o, int):
            need.setdefault(o, set()).add((s, POST))
    place: list[list[tuple[int, int]] | None] = [None] * len(steps)
    copies_kept: set[tuple[int, int]] = set()
    for k in reversed(range(len(steps))):
        ins, _ = steps[k]
        st, ph = flow.info[k]
        if st is None:  # copies: earliest needed phase per stage
            wanted = set().union(*[need.get(w, set()) for w in writes(ins)])
            best: dict[int, int] = {}
            for s, p in wanted:
                best[s] = min(best.get(s, POST), p)
            here = sorted(best.items())
            copies_kept.update(
                (w, s) for s, p in here if p != POST and (s, POST) in wanted for w in writes(ins)
            )
        else:
            here = [(st, ph)]
        place[k] = here
        for r in reads(ins):
            for s, p in here:
                need.setdefault(r, set()).add((s, p))
    return _Readers(need, place, copies_kept)


@dataclass
class _Messages:
    """Step 4 (``_messages``): what crosses between stages, and what a stage keeps.
    ``keep[s]``: registers stage s holds past the micro-batches; ``post_sends[s]``: registers
    it sends once, in post; ``received``: (register, stage, per micro-batch) of every message;
    ``sends_after``: register -> [(peer, per micro-batch)], sent as soon as it is written;
    ``recv_first``: (stage, phase) -> {register: peer}, received before its first reader."""

    keep: list
    post_sends: list
    received: set
    sends_after: dict
    recv_first: dict


def _messages(readers: _Readers, flow: _Flow, count: int) -> _Messages:
    phase, stage_of = flow.phase, flow.stage_of
    received: set[tuple[int, int, bool]] = set()  # (register, stage, per micro-batch)
    sends_after: dict[int, list[tuple[int, bool]]] = {}
    keep: list[set[int]] = [set() for _ in range(count)]
    for r, s in readers.copies_kept:
        keep[s].add(r)
    post_sends: list[list[int]] = [[] for _ in range(count)]
    summed = flow.accumulated  # complete in post
    for r, wanted in readers.need.items():
        if phase.get(r, IN) == IN and r not in stage_of:
            continue  # arguments and copies: present where read
        s0 = stage_of[r]
        for s, p in wanted:
            if p == POST and phase[r] < POST and s == s0:
                keep[s0].add(r)  # read after the micro-batches in its own stage
            if s == s0:
                continue
            micro_read = p != POST
            if micro_read:
                if phase[r] == POST:
                    raise PipelineError(
                        f"register {r} is needed per micro-batch in stage {s} "
                        "but only exists after them; this plan cannot be "
                        "pipelined."
                    )
                if (p == FORWARD and s < s0) or (p == BACKWARD and phase[r] == BACKWARD and s > s0):
                    raise PipelineError(
                        f"stage {s} needs a value of stage {s0} in its {PHASES[p]} pass, which "
                        "would make the stages wait on each other; keep the stages in forward "
                        "order (see ap.pipeline_stage)."
                    )
            key = (r, s, micro_read)
            if key in received:
                continue
            received.add(key)
            if micro_read or (phase[r] == POST and r not in summed):
                sends_after.setdefault(r, []).append((s, micro_read))
            else:  # same for every micro-batch, or a sum over
                if r not in summed:  # them: sent after them
                    keep[s0].add(r)
                post_sends[s0].append(r)
    recv_first: dict[tuple[int, int], dict[int, int]] = {}
    for r, s, micro_read in received:
        ph = min(p for t, p in readers.need[r] if t == s and (p != POST) == micro_read)
        recv_first.setdefault((s, ph), {})[r] = stage_of[r]
    return _Messages(keep, post_sends, received, sends_after, recv_first)


class _Wires:
    """Step 4's messages: ``recv``/``send`` give the instructions that move register ``r``
    between stage ``s`` and ``peer``: one Transfer between stages of this mesh (``block``), or,
    to a stage of another mesh (``crosses_meshes``), the value gathered whole once per message
    (``whole``) and sliced by the receiver into every layout it reads."""

    def __init__(self, graph, lowering, avals, mesh, planner, mine, recv_first, stage_axis):
        self.lowering, self.avals, self.mesh, self.planner = lowering, avals, mesh, planner
        self.mine, self.stage_axis = mine, stage_axis
        self.values = {v.id: v for v in graph.inputs}
        self.values.update((o.id, o) for n in graph.nodes for o in n.outputs)
        self.named = {
            reg: (vid, lay) for vid, held in lowering.where.items() for lay, reg in held.items()
        }
        self.target, self.first = {}, {}  # (stage, tag, per micro-batch) -> register / phase
        self.done_recv, self.gathered, self.done_send = set(), {}, set()
        for (s, ph), waiting in recv_first.items():
            for r, peer in waiting.items():
                if self.crosses_meshes(s, peer):
                    v, lay, full, tag = self.whole_message(r)
                    key = (s, tag, ph != POST)
                    self.first[key] = min(self.first.get(key, POST), ph)
                    if lay == full or key not in self.target:
                        self.target[key] = r if lay == full else self.target.get(key)

    def crosses_meshes(self, s, t) -> bool:
        return (s in self.mine) != (t in self.mine)

    def transfer(self, kind, r, peer, micro_read, route=Route.BLOCK, tag=None):
        shape, dtype = self.avals[r]
        return Transfer(
            kind,
            r,
            peer,
            shape,
            dtype,
            int(math.prod(shape)) * dtype.itemsize,
            micro_read,
            (self.stage_axis,),
            route,
            tag,
        )

    def whole_message(self, r):
        """(value, its layout in r, the layout holding it whole, the message's tag)."""
        if r not in self.named:
            raise PipelineError(
                f"register {r} crosses between stage meshes but holds no value "
                "of the step; an autopar bug, please report it."
            )
        vid, lay = self.named[r]
        if MB in lay.partial:
            raise PipelineError(
                f"a partial sum over micro-batches of {self.values[vid]} would "
                "cross between stage meshes; give the stages the same mesh."
            )
        full = Layout(tuple(tuple(a for a in d if a == MB) for d in lay.dims), frozenset())
        mb = next((i for i, d in enumerate(lay.dims) if MB in d), None)
        return self.values[vid], lay, full, ("whole", vid, mb)

    def recv(self, s, r, peer, p) -> list:
        micro_read = p != POST
        if not self.crosses_meshes(s, peer):
            return [self.transfer(TransferKind.RECV, r, peer, micro_read)]
        v, lay, full, tag = self.whole_message(r)
        key, out = (s, tag, micro_read), []
        if self.target.get(key) is None:
            self.target[key] = self.lowering.new_reg()
            self.avals[self.target[key]] = (full.local_shape(v.shape, self.mesh), np.dtype(v.dtype))
        src = self.target[key]
        if key not in self.done_recv and p == self.first[key]:
            self.done_recv.add(key)
            out.append(self.transfer(TransferKind.RECV, src, peer, micro_read, Route.WHOLE, tag))
        if r != src:
            steps_, _ = plan_steps(self.planner, full, lay, v.shape, v.dtype)
            out += [
                ins
                for ins, _ in emit_steps(
                    steps_,
                    src,
                    full,
                    v.shape,
                    v.dtype,
                    self.planner,
                    self.lowering.new_reg,
                    self.avals,
                    last=r,
                )
            ]
        return out

    def send(self, s, r, peer, micro_read) -> list:
        if not self.crosses_meshes(s, peer):
            return [self.transfer(TransferKind.SEND, r, peer, micro_read)]
        v, lay, full, tag = self.whole_message(r)
        out, key = [], (s, tag, micro_read)
        if key not in self.gathered:
            steps_, _ = plan_steps(self.planner, lay, full, v.shape, v.dtype)
            made = emit_steps(
                steps_,
                r,
                lay,
                v.shape,
                v.dtype,
                self.planner,
                self.lowering.new_reg,
                self.avals,
                f"{v} sent whole to stage {peer}",
            )
            out += [ins for ins, _ in made]
            self.gathered[key] = made[-1][0].out if made else r
        if key + (peer,) not in self.done_send:
            self.done_send.add(key + (peer,))
            out.append(
                self.transfer(
                    TransferKind.SEND, self.gathered[key], peer, micro_read, Route.WHOLE, tag
                )
            )
        return out


def _stage_lists(steps, readers: _Readers, messages: _Messages, wires: _Wires, count) -> list:
    """Step 5: per stage and phase, its instructions in order, messages included."""
    lists: list[dict[int, list]] = [{p: [] for p in PHASES} for _ in range(count)]
    recv_first = {k: dict(v) for k, v in messages.recv_first.items()}
    for s in range(count):
        for r in dict.fromkeys(messages.post_sends[s]):
            for t in sorted({t for rr, t, mr in messages.received if rr == r and not mr}):
                lists[s][POST] += wires.send(s, r, t, False)
    for k, (ins, _owner) in enumerate(steps):
        for s, p in readers.place[k]:
            waiting = recv_first.get((s, p), {})
            for r in reads(ins):
                if r in waiting:
                    lists[s][p] += wires.recv(s, r, waiting.pop(r), p)
            lists[s][p].append(ins)
            for w in writes(ins):
                for t, micro_read in messages.sends_after.get(w, []):
                    lists[s][p] += wires.send(s, w, t, micro_read)
    for s in range(count):  # results received in post but read by none
        for p in PHASES:
            for r, peer in recv_first.get((s, p), {}).items():
                lists[s][p] += wires.recv(s, r, peer, p)
    return lists


def _stage_program(s, lists, keep, outputs, out_stage, inputs, avals, plan, mesh, devices):
    """Step 5: stage ``s``'s StageProgram: each phase segmented, keeping what the other phases
    and the results read."""
    read_later = set(keep) | {
        o for o, t in zip(outputs, out_stage) if t == s and isinstance(o, int)
    }
    bodies = {}
    for p in PHASES:
        later = set(read_later)
        for q in PHASES:
            if q != p:
                later |= {r for ins in lists[q] for r in reads(ins)}
        body = lists[p]
        if p == POST:
            body = defer_all_reduce_readers(body)
        bodies[p] = segment(body, avals, sorted(later))
    pos = {r: i for i, r in enumerate(inputs)}
    used = sorted({pos[r] for p in PHASES for ins in lists[p] for r in reads(ins) if r in pos})
    accs = tuple(
        sorted({ins.out for p in PHASES for ins in lists[p] if isinstance(ins, Accumulate)})
    )
    return StageProgram(
        index=s,
        forward=bodies[FORWARD],
        backward=bodies[BACKWARD],
        post=bodies[POST],
        inputs=tuple(used),
        micro_inputs=tuple(i for i in used if MB in plan.in_layouts[i].axes),
        keep=tuple(sorted(keep)),
        accumulators=accs,
        devices=tuple(devices),
        mesh=mesh,
        micro_mesh=plan.mesh,
        arg_regs=tuple(inputs),
        in_layouts=tuple(plan.in_layouts),
        avals=avals,
    )
