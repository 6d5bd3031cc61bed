"""Trace a JAX function into autopar's Graph.

In: a Python function and example arguments (pytrees of arrays or ``jax.ShapeDtypeStruct``).
Out: a ``Graph`` whose inputs are the flattened leaves and whose outputs are the flattened
results (``in_tree``/``out_tree`` keep the pytree structure). Nested ``jit``, ``closed_call``,
``remat``/``jax.checkpoint``, ``custom_jvp_call`` and ``custom_vjp_call`` are inlined: by the time a training step
is traced the custom derivative rules have been applied, so their primal bodies are what runs.
``lax.scan`` is unrolled and ``lax.cond`` computed as a select of its branches
(``trace_control``).
PRNG keys (``jax.random``) are kept as their uint32 data, each operation on keys inlined as the
operations on the data JAX lowers it to (``trace_keys``). Operators whose results nothing reads
are dropped. A 16-bit activation promoted to float32 by a NumPy scalar constant
(``autopar.precision``) is warned about, naming its line.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend.core import Literal

from . import index_batching, trace_control, trace_keys
from .errors import AutoparWarning, ConfigError, LayoutError, RuleError
from .graph import Const, Graph, Node, Value
from .jax_frames import hide_autopar_frames
from .precision import promotions

hide_autopar_frames()  # the user's line, not autopar's, as an operation's source

# primitive name -> parameter holding the body to inline
_INLINE = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def _flat(fn, args):
    """``(flat_fn, specs, in_tree, out_tree)``: ``fn`` on flattened leaves, the leaves' shapes,
    and a callable giving the results' tree once ``flat_fn`` has been traced."""
    flat, in_tree = jax.tree.flatten(args)
    box = []

    def flat_fn(*leaves):
        leaves_out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
        box.append(tree)
        return leaves_out

    specs = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in flat]
    return flat_fn, specs, in_tree, lambda: box[-1]


def _graph(jaxpr, consts, in_tree, out_tree) -> Graph:
    for what, vs in (("argument", jaxpr.invars), ("result", jaxpr.outvars)):
        k = next((i for i, v in enumerate(vs) if trace_keys.is_key(v.aval)), None)
        if k is not None:
            raise RuleError(
                f"the step's {what} {k} (flattened) is a typed PRNG key "
                f"({vs[k].aval.str_short()}); pass and return its data instead: "
                "jax.random.key_data(key), or a raw jax.random.PRNGKey, which "
                "jax.random takes as it is."
            )
    b = _Builder()
    inputs = [b.new_value(v.aval) for v in jaxpr.invars]
    outs = b.inline(jaxpr, consts, inputs, "", "")
    return Graph.build(inputs, outs, b.live_nodes(outs), in_tree, out_tree)


def trace(fn, *args) -> Graph:
    flat_fn, specs, in_tree, out_tree = _flat(fn, args)
    try:
        closed = jax.make_jaxpr(flat_fn)(*specs)
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerIntegerConversionError,
        jax.errors.TracerBoolConversionError,
    ) as e:
        raise ConfigError(
            f"the step used a traced value as a Python value ({type(e).__name__}, its message "
            "below): every argument of a compiled step, Python numbers included, is traced as "
            "an array, as under jax.jit. Pass a number the step uses as a Python number (a "
            "loop count, a shape, a flag) as static_argnums/static_argnames, or bind it with "
            "functools.partial or a closure before compiling; for a choice that depends on "
            f"array values use lax.cond or jnp.where.\n{e}"
        ) from e
    except NameError as e:
        if "axis name" not in str(e):
            raise
        raise ConfigError(
            f"the step calls a collective over a mesh axis nothing binds ({e}): a step ported "
            "from pmap keeps lax.pmean/psum over its batch axis, but autopar's modes write the "
            "step for one device and insert the collectives themselves: data_parallel already "
            "averages the gradients over the devices (gradients_mean=True), so drop the "
            "lax.pmean; to call collectives yourself use parallel_mode='hybrid_parallel' with "
            "ap.comm.all_reduce(x, axis) and friends over the config's mesh axes."
        ) from None
    lines = promotions(closed.jaxpr)
    if lines:
        more = f" (and {len(lines) - 1} more lines)" if len(lines) > 1 else ""
        warnings.warn(
            AutoparWarning(
                f"the step turns 16-bit activations into float32 at {lines[0]}{more}: a NumPy "
                "scalar (np.sqrt(d), np.float32(c)) is a float32 constant to JAX, unlike a Python "
                "float, so what follows holds twice the bytes and runs at float32 speed; divide by "
                "math.sqrt(d), or cast the constant to the activation's dtype "
                "(jnp.asarray(c, x.dtype)), to stay in 16 bits."
            ),
            stacklevel=2,
        )
    return _graph(closed.jaxpr, closed.consts, in_tree, out_tree())


def trace_per_device(fn, args, mesh, in_specs, out_specs=None) -> Graph:
    """The per-device Graph of ``fn`` run under ``jax.shard_map`` on ``mesh`` (a LogicalMesh):
    arguments split by ``in_specs`` (a PartitionSpec per flattened leaf), results by
    ``out_specs`` (one per flattened result); values have local shapes and collectives
    (``psum``, ``all_gather``, ..., ``pvary``) are nodes. JAX's replication check applies: a
    result declared replicated must be the same on every device. ``out_specs=None`` traces
    once without that check, for the results' structure and local shapes only."""
    from jax.sharding import AbstractMesh, PartitionSpec

    flat_fn, specs, in_tree, out_tree = _flat(fn, args)
    am = AbstractMesh(tuple(mesh.shape), tuple(mesh.axis_names))
    if len(jax.devices()) >= mesh.size:
        # with the kind of JAX's devices, as the jax backend's mesh has it: the values inside a
        # while loop's body carry the mesh they were traced on, and must match where they run
        am = jax.sharding.Mesh(
            np.array(jax.devices()[: mesh.size]).reshape(am.axis_sizes), am.axis_names
        ).abstract_mesh
    try:
        closed = jax.make_jaxpr(
            jax.shard_map(
                flat_fn,
                mesh=am,
                in_specs=tuple(in_specs),
                out_specs=PartitionSpec() if out_specs is None else list(out_specs),
                check_vma=out_specs is not None,
            )
        )(*specs)
    except ValueError as e:
        if "out_specs" not in str(e):
            raise
        raise LayoutError(
            f"hybrid_parallel: {e}\nReturn values the same on every device "
            "(reduce them with ap.comm.all_reduce or gather them with "
            "ap.comm.all_gather), or new state in its argument's layout."
        ) from None
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    return _graph(eqn.params["jaxpr"], (), in_tree, out_tree())


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.next_id = 0
        self.effectful: set[int] = set()  # ids of nodes with side effects (callbacks)
        self.made: dict[int, Node] = {}  # value id -> the node computing it

    def live_nodes(self, outs) -> list:
        """The nodes whose results reach ``outs`` (or that have side effects), renumbered in
        order. Inlining leaves dead operators behind (a custom_jvp's zeros, a jvp's unused
        tangent): they would be planned, priced and held in memory, though nothing reads them."""
        needed = {o.id for o in outs if isinstance(o, Value)}
        keep = [False] * len(self.nodes)
        for n in reversed(self.nodes):
            if n.id in self.effectful or any(v.id in needed for v in n.outputs):
                keep[n.id] = True
                needed.update(x.id for x in n.inputs if isinstance(x, Value))
        live = [n for n in self.nodes if keep[n.id]]
        return [n if n.id == k else dataclasses.replace(n, id=k) for k, n in enumerate(live)]

    def new_value(self, aval, eqn=None) -> Value:
        try:
            dtype = np.dtype(aval.dtype)
        except TypeError:
            where = (
                (
                    f" made by '{eqn.primitive.name}' at "
                    f"{source_info_util.summarize(eqn.source_info)}"
                )
                if eqn is not None
                else ""
            )
            raise RuleError(
                f"a value of type {aval.str_short()}{where} has no array dtype "
                "autopar can shard; compute it outside the step, or return and "
                "pass its data as an array."
            ) from None
        v = Value(self.next_id, tuple(int(d) for d in aval.shape), dtype)
        self.next_id += 1
        return v

    def inline(self, jaxpr, consts, args, outer_src, outer_scope):
        env = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = Const(np.asarray(c), tuple(np.shape(c)), np.dtype(_dtype(c)))
        for var, a in zip(jaxpr.invars, args):
            env[var] = a

        def read(atom):
            if isinstance(atom, Literal):
                val = atom.val
                return Const(val, tuple(np.shape(val)), np.dtype(atom.aval.dtype))
            return env[atom]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            src = source_info_util.summarize(eqn.source_info) or outer_src
            scope = "/".join(s for s in (outer_scope, str(eqn.source_info.name_stack)) if s)
            key = _INLINE.get(eqn.primitive.name)
            control = trace_control.HANDLERS.get(eqn.primitive.name)
            if control is not None:  # scan unrolled, cond as a select
                outs = control(self, eqn, ins, src, scope)
            elif key is not None and key in eqn.params:
                body = eqn.params[key]
                if eqn.primitive.name == "custom_vjp_call_jaxpr" or hasattr(body, "consts"):
                    sub, sub_consts = body.jaxpr, body.consts
                else:
                    sub, sub_consts = body, ()
                outs = self.inline(sub, sub_consts, ins, src, scope)
            elif trace_keys.involves_keys(eqn):  # on a key's data instead (trace_keys)
                rule = trace_keys.physical_rule(eqn, f" at {src}" if src else "")
                outs = self.emit(rule, ins, src, scope)
            else:
                outs = self.add_node(eqn, ins, src, scope)
            for var, o in zip(eqn.outvars, outs):
                env[var] = o
        return [read(a) for a in jaxpr.outvars]

    def emit(self, fn, ins, src, scope) -> list:
        """``fn`` (a function of arrays shaped as ``ins`` returning a list) traced and inlined
        on ``ins``: its results as graph values."""
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ins]
        sub = jax.make_jaxpr(fn)(*specs)
        return self.inline(sub.jaxpr, sub.consts, list(ins), src, scope)

    def add_node(self, eqn, ins, src, scope) -> list:
        """``eqn`` as one operator on ``ins``: its results, new values (a batch-aligned gather
        or scatter with its aligned index columns as batching dimensions: index_batching)."""
        batched = index_batching.rewrite(eqn, ins, self.made)
        if batched is not None:
            return self.emit(batched[0], batched[1], src, scope)
        outs = [self.new_value(v.aval, eqn) for v in eqn.outvars]
        if eqn.effects:
            self.effectful.add(len(self.nodes))
        node = Node(
            len(self.nodes),
            eqn.primitive,
            tuple(ins),
            tuple(outs),
            dict(eqn.params),
            src,
            scope,
            "transpose(" in scope,
        )
        self.nodes.append(node)
        self.made.update((v.id, node) for v in outs)
        return outs
