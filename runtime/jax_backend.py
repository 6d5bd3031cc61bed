"""The JAX backend: run a Program with ``jax.shard_map`` over a ``jax.sharding.Mesh``.

In: a ``Program`` and the flattened global argument arrays. Out: the flattened global results.
The whole Program becomes one jitted ``shard_map``: arguments enter split by the Program's
input layouts (``in_specs``), every ``Segment`` binds its primitives on local blocks with local
params, every ``Collective``/``Slice`` runs as the ``jax.lax`` call of ``jax_collectives``, and
results leave in the Program's output layouts (``out_specs``). On CPU, fake devices
(``--xla_force_host_platform_device_count``) make this the in-process numerical check of every plan.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from autopar.errors import ConfigError
from autopar.graph import Const
from autopar.program import Segment

from .jax_collectives import apply_step
from .jax_distributed import fetch, multi_process, place


def jax_mesh(mesh, given=None) -> Mesh:
    """The jax Mesh for a LogicalMesh: ``given`` (the config's ``jax.sharding.Mesh``) when it
    has the mesh's shape and axis names, else its devices (in its order) or else the first
    ``mesh.size`` of ``jax.devices()``, row-major over the mesh's axes."""
    if isinstance(given, Mesh) and given.size == mesh.size:
        if tuple(given.axis_sizes) == tuple(mesh.shape) and tuple(given.axis_names) == tuple(
            mesh.axis_names
        ):
            return given
        return Mesh(given.devices.reshape(mesh.shape), mesh.axis_names)
    devices = jax.devices()
    if len(devices) < mesh.size:
        raise ConfigError(
            f"{mesh} needs {mesh.size} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{mesh.size} before importing jax, or lower device_num."
        )
    return Mesh(np.array(devices[: mesh.size]).reshape(mesh.shape), mesh.axis_names)


def _explicit(jm: Mesh) -> bool:
    """Whether ``jm`` has an Explicit axis (``jax.make_mesh``'s default in recent JAX)."""
    return any(t == AxisType.Explicit for t in getattr(jm, "axis_types", ()))


def const(c: Const):
    return np.asarray(c.value, dtype=c.dtype)


def execute(ins, get, mesh, step=apply_step) -> list:
    """Inside shard_map: run a Segment, Collective or Slice on local blocks (``get``: register
    or Const -> value; ``step(block, instruction, mesh)`` runs the latter two); the (register,
    value) pairs it produces."""
    if isinstance(ins, Segment):
        return list(zip(ins.outputs, ins(*[get(i) for i in ins.inputs])))
    return [(ins.out, step(get(ins.src), ins, mesh))]


def program_function(program, step=apply_step):
    """The per-device function of a Program: local argument blocks -> local results
    (collectives and slices run by ``step``: ``jax_collectives.apply_step``, or another
    function of the same arguments, e.g. tools/profile.py's local stand-ins)."""
    mesh = program.mesh

    def local(*blocks):
        regs = dict(zip(program.inputs, blocks))
        get = lambda r: const(r) if isinstance(r, Const) else regs[r]
        for ins in program.instructions:
            regs.update(execute(ins, get, mesh, step))
        return tuple(regs[o] for o in program.outputs if not isinstance(o, Const))

    return local


def build_alone(program):
    """A jitted callable for a Program whose ranks all compute alike (``ranks_alike``): one
    rank's step on this process's default device, flat global arguments -> flat global results
    (every one replicated, so a rank's copy is the whole value)."""
    f = jax.jit(program_function(program))
    return lambda flat_args: _with_consts(program, f(*flat_args))


def _moved(x, sharding, host=False):
    """``x``; a JAX array not already in ``sharding`` put there first (jit refuses arrays
    committed to other devices, and a mesh with other axis names failed inside shard_map);
    with ``host``, a host array too (shard_map on Explicit axes takes arrays placed as its
    in_specs say)."""
    if not isinstance(x, jax.Array):
        return jax.device_put(x, sharding) if host else x
    s = x.sharding  # (a step's own results come back P() where it takes P(None, None))
    if (
        isinstance(s, NamedSharding)
        and s.mesh == sharding.mesh
        and s.is_equivalent_to(sharding, x.ndim)
    ):
        return x
    return jax.device_put(x, sharding)


def _with_consts(program, results) -> list:
    """The flat results with the Program's constant outputs put back in their places (a
    constant result comes back as the traced function returned it, e.g. a Python float)."""
    got = iter(results)
    return [o.value if isinstance(o, Const) else next(got) for o in program.outputs]


def sharded_function(program, step=apply_step, devices=None, donate=()):
    """``(f, jax mesh, in_specs)``: the Program as one jitted ``shard_map`` over ``jax_mesh``'s
    devices (``devices``: the config's jax Mesh, or None; collectives and slices run by
    ``step``, as ``program_function``), flat global arguments -> its non-constant global
    results; ``donate``: flat argument positions whose buffers it may reuse, jax.jit's
    ``donate_argnums``)."""
    jm = jax_mesh(program.mesh, devices)
    in_specs = tuple(l.to_partition_spec() for l in program.in_layouts)
    out_specs = tuple(
        l.to_partition_spec()
        for o, l in zip(program.outputs, program.out_layouts)
        if not isinstance(o, Const)
    )
    f = jax.jit(
        jax.shard_map(
            program_function(program, step),
            mesh=jm,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=False,
        ),
        donate_argnums=tuple(donate),
    )
    return f, jm, in_specs


def build(program, process_local=(), devices=None, donate=()):
    """A jitted callable: flat global arguments -> flat global results (on ``devices``, the
    config's jax Mesh, or None: ``jax_mesh``'s; ``donate``: flat positions of arguments whose
    buffers the step may reuse). In a multi-process
    JAX runtime every process calls it with the same arguments (or, for the flat positions
    ``process_local`` marks, its own slice of the batch) and gets the whole results as numpy."""
    f, jm, in_specs = sharded_function(program, devices=devices, donate=donate)
    shardings = [NamedSharding(jm, s) for s in in_specs]
    if multi_process():
        local = set(process_local)
        call = lambda flat: [
            fetch(r)
            for r in f(
                *[place(x, sh, i in local) for i, (x, sh) in enumerate(zip(flat, shardings))]
            )
        ]
    else:  # a JAX array placed otherwise (another mesh, its axis names, other devices,
        host = _explicit(jm)  # one) is moved; host arrays too on an Explicit mesh
        call = lambda flat: f(*[_moved(x, sh, host) for x, sh in zip(flat, shardings)])

    return lambda flat_args: _with_consts(program, call(flat_args))
