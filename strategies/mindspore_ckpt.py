"""MindSpore's strategy checkpoint: the protobuf file MindSpore writes and reads for
``strategy_ckpt_config`` (any name not ending in ``.json``), from and to the dict
``Strategy.to_mindspore`` gives.

In: that dict (``current_stage``; ``parallel_strategy_item``: operator name -> stage and split
tuples; ``parallel_layout_item``: parameter name -> ``dev_matrix``, ``tensor_map``, ``field``,
``opt_weight_shard_step``, ``opt_weight_shard_size``), or the bytes of a MindSpore file. Out:
the bytes (``dumps``), or the dict back (``loads``; protobuf has no ``tensor_shape``).

The messages are MindSpore's ``mindspore.straspb`` (``ParallelStrategyMap`` and what it holds),
with the field names, numbers and labels MindSpore 2.10 publishes in its
``node_strategy.proto`` (Apache-2.0); they are declared here through protobuf's descriptor API
in a pool of their own, so nothing is generated at install and a process that also imports
MindSpore sees no clash.

Tensor maps, as MindSpore writes them: each entry counts device-matrix axes from the last
(0) and -1 is "not split". When no tensor dimension is split over more than one axis, a
parameter has one ``TensorMap`` with an entry per dimension; otherwise it has one
``TensorMap`` per tensor dimension listing that dimension's axes ([-1] for an unsplit one), and
a one-dimensional tensor gets an empty second ``TensorMap`` so that the two forms differ. The
dict holds an int per dimension, or a list for a dimension over several axes.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass

from autopar.device_matrix import DeviceSpec
from autopar.errors import LayoutError

PACKAGE = "mindspore.straspb"
_OPTIONAL, _REQUIRED, _REPEATED = 1, 2, 3
_INT64, _INT32, _STRING, _MESSAGE, _UINT32 = 3, 5, 9, 11, 13

# message -> [(field, number, label, type, message type)], as node_strategy.proto declares them
_SCHEMA = {
    "ParallelStrategy": [("dim", 1, _REPEATED, _UINT32, None)],
    "ParallelStrategys": [
        ("stage", 1, _REQUIRED, _UINT32, None),
        ("parallel_strategy", 2, _REPEATED, _MESSAGE, "ParallelStrategy"),
    ],
    "ParallelStrategyItem": [
        ("node_name", 1, _REQUIRED, _STRING, None),
        ("parallel_strategys", 2, _REQUIRED, _MESSAGE, "ParallelStrategys"),
    ],
    "DevMatrix": [("dim", 1, _REPEATED, _UINT32, None)],
    "TensorMap": [("dim", 1, _REPEATED, _INT32, None)],
    "ParamSplitShape": [("dim", 1, _REPEATED, _INT64, None)],
    "IndicesOffset": [("dim", 1, _REPEATED, _INT64, None)],
    "ParallelLayouts": [
        ("dev_matrix", 1, _REPEATED, _MESSAGE, "DevMatrix"),
        ("tensor_map", 2, _REPEATED, _MESSAGE, "TensorMap"),
        ("param_split_shape", 3, _REPEATED, _MESSAGE, "ParamSplitShape"),
        ("indices_offset", 4, _REPEATED, _MESSAGE, "IndicesOffset"),
        ("field", 5, _REQUIRED, _INT32, None),
        ("opt_weight_shard_step", 6, _REQUIRED, _INT32, None),
        ("opt_weight_shard_size", 7, _REQUIRED, _INT32, None),
    ],
    "ParallelLayoutItem": [
        ("param_name", 1, _REQUIRED, _STRING, None),
        ("parallel_layouts", 2, _REQUIRED, _MESSAGE, "ParallelLayouts"),
    ],
    "ParallelStrategyMap": [
        ("current_stage", 1, _REQUIRED, _UINT32, None),
        ("parallel_strategy_item", 2, _REPEATED, _MESSAGE, "ParallelStrategyItem"),
        ("parallel_layout_item", 3, _REPEATED, _MESSAGE, "ParallelLayoutItem"),
    ],
}


@functools.cache
def _message(name: str):
    """The protobuf message class of ``mindspore.straspb.<name>``."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    pool = _pool(descriptor_pb2, descriptor_pool)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))


@functools.cache
def _pool(descriptor_pb2, descriptor_pool):
    f = descriptor_pb2.FileDescriptorProto(
        name="autopar/mindspore_node_strategy.proto", package=PACKAGE, syntax="proto2"
    )
    for name, fields in _SCHEMA.items():
        m = f.message_type.add(name=name)
        for field, number, label, kind, ref in fields:
            fd = m.field.add(name=field, number=number, label=label, type=kind)
            if ref:
                fd.type_name = f".{PACKAGE}.{ref}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return pool


def dumps(d: dict) -> bytes:
    """MindSpore's protobuf strategy checkpoint of ``d`` (see the module docstring)."""
    m = _message("ParallelStrategyMap")(current_stage=int(d.get("current_stage", 0)))
    for name, op in d.get("parallel_strategy_item", {}).items():
        item = m.parallel_strategy_item.add(node_name=name)
        item.parallel_strategys.stage = int(op["stage"])
        for dims in op["parallel_strategy"]:
            item.parallel_strategys.parallel_strategy.add(dim=[int(x) for x in dims])
    for name, p in d.get("parallel_layout_item", {}).items():
        item = m.parallel_layout_item.add(param_name=name)
        lay = item.parallel_layouts
        lay.dev_matrix.add(dim=[int(x) for x in p["dev_matrix"]])
        tmap = list(p["tensor_map"])
        if all(isinstance(t, int) for t in tmap):
            lay.tensor_map.add(dim=tmap)
        else:
            for t in tmap:
                lay.tensor_map.add(dim=[t] if isinstance(t, int) else list(t))
            if len(tmap) == 1:
                lay.tensor_map.add()
        lay.param_split_shape.add()
        lay.indices_offset.add()
        lay.field = int(p.get("field", 0))
        lay.opt_weight_shard_step = int(p.get("opt_weight_shard_step", 0))
        lay.opt_weight_shard_size = int(p.get("opt_weight_shard_size", 0))
    return m.SerializeToString()


def loads(data: bytes, where: str = "the strategy checkpoint") -> dict:
    """The dict of a MindSpore protobuf strategy checkpoint (``dumps``'s inverse, without
    ``tensor_shape``); LayoutError naming ``where`` when ``data`` is not one."""
    from google.protobuf.message import DecodeError

    m = _message("ParallelStrategyMap")()
    try:
        m.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise LayoutError(
            f"{where} is not a MindSpore strategy checkpoint ({e}); give a file "
            "MindSpore or autopar wrote (protobuf, or JSON named *.json)."
        ) from None
    ops = {}
    for item in m.parallel_strategy_item:
        ops[item.node_name] = {
            "stage": item.parallel_strategys.stage,
            "parallel_strategy": [list(s.dim) for s in item.parallel_strategys.parallel_strategy],
        }
    params = {}
    for item in m.parallel_layout_item:
        lay = item.parallel_layouts
        if len(lay.dev_matrix) != 1 or not lay.tensor_map:
            raise LayoutError(
                f"{where}: parameter {item.param_name!r} has "
                f"{len(lay.dev_matrix)} device matrices and "
                f"{len(lay.tensor_map)} tensor maps; MindSpore writes one device "
                "matrix and at least one tensor map."
            )
        maps = [list(t.dim) for t in lay.tensor_map]
        if len(maps) == 1:
            tmap = maps[0]
        else:
            if len(maps) == 2 and not maps[1]:
                maps = maps[:1]
            tmap = [t[0] if len(t) == 1 else t for t in maps]
        params[item.param_name] = {
            "dev_matrix": list(lay.dev_matrix[0].dim),
            "tensor_map": tmap,
            "field": lay.field,
            "opt_weight_shard_step": lay.opt_weight_shard_step,
            "opt_weight_shard_size": lay.opt_weight_shard_size,
        }
    return {
        "current_stage": m.current_stage,
        "parallel_strategy_item": ops,
        "parallel_layout_item": params,
    }


def read(path) -> dict:
    """The dict of the MindSpore strategy checkpoint at ``path``: its JSON for a ``.json``
    name (or text starting with ``{``), else its protobuf."""
    import json

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LayoutError(
            f"cannot read the strategy checkpoint {path}: {e.strerror or e}."
        ) from None
    if not str(path).endswith(".json") and not data.lstrip().startswith(b"{"):
        return loads(data, str(path))
    try:
        d = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise LayoutError(
            f"{path} is not JSON ({e}); MindSpore's JSON strategy files are "
            "named *.json, its protobuf ones anything else."
        ) from None
    if not isinstance(d, dict) or "parallel_strategy_item" not in d:
        raise LayoutError(f"{path} is not a MindSpore strategy file (no parallel_strategy_item).")
    return d


@dataclass(frozen=True)
class MindSporeLayouts:
    """A MindSpore strategy file as autopar plans with it (what ``Strategy.load`` returns for
    one): each parameter's layout (``DeviceSpec``: its device matrix and tensor map; the
    optimizer-shard fields say how ranks store it, not how operators read it, and are not
    kept), each operator's split tuples, and the pipeline stage the file is of. Given to
    ``compile``/``plan`` (``strategy=`` or ``strategy_ckpt_load_file``), the argument leaves
    named like its parameters keep their layouts and the operators named like its operators
    (in files autopar wrote) their tuples; the mode plans the rest. A pipeline's files (a
    folder of them, or ``merge_pipeline_strategys``' merged file) also give each parameter's
    stage (``param_stages``), from which a pipeline's mesh follows (``stage_mesh``)."""

    path: str
    stage: int
    params: tuple  # ((name, DeviceSpec), ...)
    ops: tuple  # ((name, split tuples), ...)
    files: int = 0  # a pipeline's folder: how many stage files were merged
    param_stages: tuple = ()  # ((name, stage), ...) for a pipeline's files

    @staticmethod
    def read(path) -> MindSporeLayouts:
        """The file at ``path``, or for a folder of a pipeline's stage files all of them
        merged, as ``merge_pipeline_strategys`` merges them: every stage's operators, and each
        parameter's layout from the first stage that has it. A folder's files may have any
        names (``stage0.ckpt`` as ``Strategy.save`` writes them, ``net_pipeline_r4.ckpt`` or
        ``src_strategy_4.ckpt`` as MindSpore's ranks do): each file's stage is its operators'
        (MindSpore's dry run writes the same ``current_stage`` in every file), else its
        ``current_stage``. A merged file's ``N-`` name prefixes are its parameters' stages."""
        if os.path.isdir(path):
            return MindSporeLayouts._merged(path)
        d = read(path)
        try:
            params = tuple(
                (name, DeviceSpec(p["dev_matrix"], p["tensor_map"]))
                for name, p in d["parallel_layout_item"].items()
            )
        except (KeyError, TypeError) as e:
            raise LayoutError(
                f"{path}: a parameter's layout lacks {e}; MindSpore's files give "
                "each one dev_matrix and tensor_map."
            ) from None
        ops = tuple(
            (name, tuple(tuple(t) for t in o["parallel_strategy"]))
            for name, o in d["parallel_strategy_item"].items()
        )
        op_stages = {o.get("stage") for o in d["parallel_strategy_item"].values()} - {None}
        stage = op_stages.pop() if len(op_stages) == 1 else int(d.get("current_stage", 0))
        found = (re.fullmatch(r"(\d+)-(.+)", name) for name, _ in params)
        prefixed = [m for m in found if m is not None]
        if params and len(prefixed) == len(params):  # merge_pipeline_strategys' merged file
            return MindSporeLayouts(
                str(path),
                stage,
                tuple((m.group(2), spec) for m, (_, spec) in zip(prefixed, params)),
                ops,
                param_stages=tuple((m.group(2), int(m.group(1))) for m in prefixed),
            )
        return MindSporeLayouts(str(path), stage, params, ops)

    @staticmethod
    def _merged(path) -> MindSporeLayouts:
        names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
        parts = []
        for name in names:
            try:
                parts.append((name, MindSporeLayouts.read(os.path.join(path, name))))
            except LayoutError:
                continue  # not a strategy file: another file there
        if not parts:
            raise LayoutError(
                f"{path} is a folder without stage files (MindSpore strategy "
                "files, one per stage or per rank, e.g. stage0.ckpt, "
                "stage1.ckpt); give the path of a strategy file or of such a "
                "folder."
            )
        stems: dict[str, list[str]] = {}
        for name, _ in parts:
            stems.setdefault(os.path.splitext(name)[0], []).append(name)
        twice = [v for v in stems.values() if len(v) > 1]
        if twice:
            raise LayoutError(
                f"{path} holds {' and '.join(twice[0])}, one stage in two formats; keep one."
            )
        parts.sort(key=lambda p: p[1].stage)
        params: dict[str, DeviceSpec] = {}
        ops: dict[str, tuple] = {}
        stages: dict[str, int] = {}
        for _, part in parts:
            for name, spec in part.params:
                params.setdefault(name, spec)
                stages.setdefault(name, part.stage)
            ops.update(part.ops)
        return MindSporeLayouts(
            str(path),
            parts[0][1].stage,
            tuple(params.items()),
            tuple(ops.items()),
            len(parts),
            tuple(stages.items()),
        )

    def stage_mesh(self, devices: int) -> tuple | None:
        """The coarsest mesh shape of one stage of ``devices`` devices on which every
        parameter's device matrix of that size is a grouping of whole axes, or None when the
        files give no pipeline's stages (or no matrix of that size)."""
        from autopar.device_matrix import refining_mesh

        if not self.param_stages:
            return None
        matrices = [
            spec.dev_matrix for _, spec in self.params if math.prod(spec.dev_matrix) == devices
        ]
        return tuple(refining_mesh(matrices, devices)) if matrices else None

    def __str__(self) -> str:
        if self.files:
            return (
                f"MindSpore strategy folder {self.path} ({self.files} stage files): "
                f"{len(self.params)} parameter layouts, {len(self.ops)} operator strategies"
            )
        return (
            f"MindSpore strategy file {self.path} (stage {self.stage}): "
            f"{len(self.params)} parameter layouts, {len(self.ops)} operator strategies"
        )

    def table(self) -> str:
        """Its parameters (device matrix, tensor map, split tuple) and operators (tuples), one
        per line, as ``autopar show`` prints them."""
        rows = [str(self), "parameters:"]
        stage = dict(self.param_stages)
        rows += [
            f"  {name}{f' (stage {stage[name]})' if name in stage else ''}: {spec} split "
            f"{spec.counts()}"
            for name, spec in self.params
        ]
        rows += ["operators:"] + [f"  {name}: {list(map(list, t))}" for name, t in self.ops]
        return "\n".join(rows)

    def in_strategy(self, args, names) -> tuple:
        """Per argument of the step, the pytree of its leaves' layouts from the file (None for
        a leaf it does not name). ``names``: (leaf name, is a parameter) per leaf."""
        import warnings

        import jax

        from autopar.errors import AutoparWarning

        have = dict(self.params)
        leaves = [have.get(n) for n, _ in names]
        if not any(leaves):
            raise LayoutError(
                f"{self}: none of its parameters ({', '.join(sorted(have)[:6])}...) is an "
                f"argument of the step (its leaves are named {', '.join(n for n, _ in names[:6])}"
                "...); name the step's parameters as the file does."
            )
        unused = sorted(set(have) - {n for n, _ in names})
        if unused:
            warnings.warn(
                f"{self}: {len(unused)} of its parameters name no argument of the "
                f"step ({', '.join(unused[:4])}...): their layouts are not used.",
                AutoparWarning,
                stacklevel=3,
            )
        out, k = [], 0
        for a in args:
            tree = jax.tree.structure(a)
            size = tree.num_leaves  # type: ignore[attr-defined]  # jaxlib ships no PyTreeDef stubs
            out.append(jax.tree.unflatten(tree, leaves[k : k + size]))
            k += size
        return tuple(out)
