"""Run a PipelineProgram on the native runtime: one worker process per device.

In: a ``PipelineProgram`` and the flattened global arguments. Out: the flattened global
results. Rank r runs the stage whose devices hold it, as its position there in the stage's
mesh (stages may have meshes of different sizes). The caller exports each stage's segments once
and loads every worker with its stage's phases, its task order
(``autopar.pipeline_program.schedule``) and, per peer rank, the list of messages that peer
sends it, in the peer's order. Per call a rank gets its block of each argument its stage reads
(one per micro-batch for the batch; with ``RuntimeOptions.resident``, only a key for a result
of an earlier call it kept, when that argument is read by its stage alone, in the blocks its
ranks hold: ``runtime.resident``) and runs its tasks, by default as one executable
(``WholeStage``: every task traced in order into one jitted function, the transfers and
collectives XLA custom calls; ``RuntimeOptions.whole_step``), otherwise one instruction at a
time in Python (``_StageStep``), by the same rules:

- a forward or backward task runs that phase on the micro-batch's registers; ``post`` runs once
  on the accumulated values;
- collectives inside the stage go through ``comm_scheduler.CommScheduler`` (gradient all-reduces of
  ``post`` fused into buckets, overlapping the compute after them);
- a ``Transfer`` send is queued on a thread per destination, so a rank never waits for its
  receiver: a ``block`` transfer goes to the rank at the same position of the other stage, a
  ``whole`` one to every rank of the other stage whose position is this one's modulo this
  stage's size; a thread per source receives that peer's messages in the peer's order into a
  mailbox, and a ``Transfer`` recv waits for its (tag, micro-batch) there. The stage order of
  the schedule is then the only order that matters: GPipe and 1F1B cannot deadlock.

A worker's ``native_backend.stats()`` then also holds ``pipeline``: the step's seconds and the
seconds its stage waited for a peer's transfer (the pipeline bubble, as this rank saw it; in
the whole step, its time in the recv custom call).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from autopar.errors import AutoparError
from autopar.graph import Const
from autopar.mesh import LogicalMesh
from autopar.pipeline_program import (
    Accumulate,
    AccumulateKind,
    MicroSlice,
    MicroSliceKind,
    Route,
    Transfer,
    TransferKind,
    schedule,
)

from . import native_backend as nb
from . import resident, wire
from .comm_scheduler import CommScheduler, contiguous
from .native_step import Tracer


@dataclass(frozen=True)
class StageGroups:
    """A stage's mesh seen from global ranks: ``group`` shifts the stage's ranks by
    ``offset`` (its first rank), so ``comm_scheduler._step`` runs unchanged."""

    mesh: LogicalMesh
    offset: int

    def axis_size(self, name):
        return self.mesh.axis_size(name)

    def group(self, rank, axes):
        members, me = self.mesh.group(rank - self.offset, axes)
        return tuple(m + self.offset for m in members), me


def _inboxes(program, tasks):
    """Per global rank: {source rank: [(tag, micro-batch or None, (shape, dtype))]} in the order
    the source sends them."""
    out = {r: {} for st in program.stages for r in st.devices}
    for st, order in zip(program.stages, tasks):
        bodies = dict(st.phases())
        for name, m in list(order) + [("post", None)]:
            for t in bodies[name]:
                if not (isinstance(t, Transfer) and t.kind == TransferKind.SEND):
                    continue
                for me, src in enumerate(st.devices):
                    for dst in _targets(t, st.devices, program.stages[t.peer].devices, me):
                        out[dst].setdefault(src, []).append(
                            (t.key, m if t.micro else None, (t.shape, t.dtype))
                        )
    return out


def _targets(t, devices, peer, me):
    """The global ranks that position ``me`` of a stage on ``devices`` sends ``t`` to: the same
    position of the peer stage's devices ``peer`` (block), or every position equal to ``me``
    modulo the sending stage's size (whole)."""
    if t.route == Route.BLOCK:
        return [peer[me]]
    return [d for j, d in enumerate(peer) if j % len(devices) == me]


class PipelineRunner(nb.WorkerRunner):
    """Callable: flat global arguments -> flat global results; ``close()`` stops the workers."""

    def __init__(self, program, timeout: float = 10.0):
        self.program = p = program
        self.mesh, self.timeout = p.mesh, timeout
        tasks = schedule(p.scheduler, len(p.stages), p.micro_batches)
        inboxes = _inboxes(p, tasks)
        self._payloads, self.options = {}, nb.RuntimeOptions.from_env()
        devices = tuple(x.devices for x in p.stages)
        for st in p.stages:
            phases = {name: nb.shippable(body) for name, body in st.phases()}
            outs = tuple(
                (k, o, not lay.is_replicated())
                for k, (o, lay, s) in enumerate(zip(p.outputs, p.out_layouts, p.out_stages))
                if s == st.index and not isinstance(o, Const)
            )
            base = StagePayload(
                groups=StageGroups(st.mesh, st.devices[0]),
                stage=st.index,
                devices=devices,
                phases=phases,
                tasks=tasks[st.index],
                keep=frozenset(st.keep),
                outputs=outs,
                inputs=tuple(st.arg_regs[i] for i in st.inputs),
                micro_inputs=tuple(st.arg_regs[i] for i in st.micro_inputs),
                micro=p.micro_batches,
                buckets=st.buckets,
                bucket_bytes=st.bucket_bytes,
                inbox={},
                options=self.options,
                in_avals={st.arg_regs[i]: st.avals[st.arg_regs[i]] for i in st.inputs},
            )
            for r in st.devices:
                self._payloads[r] = dataclasses.replace(base, inbox=inboxes[r])
        # kept results: every result (not a constant) the workers may hold between calls
        # (runtime.resident; kept when RESIDENT_BYTES or more), and per argument the number of
        # stages reading it (passed back by key only to one reading stage)
        self._resident = resident.Residency() if self.options.resident else None
        self._kept = [
            k
            for k, (o, lay, s) in enumerate(zip(p.outputs, p.out_layouts, p.out_stages))
            if not isinstance(o, Const)
            and _global_bytes(p.stages[s], o, lay) >= resident.RESIDENT_BYTES
        ]
        self._readers = [
            sum(i in st.inputs for st in p.stages) for i in range(len(p.stages[0].in_layouts))
        ]
        self._start()

    def _loads(self):
        return load_stage, [(self._payloads[r],) for r in range(self.mesh.size)]

    def __call__(self, flat_args):
        p = self.program
        self._ready()
        res, job = self._resident, self.job
        M = p.micro_batches
        per_rank = [{} for _ in range(p.mesh.size)]
        for st in p.stages:
            K, mm = st.mesh.size, st.micro_mesh
            for i in st.inputs:
                x, lay, reg = flat_args[i], st.in_layouts[i], st.arg_regs[i]
                micro = i in st.micro_inputs
                ref = (
                    None
                    if res is None or micro or self._readers[i] != 1
                    else res.ref_for(
                        x,
                        job,
                        _held(
                            st, np.shape(x), lambda me: lay.block(np.shape(x), mm.coords(me), mm)
                        ),
                    )
                )
                if ref is not None:
                    for r in st.devices:
                        per_rank[r][reg] = [ref]
                    continue
                x = np.asarray(x)
                for me, r in enumerate(st.devices):
                    per_rank[r][reg] = [
                        contiguous(x[lay.block(x.shape, mm.coords(m * K + me), mm)])
                        for m in (range(M) if micro else [0])
                    ]
        keys = {} if res is None else {k: res.key() for k in self._kept}
        drop = res.drops() if res else []
        try:
            ranks = self._call(run_stage, [(b, keys, drop) for b in per_rank], borrow=True)
        except AutoparError:
            if res and not self.job.failure:
                res.dropped_later(drop)  # the workers may not have got to them
            raise
        out = []
        for k, (o, lay, s) in enumerate(zip(p.outputs, p.out_layouts, p.out_stages)):
            if isinstance(o, Const):
                out.append(o.value)
                continue
            st = p.stages[s]
            got = [ranks[d][k] for d in st.devices]
            x = np.array(got[0]) if lay.is_replicated() else lay.assemble(got, st.mesh)
            if k in keys:
                x = res.kept(
                    x,
                    keys[k],
                    job,
                    _held(st, x.shape, lambda me: lay.block(x.shape, st.mesh.coords(me), st.mesh)),
                )
            out.append(x)
        return out


def _global_bytes(stage, reg, layout) -> int:
    """Bytes of the whole value of a stage's register ``reg`` in ``layout``."""
    shape, dtype = stage.avals[reg]
    return (
        math.prod(n * c for n, c in zip(shape, layout.splits(stage.mesh)))
        * np.dtype(dtype).itemsize
    )


def _held(stage, shape, block) -> tuple:
    """What the ranks of ``stage`` hold of a ``shape`` tensor, each its ``block(position)``:
    a result kept so is passed back by key where an argument's blocks are the same."""
    return (
        stage.index,
        tuple(shape),
        tuple(tuple((b.start, b.stop) for b in block(me)) for me in range(len(stage.devices))),
    )


# --- in the workers ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StagePayload:
    """What ``PipelineRunner`` ships to one rank: its stage's collective groups, index and
    phases (``shippable``; compiled once loaded), every stage's devices, its task order, the
    registers kept across micro-batches, its results ((position, register, split) each), its
    argument registers (all, and those with a block per micro-batch), the micro-batch count,
    the stage's all-reduce buckets, per peer rank the messages it sends this one, in order, the
    runtime options and the shape and dtype of each argument block."""

    groups: StageGroups
    stage: int
    devices: tuple
    phases: dict
    tasks: tuple
    keep: frozenset
    outputs: tuple
    inputs: tuple
    micro_inputs: tuple
    micro: int
    buckets: tuple  # StageProgram.buckets
    bucket_bytes: int
    inbox: dict
    options: nb.RuntimeOptions
    in_avals: dict  # argument register -> (local shape, dtype) of one block


def load_stage(comm, payload: StagePayload, cache=None):
    """Compile the stage's segments now (so a stage's first step does not compile while its
    peers wait on it), shared across the stage's ranks: as one executable (``WholeStage``)
    with ``RuntimeOptions.whole_step``, else each segment for ``run_stage``'s interpreter;
    answer once every rank of the job has compiled."""
    nb.WORKER.whole = None
    payload.options.apply_x64()
    if payload.options.whole_step and supported(payload) is None:
        nb.WORKER.stage = payload
        nb.WORKER.whole = WholeStage(comm, payload, cache)
    else:
        segments = [
            s[1] for steps in payload.phases.values() for s in steps if isinstance(s, tuple)
        ]
        ranks = list(payload.devices[payload.stage])
        compiled = iter(nb.compile_shared(comm, segments, ranks, cache))
        phases = {
            name: [
                ("segment", next(compiled), s[2], s[3]) if isinstance(s, tuple) else s
                for s in steps
            ]
            for name, steps in payload.phases.items()
        }
        nb.WORKER.stage = dataclasses.replace(payload, phases=phases)
        nb.WORKER.comm_thread()
    # stages compile different programs: a stage done early would otherwise answer at once and
    # start the launcher's clock on one still compiling (a collective timeout behind it)
    nb.compiled_everywhere(comm)
    return True


class _Mailbox:
    """Messages from other stages. A thread per source rank receives that peer's messages in
    its send order into a dict, from the first time this rank waits for one of them (so a
    receive's timeout counts from when the stage needs the peer, not from the step's start)
    to the step's last message."""

    def __init__(self, comm, inbox):
        self.comm = comm
        self.got, self.error = {}, None
        self.waited = 0.0  # seconds the stage waited for a peer
        self.cv = threading.Condition()
        self.inbox, self.threads = inbox, {}  # source rank -> [(tag, micro-batch, aval)]
        self.source = {(tag, m): src for src, msgs in inbox.items() for tag, m, _ in msgs}

    def _start(self, src):
        t = threading.Thread(
            target=self._receive, args=(self.comm, src, self.inbox[src]), daemon=True
        )
        t.start()
        self.threads[src] = t

    def _receive(self, comm, peer, msgs):
        try:
            for reg, m, (shape, dtype) in msgs:
                buf = wire.empty(shape, dtype)
                comm.recv(buf, peer)
                with self.cv:
                    self.got[(reg, m)] = buf
                    self.cv.notify_all()
        except BaseException as e:  # noqa: BLE001  (handed to the main thread)
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def take(self, reg, m):
        src = self.source[(reg, m)]
        if src not in self.threads:
            self._start(src)
        t0 = time.perf_counter()
        with self.cv:
            while (reg, m) not in self.got:
                if self.error is not None:
                    raise self.error
                self.cv.wait()
            self.waited += time.perf_counter() - t0
            return self.got.pop((reg, m))

    def join(self):
        for src in self.inbox:  # messages sent but read by no step
            if src not in self.threads:
                self._start(src)
        for t in self.threads.values():
            t.join()
        if self.error is not None:
            raise self.error


@functools.cache
def _sender(peer):
    return ThreadPoolExecutor(1, thread_name_prefix=f"autopar-send{peer}")


def run_stage(comm, blocks, keys=None, drop=()):
    """One step of this rank's stage: its tasks in order, then ``post``; per result position,
    its block (None for a replicated result on ranks other than the stage's first). Argument
    blocks may be references (``resident.is_ref``) to blocks this rank kept; it keeps the
    results under ``keys`` (result position -> key) and forgets those under ``drop``."""
    payload = nb.WORKER.stage
    nb.WORKER.stats["kept_args"] = sum(resident.is_ref(b) for bs in blocks.values() for b in bs)
    blocks = {r: resident.take(bs, drop) for r, bs in blocks.items()}
    mine = {k for k, _, _ in payload.outputs}
    keys = {k: key for k, key in (keys or {}).items() if k in mine}
    meter = nb.PeakMeter(nb.WORKER.stats)
    start = time.perf_counter()
    if nb.WORKER.whole is not None:
        waited = comm.recv_seconds
        results = nb.WORKER.whole(blocks)
        nb.WORKER.stats["pipeline"] = {
            "step_s": time.perf_counter() - start,
            "wait_s": comm.recv_seconds - waited,
        }
        nb.WORKER.stats["buckets"] = nb.WORKER.whole.buckets
        meter.stop(sum(b.nbytes for bs in blocks.values() for b in bs))
        me = comm.rank - payload.groups.offset
        resident.keep({k: x for (k, _, _), x in zip(payload.outputs, results)}, keys)
        return {
            k: np.asarray(x) if (split or me == 0) else None
            for (k, _, split), x in zip(payload.outputs, results)
        }
    run = _StageStep(comm, payload, blocks)
    for name, m in list(payload.tasks) + [("post", None)]:
        run.task(name, m)
    results = [run.step[o] for _, o, _ in payload.outputs]
    for f in run.sends:
        f.result()
    run.mailbox.join()
    nb.WORKER.stats["pipeline"] = {
        "step_s": time.perf_counter() - start,
        "wait_s": run.mailbox.waited,
    }
    meter.stop(sum(b.nbytes for bs in blocks.values() for b in bs))
    resident.keep({k: x for (k, _, _), x in zip(payload.outputs, results)}, keys)
    return {
        k: x if (split or run.me == 0) else None
        for (k, _, split), x in zip(payload.outputs, results)
    }


# its argument blocks may be views of the call's message (worker.py)
run_stage.borrows = True  # type: ignore[attr-defined]  # mypy types no attributes of a function


class _StageStep:
    """The registers of one step of a stage: ``step`` (values for the whole step: arguments
    the same for every micro-batch, values kept across micro-batches, sums over them), one
    dict per micro-batch, the accumulators, the sends in flight and the mailbox."""

    def __init__(self, comm, payload, blocks):
        self.comm, self.payload = comm, payload
        self.mine = payload.devices[payload.stage]
        self.me = comm.rank - self.mine[0]
        self.mailbox = _Mailbox(comm, payload.inbox)
        self.sends = []
        self.step = {r: b[0] for r, b in blocks.items() if r not in payload.micro_inputs}
        self.micro = [{r: blocks[r][m] for r in payload.micro_inputs} for m in range(payload.micro)]
        self.acc = {}

    def task(self, name, m):
        """Run phase ``name`` on micro-batch ``m`` (None: ``post``, on the accumulated sums)."""
        step, keep = self.step, self.payload.keep
        regs = step if m is None else self.micro[m]
        comms = CommScheduler(
            self.comm,
            self.payload.groups,
            self.payload.buckets,
            self.payload.bucket_bytes,
            self.payload.options.overlap,
            thread=nb.WORKER.comm_thread(),
            reducers=nb.WORKER.reducers,
        )
        if name == "post":
            for r, v in self.acc.items():
                step[r] = (
                    wire.aligned(np.concatenate(v[1], axis=v[0])) if isinstance(v, tuple) else v
                )

        def get(r):
            if isinstance(r, Const):
                return np.asarray(r.value, r.dtype)
            if r in regs:
                return regs[r]
            if r in step:
                return step[r]
            regs[r] = comms.wait(r)
            return regs[r]

        def put(r, value):
            regs[r] = value
            if r in keep:
                step[r] = value

        try:
            for st in self.payload.phases[name]:
                if isinstance(st, Transfer):
                    self._transfer(st, m, get, put)
                elif isinstance(st, Accumulate):
                    self._accumulate(st, get(st.src))
                elif isinstance(st, MicroSlice):
                    regs[st.out] = self._micro_slice(st, get(st.src), m)
                else:
                    for o, y in nb.execute(st, get, comms):
                        put(o, y)
            comms.flush()
            for r in list(comms.futures):
                put(r, comms.wait(r))
        finally:
            comms.close()
        if name == "backward":
            self.micro[m] = {}

    def _transfer(self, st, m, get, put):
        if st.kind == TransferKind.SEND:
            x = wire.aligned(get(st.reg))  # as the receiver's: comm_scheduler._all_to_all
            for dst in _targets(st, self.mine, self.payload.devices[st.peer], self.me):
                self.sends.append(_sender(dst).submit(self.comm.send, x, dst))
        else:
            put(st.reg, self.mailbox.take(st.key, m if st.micro else None))

    def _accumulate(self, st, x):
        if st.kind == AccumulateKind.SUM:
            if st.out in self.acc:
                np.add(self.acc[st.out], x, out=self.acc[st.out])
            else:
                self.acc[st.out] = wire.empty(x.shape, x.dtype)
                np.copyto(self.acc[st.out], x)
        else:
            self.acc.setdefault(st.out, (st.dim, []))[1].append(x)

    def _micro_slice(self, st, x, m):
        if st.kind == MicroSliceKind.ZERO:
            return x if m == 0 else wire.zeros(x.shape, x.dtype)
        n = x.shape[st.dim] // self.payload.micro
        return wire.aligned(np.take(x, range(m * n, (m + 1) * n), axis=st.dim))


def supported(payload) -> str | None:
    """Why a stage cannot run as one executable (``WholeStage``), or None."""
    from .native_step import supported as step_supported

    why = step_supported([i for body in payload.phases.values() for i in body])
    if why is not None:
        return why
    stages: dict[int, int] = {}  # stage -> the one rank this rank receives from there
    for src in payload.inbox:
        stage = next(s for s, devices in enumerate(payload.devices) if src in devices)
        if stages.setdefault(stage, src) != src:
            return f"this rank receives from two ranks of stage {stage}"
    return None


class WholeStage(Tracer):
    """A rank's pipeline step as one executable (``native_step``'s, with transfers): its
    tasks in the schedule's order, then ``post``, all traced into one jitted function, the
    micro-batch index static in each task. Callable: the rank's blocks ({argument register:
    one block, or one per micro-batch}) -> its results, one per ``payload.outputs``.

    A ``Transfer`` send is the ``send`` custom call, which queues the message on a thread per
    receiving rank and returns (``sends_done`` at the step's end waits for them), so a stage
    never waits for its receiver; a recv is the ``recv`` custom call, taking the sending
    stage's messages in their send order (the trace knows it: messages sent before the one
    needed are taken first and kept, as ``_Mailbox`` does at run time), after the compute
    traced so far. Each task issues and awaits its own all-reduce buckets, as the interpreted
    runner's ``CommScheduler`` per task does. Every rank of a stage runs the same executable
    (its position in the stage an argument; each transfer's custom call gets every rank's
    pair and picks its own), compiled once for the stage."""

    def __init__(self, comm, payload: StagePayload, cache=None):
        import jax
        from jax import export

        self._setup(
            comm,
            payload.groups.mesh,
            payload.groups.offset,
            payload.options,
            payload.buckets,
            payload.bucket_bytes,
        )
        self.payload = p = payload
        self.segments = {
            (name, k): export.deserialize(ins[1])
            for name, body in p.phases.items()
            for k, ins in enumerate(body)
            if isinstance(ins, tuple)
        }
        self.mine = p.devices[p.stage]
        # per sending stage: the messages it sends this stage, in its order (the same for
        # every rank here), and the (from, to) pairs their recv takes
        self.inbox = {}
        for src, msgs in p.inbox.items():
            stage = next(s for s, d in enumerate(p.devices) if src in d)
            peers = p.devices[stage]
            self.inbox[stage] = (
                msgs,
                {
                    "from": tuple(peers[j % len(peers)] for j in range(len(self.mine))),
                    "to": tuple(self.mine),
                },
            )
        self.args = [
            (r, m) for r in p.inputs for m in (range(p.micro) if r in p.micro_inputs else [None])
        ]
        self.avals = [jax.ShapeDtypeStruct(*p.in_avals[r]) for r, _ in self.args] + [
            jax.ShapeDtypeStruct((), np.int32)
        ]
        lowered = jax.jit(self._step).lower(*self.avals)
        (self.fn,) = nb.compile_rounds(comm, [lowered.compile], list(self.mine), cache)
        self.position = np.int32(comm.rank - self.mine[0])

    def __call__(self, blocks) -> list:
        flat = [blocks[r][0 if m is None else m] for r, m in self.args]
        return self.results(lambda: self.fn(*flat, self.position))

    def _step(self, *flat):
        p = self.payload
        *flat, me = flat
        step = {r: x for (r, m), x in zip(self.args, flat) if m is None}
        self.micro = [
            {r: x for (r, mm), x in zip(self.args, flat) if mm == m} for m in range(p.micro)
        ]
        self._begin(me, {}, step, p.keep)
        self.acc, self.got, self.taken = {}, {}, dict.fromkeys(self.inbox, 0)
        for name, m in list(p.tasks) + [("post", None)]:
            self._task(name, m)
        for stage, (msgs, _) in self.inbox.items():  # messages sent but read by no step
            while self.taken[stage] < len(msgs):
                self._receive(stage)
        (self.order,) = self.call("sends_done", (), self.order)
        return [self.step[o] for _, o, _ in p.outputs] + [self.order]

    def _task(self, name, m):
        import jax.numpy as jnp

        if name == "post":
            for r, v in self.acc.items():
                self.step[r] = jnp.concatenate(v[1], axis=v[0]) if isinstance(v, tuple) else v
        self.regs = self.step if m is None else self.micro[m]
        for k, ins in enumerate(self.payload.phases[name]):
            if isinstance(ins, Transfer):
                self._transfer(ins, m)
            elif isinstance(ins, Accumulate):
                self._accumulate(ins, self.get(ins.src))
            elif isinstance(ins, MicroSlice):
                self.regs[ins.out] = self._micro_slice(ins, self.get(ins.src), m)
            else:
                self.run(ins, self.segments.get((name, k)))
        self.settle()
        if name == "backward":
            self.micro[m] = {}

    def _transfer(self, t, m):
        if t.kind == TransferKind.SEND:
            pairs = [
                (src, dst)
                for me, src in enumerate(self.mine)
                for dst in _targets(t, self.mine, self.payload.devices[t.peer], me)
            ]
            (self.order,) = self.call(
                "send",
                (),
                self.get(t.reg),
                self.order,
                **{"from": tuple(a for a, _ in pairs)},
                to=tuple(b for _, b in pairs),
            )
            return
        key = (t.key, m if t.micro else None)
        while key not in self.got:
            self._receive(t.peer)
        self.put(t.reg, self.got.pop(key))

    def _receive(self, stage):
        """The next message of ``stage``'s, into ``self.got``."""
        from jax import ShapeDtypeStruct

        msgs, pairs = self.inbox[stage]
        tag, m, (shape, dtype) = msgs[self.taken[stage]]
        self.taken[stage] += 1
        self.got[(tag, m)], self.order = self.call(
            "recv", (ShapeDtypeStruct(tuple(shape), dtype),), self.after(), self.order, **pairs
        )

    def _accumulate(self, st, x):
        if st.kind == AccumulateKind.SUM:
            self.acc[st.out] = x if st.out not in self.acc else self.acc[st.out] + x
        else:
            self.acc.setdefault(st.out, (st.dim, []))[1].append(x)

    def _micro_slice(self, st, x, m):
        import jax.numpy as jnp
        from jax import lax

        if st.kind == MicroSliceKind.ZERO:
            return x if m == 0 else jnp.zeros_like(x)
        n = x.shape[st.dim] // self.payload.micro
        return lax.slice_in_dim(x, m * n, (m + 1) * n, axis=st.dim)
