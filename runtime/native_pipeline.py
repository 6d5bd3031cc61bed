"""Run a PipelineProgram on the native runtime: one worker process per device.

In: a ``PipelineProgram`` and the flattened global arguments. Out: the flattened global
results. Rank r runs stage ``r // K`` (K devices per stage) as local rank ``r % K`` of the
stage mesh. The caller exports each stage's segments once and loads every worker with its
stage's phases, its task order (``autopar.pipeline.schedule``) and, per peer rank, the list of
messages that peer sends it, in the peer's order. Per call a rank gets its block of each
argument its stage reads (one per micro-batch for the batch) and runs its tasks:

- a forward or backward task runs that phase on the micro-batch's registers; ``post`` runs once
  on the accumulated values;
- collectives inside the stage go through ``native_backend._Comms`` (gradient all-reduces of
  ``post`` fused into buckets, overlapping the compute after them);
- a ``Transfer`` send is queued on a thread per destination, so a rank never waits for its
  receiver; a thread per source receives that peer's messages in the peer's order into a
  mailbox, and a ``Transfer`` recv waits for its (register, micro-batch) there. The stage
  order of the schedule is then the only order that matters: GPipe and 1F1B cannot deadlock.

A worker's ``native_backend.stats()`` then also holds ``pipeline``: the step's seconds and the
seconds its stage waited for a peer's transfer (the pipeline bubble, as this rank saw it).
"""
from __future__ import annotations

import functools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from autopar.graph import Const
from autopar.pipeline import Accumulate, MicroSlice, Transfer, schedule

from . import native_backend as nb
from . import wire


@dataclass(frozen=True)
class StageGroups:
    """The stage mesh seen from global ranks: ``group`` shifts the stage's ranks by
    ``offset`` (its first rank), so ``native_backend._step`` runs unchanged."""
    mesh: object
    offset: int

    def axis_size(self, name):
        return self.mesh.axis_size(name)

    def group(self, rank, axes):
        members, me = self.mesh.group(rank - self.offset, axes)
        return tuple(m + self.offset for m in members), me


def _messages(program, tasks):
    """(source stage, destination stage) -> [(register, micro-batch or None)] in send order."""
    out = {}
    for st, order in zip(program.stages, tasks):
        bodies = dict(st.phases())
        for name, m in list(order) + [("post", None)]:
            for ins in bodies[name]:
                if isinstance(ins, Transfer) and ins.kind == "send":
                    out.setdefault((st.index, ins.peer), []).append(
                        (ins.reg, m if ins.micro else None))
    return out


class PipelineRunner(nb.WorkerRunner):
    """Callable: flat global arguments -> flat global results; ``close()`` stops the workers."""

    def __init__(self, program, timeout: float = 10.0, bucket_bytes: int = 25 << 20):
        from autopar.redistribution.planner import Planner
        self.program = p = program
        self.mesh, self.timeout = p.mesh, timeout
        K = p.stage_mesh.size
        planner = Planner(p.stage_mesh)
        tasks = schedule(p.scheduler, len(p.stages), p.micro_batches)
        messages = _messages(p, tasks)
        self._payloads = []
        for st in p.stages:
            prices = {}
            phases = {name: nb.shippable(body, planner, prices) for name, body in st.phases()}
            outs = tuple((k, o, not lay.is_replicated()) for k, (o, lay, s) in
                         enumerate(zip(p.outputs, p.out_layouts, p.out_stages))
                         if s == st.index and not isinstance(o, Const))
            inbox = {src: [(r, m, p.avals[r]) for r, m in msgs]
                     for (src, dst), msgs in messages.items() if dst == st.index}
            self._payloads.append(dict(
                groups=StageGroups(p.stage_mesh, st.devices[0]), K=K, stage=st.index,
                phases=phases, tasks=tasks[st.index], keep=frozenset(st.keep), outputs=outs,
                inputs=tuple(p.inputs[i] for i in st.inputs),
                micro_inputs=tuple(p.inputs[i] for i in st.micro_inputs),
                micro=p.micro_batches, inbox=inbox, bucket_bytes=bucket_bytes, prices=prices))
        self._start()

    def _loads(self):
        K = self.program.stage_mesh.size
        return load_stage, [(self._payloads[r // K],) for r in range(self.mesh.size)]

    def __call__(self, flat_args):
        p = self.program
        self._ready()
        K, M, mm = p.stage_mesh.size, p.micro_batches, p.micro_mesh
        per_rank = []
        for r in range(p.mesh.size):
            st = p.stages[r // K]
            blocks = {}
            for i in st.inputs:
                x, lay = np.asarray(flat_args[i]), p.in_layouts[i]
                ms = range(M) if i in st.micro_inputs else [0]
                blocks[p.inputs[i]] = [nb._c(x[lay.block(x.shape, mm.coords(m * K + r % K), mm)])
                                       for m in ms]
            per_rank.append((blocks,))
        ranks = self._call(run_stage, per_rank)
        out = []
        for k, (o, lay, s) in enumerate(zip(p.outputs, p.out_layouts, p.out_stages)):
            if isinstance(o, Const):
                out.append(o.value)
                continue
            got = [ranks[s * K + i][k] for i in range(K)]
            out.append(got[0] if lay.is_replicated() else lay.assemble(got, p.stage_mesh))
        return out


# --- in the workers ---------------------------------------------------------------------------

_STAGE: list = []


def load_stage(comm, payload, cache=None):
    """Compile the stage's segments now (so a stage's first step does not compile while its
    peers wait on it), shared across the stage's ranks."""
    first, K = payload["groups"].offset, payload["K"]
    segments = [s[1] for steps in payload["phases"].values() for s in steps
                if isinstance(s, tuple)]
    compiled = iter(nb.compile_shared(comm, segments, list(range(first, first + K)), cache))
    phases = {name: [("segment", next(compiled), s[2], s[3]) if isinstance(s, tuple) else s
                     for s in steps] for name, steps in payload["phases"].items()}
    _STAGE[:] = [dict(payload, phases=phases)]
    sys.setswitchinterval(1e-4)
    if not nb._COMM_THREAD:
        nb._COMM_THREAD.append(ThreadPoolExecutor(1, thread_name_prefix="autopar-comm"))
    return True


class _Mailbox:
    """Messages from other stages. A thread per source rank receives that peer's messages in
    its send order into a dict, from the first time this rank waits for one of them (so a
    receive's timeout counts from when the stage needs the peer, not from the step's start)
    to the step's last message."""

    def __init__(self, comm, inbox, K):
        self.comm, self.K = comm, K
        self.got, self.error = {}, None
        self.waited = 0.0                      # seconds the stage waited for a peer
        self.cv = threading.Condition()
        self.inbox, self.threads = inbox, {}
        self.source = {(reg, m): src for src, msgs in inbox.items() for reg, m, _ in msgs}

    def _start(self, src):
        peer = src * self.K + self.comm.rank % self.K
        t = threading.Thread(target=self._receive, args=(self.comm, peer, self.inbox[src]),
                             daemon=True)
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
        except BaseException as e:             # noqa: BLE001  (handed to the main thread)
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
        for src in self.inbox:                 # messages sent but read by no step
            if src not in self.threads:
                self._start(src)
        for t in self.threads.values():
            t.join()
        if self.error is not None:
            raise self.error


@functools.lru_cache(maxsize=None)
def _sender(peer):
    return ThreadPoolExecutor(1, thread_name_prefix=f"autopar-send{peer}")


def run_stage(comm, blocks):
    P = _STAGE[0]
    meter = nb._PeakMeter()
    start = time.perf_counter()
    K, M, keep = P["K"], P["micro"], P["keep"]
    mailbox = _Mailbox(comm, P["inbox"], K)
    sends = []
    step = {r: b[0] for r, b in blocks.items() if r not in P["micro_inputs"]}
    micro = [{r: blocks[r][m] for r in P["micro_inputs"]} for m in range(M)]
    acc = {}
    peer_of = lambda stage: stage * K + comm.rank % K
    for name, m in list(P["tasks"]) + [("post", None)]:
        regs = step if m is None else micro[m]
        comms = nb._Comms(comm, P["groups"], P["bucket_bytes"], P["prices"])
        if name == "post":
            for r, v in acc.items():
                step[r] = wire.aligned(np.concatenate(v[1], axis=v[0])) if isinstance(v, tuple) else v

        def get(r):
            if isinstance(r, Const):
                return np.asarray(r.value, r.dtype)
            if r in regs:
                return regs[r]
            if r in step:
                return step[r]
            regs[r] = comms.wait(r)
            return regs[r]

        try:
            for st in P["phases"][name]:
                if isinstance(st, Transfer):
                    if st.kind == "send":
                        x = nb._c(get(st.reg))
                        sends.append(_sender(peer_of(st.peer)).submit(comm.send, x, peer_of(st.peer)))
                    else:
                        regs[st.reg] = mailbox.take(st.reg, m if st.micro else None)
                        if st.reg in keep:
                            step[st.reg] = regs[st.reg]
                elif isinstance(st, Accumulate):
                    x = get(st.src)
                    if st.kind == "sum":
                        if st.out in acc:
                            np.add(acc[st.out], x, out=acc[st.out])
                        else:
                            acc[st.out] = wire.empty(x.shape, x.dtype)
                            np.copyto(acc[st.out], x)
                    else:
                        acc.setdefault(st.out, (st.dim, []))[1].append(x)
                elif isinstance(st, MicroSlice):
                    x = get(st.src)
                    if st.kind == "zero":
                        regs[st.out] = x if m == 0 else wire.zeros(x.shape, x.dtype)
                    else:
                        n = x.shape[st.dim] // M
                        regs[st.out] = wire.aligned(np.take(x, range(m * n, (m + 1) * n), axis=st.dim))
                else:
                    for o, y in nb.execute(st, get, comms):
                        regs[o] = y
                        if o in keep:
                            step[o] = y
            comms.flush()
            for r in list(comms.futures):
                regs[r] = comms.wait(r)
                if r in keep:
                    step[r] = regs[r]
        finally:
            comms.close()
        if name == "backward":
            micro[m] = {}
    results = [step[o] for _, o, _ in P["outputs"]]
    for f in sends:
        f.result()
    mailbox.join()
    nb._STATS["pipeline"] = {"step_s": time.perf_counter() - start, "wait_s": mailbox.waited}
    meter.stop(sum(b.nbytes for bs in blocks.values() for b in bs))
    out = {}
    for (k, _, split), x in zip(P["outputs"], results):
        out[k] = x if (split or comm.rank % K == 0) else None
    return out
