"""The native backend: run a Program on one worker process per device with autopar's C++
collectives (``autopar._native``), compute on JAX's CPU backend inside each worker.

In: a ``Program`` and the flattened global arguments. Out: the flattened global results: one
rank's copy of a replicated result (the ranks share the large ones out, ``_answerers``, and
each stays in the shared memory its rank wrote it into while it is held, up to
``LENT_ANSWERS`` calls' worth: ``Job.call``), the ranks' blocks put together for a split one
(parameters and optimizer state keep their layout from step to step). A Program whose ranks
would all compute the same values and exchange nothing (``Program.ranks_alike``) starts no
workers: ``Compiled`` runs one rank's step in the caller (``jax_backend.build_alone``).

The caller exports every ``Segment`` once with ``jax.export`` (``shippable``: local shapes,
serialised, so the workers never see the user's Python function), starts a
``runtime.launcher.Job`` with ``mesh.size`` ranks (host ids from the topology's innermost
level, ``host_ids``) and loads the program into every worker; the workers stay alive until the
runner is closed or collected, so a second call pays only for the step. Per call, rank r gets
its block of every argument (``Layout.block`` at ``mesh.coords(r)``; with
``RuntimeOptions.resident``, the default, only a key for a result of an earlier call it still
holds, ``runtime.resident``). By default (``RuntimeOptions.whole_step``) it runs its whole step
as one executable (``runtime.native_step``), its arguments and results smaller than
``resident.RESIDENT_BYTES`` packed, replicated and split ones apart, two arrays each way
(``runtime.packing``; a loop's small replicated state is kept in the workers too); otherwise,
and for a program with a Reduction Server, it runs the instructions: segments through their
exported executables, collectives through ``Comm`` over ``mesh.group(r, axes)`` (first axis
major, as in jax_collectives), slices locally; each register is freed after its last reader.
Collectives run on a background thread; all-reduces are fused into the program's buckets
(``Program.buckets``: up to ``allreduce_fusion_bytes``, 25 MiB by default, DDP's) that
overlap with the compute after them (``CommScheduler``), each bucket with the algorithm its all-reduces' prices
(``Collective.prices``, set by the lowering: the worker plans nothing) make cheapest for its size.

All-reduce algorithms: the planner names the native ones (``_native.ALLREDUCE_ALGORITHMS``),
and each runs under its own name. A program whose all-reduces may take "reduction_server" (its
topology has ``reducers``) gets that many more ranks after the devices' (hosts of their own):
they compute nothing and serve the step's Reduction Server all-reduces until the devices'
ranks release them at the step's end.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from autopar.errors import AutoparError, CollectiveError, ConfigError
from autopar.graph import Const
from autopar.mesh import LogicalMesh
from autopar.program import Collective, Segment, StepKind

from . import resident
from .comm_scheduler import CommScheduler
from .options import RuntimeOptions
from .packing import ArgPacker, Packing
from .peak_memory import PeakMeter

if TYPE_CHECKING:
    from .native_pipeline import StagePayload, WholeStage
    from .native_step import WholeStep


def _check_algorithm(name: str) -> None:
    """Raise unless ``name`` is a native all-reduce algorithm (checked once per program)."""
    from autopar import _native

    known = set(_native.ALLREDUCE_ALGORITHMS) | {"reduction_server"}
    if name not in known:
        raise CollectiveError(
            f"the plan asks for all-reduce algorithm {name!r}, which the native "
            f"runtime does not have (it has {sorted(known)}); re-plan with this "
            "autopar version, whose cost table names only those."
        )


@dataclass(frozen=True, kw_only=True)
class ProgramPayload:
    """What ``NativeRunner`` ships to every rank: the mesh, the instructions (``shippable``),
    argument and result registers, who answers each of a rank's answer's places (``answer_by``:
    None, every rank its block of a split result; else the one rank that sends a replicated
    one), the program's all-reduce buckets and the runtime options."""

    mesh: LogicalMesh
    instructions: tuple
    inputs: tuple
    outputs: tuple
    answer_by: tuple
    buckets: tuple  # Program.buckets: the all-reduces fused per call
    bucket_bytes: int  # Program.bucket_bytes
    options: RuntimeOptions
    in_avals: tuple = ()  # (local shape, dtype) per argument register
    packing: Packing | None = None  # whole steps: small arguments and results packed


def _fresh_stats() -> dict:
    return {
        "all_reduce_calls": 0,
        "buckets": [],
        "host": None,
        "input_bytes": [],
        "step_peak_bytes": None,
        "measure": False,
    }


@dataclass
class WorkerState:
    """What a worker process keeps between the calls of its job (a job's workers serve only
    that job): the loaded program (``payload`` with its ``steps`` compiled and the registers
    ``frees`` after each step) or pipeline ``stage``, the thread every collective runs on, and
    the counters ``stats`` returns."""

    payload: ProgramPayload | None = None
    steps: list = field(default_factory=list)
    frees: list = field(default_factory=list)
    stage: StagePayload | None = None  # native_pipeline: the loaded stage
    whole: WholeStep | WholeStage | None = None  # the whole-step executable, when the options ask
    reducers: list = field(default_factory=list)  # the job's Reduction Server ranks
    stats: dict = field(default_factory=_fresh_stats)
    thread: ThreadPoolExecutor | None = None
    cache: str | None = None  # the job's XLA cache folder (compile_rounds)

    def comm_thread(self) -> ThreadPoolExecutor:
        """The one thread collectives run on, started with the first program loaded. The comm
        thread hands results back to a main thread that may hold the GIL; Python's default 5 ms
        switch interval would then delay every collective by up to that much."""
        if self.thread is None:
            sys.setswitchinterval(1e-4)
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="autopar-comm")
        return self.thread


WORKER = WorkerState()  # this process's, when it is a worker of a job
# seconds a rank waits at a load's barrier for its peers' compiles (see compile_shared)
COMPILE_TIMEOUT = 300.0


def shippable(instructions) -> tuple:
    """Instructions as a worker loads them: each Segment exported once with ``jax.export``
    (local shapes; serialised, so the workers never see the user's function) as
    ("segment", bytes, inputs, outputs); each all-reduce's algorithm checked."""
    import jax
    from jax import export

    out = []
    for ins in instructions:
        if isinstance(ins, Segment):
            avals = [jax.ShapeDtypeStruct(s, d) for s, d in ins.in_avals]
            exported = export.export(jax.jit(ins))(*avals)
            out.append(("segment", exported.serialize(), ins.inputs, ins.outputs))
            continue
        if (
            isinstance(ins, Collective)
            and ins.kind == StepKind.ALL_REDUCE
            and ins.algorithm != "local"
        ):  # (over size-1 axes only: nothing exchanged)
            _check_algorithm(ins.algorithm)
        out.append(ins)
    return tuple(out)


_RESTART = threading.Lock()
PRIVATE_CACHE = "autopar-xla-"  # a job's own XLA cache folder (none configured): its prefix


class WorkerRunner:
    """A job of worker processes with a program loaded in every rank, restarted on the next
    call after a failure or ``close()``. Subclasses set ``mesh``, ``timeout``, ``options`` (a
    ``RuntimeOptions``; its ``direct`` goes to the job) and ``_loads()`` -> (worker function,
    per-rank arguments), and may set ``reducers`` (Reduction Server ranks after the mesh's)."""

    reducers = 0

    def _start(self):
        """A new job with the program loaded (first use, and after a failed or closed one).
        The workers share an XLA compilation cache: the caller's persistent one when JAX has
        one configured (``jax_compilation_cache_dir``, e.g. from JAX_COMPILATION_CACHE_DIR), so
        segments compiled by an earlier job or run load from it, else one private to the job
        and removed with it."""
        import jax

        from .launcher import Job

        places = dict(enumerate(self.options.hosts)) or None
        hosts = host_ids(self.mesh.topology)
        hosts += [hosts[-1] + 1 + j for j in range(self.reducers)]  # a host per reducer
        if places and len(places) != hosts[-1] + 1:
            raise ConfigError(
                f"RuntimeOptions.hosts names {len(places)} hosts; this program runs on "
                f"{hosts[-1] + 1 - self.reducers} hosts"
                + (f" and {self.reducers} reducer hosts after them" if self.reducers else "")
                + ": name one per host."
            )
        self.job = Job(
            len(hosts),
            hosts=hosts,
            timeout=self.timeout,
            direct=self.options.direct,
            inter_host="tcp" if places else "shm",
            namespaces=places,
            tcp_streams=self.options.tcp_streams,
        )
        users = jax.config.jax_compilation_cache_dir
        cache = users or tempfile.mkdtemp(prefix=PRIVATE_CACHE)
        job, owner = self.job, os.getpid()

        def stop():
            job.close()
            if not users and os.getpid() == owner:  # not in a forked child: the parent's
                shutil.rmtree(cache, ignore_errors=True)

        self._finalizer = weakref.finalize(self, stop)
        fn, per_rank = self._loads()
        self._call(fn, [args + (cache,) for args in per_rank], loading=True)

    def _call(self, fn, per_rank, borrow=False, loading=False):
        """``job.call``; a job that failed is closed at once (its workers stopped), so nothing
        is left running, and the next call starts a new one."""
        try:
            return self.job.call(fn, per_rank, borrow, loading)
        except AutoparError:
            if self.job.failure:
                self._finalizer()
            raise

    def _ready(self):
        if self.job.closed or self.job.failure:
            with _RESTART:  # threads sharing the runner start one new job
                if self.job.closed or self.job.failure:
                    self._finalizer()
                    self._start()

    def close(self):
        """Stop the workers; calling the runner again starts new ones. Closed by its user,
        the job has as many warm workers readied for the next one (``Job.keep_warm``): warming
        them while this job ran would have taken the cores from its steps."""
        self._finalizer()
        if getattr(self, "job", None) is not None:
            self.job.keep_warm()


class NativeRunner(WorkerRunner):
    """Callable: flat global arguments -> flat global results; ``close()`` stops the workers."""

    def __init__(
        self,
        program,
        timeout: float = 10.0,
        options: RuntimeOptions | None = None,
    ):
        from .native_step import supported

        self.program, self.mesh, self.timeout = program, program.mesh, timeout
        self.options = options or RuntimeOptions.from_env()
        instructions = shippable(program.instructions)
        results = [
            (o, l) for o, l in zip(program.outputs, program.out_layouts) if not isinstance(o, Const)
        ]
        split = tuple(not l.is_replicated() for _, l in results)
        # results of RESIDENT_BYTES or more may stay in the workers (runtime.resident); the
        # smaller ones, and arguments as small, travel packed to and from a whole step
        large = [
            k
            for k, (o, l) in enumerate(results)
            if _global_bytes(program, o, l) >= resident.RESIDENT_BYTES
        ]
        self._kept = large if self.options.resident else []
        packing = None
        if self.options.whole_step and supported(instructions) is None:
            small_args = sorted(
                (
                    i
                    for i, (r, l) in enumerate(zip(program.inputs, program.in_layouts))
                    if _global_bytes(program, r, l) < resident.RESIDENT_BYTES
                ),
                key=lambda i: not program.in_layouts[i].is_replicated(),
            )
            packing = Packing.plan(
                [program.avals[r] for r in program.inputs],
                small_args,
                sum(program.in_layouts[i].is_replicated() for i in small_args),
                [program.avals[o] for o, _ in results],
                split,
                [k for k in range(len(results)) if k not in large],
            )
        self._packing = packing
        packed = packing.args if packing else ()
        self._unpacked = [i for i in range(len(program.inputs)) if i not in packed]
        self._packed_rep = [i for i in packed if program.in_layouts[i].is_replicated()]
        self._packed_split = [i for i in packed if not program.in_layouts[i].is_replicated()]
        self._packer = packing and ArgPacker(packing, program.mesh.size)
        self._lock = threading.Lock()  # the packer's buffers: one call at a time
        others = packing.other_results(len(results)) if packing else range(len(results))
        first = 2 if packing else 0  # the two packs come first in a rank's answer
        self._answer_at = {k: first + j for j, k in enumerate(others)}
        self._outs_in_order, k = [], 0  # per output: (it, result index (a Const's None),
        for o, l in zip(program.outputs, program.out_layouts):  # place in an answer, layout,
            # whether replicated)
            self._outs_in_order.append(
                (o, None, None, l, True)
                if isinstance(o, Const)
                else (o, k, self._answer_at.get(k), l, l.is_replicated())
            )
            k += not isinstance(o, Const)
        self._outs = [entry for entry in self._outs_in_order if entry[1] is not None]
        answer_split = ((False, True) if packing else ()) + tuple(split[k] for k in others)
        sizes = ((0, 0) if packing else ()) + tuple(
            _global_bytes(program, *results[k]) for k in others
        )
        self._answer_by = _answerers(answer_split, sizes, program.mesh.size)
        self._payload = ProgramPayload(
            mesh=program.mesh,
            instructions=instructions,
            inputs=program.inputs,
            outputs=program.outputs,
            answer_by=self._answer_by,
            buckets=program.buckets,
            bucket_bytes=program.bucket_bytes,
            options=self.options,
            in_avals=tuple(program.avals[r] for r in program.inputs),
            packing=packing,
        )
        served = any(
            a == "reduction_server"
            for ins in instructions
            if isinstance(ins, Collective) and ins.kind == StepKind.ALL_REDUCE
            for a in (ins.algorithm, *(price[0] for price in ins.prices))
        )
        self.reducers = program.mesh.topology.reducers if served else 0
        self._resident: resident.Residency | None = (
            resident.Residency() if self.options.resident else None
        )
        self._pack_key = None  # the key of the replicated results' pack kept last
        # (argument index, shape) -> every rank's slices
        self._slices: dict[tuple[int, tuple], list[tuple[slice, ...]]] = {}
        self._start()

    def _loads(self):
        return load, [(self._payload,)] * (self.mesh.size + self.reducers)

    def __call__(self, flat_args):
        self._ready()
        with self._lock:
            return self._step(flat_args)

    def _step(self, flat_args):
        mesh, p = self.program.mesh, self.program
        res, job = self._resident, self.job
        pk, layouts = self._packing, p.in_layouts
        # per rank its argument blocks (arrays) and in order of the blocks, the key of each
        # one the workers kept (runtime.resident) or None for the next of its arrays
        per_rank, refs = [[] for _ in range(mesh.size)], []
        if pk is not None:
            split = [[] for _ in range(mesh.size)]
            for i in self._packed_split:
                x = np.asarray(flat_args[i])
                for blocks, where in zip(split, self._blocks(i, layouts[i], x.shape)):
                    blocks.append(x[where])
            packs, head = self._packer.fill([flat_args[i] for i in self._packed_rep], split)
            for blocks, parts in zip(per_rank, packs):
                blocks += parts
            refs += [head, None]
        for i in self._unpacked:
            x, l = flat_args[i], layouts[i]
            ref = res.ref_for(x, job, l) if res else None
            refs.append(ref)
            if ref is not None:
                continue
            x = np.asarray(x)
            for blocks, where in zip(per_rank, self._blocks(i, l, x.shape)):
                blocks.append(x[where])  # wire and ArgPacker copy any layout
        keys = {} if res is None else self._resident_keys()
        drop = res.drops() if res else []
        # the replicated results' pack stays in the workers too, for a loop's next call
        pack_key = res.pack_key() if res and pk is not None and pk.run is not None else None
        lend = job.lent() < LENT_ANSWERS
        try:
            # the ranks' results are read where they arrived: a large replicated one is the
            # shared memory its rank wrote it into (while it is held, the rank answers into
            # another: Job.call), the others copied once, into the caller's whole array or out
            # of their pack (a fresh copy of each first cost a page fault per 4 KB, most of the
            # caller's time per call with split parameters)
            kept = {self._answer_at[k]: key for k, key in keys.items()}
            if pack_key is not None:
                kept[0] = pack_key
            ranks = self._call(
                run,
                [(b, refs, kept, drop) for b in per_rank] + [([], [], {}, drop)] * self.reducers,
                borrow=True,
            )[: mesh.size]
        except AutoparError:
            if res and not self.job.failure:  # the workers may not have got to them
                res.dropped_later(drop + [k for k in (self._pack_key, pack_key) if k is not None])
            self._pack_key = None
            raise
        if self._pack_key is not None:  # the last call's pack: not referred to again
            res.dropped_later([self._pack_key])
        self._pack_key = pack_key
        ranks = [self._places(r, got) for r, (_, got) in enumerate(ranks)]
        answers = {}
        if pk is not None:  # the packed results: one rank's block, or every rank's, by k
            # a loop passes them back: one block, or (kept in the workers, read-only) none
            rep, own = pk.replicated_pack.copies(
                ranks[self._answer_by[0]][0], writeable=pack_key is None
            )
            self._packer.returned(rep, own, pack_key)
            answers = dict(zip(pk.replicated, rep))
            split = [pk.split_pack.views(got[1]) for got in ranks]
            answers.update(
                (k, self._outs[k][3].assemble([views[j] for views in split], mesh))
                for j, k in enumerate(pk.split)
            )
        out = []
        for o, k, at, layout, replicated in self._outs_in_order:
            if k is None:
                out.append(o.value)
                continue
            if at is None:  # packed: copied or put together above
                x = answers[k]
            elif replicated:
                x = ranks[self._answer_by[at]][at]
                x = x if lend else np.array(x)
            else:  # each rank's block in its place
                x = layout.assemble([r[at] for r in ranks], mesh)
            out.append(res.kept(x, keys[k], job, layout) if k in keys else x)
        return out

    def _places(self, rank: int, got: list) -> list:
        """A rank's answer (the arrays it sent, ``run``) by place in an answer: None where
        another rank sends a replicated result."""
        it = iter(got)
        return [next(it) if by is None or by == rank else None for by in self._answer_by]

    def _blocks(self, i: int, layout, shape) -> list:
        """Every rank's slices of argument ``i`` of ``shape``, in rank order (found once)."""
        got = self._slices.get((i, shape))
        if got is None:
            mesh = self.program.mesh
            got = self._slices[i, shape] = [
                layout.block(shape, mesh.coords(r), mesh) for r in range(mesh.size)
            ]
        return got

    def _resident_keys(self) -> dict:
        """A fresh key per result of ``RESIDENT_BYTES`` or more (by result index)."""
        res = self._resident
        assert res is not None  # asked only with results kept in the workers
        return {k: res.key() for k in self._kept}


LENT_ANSWERS = 4  # a rank's answers whose results the caller may hold in place at once


def _answerers(split, sizes, nranks) -> tuple:
    """Who sends each place of a rank's answer (``split``: whether it is a split result, whose
    block every rank sends; ``sizes``: its bytes): None for a split one; for a replicated one,
    the rank with the fewest replicated bytes to send so far, largest first (rank 0 for the
    first), so that the ranks write a data-parallel step's parameters into their answers side
    by side rather than rank 0 all of them."""
    load = [0] * nranks
    by: list[int | None] = [None] * len(split)
    for i in sorted(range(len(split)), key=lambda i: -sizes[i]):
        if not split[i]:
            rank = min(range(nranks), key=lambda r: (load[r], r))
            by[i] = rank
            load[rank] += sizes[i]
    return tuple(by)


def _global_bytes(program, register, layout) -> int:
    """The bytes of a register's whole value (its local block times the layout's splits)."""
    shape, dtype = program.avals[register]
    return np.dtype(dtype).itemsize * math.prod(shape) * math.prod(layout.splits(program.mesh))


def host_ids(topology) -> list[int]:
    """Device d's host: d // (size of the innermost topology level), device order being the
    topology's (innermost fastest). The native 2D all-reduces split their groups by it."""
    inner = topology.levels[-1].size
    return [d // inner for d in range(topology.num_devices)]


# --- in the workers ---------------------------------------------------------------------------


def compile_shared(comm, segments, ranks, cache):
    """The compiled executables of serialised segments that every rank of ``ranks`` runs
    (``compile_rounds``)."""
    import jax
    from jax import export

    exported = [export.deserialize(b) for b in segments]
    return compile_rounds(
        comm,
        [lambda e=e: jax.jit(e.call).lower(*e.in_avals).compile() for e in exported],
        ranks,
        cache,
    )


def compile_rounds(comm, compiles, ranks, cache):
    """``[c() for c in compiles]``, each compiled once for the job: in rounds, the i-th rank
    of ``ranks`` runs ``compiles[round * len(ranks) + i]`` into the job's XLA cache directory
    ``cache``, and after the rounds every rank loads the rest from it (a round is one compile
    long, and its barrier waits up to ``COMPILE_TIMEOUT`` rather than the collective timeout:
    a compile on a loaded machine can take longer than a collective may wait)."""
    import jax

    WORKER.cache = cache
    if cache is None or len(ranks) == 1:
        return [c() for c in compiles]
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    out, me, n = [None] * len(compiles), ranks.index(comm.rank), len(ranks)
    for start in range(0, len(compiles), n):
        if start + me < len(compiles):
            out[start + me] = compiles[start + me]()
        comm.barrier(list(ranks), timeout=max(comm.timeout, COMPILE_TIMEOUT))
    return [done if done is not None else c() for done, c in zip(out, compiles)]


def load(comm, payload, cache=None):
    """Compile the program's segments (a job runs one program), shared across the ranks of
    the mesh; a Reduction Server rank (after them) only keeps the payload, and waits at a
    barrier of the whole job until the devices' ranks have compiled: its answer would
    otherwise come at once and start the launcher's clock on the compiling ranks (which a
    loaded machine's compiles outlast)."""
    devices = list(range(payload.mesh.size))
    payload.options.apply_x64()
    WORKER.payload, WORKER.reducers = payload, list(range(len(devices), comm.size))
    # every call's argument blocks have these shapes (counted once: jax.Array.nbytes per call
    # took 0.07 ms of a 2-rank medium GPT step's critical path, its caches cold after the step)
    WORKER.stats["input_bytes"] = [math.prod(s) * np.dtype(d).itemsize for s, d in payload.in_avals]
    if comm.rank not in devices:
        compiled_everywhere(comm)
        return True
    WORKER.whole = None
    if payload.options.whole_step:
        from .native_step import WholeStep, supported

        if supported(payload.instructions) is None:
            WORKER.payload, WORKER.whole = payload, WholeStep(comm, payload, devices, cache)
            return True
    compiled = iter(
        compile_shared(
            comm, [ins[1] for ins in payload.instructions if isinstance(ins, tuple)], devices, cache
        )
    )
    steps = [
        ("segment", next(compiled), ins[2], ins[3]) if isinstance(ins, tuple) else ins
        for ins in payload.instructions
    ]
    WORKER.payload, WORKER.steps = payload, steps
    WORKER.frees = _last_reads(steps, payload.outputs)
    WORKER.comm_thread()
    if WORKER.reducers:
        compiled_everywhere(comm)
    return True


def remove_private_cache() -> None:
    """A worker whose caller went away (killed, or exited without closing the job) removes the
    job's own XLA cache folder, which the caller would have removed on close."""
    if WORKER.cache and os.path.basename(WORKER.cache).startswith(PRIVATE_CACHE):
        shutil.rmtree(WORKER.cache, ignore_errors=True)


def compiled_everywhere(comm):
    """Every rank of the job, reducers included, past its compiles (``COMPILE_TIMEOUT``)."""
    comm.barrier(list(range(comm.size)), timeout=max(comm.timeout, COMPILE_TIMEOUT))


def _last_reads(steps, outputs):
    """Per step, the registers no later step or result reads: freed once it has run, so a
    worker holds what the planner's live intervals say, not every value of the step."""
    last = {}
    for k, st in enumerate(steps):
        for r in st[2] if isinstance(st, tuple) else (st.src,):
            if not isinstance(r, Const):
                last[r] = k
    keep = {o for o in outputs if not isinstance(o, Const)}
    frees = [[] for _ in steps]
    for r, k in last.items():
        if r not in keep:
            frees[k].append(r)
    return frees


def execute(st, get, comms) -> list:
    """Run one loaded step (a compiled segment, a collective or a slice); the (register,
    value) pairs it produced now (an all-reduce's result comes later, from ``comms.wait``)."""
    if isinstance(st, tuple):
        _, exe, ins, outs = st
        return list(zip(outs, [np.asarray(y) for y in exe(*[get(i) for i in ins])]))
    if st.kind == StepKind.ALL_REDUCE:
        comms.all_reduce(st, get(st.src))
        return []
    return [(st.out, comms.run(st, get(st.src)))]


def run(comm, arrays, refs, keys=None, drop=()):
    """One step on this rank (a ``flat`` call, ``worker``): its argument blocks, given in
    order by ``refs``: the key of a block it kept (``resident``) or None for the next of
    ``arrays`` -> (None, the results it answers: its split ones, and the replicated ones
    ``answer_by`` names it for, in order). It also keeps the results under ``keys`` (place in
    an answer -> key) and forgets those under ``drop``."""
    p, stats = WORKER.payload, WORKER.stats
    stats["kept_args"] = len(refs) - refs.count(None)
    it = iter(arrays)
    blocks = resident.take([next(it) if b is None else b for b in refs], drop)
    if comm.rank >= p.mesh.size:  # a reducer: serve the step's Reduction Servers
        stats["all_reduce_calls"] += comm.serve_reductions(
            list(range(p.mesh.size)), WORKER.reducers
        )
        return None, []
    meter = PeakMeter(stats)
    if WORKER.whole is not None:
        from autopar._native import collective_seconds

        t0, c0 = time.perf_counter(), collective_seconds()
        results = WORKER.whole(blocks)
        stats["step_seconds"] = time.perf_counter() - t0
        stats["collective_seconds"] = collective_seconds() - c0
        stats["buckets"], stats["host"] = WORKER.whole.buckets, comm.host
        stats["all_reduce_calls"] += len(WORKER.whole.buckets)
    else:
        results = _interpret(comm, blocks, list(range(p.mesh.size)))
    meter.stop(sum(stats["input_bytes"]))
    resident.keep(results, keys or {})
    return None, [
        np.asarray(x)
        for x, by in zip(results, p.answer_by)  # a whole step's are
        if by is None or by == comm.rank
    ]  # JAX arrays


# its argument blocks are views of the call's message (worker.py)
run.flat = True  # type: ignore[attr-defined]  # mypy types no attributes of a function


def _interpret(comm, blocks, workers) -> list:
    """The loaded program's steps in turn (collectives on the comm thread): the results."""
    p, stats = WORKER.payload, WORKER.stats
    assert p is not None  # ``load`` ran first
    regs = dict(zip(p.inputs, blocks))
    comms = CommScheduler(
        comm,
        p.mesh,
        p.buckets,
        p.bucket_bytes,
        p.options.overlap,
        thread=WORKER.comm_thread(),
        reducers=WORKER.reducers,
    )

    def get(r):
        if isinstance(r, Const):
            return np.asarray(r.value, r.dtype)
        if r not in regs:
            regs[r] = comms.wait(r)
        return regs[r]

    try:
        for st, done in zip(WORKER.steps, WORKER.frees):
            regs.update(execute(st, get, comms))
            for r in done:
                regs.pop(r, None)
        results = [get(o) for o in p.outputs if not isinstance(o, Const)]
    finally:
        comms.close()
    if WORKER.reducers:
        comm.release_reducers(WORKER.reducers, workers)
    stats["all_reduce_calls"] += len(comms.buckets)
    stats["buckets"], stats["host"] = comms.buckets, comm.host
    return results


def stats(comm):
    """This worker's counters (for tests and benchmarks): all-reduce calls issued, the latest
    step's all-reduce calls as (tensors, bytes, algorithm), its seconds (``step_seconds``) and
    the part of them inside the collectives' custom calls, moving data or waiting for peers
    (``collective_seconds``; whole-step executables only), argument block sizes, the latest
    measured step's peak memory (``peak_memory.PeakMeter``; None until ``measure_memory`` turned
    measuring on and a step ran) and its host id."""
    return dict(WORKER.stats)
