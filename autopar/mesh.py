"""Logical device mesh: named axes with sizes, each lying inside one topology level.

In: a shape, optional axis names and a Topology. Out: a frozen ``LogicalMesh``. Devices are
numbered row-major over the axes (the last axis varies fastest), as in ``jax.sharding.Mesh``
built from ``np.arange(n).reshape(shape)``. Axes are placed on topology levels innermost first,
so the last axis rides the fastest links. Planning sees only this object.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .errors import ConfigError
from .frozen import cached_hash
from .topology import Level, Topology

DEFAULT_AXIS_NAMES = {1: ("x",), 2: ("x", "y"), 3: ("x", "y", "z")}


def default_axis_names(ndim: int) -> tuple[str, ...]:
    return DEFAULT_AXIS_NAMES.get(ndim, tuple(f"a{i}" for i in range(ndim)))


@cached_hash
@dataclass(frozen=True)
class LogicalMesh:
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    topology: Topology

    def __post_init__(self):
        if len(self.axis_names) != len(self.shape):
            raise ConfigError(f"mesh axis names {self.axis_names} do not match shape {self.shape}.")
        if (
            len(set(self.axis_names)) != len(self.axis_names)
            or "_" in self.axis_names
            or not all(isinstance(a, str) and a.isidentifier() for a in self.axis_names)
        ):
            raise ConfigError(
                f"mesh axis names {self.axis_names} must be distinct identifiers "
                "(letters, digits, '_'), and not '_' itself."
            )
        if any(s < 1 for s in self.shape):
            raise ConfigError(f"mesh shape {self.shape} has a non-positive size.")
        if math.prod(self.shape) != self.topology.num_devices:
            raise ConfigError(
                f"mesh shape {self.shape} has {math.prod(self.shape)} devices but the topology has "
                f"{self.topology.num_devices}; make device_num equal the product of mesh_shape."
            )

    @staticmethod
    def create(shape, axis_names=None, topology: Topology | None = None) -> LogicalMesh:
        shape = tuple(int(s) for s in shape)
        names = tuple(axis_names) if axis_names else default_axis_names(len(shape))
        return LogicalMesh(names, shape, topology or Topology.local(math.prod(shape)))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_index(name)]

    def axis_index(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ConfigError(f"no mesh axis {name!r}; the mesh has {self.axis_names}.") from None

    def coords(self, device: int) -> dict:
        """Axis name -> index of ``device`` (row-major numbering)."""
        out = {}
        for name, size in reversed(list(zip(self.axis_names, self.shape))):
            device, out[name] = divmod(device, size)
        return {a: out[a] for a in self.axis_names}

    def group(self, device: int, axes) -> tuple[tuple[int, ...], int]:
        """The devices that differ from ``device`` only on ``axes``, ordered by their combined
        index over ``axes`` (first axis major), and ``device``'s position among them."""
        coords = self.coords(device)
        members = []
        for idx in itertools.product(*[range(self.axis_size(a)) for a in axes]):
            c = dict(coords, **dict(zip(axes, idx)))
            d = 0
            for name, size in zip(self.axis_names, self.shape):
                d = d * size + c[name]
            members.append(d)
        return tuple(members), members.index(device)

    def level(self, name: str) -> Level:
        """The topology level whose links an axis uses (its slowest level if it spans several)."""
        return self._levels()[self.axis_index(name)]

    def inner_size(self, name: str) -> int:
        """How many of an axis's positions lie inside one unit of the topology's innermost
        level (one host): its size for an axis inside a host, 1 for one wholly across hosts,
        between for an axis spanning both (its minor factor is inside)."""
        return self._factor()[1][self.axis_index(name)]

    def _levels(self) -> tuple[Level, ...]:
        return self._factor()[0]

    def _factor(self) -> tuple[tuple[Level, ...], tuple[int, ...]]:
        """Per axis, its slowest topology level and its factor inside the innermost level."""
        levels = list(self.topology.levels)
        out, inside = [], []
        li, room = len(levels) - 1, levels[-1].size
        for size in reversed(self.shape):
            lv, inner = levels[li], 1
            while size > 1:
                if room == 1:
                    li -= 1
                    room = levels[li].size
                g = math.gcd(size, room)
                if g == 1:
                    raise ConfigError(
                        f"mesh shape {self.shape} does not factor over {self.topology}."
                    )
                if li == len(levels) - 1:
                    inner *= g
                size //= g
                room //= g
                lv = levels[li]
            out.append(lv)
            inside.append(inner)
        return tuple(reversed(out)), tuple(reversed(inside))

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"
