"""``static_argnums`` / ``static_argnames`` / ``donate_argnums`` with ``jax.jit``'s meaning.

In: the step, its example arguments and the three options as ``jax.jit`` takes them. Out:
``split_static`` gives the step as a function of its other (dynamic) arguments alone, those
arguments, and a ``CallArgs`` that, per call, checks the static arguments are the ones the step
was compiled for (``dynamic``), maps the step's argument positions to the dynamic ones
(``position``; ``over_dynamic`` for batch_argnums and in_strategy) and names the flattened leaves that are donated (``donated_leaves``). Static
arguments must be hashable, as jax.jit requires: they are compared by ``==``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import jax

from ..errors import ConfigError, LayoutError


def _positions(value, what: str, n: int) -> tuple:
    given = (value,) if isinstance(value, int) else tuple(value or ())
    if not all(isinstance(k, int) and not isinstance(k, bool) and -n <= k < n for k in given):
        raise ConfigError(
            f"{what}={value!r} must be argument positions, integers in "
            f"0 .. {n - 1} (the step takes {n} arguments)."
        )
    return tuple(sorted({k % n for k in given}))


@dataclass(frozen=True)
class CallArgs:
    """The static positions with their compiled values, and the donated positions, of a
    step of ``count`` arguments."""

    count: int
    static: tuple = ()  # positions
    values: tuple = ()  # their values, as compiled
    donate: tuple = ()  # positions (of the step's arguments)
    name: str = "step"

    def dynamic(self, args) -> tuple:
        """``args`` without the static ones, which must equal the compiled values."""
        if not self.static:
            return tuple(args)
        if len(args) != self.count:
            raise ConfigError(
                f"the compiled {self.name} takes {self.count} arguments, "
                f"{len(self.static)} of them static; it was given {len(args)}."
            )
        for k, want in zip(self.static, self.values):
            if not (args[k] is want or args[k] == want):
                raise ConfigError(
                    f"{self.name} was compiled for static argument {k} = {want!r}, called "
                    f"with {args[k]!r}; compile again for the new value (@ap.parallel compiles "
                    "once per value, as jax.jit does)."
                )
        return tuple(a for k, a in enumerate(args) if k not in self.static)

    def position(self, k: int) -> int:
        """The dynamic position of the step's argument ``k`` (not a static one)."""
        return k - sum(1 for s in self.static if s < k)

    def over_dynamic(self, batch_argnums, in_strategy) -> tuple:
        """``(batch_argnums, in_strategy)``, given over every argument of the step, over its
        dynamic ones; a static argument named as a batch or given a layout raises."""
        if not self.static:
            return batch_argnums, in_strategy
        if batch_argnums is not None:
            given = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
            if any(k % self.count in self.static for k in given if isinstance(k, int)):
                raise ConfigError(
                    f"batch_argnums={batch_argnums!r} names a static argument "
                    f"(static: {self.static}); name the batch arrays."
                )
            batch_argnums = tuple(
                self.position(k % self.count) if isinstance(k, int) else k for k in given
            )
        if in_strategy is not None:
            if len(in_strategy) != self.count:
                raise LayoutError(
                    f"in_strategy has {len(in_strategy)} entries for "
                    f"{self.count} arguments; give one per argument, None for "
                    "the static ones."
                )
            if any(in_strategy[k] is not None for k in self.static):
                raise LayoutError(
                    f"in_strategy gives a layout for static argument(s) "
                    f"{self.static}; a static argument is a Python value, not "
                    "laid out: give None there."
                )
            in_strategy = tuple(s for k, s in enumerate(in_strategy) if k not in self.static)
        return batch_argnums, in_strategy

    def donated_leaves(self, dynamic_args) -> tuple:
        """Flat leaf positions of the donated arguments among ``dynamic_args``."""
        out: list[int] = []
        j = 0
        keep = {self.position(k) for k in self.donate}
        for i, a in enumerate(dynamic_args):
            n = len(jax.tree.leaves(a))
            if i in keep:
                out += range(j, j + n)
            j += n
        return tuple(out)


def split_static(fn, args, static_argnums=None, static_argnames=None, donate_argnums=None):
    """``(step of the dynamic arguments, those arguments, CallArgs)`` (the step itself and
    ``args`` when nothing is static)."""
    name = getattr(fn, "__name__", "step")
    n = len(args)
    static = set(_positions(static_argnums, "static_argnums", n))
    if static_argnames:
        names = (static_argnames,) if isinstance(static_argnames, str) else static_argnames
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        for nm in names:
            if nm not in params[:n]:
                raise ConfigError(
                    f"static_argnames names {nm!r}, not a positional parameter "
                    f"of {name} among its {n} arguments ({params[:n]})."
                )
            static.add(params.index(nm))
    static = tuple(sorted(static))
    donate = _positions(donate_argnums, "donate_argnums", n)
    if set(donate) & set(static):
        raise ConfigError(
            f"donate_argnums={donate_argnums!r} names a static argument; only "
            "arrays can be donated."
        )
    values = tuple(args[k] for k in static)
    for k, v in zip(static, values):
        try:
            hash(v)
        except TypeError:
            raise ConfigError(
                f"static argument {k} of {name} ({type(v).__name__}) is not "
                "hashable; jax.jit requires static arguments to be hashable: pass "
                "a tuple or a frozen dataclass."
            ) from None
    call = CallArgs(n, static, values, donate, name)
    if not static:
        return fn, tuple(args), call

    def dynamic_step(*dyn):
        it = iter(dyn)
        return fn(*[values[static.index(k)] if k in static else next(it) for k in range(n)])

    dynamic_step.__name__ = name
    return dynamic_step, call.dynamic(args), call
