"""Strategy: the chosen layout of every operator and argument, as plain data.

In: built by ``autopar.compiler.api`` from an ``Assignment`` (or loaded from JSON). Out: a frozen
``Strategy`` that prints as a table (``table()``), serialises to autopar's JSON (``to_json``,
``save``, ``Strategy.load``/``from_json``, exact round trip) and to MindSpore's strategy
checkpoint JSON (``save(path, format="mindspore")``: ``parallel_strategy_item`` with one
split-count list per operator input, ``parallel_layout_item`` with ``dev_matrix``,
``tensor_map`` and ``tensor_shape`` per parameter).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from autopar.errors import LayoutError
from autopar.graph import type_str
from autopar.layout import Layout
from autopar.mesh import LogicalMesh
from autopar.pipeline_program import pipeline_seconds

from .optimizer import mindspore_fields

FORMAT = "autopar-strategy"
VERSION = 1


def step_seconds(ops, output_comm: float, overhead: float, compute=None) -> float:
    """A step's estimated seconds from its OpStrategy ``ops``: their compute (or ``compute``,
    one rank's as measured: profile_plans) plus the communication feeding them and the
    results' (no overlap assumed) plus the per-call ``overhead``. What a Strategy reports, and
    what auto_parallel ranks its lowered plans by before a Strategy exists."""
    if compute is None:
        compute = sum(o.compute_time for o in ops)
    return compute + sum(o.comm_time for o in ops) + output_comm + overhead


def device_ranges(devices) -> str:
    """``[0-255]`` for devices 0 .. 255, ``[0, 1]`` for two, ``[0-3, 8-11]`` for runs: a
    stage's devices as a reader scans them (a 1536-GPU plan lists 192 per stage)."""
    runs: list[list[int]] = []  # [first, last] of each run
    out: list[str] = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    for a, b in runs:
        out += [str(a)] if a == b else [str(a), str(b)] if b == a + 1 else [f"{a}-{b}"]
    return "[" + ", ".join(out) + "]"


@dataclass(frozen=True, kw_only=True)
class InputStrategy:
    name: str  # pytree path of the argument leaf, e.g. "params.h0.w1"
    shape: tuple
    dtype: str
    layout: Layout
    is_param: bool  # a leaf of the first argument (the parameters)
    update: Layout | None = None  # the parallel optimizer's layout of its update, if sharded


@dataclass(frozen=True, kw_only=True)
class OpStrategy:
    name: str  # "<primitive>.<node index>"
    prim: str
    source: str  # the user's source line
    in_shapes: tuple
    out_shapes: tuple
    in_layouts: tuple  # Layout per operand (literal operands included)
    out_layouts: tuple
    comm_time: float = 0.0  # estimated seconds of the redistributions feeding this operator
    compute_time: float = 0.0  # estimated seconds of the operator itself on one device
    out_bytes: int = 0  # bytes its outputs occupy on one device
    stage: int = 0  # pipeline stage that runs it
    operands: tuple = ()  # per operand: the operator making it ("dot_general.3"), the
    # argument ("params.w1") or "" for a literal
    converted: tuple = ()  # per output: the Layout it is converted to once before its
    # readers read it (None: read as made); empty: none converted


@dataclass(frozen=True, kw_only=True)
class StageStrategy:
    index: int
    devices: tuple  # global device ranks of the stage
    seconds: float  # estimated seconds of one micro-batch (forward and backward)
    memory: int  # estimated peak bytes per device
    mesh_shape: tuple = ()  # the stage's mesh (operator layouts of the stage are on it)
    axis_names: tuple = ()


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """One plan auto_parallel lowered and priced on its mesh before choosing (its label says
    which: the search's, data parallelism's, every operator replicated, ...)."""

    label: str
    seconds: float  # its estimated step
    compute: float  # ... of which compute (measured, when profiled)
    comm: float  # ... communication, by the redistributions it runs
    overhead: float  # ... and the per-call cost
    peak_memory: int  # bytes per device at its peak
    chosen: bool = False
    fits: bool = True  # within max_device_memory


@dataclass(frozen=True, kw_only=True)
class PipelineChoice:
    """One pipeline the planner tried for ``pipeline_stages``/``micro_batches`` "auto"."""

    stages: int
    micro_batches: int
    seconds: float | None = None  # its estimated step (None: it could not be planned)
    peak_memory: int | None = None
    note: str = ""  # why it could not be planned, or "chosen"
    interleave: int = 1  # model parts per stage's devices

    def __str__(self) -> str:
        what = (
            f"{self.seconds * 1e6:.1f} us, peak {format_bytes(self.peak_memory)}"
            if self.seconds is not None and self.peak_memory is not None
            else self.note
        )
        chosen = "  <- chosen" if self.note == "chosen" else ""
        parts = f" x {self.interleave} parts interleaved" if self.interleave > 1 else ""
        return (
            f"{self.stages} stage(s){parts} x {self.micro_batches} micro-batch(es): {what}{chosen}"
        )


@dataclass(frozen=True, kw_only=True)
class CommStrategy:
    kind: str  # a collective kind ("all_reduce", ...), or "send"/"recv" between stages
    axes: tuple  # mesh axis names it runs over
    shape: tuple  # local operand shape
    dtype: str
    bytes: int  # per-device payload
    seconds: float  # estimated seconds (alpha-beta cost of the topology)
    reason: str = ""  # what needed it, e.g. "dot_general.12 input 0"
    stage: int = 0  # pipeline stage that runs it
    count: int = 1  # times per step (a transfer per micro-batch runs micro_batches times)


@dataclass(frozen=True, eq=False, kw_only=True)
class Strategy:
    mode: str
    search: str
    mesh_shape: tuple
    axis_names: tuple
    inputs: tuple  # InputStrategy per flattened argument leaf
    ops: tuple  # OpStrategy per graph node, in graph order
    output_comm_time: float = 0.0  # estimated seconds to lay the results out as returned
    overhead_time: float = 0.0  # estimated seconds per call besides operators and
    # collectives (cost_model.call_overhead)
    peak_memory: int = 0  # estimated peak bytes live on one device
    peak_op: str = ""  # the operator running at the peak
    memory_limit: int | None = None  # max_device_memory, if set
    stages: tuple = ()  # StageStrategy per pipeline stage (empty: no pipeline)
    micro_batches: int = 1
    scheduler: str = ""
    pipeline_interleave: int = 1  # stages per device group (stage j on group j mod groups)
    recompute: str = "as_written"  # the step's recomputation kept ("as_written"), kept for
    # the large values only ("selective") or dropped ("none":
    # autopar.recompute)
    collectives: tuple = ()  # CommStrategy per communication step of the program
    memory_timeline: tuple = ()  # (operator or collective, bytes live on one device) in
    # execution order (empty for a pipeline: see stages)
    pipeline_choices: tuple = ()  # PipelineChoice per pipeline tried ("auto"; else empty)
    search_cost: float | None = None  # auto_parallel: the plan's cost in the search's model
    search_bound: float | None = None  # ... and the least any plan could cost there, proved
    measured_compute: float | None = None  # profile_plans: one rank's compute, measured
    # (tools/profile.py), for the ops' priced sum
    alternatives: tuple = ()  # Alternative per plan auto_parallel compared (else empty)
    topology: str = ""  # what priced it: the preset, or the calibration file
    # and when it was measured (Topology.source)
    outputs: tuple = ()  # Layout per flattened result leaf (empty for a pipeline,
    # whose results are on their stages' meshes)
    # (phase, seconds) of the compile that made it: trace, search (candidates, problem, solver),
    # lower; not saved to files
    phase_seconds: tuple = field(default=(), compare=False)
    # (arguments' pytree structure, results') of the traced step, for ``shardings``; not saved
    trees: tuple = field(default=(), compare=False)

    @property
    def comm_time(self) -> float:
        return sum(o.comm_time for o in self.ops) + self.output_comm_time

    @property
    def compute_time(self) -> float:
        """One rank's compute: measured when the plan was profiled, else the ops' priced sum."""
        if self.measured_compute is not None:
            return self.measured_compute
        return sum(o.compute_time for o in self.ops)

    @property
    def step_time(self) -> float:
        """Estimated step time (``step_seconds``)."""
        return step_seconds(
            self.ops, self.output_comm_time, self.overhead_time, self.measured_compute
        )

    @property
    def pipeline_time(self) -> float:
        """A pipeline's estimated step: ``pipeline_program.pipeline_seconds`` of its stages
        (every stage's time per micro-batch plus micro_batches - 1 times the slowest;
        interleaved, Megatron-LM's schedule of the parts), plus the per-call overhead; 0
        without stages."""
        secs = [st.seconds for st in self.stages]
        return (
            pipeline_seconds(secs, self.micro_batches, self.pipeline_interleave)
            + self.overhead_time
            if secs
            else 0.0
        )

    @property
    def search_gap(self) -> float | None:
        """(search_cost - search_bound) / search_cost: how far the search's plan can be from
        the best in its own model; None without a bound."""
        if self.search_cost is None or self.search_bound is None:
            return None
        return (
            (self.search_cost - self.search_bound) / self.search_cost if self.search_cost else 0.0
        )

    def __repr__(self) -> str:
        mesh = ", ".join(f"{n}={k}" for n, k in zip(self.axis_names, self.mesh_shape))
        staged = (
            f", {len(self.stages)} stages x {self.micro_batches} micro-batches"
            if self.stages
            else ""
        )
        step = self.pipeline_time if self.stages else self.step_time
        return (
            f"Strategy({self.mode}, {self.search}, mesh ({mesh}){staged}, "
            f"{len(self.inputs)} arguments, {len(self.ops)} operators, estimated step "
            f"{step * 1e3:.3f} ms, peak {format_bytes(self.peak_memory)} per device)"
        )

    def _repr_html_(self) -> str:
        """A notebook's view: the summary, then each argument's layout (``table()`` in full)."""
        import html

        rows = "".join(
            f"<tr><td>{html.escape(i.name)}</td><td>{html.escape(type_str(i.shape, i.dtype))}"
            f"</td><td><code>{html.escape(str(i.layout))}</code></td><td>"
            f"{'' if i.update is None else html.escape(str(i.update))}</td></tr>"
            for i in self.inputs
        )
        head = "<br>".join(html.escape(line) for line in self.table().splitlines()[:2])
        return (
            f"<div><p>{head}</p><table><thead><tr><th>argument</th><th>type</th>"
            f"<th>layout</th><th>update</th></tr></thead><tbody>{rows}</tbody></table>"
            "</div>"
        )

    def shardings(self, mesh) -> tuple:
        """``(in_shardings, out_shardings)``: the plan's argument and result layouts as
        ``jax.sharding.NamedSharding``s on ``mesh`` (a ``jax.sharding.Mesh`` with the plan's
        axis names and sizes; an ``AbstractMesh`` for shapes alone), pytrees matching the
        step's arguments (a tuple, one per argument) and results, as ``jax.jit(step,
        in_shardings=..., out_shardings=...)`` takes them. A Strategy read from a file does not
        know the pytrees: its shardings are flat tuples, one per leaf."""
        from autopar.shardings import mesh_of, named_shardings

        if self.stages:
            raise LayoutError(
                f"this plan is a pipeline of {len(self.stages)} stages, each "
                "holding its arguments on its own devices, which one "
                "NamedSharding over the whole mesh cannot say; see each "
                "input's layout on its stage's mesh in strategy.inputs."
            )
        mesh = mesh_of(mesh, self.axis_names, self.mesh_shape)
        in_tree, out_tree = self.trees or (None, None)
        return (
            named_shardings([i.layout for i in self.inputs], mesh, in_tree),
            named_shardings(self.outputs, mesh, out_tree),
        )

    def mesh_matches(self, mesh: LogicalMesh) -> bool:
        return tuple(mesh.shape) == self.mesh_shape and tuple(mesh.axis_names) == self.axis_names

    # ------------------------------------------------------------------ table
    def explain(self) -> str:
        """Why this plan: the plans auto_parallel priced on the mesh (its search's, data
        parallelism's, every operator replicated) with their estimates by term, and how much
        the chosen one gains or loses on each against each other; a pipeline's tries too.
        One screen."""
        rows = [
            f"{self.mode} on mesh ({', '.join(f'{n}={k}' for n, k in zip(self.axis_names, self.mesh_shape))}), "
            f"priced on {self.topology or 'an unnamed topology'}"
        ]
        if not self.alternatives and not self.pipeline_choices:
            rows.append("no alternatives were compared: the mode's planner gives one plan")
            return "\n".join(rows)
        if self.alternatives:
            rows += [
                "plans compared (estimated step = compute + communication + per call; peak "
                "memory per device):"
            ]
            for a in self.alternatives:
                rows.append(
                    f"  {'->' if a.chosen else '  '} {a.label}: {a.seconds * 1e6:.1f} us "
                    f"= {a.compute * 1e6:.1f} + {a.comm * 1e6:.1f} + "
                    f"{a.overhead * 1e6:.1f}; {format_bytes(a.peak_memory)}"
                    + ("" if a.fits else " (over max_device_memory)")
                )
            win = next((a for a in self.alternatives if a.chosen), None)
            if win is not None:
                for a in self.alternatives:
                    if a is win or a.seconds == win.seconds:
                        continue
                    d = lambda x, y: f"{(x - y) * 1e6:+.1f} us"
                    rows.append(
                        f"  against {a.label}: step {d(win.seconds, a.seconds)} (compute "
                        f"{d(win.compute, a.compute)}, communication {d(win.comm, a.comm)}, "
                        f"per call {d(win.overhead, a.overhead)}), memory "
                        f"{format_bytes(win.peak_memory)} against {format_bytes(a.peak_memory)}"
                    )
            ties = [
                a.label
                for a in self.alternatives
                if a is not win and win and a.seconds == win.seconds
            ]
            if ties:
                rows.append(f"  estimated the same as: {'; '.join(ties)} (the first is kept)")
        if self.pipeline_choices:
            rows += ["pipelines tried:"] + [f"  {c}" for c in self.pipeline_choices]
        return "\n".join(rows)

    def table(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.mesh_shape))
        cap = "no cap" if self.memory_limit is None else f"cap {format_bytes(self.memory_limit)}"
        head = [
            f"strategy: mode={self.mode} search={self.search} mesh=({mesh})",
            f"estimated step {self.step_time * 1e6:.1f} us = compute "
            f"{self.compute_time * 1e6:.1f} us"
            + (" (measured)" if self.measured_compute is not None else "")
            + f" + communication {self.comm_time * 1e6:.1f} us"
            + (f" + per call {self.overhead_time * 1e6:.1f} us" if self.overhead_time else "")
            + "; "
            f"peak memory {format_bytes(self.peak_memory)} per device at {self.peak_op or '-'} ({cap})",
        ]
        if self.search_cost is not None:
            head.append(
                f"search: the plan costs {self.search_cost * 1e6:.1f} us in the search's "
                "model; "
                + (
                    "no lower bound proved"
                    if self.search_bound is None
                    else f"every plan costs at least {self.search_bound * 1e6:.1f} "
                    f"us there (proved): gap {self.search_gap:.2%}"
                )
            )
        if self.topology:
            head.append(f"priced on: {self.topology}")
        if self.recompute == "none":
            head.append("recomputation: none (the backward pass reads the forward pass's values)")
        elif self.recompute == "selective":
            head.append(
                "recomputation: selective (the backward pass recomputes the large, "
                "cheap values, the attention's scores, and reads the others)"
            )
        if self.stages:
            parts = (
                f" ({self.pipeline_interleave} per device group, interleaved)"
                if self.pipeline_interleave > 1
                else ""
            )
            head.append(
                f"pipeline: {len(self.stages)} stages{parts}, {self.micro_batches} "
                f"micro-batches, {self.scheduler}, estimated step {self.pipeline_time * 1e6:.1f} us "
                "(operator layouts are per stage; times per micro-batch)"
            )
            head += [
                f"  stage {st.index}: devices {device_ranges(st.devices)}"
                + (
                    f" mesh ({', '.join(f'{n}={k}' for n, k in zip(st.axis_names, st.mesh_shape))})"
                    if st.mesh_shape
                    else ""
                )
                + f", {st.seconds * 1e6:.1f} us, peak {format_bytes(st.memory)} per device"
                for st in self.stages
            ]
        if self.pipeline_choices:
            head.append(
                "pipelines considered (pipeline_stages / micro_batches 'auto'; the "
                "least estimated step within the cap is chosen):"
            )
            head += [f"  {c}" for c in self.pipeline_choices]
        staged = bool(self.stages)
        rows = [("argument", "shape", "layout", "", "", "", "", "")]
        rows += [
            (
                i.name,
                type_str(i.shape, i.dtype),
                str(i.layout) + (f" (update {i.update})" if i.update is not None else ""),
                "",
                "",
                "",
                "",
                "",
            )
            for i in self.inputs
        ]
        rows.append(
            (
                "operator",
                "output",
                "inputs -> output layout",
                "compute us",
                "comm us",
                "memory",
                "stage" if staged else "",
                "source",
            )
        )
        for o in self.ops:
            outs = " ".join(type_str(s, "") for s in o.out_shapes)
            lay = ", ".join(map(str, o.in_layouts)) + " -> " + ", ".join(map(str, o.out_layouts))
            rows.append(
                (
                    o.name,
                    outs,
                    lay,
                    f"{o.compute_time * 1e6:.2f}",
                    f"{o.comm_time * 1e6:.1f}" if o.comm_time else "",
                    format_bytes(o.out_bytes),
                    str(o.stage) if staged else "",
                    short_source(o.source),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(8)]
        lines = head
        for r in rows:
            if r[0] in ("argument", "operator") and r[1] in ("shape", "output"):
                lines.append("")
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return "\n".join(lines)

    # ------------------------------------------------------------------ autopar JSON
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "mode": self.mode,
            "search": self.search,
            "mesh": {"shape": list(self.mesh_shape), "axis_names": list(self.axis_names)},
            "inputs": [
                {
                    "name": i.name,
                    "shape": list(i.shape),
                    "dtype": i.dtype,
                    "layout": str(i.layout),
                    "is_param": i.is_param,
                    **({"update": str(i.update)} if i.update is not None else {}),
                }
                for i in self.inputs
            ],
            "ops": [
                {
                    "name": o.name,
                    "prim": o.prim,
                    "source": o.source,
                    "in_shapes": [list(s) for s in o.in_shapes],
                    "out_shapes": [list(s) for s in o.out_shapes],
                    "in": [str(l) for l in o.in_layouts],
                    "out": [str(l) for l in o.out_layouts],
                    "comm_time": o.comm_time,
                    "compute_time": o.compute_time,
                    "out_bytes": o.out_bytes,
                    "stage": o.stage,
                    "operands": list(o.operands),
                    **(
                        {"converted": [None if l is None else str(l) for l in o.converted]}
                        if o.converted
                        else {}
                    ),
                }
                for o in self.ops
            ],
            "stages": [
                {
                    "index": st.index,
                    "devices": list(st.devices),
                    "seconds": st.seconds,
                    "memory": st.memory,
                    "mesh": {"shape": list(st.mesh_shape), "axis_names": list(st.axis_names)},
                }
                for st in self.stages
            ],
            "micro_batches": self.micro_batches,
            "scheduler": self.scheduler,
            **(
                {"pipeline_interleave": self.pipeline_interleave}
                if self.pipeline_interleave > 1
                else {}
            ),
            **({"recompute": self.recompute} if self.recompute != "as_written" else {}),
            "collectives": [
                {
                    "kind": c.kind,
                    "axes": list(c.axes),
                    "shape": list(c.shape),
                    "dtype": c.dtype,
                    "bytes": c.bytes,
                    "seconds": c.seconds,
                    "reason": c.reason,
                    "stage": c.stage,
                    "count": c.count,
                }
                for c in self.collectives
            ],
            "memory_timeline": [[name, b] for name, b in self.memory_timeline],
            **({"outputs": [str(l) for l in self.outputs]} if self.outputs else {}),
            **(
                {
                    "pipeline_choices": [
                        {
                            "stages": c.stages,
                            "micro_batches": c.micro_batches,
                            "seconds": c.seconds,
                            "peak_memory": c.peak_memory,
                            "note": c.note,
                            **({"interleave": c.interleave} if c.interleave > 1 else {}),
                        }
                        for c in self.pipeline_choices
                    ]
                }
                if self.pipeline_choices
                else {}
            ),
            "output_comm_time": self.output_comm_time,
            "overhead_time": self.overhead_time,
            "peak_memory": self.peak_memory,
            "peak_op": self.peak_op,
            "memory_limit": self.memory_limit,
            **({"search_cost": self.search_cost} if self.search_cost is not None else {}),
            **({"search_bound": self.search_bound} if self.search_bound is not None else {}),
            **(
                {"measured_compute": self.measured_compute}
                if self.measured_compute is not None
                else {}
            ),
            **({"topology": self.topology} if self.topology else {}),
            **(
                {"alternatives": [dict(vars(a)) for a in self.alternatives]}
                if self.alternatives
                else {}
            ),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_json(text: str) -> Strategy:
        """The strategy in autopar's JSON ``text``, every field checked (``strategy_file``)."""
        from .strategy_file import read

        return read(text)

    @staticmethod
    def load(path):
        """The strategy autopar saved at ``path`` (its JSON), or for a MindSpore strategy
        checkpoint (protobuf, or MindSpore's JSON) a ``mindspore_ckpt.MindSporeLayouts``: its
        parameters' layouts and operators' tuples, which ``compile``/``plan`` take as
        ``strategy`` and plan around; for the folder of a pipeline's stage files that ``save``
        wrote, the same of all of them merged."""
        from .mindspore_ckpt import MindSporeLayouts, loads

        if os.path.isdir(path):  # a pipeline's MindSpore stage files (``save``)
            return MindSporeLayouts.read(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise LayoutError(f"cannot read the strategy file {path}: {e.strerror or e}.") from None
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = None
        if not str(path).endswith(".json") and not (text or "").lstrip().startswith(("{", "[")):
            try:
                loads(data, str(path))
            except LayoutError:
                if text is None:  # neither JSON text nor MindSpore's protobuf
                    raise
            else:
                return MindSporeLayouts.read(path)
        elif '"parallel_strategy_item"' in (text or "") and '"autopar-strategy"' not in text:
            return MindSporeLayouts.read(path)
        return Strategy.from_json(text)

    # ------------------------------------------------------------------ MindSpore JSON
    def to_mindspore(self, stage: int | None = None) -> dict:
        """MindSpore's strategy checkpoint as a dict (``mindspore_ckpt``'s form): of the whole
        strategy (every operator; each parameter on the mesh of the stage of its first
        reader), or of pipeline stage ``stage``: what that stage's devices write in MindSpore
        (its operators, every parameter they read, ``current_stage`` = ``stage``), the files
        ``merge_pipeline_strategys`` puts together."""
        mesh = LogicalMesh.create(self.mesh_shape, self.axis_names)
        meshes = {
            st.index: LogicalMesh.create(st.mesh_shape, st.axis_names)
            for st in self.stages
            if st.mesh_shape
        }
        mine = [o for o in self.ops if stage is None or o.stage == stage]
        ops = {
            o.name: {
                "stage": o.stage,
                "parallel_strategy": [
                    list(l.to_strategy(meshes.get(o.stage, mesh))) for l in o.in_layouts
                ],
            }
            for o in mine
        }
        read_in: dict[str, int] = {}  # argument -> the stage of its first reader (here)
        for o in mine:
            for name in o.operands:
                read_in.setdefault(name, o.stage)
        params = {}
        for i in self.inputs:
            if i.is_param and (stage is None or i.name in read_in):
                on = meshes.get(read_in.get(i.name), mesh)
                dm, tmap = i.layout.to_tensor_map(on)
                params[i.name] = {
                    "dev_matrix": list(dm),
                    "tensor_map": [list(t) if isinstance(t, tuple) else t for t in tmap],
                    "tensor_shape": list(i.shape),
                    "field": 0,
                    **_opt_shard(i, on),
                }
        return {
            "current_stage": stage or 0,
            "parallel_strategy_item": ops,
            "parallel_layout_item": params,
        }

    def save(self, path, format: str | None = None) -> None:
        """Write the strategy to ``path``. ``format``: "autopar" (autopar's JSON, which
        ``Strategy.load`` reads back exactly), "mindspore" (MindSpore's strategy checkpoint:
        its JSON when the name ends in ``.json``, which cannot hold a dimension split over
        several mesh axes and refuses one, else its protobuf, which can), or None: autopar's
        JSON for a ``.json`` name and MindSpore's protobuf for any other (as MindSpore decides
        by the name). A pipeline in MindSpore's format is what MindSpore's stages write: one
        file per stage, ``path`` being the folder made for them (``stage0.ckpt``, ... or
        ``.json`` when ``path`` ends in ``.json``), which ``merge_pipeline_strategys`` takes
        whole."""
        if format not in (None, "autopar", "mindspore"):
            raise LayoutError(
                f"format={format!r}: choose 'autopar' or 'mindspore' (or leave "
                "it out: chosen by the file name)."
            )
        as_json = str(path).endswith(".json")
        if format == "autopar" or (format is None and as_json):
            files = {path: self.to_json().encode()}
        else:
            from .mindspore_ckpt import dumps

            hyphen = [i.name for i in self.inputs if i.is_param and "-" in i.name]
            if hyphen:
                import warnings

                from autopar.errors import AutoparWarning

                warnings.warn(
                    f"{path}: parameter {hyphen[0]!r}"
                    + (f" (and {len(hyphen) - 1} more)" if len(hyphen) > 1 else "")
                    + " has a "
                    "hyphen in its name, which MindSpore's checkpoint transforms "
                    "(rank_list_for_transform, transform_checkpoints) read as the stage prefix "
                    "merge_pipeline_strategys writes ('0-name'), so they fail on this file; "
                    "name the parameters without '-' (e.g. '_').",
                    AutoparWarning,
                    stacklevel=2,
                )
            encode = (
                (lambda d: json.dumps(self._mindspore_json(path, d), indent=1).encode())
                if as_json
                else dumps
            )
            if not self.stages:
                files = {path: encode(self.to_mindspore())}
            else:
                try:
                    os.makedirs(path, exist_ok=True)
                except OSError as e:
                    raise LayoutError(
                        f"cannot make the folder {path} for the pipeline's stage "
                        f"files: {e.strerror or e}."
                    ) from None
                files = {
                    os.path.join(
                        path, f"stage{st.index}" + (".json" if as_json else ".ckpt")
                    ): encode(self.to_mindspore(st.index))
                    for st in self.stages
                }
        for name, data in files.items():
            with open(name, "wb") as f:
                f.write(data)

    def _mindspore_json(self, path, d: dict) -> dict:
        """``d`` (from ``to_mindspore``), refusing what MindSpore's JSON reader cannot take."""
        for name, p in d["parallel_layout_item"].items():
            nested = [i for i, t in enumerate(p["tensor_map"]) if isinstance(t, list)]
            if nested:
                layout = next(str(i.layout) for i in self.inputs if i.name == name)
                raise LayoutError(
                    f"{path}: parameter {name}'s layout {layout} splits dimension {nested[0]} "
                    "over several mesh axes, which MindSpore's JSON strategy file cannot hold "
                    "(its reader takes one axis per dimension); save it under a name not "
                    "ending in .json (e.g. strategy.ckpt) for MindSpore's protobuf checkpoint, "
                    "which holds it."
                )
        return d


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KB': bytes in B, KB, MB or GB (powers of 1024), one decimal above B."""
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def short_source(source: str) -> str:
    """'path/to/file.py:12:4 (fn)' -> 'file.py:12 (fn)'."""
    if not source:
        return ""
    loc, _, fn = source.partition(" ")
    parts = loc.rsplit("/", 1)[-1].split(":")
    return ":".join(parts[:2]) + (f" {fn}" if fn else "")


def _opt_shard(i: InputStrategy, mesh) -> dict:
    """MindSpore's optimizer-shard fields of parameter ``i`` on ``mesh`` (its stage's), or a
    LayoutError where MindSpore's rule cannot describe how autopar shards its update."""
    fields = mindspore_fields(i.layout, i.update, mesh)
    if fields is None:
        raise LayoutError(
            f"parameter {i.name}'s update runs in {i.update} (stored in {i.layout}): MindSpore's "
            "optimizer shard splits only dimension 0 of the tensor-parallel slice, inside its "
            "axes, over the innermost free mesh axes, so its opt_weight_shard fields cannot say "
            "how. Plan with strategy_ckpt_save_file (or strategy_ckpt_config's save_file) set to "
            "the MindSpore file's name, and autopar shards updates as MindSpore does; or save in "
            "autopar's JSON (a .json name)."
        )
    return fields
