"""Tensor layouts on a logical mesh.

In: per tensor dimension the ordered mesh axes that split it (major first), and the set of
axes over which the value is a pending partial sum. Out: a frozen ``Layout`` with
- a canonical text form ``[x,(y,z),_] sum{w}`` and ``Layout.parse`` (``parse(str(l)) == l``),
- local (per-device) shapes, validation against a shape and mesh,
- conversions to/from MindSpore split-count tuples, MindSpore (device_matrix, tensor_map),
  and ``jax.sharding.PartitionSpec``.

Split counts -> mesh axes (``Layout.from_strategy``), the documented deterministic mapping:
tensor dimensions are taken left to right; for a count ``c > 1`` the chosen axes are the
subsequence of still-unused mesh axes, in mesh order, whose sizes multiply to ``c``; among
those the one with the fewest axes wins, then the one whose axis indices are lexicographically
smallest. So on mesh ``(x=2, y=4)``: ``(2, 4)`` -> ``[x,y]``, ``(8, 1)`` -> ``[(x,y),_]``,
``(4, 2)`` -> ``[y,x]``, ``(1, 4)`` -> ``[_,y]``. A layout never communicates.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass

import numpy as np

from .errors import LayoutError
from .frozen import cached_hash
from .mesh import LogicalMesh


@cached_hash
@dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[str, ...], ...]
    partial: frozenset = frozenset()

    def __new__(cls, dims=None, partial=frozenset(), rank_list=None):
        """``Layout(dims, partial)``; MindSpore's form ``Layout((2, 4), ("dp", "mp"))`` (a device
        matrix and an alias per dimension, and its ``rank_list`` when that is the devices in
        order) returns a ``device_matrix.MeshTemplate``, which called with an alias per tensor
        dimension (``("dp", "None")``) gives that tensor's layout on the device matrix."""
        if (
            isinstance(dims, (tuple, list))
            and dims
            and all(isinstance(d, int) and not isinstance(d, bool) for d in dims)
        ):
            from .device_matrix import MeshTemplate

            if rank_list is not None and list(rank_list) != list(range(math.prod(dims))):
                raise LayoutError(
                    f"ap.Layout({tuple(dims)}, {partial!r}, rank_list={list(rank_list)!r}): in "
                    "MindSpore, rank_list names the ranks the device matrix's positions stand "
                    "for, in that order (a layout over some devices, or over them reordered); "
                    "autopar's device matrices number the step's devices in order. Leave "
                    "rank_list out, or order the devices themselves (ParallelConfig(mesh="
                    "jax.sharding.Mesh(devices_in_your_order, names)))."
                )
            return MeshTemplate(dims, partial)
        if rank_list is not None:
            raise LayoutError(
                "rank_list belongs to MindSpore's form, Layout(device_matrix, "
                "alias_names, rank_list)."
            )
        return super().__new__(cls)

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(tuple(d) for d in self.dims))
        object.__setattr__(self, "partial", frozenset(self.partial))
        used = [a for d in self.dims for a in d]
        if len(set(used)) != len(used) or set(used) & self.partial:
            raise LayoutError(
                f"layout {self} uses a mesh axis twice; each axis may split one "
                "dimension or be a partial-sum axis, not both."
            )

    # ------------------------------------------------------------------ constructors
    @staticmethod
    @functools.lru_cache(maxsize=64)
    def replicated(rank: int) -> Layout:
        return Layout(((),) * rank)

    @staticmethod
    def parse(text: str) -> Layout:
        m = re.fullmatch(r"\s*\[(.*)\]\s*(?:sum\{([^}]*)\})?\s*", text)
        if not m:
            raise LayoutError(
                f"cannot parse layout {text!r}; expected e.g. '[x,(y,z),_] sum{{w}}'."
            )
        body, part = m.group(1).strip(), m.group(2)
        dims: list[tuple[str, ...]] = []
        for tok in re.findall(r"\([^)]*\)|[^,\s()]+", body):
            if tok == "_":
                dims.append(())
            elif tok.startswith("("):
                dims.append(tuple(a.strip() for a in tok[1:-1].split(",") if a.strip()))
            else:
                dims.append((tok,))
        partial = (
            frozenset(a.strip() for a in part.split(",") if a.strip()) if part else frozenset()
        )
        return Layout(tuple(dims), partial)

    @staticmethod
    def from_strategy(counts, mesh: LogicalMesh) -> Layout:
        """MindSpore split counts of one tensor, e.g. ``(2, 4)``, mapped as the module doc says."""
        counts = tuple(int(c) for c in counts)
        free = list(range(len(mesh.shape)))
        dims = []
        for i, c in enumerate(counts):
            if c < 1:
                raise LayoutError(f"split count {c} at dimension {i} of {counts} must be >= 1.")
            if c == 1:
                dims.append(())
                continue
            pick = _axes_for_count(c, free, mesh)
            if pick is None:
                raise LayoutError(
                    f"split counts {counts}: no unused mesh axes of {mesh} multiply to {c} for "
                    f"dimension {i}; use counts that are products of distinct mesh axis sizes, "
                    "or give an ap.Layout naming the axes."
                )
            for a in pick:
                free.remove(a)
            dims.append(tuple(mesh.axis_names[a] for a in pick))
        return Layout(tuple(dims))

    @staticmethod
    def from_tensor_map(device_matrix, tensor_map, mesh: LogicalMesh) -> Layout:
        """MindSpore ``(dev_matrix, tensor_map)``: entry ``-1`` = not split, entry ``k`` = device
        matrix dimension ``len(dev_matrix) - 1 - k``; a tuple entry splits over several."""
        dm = tuple(device_matrix)
        if dm != mesh.shape:
            raise LayoutError(f"device matrix {dm} differs from the mesh shape {mesh.shape}.")
        dims = []
        for t in tensor_map:
            ts = t if isinstance(t, (tuple, list)) else (t,)
            for k in ts:
                if not (k == -1 or 0 <= k < len(dm)):
                    raise LayoutError(
                        f"tensor_map {tuple(tensor_map)} has entry {k}; entries are -1 "
                        f"or device-matrix indices 0..{len(dm) - 1} (counted from the right)."
                    )
            dims.append(tuple(mesh.axis_names[len(dm) - 1 - k] for k in ts if k != -1))
        return Layout(tuple(dims))

    @staticmethod
    def from_partition_spec(spec, rank: int) -> Layout:
        """``jax.sharding.PartitionSpec`` of a rank-``rank`` tensor: an entry per leading
        dimension (None: not split; a name or a tuple of names, major first), the rest not
        split; ``P("x", None)`` -> ``[x,_]``. ``P.UNCONSTRAINED`` is refused: a layout is
        fixed."""
        entries = list(spec)
        if len(entries) > rank:
            raise LayoutError(
                f"PartitionSpec {spec} has {len(entries)} entries for a rank-{rank} "
                "tensor; give at most one per dimension."
            )
        dims = []
        for e in entries + [None] * (rank - len(entries)):
            axes = () if e is None else tuple(e) if isinstance(e, (tuple, list)) else (e,)
            if not all(isinstance(a, str) for a in axes):
                raise LayoutError(
                    f"PartitionSpec {spec}: entry {e!r} is not a mesh axis name, a "
                    "tuple of them or None (P.UNCONSTRAINED leaves the layout "
                    "open, which a fixed layout cannot); e.g. P('x', None)."
                )
            dims.append(axes)
        return Layout(tuple(dims))

    # ------------------------------------------------------------------ queries
    @property
    def rank(self) -> int:
        return len(self.dims)

    @functools.cached_property
    def axes(self) -> frozenset:
        return frozenset(a for d in self.dims for a in d)

    def is_replicated(self) -> bool:
        return not self.axes and not self.partial

    def splits(self, mesh: LogicalMesh) -> tuple[int, ...]:
        return _splits(self, mesh)

    def local_shape(self, shape, mesh: LogicalMesh) -> tuple[int, ...]:
        return _local_shape(self, tuple(shape), mesh)

    def block(self, shape, coords, mesh: LogicalMesh) -> tuple[slice, ...]:
        """The slices of a ``shape`` tensor held by the device at ``coords`` (axis name ->
        index): a dimension split over axes ``(x, y)`` holds block ``ix * ny + iy``."""
        out = []
        for axes, n in zip(self.dims, shape):
            idx, count = 0, 1
            for a in axes:
                idx = idx * mesh.axis_size(a) + int(coords[a])
                count *= mesh.axis_size(a)
            out.append(slice(idx * (n // count), (idx + 1) * (n // count)))
        return tuple(out)

    def assemble(self, blocks, mesh: LogicalMesh):
        """The whole tensor from the blocks of every device of ``mesh``, in device order."""
        first = np.asarray(blocks[0])
        shape = tuple(s * c for s, c in zip(first.shape, self.splits(mesh)))
        whole = np.empty(shape, first.dtype)
        for d, got in enumerate(blocks):
            whole[self.block(shape, mesh.coords(d), mesh)] = got
        return whole

    def check(self, shape, mesh: LogicalMesh, what: str = "value") -> Layout:
        """Raise LayoutError unless this layout fits a tensor of ``shape`` on ``mesh``."""
        shape = tuple(shape)
        if self.rank != len(shape):
            raise LayoutError(
                f"{what}: layout {self} has {self.rank} dimensions but the tensor "
                f"has shape {shape}; give one entry per dimension."
            )
        for a in self.axes | self.partial:
            if a not in mesh.axis_names:
                raise LayoutError(f"{what}: layout {self} names axis {a!r}, not on {mesh}.")
        for i, (s, c) in enumerate(zip(shape, self.splits(mesh))):
            if s % c:
                raise LayoutError(
                    f"{what}: dimension {i} of size {s} (shape {shape}) is split "
                    f"{c} ways by {self}, which does not divide it; choose a split "
                    f"that divides {s}."
                )
        return self

    # ------------------------------------------------------------------ conversions
    def to_strategy(self, mesh: LogicalMesh) -> tuple[int, ...]:
        return self.splits(mesh)

    def to_tensor_map(self, mesh: LogicalMesh):
        """MindSpore ``(device_matrix, tensor_map)``; see ``from_tensor_map``."""
        n = len(mesh.shape)
        tmap = []
        for d in self.dims:
            ks = [n - 1 - mesh.axis_index(a) for a in d]
            tmap.append(-1 if not ks else (ks[0] if len(ks) == 1 else tuple(ks)))
        return tuple(mesh.shape), tuple(tmap)

    def to_partition_spec(self):
        from jax.sharding import PartitionSpec

        if self.partial:
            raise LayoutError(
                f"layout {self} holds partial sums, which a PartitionSpec cannot "
                "express; reduce them first."
            )
        return PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else d) for d in self.dims])

    # ------------------------------------------------------------------ text
    def __str__(self) -> str:
        body = ",".join(
            "_" if not d else (d[0] if len(d) == 1 else "(" + ",".join(d) + ")") for d in self.dims
        )
        tail = f" sum{{{','.join(sorted(self.partial))}}}" if self.partial else ""
        return f"[{body}]{tail}"

    def __repr__(self) -> str:
        return f"Layout.parse({str(self)!r})"


def _axes_for_count(c: int, free: list[int], mesh: LogicalMesh):
    for k in range(1, len(free) + 1):
        for combo in itertools.combinations(free, k):
            if math.prod(mesh.shape[a] for a in combo) == c:
                return combo
    return None


@functools.lru_cache(maxsize=1 << 16)  # planning asks the same few pairs millions of times
def _splits(layout: Layout, mesh: LogicalMesh) -> tuple[int, ...]:
    unknown = sorted(layout.axes - set(mesh.axis_names))
    if unknown:
        raise LayoutError(f"layout {layout} names axes {unknown}, not on {mesh}.")
    return tuple(math.prod(mesh.axis_size(a) for a in d) for d in layout.dims)


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(layout: Layout, shape: tuple, mesh: LogicalMesh) -> tuple[int, ...]:
    return tuple(s // c for s, c in zip(shape, _splits(layout, mesh)))
