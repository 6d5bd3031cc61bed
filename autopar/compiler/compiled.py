"""The ``Compiled`` step ``compile`` returns: call it like the original function.

In: the step function, its traced Graph, the config, the chosen Strategy and Program, and the
arguments' tree and leaf types it was compiled for. Out: calling it checks the arguments
against those, starts the config's runtime on the first call (native workers, one rank in
this process for a plan whose ranks compute alike, a pipeline's runner, or the jax backend's
shard_map) and returns the step's results as the plain function's pytree.
"""

from __future__ import annotations

import time

import jax
from jax.core import Tracer

from ..arguments import _canonical, leaf_type
from ..config import Backend
from ..errors import ConfigError
from ..graph import type_str
from ..pipeline_program import PipelineProgram
from ..progress import logger
from ..shardings import named_shardings


class Compiled:
    """A compiled step: call it like the original function."""

    def __init__(
        self,
        fn,
        graph,
        config,
        strategy,
        program,
        in_tree,
        leaf_types,
        process_local=(),
        keys=None,
        call_args=None,
        donated=(),
    ):
        self.fn, self.graph, self.config = fn, graph, config
        self._call_args = call_args  # call_args.CallArgs: static arguments, donated ones
        self._donated = donated  # flat positions of donated leaves (the jax backend's)
        self._keys = keys  # compiler.key_args.KeyData: typed PRNG keys in and out
        self.strategy, self.program = strategy, program
        self._in_tree, self._leaf_types = in_tree, leaf_types
        self._process_local = process_local  # flat positions holding this process's rows
        self._runner = None
        self._timings = {}
        self._seen = None  # (shape, dtype) per leaf of the last call that checked

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", "step")
        return (
            f"Compiled({name}, {self.strategy.mode} on {self.config.backend.value}, "
            f"{self.program.mesh}, {len(self.program.collectives())} collectives)"
        )

    def collectives(self):
        return self.program.collectives()

    def _shardings(self, layouts, tree, keys):
        if isinstance(self.program, PipelineProgram):
            raise ConfigError(
                f"{self.strategy.mode}'s plan is a pipeline of {len(self.program.stages)} "
                "stages, each holding its arguments on its own devices, which one NamedSharding "
                "over the whole mesh cannot say; strategy.inputs lists each argument's layout on "
                "its stage's mesh."
            )
        from ..runtime.jax_backend import jax_mesh

        key_dims = {j: len(impl.key_shape) for j, impl in keys.items()}
        return named_shardings(
            layouts, jax_mesh(self.program.mesh, self.config.mesh), tree, key_dims
        )

    @property
    def in_shardings(self):
        """The plan's argument layouts as a pytree of ``jax.sharding.NamedSharding`` matching
        the step's arguments (a tuple, one entry per argument), for ``jax.jit(step,
        in_shardings=...)``, ``jax.device_put`` or orbax; on the config's ``mesh`` when one was
        given, else on the first devices of ``jax.devices()``."""
        return self._shardings(
            self.program.in_layouts,
            self._in_tree,
            self._keys.args if self._keys is not None else {},
        )

    @property
    def out_shardings(self):
        """The plan's result layouts as a pytree of ``NamedSharding`` matching the step's
        results (``in_shardings``' mesh), for ``jax.jit(step, out_shardings=...)``."""
        return self._shardings(
            self.program.out_layouts,
            self.program.out_tree,
            self._keys.results if self._keys is not None else {},
        )

    def close(self):
        """Stop the runtime this step started (the native backend's worker processes); calling
        the step again starts a new one. Also ``with ap.compile(...) as step:``."""
        runner, self._runner = self._runner, None
        if runner is not None and hasattr(runner, "close"):
            runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def on_workers(self, fn) -> list:
        """``fn(comm)`` run in every native worker process, in rank order (diagnostics, tests
        and benchmarks: ``autopar.runtime.native_backend.stats`` gives each rank's counters).
        ``fn`` must be importable by the workers (a module-level function). Raises ConfigError
        on the jax backend, before the first call, or for a step run in the caller."""
        if self._runner is None or not hasattr(self._runner, "job"):
            native, n = self.config.backend is Backend.NATIVE, self.program.mesh.size
            why = (
                " yet; call it once first."
                if native and self._runner is None
                else " (its ranks exchange nothing: one rank's step runs in this process)."
                if native
                else f" (backend={self.config.backend.value!r}, {n} device(s))."
            )
            raise ConfigError("on_workers: this step has no native workers" + why)
        job = self._runner.job  # Reduction Server ranks, if any, come last
        return job.call(fn, [()] * job.nranks)[: self.program.mesh.size]

    @property
    def timings(self) -> dict:
        """Seconds of each compile phase (trace, search, lower) and, after the first call,
        ``start``: building the runner (starting the workers, compiling the segments) and
        ``first_call``: the first step, start included."""
        return {**dict(self.strategy.phase_seconds), **self._timings}

    def __call__(self, *args, **kwargs):
        if kwargs:
            args = positional(self.fn, args, kwargs)
        if self._call_args is not None and self._call_args.static:
            args = self._call_args.dynamic(args)
        if self._runner is None:
            t0 = time.monotonic()
            out = self._call(*args)
            self._timings["first_call"] = time.monotonic() - t0
            logger.info(
                "%s: first call %.2f s (runner started in %.2f s)",
                self.strategy.mode,
                self._timings["first_call"],
                self._timings.get("start", 0.0),
            )
            return out
        return self._call(*args)

    def _checked(self, flat) -> bool:
        """Whether ``flat`` has the compiled leaf types: at once when every leaf has the shape
        and dtype attributes the last checked call's had (a training loop's arrays: 4 us a leaf
        through ``leaf_type``, most of a small step's own time in this process)."""
        try:
            seen = [(x.shape, x.dtype) for x in flat]
        except AttributeError:
            seen = None
        if seen is not None and seen == self._seen:
            return True
        if [leaf_type(x) for x in flat] != self._leaf_types:
            return False
        self._seen = seen
        return True

    def _make_runner(self):
        if self.config.backend is Backend.XLA:
            return self._xla()[0]
        native = self.config.backend is Backend.NATIVE
        if isinstance(self.program, PipelineProgram):
            if native:
                from ..runtime.native_pipeline import PipelineRunner

                return PipelineRunner(self.program, self.config.collective_timeout)
            from ..runtime.jax_pipeline import PipelineRunner

            return PipelineRunner(self.program, self._process_local)
        if native and self.program.ranks_alike():  # nothing to exchange: one rank's step
            from ..runtime.jax_backend import build_alone

            return build_alone(self.program)
        if native and self.program.mesh.size > 1:
            from ..runtime.native_backend import NativeRunner

            return NativeRunner(self.program, self.config.collective_timeout)
        from ..runtime.jax_backend import build

        return build(self.program, self._process_local, self.config.mesh, self._donated)

    def init(self, init_fn, *init_args, argnums=None):
        """The step's arguments at ``argnums`` (an int, or a tuple when ``init_fn`` returns a
        tuple of them; default: the arguments ``init_fn``'s result matches, by pytree and
        leaf types) made by ``init_fn(*init_args)`` directly in the plan's layouts: one
        ``jax.jit`` with the plan's shardings as its ``out_shardings``, so each device computes
        and holds its own block and no value is ever whole on one device (compile the step
        for ``jax.eval_shape``'s abstract arguments first, and a model too large for one
        device is never built whole). The jax and xla backends."""
        if self.config.backend is Backend.NATIVE:
            raise ConfigError(
                "init: the native runtime hands each step's values back to the caller whole "
                "(host numpy arrays), so a sharded initialisation would not keep them apart; "
                "use backend='jax' or 'xla' (one process holds each device's block), or call "
                "init_fn yourself."
            )
        made = jax.eval_shape(init_fn, *init_args)
        argnums = self._matching(made, argnums, getattr(init_fn, "__name__", "init_fn"))
        return jax.jit(init_fn, out_shardings=self._argument_shardings(argnums))(*init_args)

    def save(self, path, state, argnums=None) -> str:
        """A sharded checkpoint of ``state`` (the step's argument(s) ``argnums``, or those it
        matches: e.g. ``(params, opt_state)``) at the new directory ``path``, with
        orbax-checkpoint, the plan beside it (``compiler.checkpoint``)."""
        from .checkpoint import save

        return save(self, path, state, argnums)

    def restore(self, path, argnums=0):
        """The state saved at ``path`` (by this plan or another one's ``save``) as the step's
        argument(s) ``argnums`` (an int, or a tuple for a run of them) in this plan's
        layouts."""
        from .checkpoint import restore

        return restore(self, path, argnums)

    def _argument_types(self, argnums=None):
        """Per argument of the step, the pytree of its leaves' ``(shape, dtype)``; with
        ``argnums``, that argument's (an int) or a tuple of those (a tuple)."""
        args = jax.tree.unflatten(self._in_tree, self._leaf_types)
        args = args if isinstance(args, tuple) else (args,)
        if argnums is None:
            return args
        return tuple(args[k] for k in argnums) if isinstance(argnums, tuple) else args[argnums]

    def _argument_shardings(self, argnums):
        """``in_shardings`` of argument ``argnums`` (an int), or a tuple of those (a tuple)."""
        shardings = self.in_shardings
        return (
            tuple(shardings[k] for k in argnums)
            if isinstance(argnums, tuple)
            else shardings[argnums]
        )

    def _matching(self, made, argnums, what):
        """``argnums`` for a pytree ``made`` of arrays (or ShapeDtypeStructs) that is the
        step's argument ``argnums`` (an int) or a tuple of them (a ConfigError where it is
        not); None: the argument, or run of arguments, ``made`` matches (pytree, shapes,
        dtypes)."""
        args = self._argument_types()
        got = jax.tree.map(lambda x: (tuple(x.shape), _canonical(x.dtype)), made)
        if argnums is None:
            argnums = next((k for k, a in enumerate(args) if a == got), None)
            if argnums is None and isinstance(got, tuple):
                n = len(got)
                argnums = next(
                    (
                        tuple(range(k, k + n))
                        for k in range(len(args) - n + 1)
                        if args[k : k + n] == got
                    ),
                    None,
                )
            if argnums is None:
                raise ConfigError(
                    f"{what} gives {jax.tree.structure(made)}, which matches none of the "
                    "step's arguments (pytree, shapes and dtypes) nor a run of them; pass "
                    "argnums."
                )
        if self._argument_types(argnums) != got:
            raise ConfigError(
                f"{what} differs from the step's argument(s) {argnums} in "
                "pytree, shapes or dtypes; compile the step for "
                "jax.eval_shape(...)'s result of the same function."
            )
        return argnums

    def _xla(self):
        """The xla backend's ``(call, jitted)`` (runtime.xla_backend), made once."""
        if getattr(self, "_xla_built", None) is None:
            from ..runtime.jax_backend import jax_mesh
            from ..runtime.xla_backend import build

            self._xla_built = build(
                self.graph,
                self.program.in_layouts,
                self.program.out_layouts,
                [o.out_layouts for o in self.strategy.ops],
                jax_mesh(self.program.mesh, self.config.mesh),
                self._donated,
            )
        return self._xla_built

    def xla_collectives(self):
        """backend='xla': the collectives XLA's partitioner inserted, ``Counter((kind, bytes
        per device) -> count)`` read from the compiled module (compiled here if not yet)."""
        if self.config.backend is not Backend.XLA:
            raise ConfigError(
                "xla_collectives: the step runs on backend="
                f"{self.config.backend.value!r}; compile it with backend='xla'."
            )
        from ..runtime.xla_backend import collectives

        specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self.graph.inputs]
        return collectives(self._xla()[1].lower(*specs).compile().as_text())

    def _call(self, *args):
        if self._keys is not None:
            args = self._keys.args_in(args)
        flat, tree = jax.tree.flatten(args)
        if any(isinstance(x, Tracer) for x in flat):
            raise ConfigError(_TRACED.format(name=getattr(self.fn, "__name__", "step")))
        if tree != self._in_tree or not self._checked(flat):
            got = [leaf_type(x) for x in flat]
            raise ConfigError(
                f"compiled for arguments {_types(self._leaf_types)} "
                f"({self._in_tree}) but called with {_types(got)} ({tree}); "
                "compile again for new shapes."
            )
        if self._runner is None:
            t0 = time.monotonic()
            logger.info(
                "starting the %s runner on %d device(s)",
                self.config.backend.value,
                self.program.mesh.size,
            )
            self._runner = self._make_runner()
            self._timings["start"] = time.monotonic() - t0
        out = jax.tree.unflatten(self.program.out_tree, self._runner(flat))
        return out if self._keys is None else self._keys.results_out(out)


_TRACED = (
    "the compiled {name} was called inside a JAX transformation (jax.grad, jax.jit, jax.vmap, "
    "lax.scan...): a compiled step runs its plan on its devices and returns concrete arrays, "
    "so it cannot be traced. Put the transformation inside the step before compiling "
    "(ap.compile(lambda p, b: jax.value_and_grad(loss)(p, b), ...)), call the compiled step "
    "outside it, or take the plan into your own jax.jit with compiled.in_shardings and "
    "compiled.out_shardings."
)


def _types(leaf_types) -> str:
    return "[" + ", ".join(type_str(*t) for t in leaf_types) + "]"


def positional(fn, args, kwargs) -> tuple:
    """A call's arguments in ``fn``'s order, keyword ones put in their places by its signature
    (``step(params=p, batch=b)``, as jax.jit takes them)."""
    import inspect

    name = getattr(fn, "__name__", "step")
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"calling the compiled {name}: {e}") from None
    if bound.kwargs:
        raise ConfigError(
            f"{name} takes {sorted(bound.kwargs)} as keyword-only or **kwargs "
            "arguments; a compiled step takes its arguments by position or by the "
            "name of a positional parameter."
        )
    return bound.args
