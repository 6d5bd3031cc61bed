"""The arguments of a step: their names, their layouts and the state the step threads through.

In: the example arguments (pytrees; the first holds the parameters), the traced Graph (or any
object with ``inputs``: Values with global shapes), the ParallelConfig, the LogicalMesh,
``batch_argnums`` and ``in_strategy``. Out: per flattened leaf its name (``leaf_names``) and
type (``leaf_type``); the layouts the mode, ``dataset_strategy`` and ``in_strategy`` fix
(``arg_layouts``); the layouts ``ap.shard`` fixes (``fixed_layouts``); which results are new
values of which arguments (``state_pairs``). Invalid specs raise ``LayoutError``/``ConfigError``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .annotate import shard_p
from .config import ParallelMode
from .device_matrix import DeviceSpec, MeshTemplate, OperatorSpec
from .errors import ConfigError, LayoutError
from .layout import Layout


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_names(args) -> list[tuple[str, bool]]:
    """(name, is_param) per flattened leaf: parameter leaves by their path ("h0.w1"), other
    arguments as "arg<i>.<path>"."""
    out = []
    for i, a in enumerate(args):
        for path, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            p = ".".join(_key_str(k) for k in path)
            out.append(((p or "params") if i == 0 else f"arg{i}" + (f".{p}" if p else ""), i == 0))
    return out


def check_call(fn, args, batch_argnums) -> tuple:
    """ConfigError unless ``fn`` is callable, every argument leaf is a number or an array of
    numbers (or a ``jax.ShapeDtypeStruct``) and ``batch_argnums`` names arguments; the batch
    arguments' positions as a tuple (default, until the step is traced: every argument after
    the first; ``default_batch`` then leaves out the state the step returns)."""
    if not callable(fn):
        raise ConfigError(f"the step {fn!r} is not callable; pass the function to compile.")
    for (name, _), x in zip(leaf_names(args), jax.tree.leaves(args)):
        dtype = getattr(x, "dtype", None)
        if dtype is None and isinstance(x, (bool, int, float, complex)):
            continue
        try:
            kind = np.dtype(dtype).kind if dtype is not None else None
        except TypeError:
            kind = None
        if kind not in tuple("biufc") and not (
            dtype is not None and jax.dtypes.issubdtype(dtype, np.number)
        ):
            raise ConfigError(
                f"argument leaf {name} is {type(x).__name__} "
                f"{_short(x)}; every argument leaf must be a number or an array of "
                "numbers (or a jax.ShapeDtypeStruct). For a Python value (an "
                "optax optimizer, a config, a flag) pass its position as "
                "static_argnums (or its name as static_argnames), as jax.jit "
                "takes it, or bind it first: functools.partial(step, value)."
            )
    if batch_argnums is None:
        return tuple(range(1, len(args)))
    given = [batch_argnums] if isinstance(batch_argnums, int) else batch_argnums
    if (
        not isinstance(given, (list, tuple))
        or not all(
            isinstance(k, int) and not isinstance(k, bool) and -len(args) <= k < len(args)
            for k in given
        )
        or isinstance(batch_argnums, bool)
    ):
        raise ConfigError(
            f"batch_argnums={batch_argnums!r} must be an argument position or a "
            f"tuple of them, integers in 0 .. {len(args) - 1} (the step takes "
            f"{len(args)} arguments), e.g. (1,)."
        )
    out = tuple(k % len(args) for k in given)
    if len(set(out)) != len(out):
        raise ConfigError(f"batch_argnums={batch_argnums!r} names an argument twice.")
    return out


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def leaf_type(x) -> tuple:
    """(shape, dtype) of an argument leaf as JAX will see it (float64 -> float32 unless x64),
    to compare (``type_str(*t)`` prints it). An array's own dtype is its type (``result_type``
    would say the same, at 30 us a call); scalars and other leaves go through ``result_type``."""
    if isinstance(x, (np.ndarray, jax.Array)):
        return tuple(x.shape), _canonical(x.dtype)
    return tuple(np.shape(x)), _canonical(jax.numpy.result_type(x))


@functools.cache
def _canonical(dtype):
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)  # typed PRNG keys


def check_counts(spec, shape, devices: int, what) -> tuple:
    """``spec`` as a split tuple for a value of ``shape`` on ``devices`` devices, or the
    LayoutError that says what is wrong with it."""
    counts = tuple(spec)
    if not all(isinstance(c, (int, np.integer)) and c >= 1 for c in counts):
        raise LayoutError(
            f"{what}: strategy {counts} must hold integer split counts >= 1 "
            "(1 = not split); to name mesh axes give a "
            "jax.sharding.PartitionSpec, e.g. P(None, 'y'), an ap.Layout or its "
            "text, e.g. '[_,y]' (Layout.from_partition_spec converts)."
        )
    if len(counts) != len(shape):
        raise LayoutError(
            f"{what}: strategy {counts} has {len(counts)} entries but the value "
            f"has shape {tuple(shape)}; give one split count per dimension."
        )
    if math.prod(counts) > devices:
        raise LayoutError(
            f"{what}: strategy {counts} splits into {math.prod(counts)} parts but "
            f"there are only {devices} devices; lower the split counts."
        )
    for i, (s, c) in enumerate(zip(shape, counts)):
        if s % c:
            raise LayoutError(
                f"{what}: split count {c} does not divide dimension {i} of size "
                f"{s} (shape {tuple(shape)}); choose a divisor of {s}."
            )
    return tuple(int(c) for c in counts)


def spec_layout(spec, shape, mesh, what) -> Layout:
    """A user's layout of a value of ``shape`` on ``mesh`` (split counts, a PartitionSpec, a
    Layout or its text, MindSpore's device-matrix forms), checked; ``what`` names it in errors."""
    if isinstance(spec, str):
        spec = Layout.parse(spec)
    if isinstance(spec, PartitionSpec):
        spec = Layout.from_partition_spec(spec, len(shape))
    if isinstance(spec, MeshTemplate):
        raise LayoutError(
            f"{what}: {spec} is a device matrix, not a layout: call it with one "
            "alias per tensor dimension, e.g. ap.Layout((2, 4), ('dp', 'mp'))"
            "('dp', 'None')."
        )
    if isinstance(spec, OperatorSpec):
        first = spec.resolve(mesh.size, what)
        if not spec.repeat_left and not first.fits(mesh):  # a mesh of the user's: the
            first = replace(spec, repeat_left=True).resolve(mesh.size, what)  # repeat first
        spec = first
    if isinstance(spec, DeviceSpec):
        if len(spec.tensor_map) != len(shape):
            raise LayoutError(
                f"{what}: {spec} has {len(spec.tensor_map)} tensor-map entries but "
                f"the value has shape {tuple(shape)}; give one per dimension."
            )
        spec = spec.to_layout(mesh, what)
    if not isinstance(spec, Layout):
        counts = check_counts(spec, shape, mesh.size, what)
        try:
            spec = Layout.from_strategy(counts, mesh)
        except LayoutError as e:
            raise LayoutError(
                f"{what}: {e} With mesh_shape={mesh.shape} the counts must be products "
                "of distinct mesh axis sizes; for this split choose a mesh_shape "
                "that has such axes (e.g. (4, 2) for a 4-way split on 8 devices)."
            ) from None
    spec = Layout(
        tuple(
            tuple(a for a in d if a not in mesh.axis_names or mesh.axis_size(a) > 1)
            for d in spec.dims
        ),
        spec.partial,
    )  # size-1 axes split nothing
    if spec.partial:
        raise LayoutError(
            f"{what}: layout {spec} is a partial sum; a user layout says how a whole "
            "value is split, so remove the sum{...} part."
        )
    return spec.check(shape, mesh, what)


def arg_layouts(config, mesh, graph, args, batch_argnums, in_strategy, names) -> dict:
    mode = config.parallel_mode
    leaf_arg = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    layouts = {}
    ds = config.dataset_strategy
    if mode is ParallelMode.DATA_PARALLEL or (
        mode is ParallelMode.HYBRID_PARALLEL and ds in (None, "data_parallel")
    ):
        axes = tuple(a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1)
        for j, v in enumerate(graph.inputs):
            if leaf_arg[j] in batch_argnums and v.shape:
                if v.shape[0] % mesh.size:
                    raise LayoutError(
                        f"data_parallel: batch argument {names[j][0]} has dimension 0 "
                        f"of size {v.shape[0]}, not divisible by device_num="
                        f"{mesh.size}; use a batch size that is a multiple of it (if "
                        f"argument {leaf_arg[j]} is not a batch, pass batch_argnums "
                        "naming only the batch arguments)."
                    )
                layouts[j] = Layout((axes,) + ((),) * (len(v.shape) - 1))
    if mode is ParallelMode.STAND_ALONE or mesh.size == 1:
        return layouts
    if mode is ParallelMode.DATA_PARALLEL and ds not in (None, "data_parallel"):
        raise ConfigError(
            f"dataset_strategy={ds!r} with parallel_mode='data_parallel', which "
            "always splits the batch; use semi_auto_parallel or auto_parallel."
        )
    free = (
        ParallelMode.SEMI_AUTO_PARALLEL,
        ParallelMode.AUTO_PARALLEL,
        ParallelMode.HYBRID_PARALLEL,
    )
    if ds is not None and mode in free:
        batch = [j for j, v in enumerate(graph.inputs) if leaf_arg[j] in batch_argnums]
        if isinstance(ds, tuple) and len(ds) != len(batch):
            raise ConfigError(
                f"dataset_strategy has {len(ds)} entries but the step has "
                f"{len(batch)} batch leaves ({', '.join(names[j][0] for j in batch)}); "
                "give one split tuple per batch leaf."
            )
        for k, j in enumerate(batch):
            shape = graph.inputs[j].shape
            spec = (
                ds[k]
                if isinstance(ds, tuple)
                else (
                    (mesh.size,) + (1,) * (len(shape) - 1)
                    if ds == "data_parallel" and shape
                    else (1,) * len(shape)
                )
            )
            layouts[j] = spec_layout(spec, shape, mesh, f"dataset_strategy of {names[j][0]}")
    if in_strategy is not None and mode in free:
        if len(in_strategy) != len(args):
            raise LayoutError(
                f"in_strategy has {len(in_strategy)} entries for {len(args)} "
                "arguments; give one per argument (None for 'no constraint')."
            )
        is_leaf = lambda x: (
            x is None
            or isinstance(x, (Layout, str, DeviceSpec, PartitionSpec))
            or (isinstance(x, tuple) and all(isinstance(c, (int, float)) for c in x))
        )
        j = 0
        for a, spec in zip(args, in_strategy):
            try:  # spec is a prefix of the argument: one entry covers a whole subtree
                per_leaf = jax.tree.map(
                    lambda s, sub: _Covers(s, len(jax.tree.leaves(sub))), spec, a, is_leaf=is_leaf
                )
            except ValueError as e:
                named = isinstance(spec, tuple) and any(isinstance(x, str) for x in spec)
                raise LayoutError(
                    f"in_strategy entry {spec!r} does not match the structure of its argument"
                    + (
                        f"; to split by mesh axis names write a PartitionSpec, "
                        f"P{spec!r}, or a layout's text like '[x,_]'"
                        if named
                        else ""
                    )
                    + f": {str(e).splitlines()[0]}"
                ) from None
            specs = [s for group in jax.tree.leaves(per_leaf) for s in group.specs()]
            for s in specs:
                if s is not None:
                    layouts[j] = spec_layout(
                        s, graph.inputs[j].shape, mesh, f"in_strategy of {names[j][0]}"
                    )
                j += 1
    return layouts


class _Covers:
    """One in_strategy entry and how many argument leaves it covers (a pytree leaf: lists in
    the arguments, a model's list of layers, stay structure)."""

    def __init__(self, spec, count):
        self.spec, self.count = spec, count

    def specs(self) -> list:
        return [self.spec] * self.count


def fixed_layouts(config, mesh, graph) -> dict:
    if config.parallel_mode not in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
        return {}
    return {
        n.id: spec_layout(
            n.params["spec"], n.outputs[0].shape, mesh, f"ap.shard at {n.source or n.name}"
        )
        for n in graph.nodes
        if n.prim == shard_p.name
    }


def default_batch(graph) -> tuple:
    """The batch arguments when the user names none: every argument after the first whose new
    version the step does not return (``state_pairs``: optimizer state, a PRNG key threaded
    through) and that is not a PRNG key (``_key_like``), so ``step(params, opt_state, batch)``
    and ``step(params, batch, key)`` split the batch alone; every argument after the first if
    that leaves none."""
    args = [jax.tree.leaves(a) for a in jax.tree.unflatten(graph.in_tree, range(len(graph.inputs)))]
    state = {i for i, _ in state_pairs(graph)}
    batch = tuple(
        a
        for a in range(1, len(args))
        if not (args[a] and set(args[a]) <= state)
        and not (args[a] and all(_key_like(graph.inputs[j]) for j in args[a]))
    )
    return batch or tuple(range(1, len(args)))


def _key_like(v) -> bool:
    """Whether graph input ``v`` holds PRNG key data: uint32 with a last dimension of 2
    (threefry, ``jax.random.PRNGKey`` or a typed key's data) or 4 (rbg), at most one other."""
    return np.dtype(v.dtype) == np.uint32 and 1 <= len(v.shape) <= 2 and v.shape[-1] in (2, 4)


def state_pairs(graph) -> tuple:
    """(graph input, graph output) leaf positions of the state a step threads through: each
    top-level result that repeats an argument's pytree structure, shapes and dtypes (new
    parameters, new optimizer state) is paired leaf by leaf with the first such argument."""
    n_in, n_out = len(graph.inputs), len(graph.outputs)
    args = jax.tree.unflatten(graph.in_tree, range(n_in))
    outs = jax.tree.unflatten(graph.out_tree, range(n_out))
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    typ = lambda x: (tuple(x.shape), np.dtype(x.dtype))
    pairs: list[tuple[int, int]] = []
    used: set[int] = set()
    for out in outs:
        o_leaves, o_tree = jax.tree.flatten(out)
        for a, arg in enumerate(args):
            a_leaves, a_tree = jax.tree.flatten(arg)
            if (
                a not in used
                and a_tree == o_tree  # type: ignore[operator]  # jaxlib has no PyTreeDef stub
                and all(
                    typ(graph.inputs[i]) == typ(graph.outputs[j])
                    for i, j in zip(a_leaves, o_leaves)
                )
            ):
                used.add(a)
                pairs += zip(a_leaves, o_leaves)
                break
    return tuple(pairs)
