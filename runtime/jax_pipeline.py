"""Run a PipelineProgram on JAX devices: one controller, each stage on its own devices.

In: a ``PipelineProgram`` and the flattened global arguments. Out: the flattened global
results. Stage s runs on the JAX devices numbered by its ``devices``, shaped like its mesh
(stages may differ in size). Each phase of each stage is one jitted ``shard_map`` over those
devices; a register lives as the stack of its per-device blocks (shape ``(K, *local)``, split
over the stage's devices on dimension 0), so a ``block`` Transfer is a ``jax.device_put`` of
the stack onto the receiving stage's devices, block i to device i, and a ``whole`` one puts the
sender's first block (the whole value) on every receiving device. The controller issues the
tasks of every stage in an order that respects the schedule and the transfers; JAX's
asynchronous dispatch lets stages run at the same time. A phase that receives, after other
work, what a peer stage computes from that work (a global gradient norm over both stages'
gradients, a parameter both stages read) runs as one function per part (``_parts``), in the
order the native runner's blocking receives give it. Accumulation (a sum or a concatenation
over micro-batches) runs on the stage's devices between phases.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.errors import ConfigError, PipelineError
from autopar.graph import Const
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
from autopar.program import reads, writes

from .jax_backend import const, execute
from .jax_distributed import fetch, move, multi_process


class _Phase:
    """One phase of one stage as a jitted function: (m, *stacked inputs) -> stacked outputs."""

    def __init__(self, body, exported, stage_mesh, jmesh, micro):
        made, ins = set(), []
        for i in body:
            if isinstance(i, Transfer) and i.kind == TransferKind.RECV:
                made.add(i.reg)
                ins.append(i.reg)
                continue
            for r in reads(i):
                if r not in made and r not in ins:
                    ins.append(r)
            if not isinstance(i, Accumulate):  # its sum exists after the micro-batches
                made.update(writes(i))
        transfers = [i for i in body if isinstance(i, Transfer)]
        self.recv_keys = {i.reg: i.key for i in transfers if i.kind == TransferKind.RECV}
        sent = [i.reg for i in transfers if i.kind == TransferKind.SEND]
        acc = [i.src for i in body if isinstance(i, Accumulate)]
        self.inputs = tuple(ins)
        self.outputs = tuple(
            dict.fromkeys([r for r in sent + acc if r in made] + [r for r in exported if r in made])
        )
        self.accumulates = [i for i in body if isinstance(i, Accumulate)]
        self.sends = [i for i in body if isinstance(i, Transfer) and i.kind == TransferKind.SEND]
        steps = [i for i in body if not isinstance(i, (Transfer, Accumulate))]

        def local(m, *blocks):
            regs = {r: b[0] for r, b in zip(self.inputs, blocks)}
            get = lambda r: const(r) if isinstance(r, Const) else regs[r]
            for st in steps:
                if isinstance(st, MicroSlice):
                    x = get(st.src)
                    if st.kind == MicroSliceKind.ZERO:
                        regs[st.out] = jnp.where(m == 0, x, jnp.zeros_like(x))
                    else:
                        n = x.shape[st.dim] // micro
                        regs[st.out] = jax.lax.dynamic_slice_in_dim(x, m * n, n, st.dim)
                else:
                    regs.update(execute(st, get, stage_mesh))
            return tuple(regs[r][None] for r in self.outputs)

        if stage_mesh.size > 1:
            spec = P(tuple(stage_mesh.axis_names))
            self.fn = jax.jit(
                jax.shard_map(
                    local,
                    mesh=jmesh,
                    in_specs=(P(),) + (spec,) * len(ins),
                    out_specs=(spec,) * len(self.outputs),
                    check_vma=False,
                )
            )
        else:
            self.fn = jax.jit(local)


def _parts(name: str, body) -> list:
    """Phase ``name``'s ``body`` cut before each receive that follows other work -> (name of
    the part: ``name``, then ``name.1``, ...; its instructions). A part runs as one function,
    all its inputs present before it starts, and publishes its sends when it ends."""
    is_recv = lambda i: isinstance(i, Transfer) and i.kind == TransferKind.RECV
    parts: list[list] = [[]]  # instructions, per part
    for i in body:
        if is_recv(i) and not all(is_recv(j) for j in parts[-1]):
            parts.append([])
        parts[-1].append(i)
    return [(name if k == 0 else f"{name}.{k}", part) for k, part in enumerate(parts)]


@dataclass(eq=False)
class _Run:
    """The state of one call: ``store`` maps (stage, register or tag, micro-batch or None) to a
    stacked value; ``acc`` per stage, accumulation register -> its sum so far, or (dim, parts)
    for a concatenation; ``nxt`` per stage, the index of its next task."""

    store: dict
    acc: list
    nxt: list


class PipelineRunner:
    """Callable: flat global arguments -> flat global results."""

    def __init__(self, program, process_local=()):
        self.p = p = program
        self.process_local = set(process_local) if multi_process() else set()
        devices = jax.devices()
        if len(devices) < p.mesh.size:
            raise ConfigError(
                f"{p.mesh} needs {p.mesh.size} devices but JAX sees {len(devices)} "
                f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_"
                f"count={p.mesh.size} before importing jax, or lower device_num."
            )
        self.shardings, self.phases, self.tasks = [], [], []
        self._done = []  # per stage, the part after which a micro-batch's values go
        results = {o for o in p.outputs if isinstance(o, int)}
        for st, order in zip(
            p.stages, schedule(p.scheduler, len(p.stages), p.micro_batches, p.interleave)
        ):
            devs = np.array([devices[d] for d in st.devices])
            jmesh = Mesh(devs.reshape(st.mesh.shape), st.mesh.axis_names)
            self.shardings.append(NamedSharding(jmesh, P(tuple(st.mesh.axis_names))))
            named = {name: _parts(name, body) for name, body in st.phases()}
            parts = [part for ps in named.values() for part in ps]
            phases = {}
            for k, (name, body) in enumerate(parts):
                elsewhere = set(st.keep) | results
                for other, (_, b) in enumerate(parts):
                    if other != k:
                        elsewhere |= {r for i in b for r in reads(i)}
                phases[name] = _Phase(body, elsewhere, st.mesh, jmesh, p.micro_batches)
            self.phases.append(phases)
            self.tasks.append(
                [(part, m) for name, m in list(order) + [("post", None)] for part, _ in named[name]]
            )
            self._done.append(named["backward"][-1][0])

    def _stacked(self, x, i, m, s):
        st = self.p.stages[s]
        K, mm, lay = st.mesh.size, st.micro_mesh, st.in_layouts[i]
        blocks = [
            np.asarray(x)[lay.block(np.shape(x), mm.coords((m or 0) * K + k), mm)] for k in range(K)
        ]
        return jax.device_put(np.stack(blocks), self.shardings[s])

    def _sent(self, t, v, s):
        """What a send of stacked value ``v`` puts on the peer stage (see the module docstring)."""
        if t.route == Route.BLOCK:
            return v
        k = self.p.stages[t.peer].mesh.size
        out = jnp.broadcast_to(v[0], (k,) + v.shape[1:])
        return jax.device_put(out, self.shardings[s]) if multi_process() else out

    def __call__(self, flat_args):
        """Flat global arguments -> flat global results: each sweep runs the next task of every
        stage whose inputs have arrived, until every stage has run all its tasks. In a
        multi-process JAX runtime every process runs this same sweep; the positions of
        ``process_local`` hold each process's slice of the batch, put together first."""
        if self.process_local:
            flat_args = [
                np.asarray(multihost_utils.process_allgather(x, tiled=True))
                if i in self.process_local
                else x
                for i, x in enumerate(flat_args)
            ]
        run = _Run(
            self._arguments(flat_args), [{} for _ in self.p.stages], [0] * len(self.p.stages)
        )
        while any(n < len(t) for n, t in zip(run.nxt, self.tasks)):
            progressed = False
            for s in range(len(self.p.stages)):
                if run.nxt[s] < len(self.tasks[s]) and self._run_next(run, s):
                    progressed = True
            if not progressed:
                raise self._stuck(run)
        return self._results(run.store)

    def _arguments(self, flat_args) -> dict:
        """Flat global arguments -> the initial store: each stage's argument registers, stacked
        on its devices (per micro-batch for the micro-batched ones)."""
        p = self.p
        store: dict[tuple, jax.Array] = {}
        for st in p.stages:
            for i in st.inputs:
                r = st.arg_regs[i]
                for m in range(p.micro_batches) if i in st.micro_inputs else [None]:
                    store.setdefault((st.index, r, m), self._stacked(flat_args[i], i, m, st.index))
        return store

    def _run_next(self, run: _Run, s: int) -> bool:
        """Run stage ``s``'s next task if its inputs are in ``run.store``, publishing what it
        makes (``_publish``) -> whether it ran."""
        name, m = self.tasks[s][run.nxt[s]]
        ph = self.phases[s][name]
        vals = self._gather(run.store, s, ph, m)
        if vals is None:
            return False
        self._publish(run, s, ph, m, ph.fn(jnp.int32(m or 0), *vals))
        if name == self._done[s]:  # micro-batch m is done on this stage
            for key in [k for k in run.store if k[0] == s and k[2] == m]:
                del run.store[key]
        run.nxt[s] += 1
        if self.tasks[s][run.nxt[s] : run.nxt[s] + 1] == [("post", None)]:  # the sums post reads
            for a, v in run.acc[s].items():
                run.store[(s, a, None)] = (
                    jnp.concatenate(v[1], axis=v[0] + 1) if isinstance(v, tuple) else v
                )
        return True

    def _gather(self, store, s: int, ph: _Phase, m):
        """The inputs of phase ``ph`` of stage ``s`` for micro-batch ``m`` -> their stacks on the
        stage's devices, or None while one has not arrived."""
        vals = []
        for r in ph.inputs:
            v = self._find(store, s, ph.recv_keys.get(r, r), m)
            if v is None:
                return None
            vals.append(move(v, self.shardings[s]))
        return vals

    def _publish(self, run: _Run, s: int, ph: _Phase, m, outs) -> None:
        """The outputs ``outs`` of phase ``ph`` of stage ``s`` on micro-batch ``m`` -> stored
        (kept registers also for every micro-batch), accumulated, and sent to peer stages."""
        st = self.p.stages[s]
        for r, v in zip(ph.outputs, outs):
            run.store[(s, r, m)] = v
            if r in st.keep:
                run.store[(s, r, None)] = v
        for a in ph.accumulates:
            v = run.store[(s, a.src, m)]
            if a.kind == AccumulateKind.SUM:
                run.acc[s][a.out] = v if a.out not in run.acc[s] else run.acc[s][a.out] + v
            else:
                run.acc[s].setdefault(a.out, (a.dim, []))[1].append(v)
        for t in ph.sends:
            run.store[(t.peer, t.key, m if t.micro else None)] = self._sent(
                t, run.store[(s, t.reg, m)], s
            )

    def _stuck(self, run: _Run) -> PipelineError:
        """A sweep where no stage could run -> the error naming what each stage waits for."""
        waits = []
        for s in range(len(self.p.stages)):
            if run.nxt[s] < len(self.tasks[s]):
                name, m = self.tasks[s][run.nxt[s]]
                ph = self.phases[s][name]
                miss = [
                    r
                    for r in ph.inputs
                    if self._find(run.store, s, ph.recv_keys.get(r, r), m) is None
                ]
                waits.append(f"stage {s} {name} {m} for %r{miss[0]}")
        return PipelineError(
            "the pipeline's stages wait on each other: no stage can run "
            f"its next task ({'; '.join(waits)}; an autopar bug, please "
            "report it)."
        )

    def _results(self, store) -> list:
        """The final store -> the flat global results, assembled from their stages' blocks."""
        p, out = self.p, []
        for o, lay, s in zip(p.outputs, p.out_layouts, p.out_stages):
            if isinstance(o, Const):
                out.append(o.value)
                continue
            blocks = fetch(store[(s, o, None)])
            out.append(blocks[0] if lay.is_replicated() else lay.assemble(blocks, p.stages[s].mesh))
        return out

    @staticmethod
    def _find(store, s, r, m):
        for key in ((s, r, m), (s, r, None)):
            if key in store:
                return store[key]
        return None
