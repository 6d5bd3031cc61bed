"""MindSpore's layouts on a device matrix, and their place on autopar's logical mesh.

MindSpore describes a tensor's layout on a device matrix of its own (ranks numbered row-major
over it), not on one mesh shared by the whole step: ``Layout((2, 4), ("dp", "mp"))("dp",
"None")`` names the device matrix, and an operator's split tuples (``MatMul.shard(((2, 1),
(1, 4)))`` with 8 devices) derive one from the operator. In:
- ``DeviceSpec(dev_matrix, tensor_map, names)``: MindSpore's (device matrix, tensor map) of one
  tensor (tensor-map entries count device-matrix dimensions from the right, -1 = not split, a
  tuple = several); ``names`` optionally name the device-matrix dimensions.
- ``MeshTemplate(dev_matrix, names)``, what ``ap.Layout((2, 4), ("dp", "mp"))`` returns: called
  with one alias (or "None", or a tuple of aliases) per tensor dimension it gives a DeviceSpec.
- ``OperatorSpec(letters, counts, operand)``: operand ``operand`` of an operator whose operands'
  dimensions carry ``letters`` (one letter per loop of the operator, shared where operands
  share it) and whose split tuples are ``counts``: MindSpore's operator device matrix is
  ``[count of each letter, in order of first appearance] + [repeat]`` (the repeat, device
  number / product, rightmost, as MindSpore 2.10's operators place it; leftmost for a Gather
  whose table is split along the gathered axis over fewer than all the devices, as its
  GatherInfo does), so ``((2, 1), (1, 4))`` on a MatMul of 8 devices is device matrix
  (2, 1, 4), its first operand split over 2 and its second over 4, and ``((2, 1), (1, 2))``
  is (2, 1, 2, 2): ranks 2r and 2r + 1 hold the same slices.
Out: ``DeviceSpec.to_layout(mesh)``, the autopar Layout naming the mesh axes that make up each
device-matrix dimension (a mesh refines a device matrix when its axes, in order, group into
runs whose sizes multiply to the device matrix's dimensions: both number ranks row-major, so
the ranks agree), and ``refining_mesh(matrices, n)``, the coarsest mesh refining every given
device matrix (its cut points are the union of theirs; ``LayoutError`` when they cross).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import LayoutError
from .layout import Layout
from .mesh import LogicalMesh


def _ints(xs) -> bool:
    return (
        isinstance(xs, (tuple, list))
        and len(xs) > 0
        and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)
    )


@dataclass(frozen=True)
class DeviceSpec:
    dev_matrix: tuple
    tensor_map: tuple
    names: tuple | None = None

    def __post_init__(self):
        dm = tuple(self.dev_matrix)
        tmap = tuple(tuple(t) if isinstance(t, (tuple, list)) else t for t in self.tensor_map)
        object.__setattr__(self, "dev_matrix", dm)
        object.__setattr__(self, "tensor_map", tmap)
        if not _ints(dm) or min(dm) < 1:
            raise LayoutError(f"device matrix {dm} must be a tuple of sizes >= 1, e.g. (2, 4).")
        used = [k for t in tmap for k in (t if isinstance(t, tuple) else (t,)) if k != -1]
        if any(not isinstance(k, int) or not 0 <= k < len(dm) for k in used) or len(
            set(used)
        ) != len(used):
            raise LayoutError(
                f"tensor map {tmap} on device matrix {dm}: entries are -1 or "
                f"device-matrix dimensions 0..{len(dm) - 1} counted from the "
                "right, each used once."
            )

    @staticmethod
    def of_tuple(
        counts, n: int, what: str = "strategy", repeat_right: bool = False, lead: tuple = ()
    ) -> DeviceSpec:
        """MindSpore's layout of one tensor's split tuple by itself on ``n`` devices (a cell's
        ``shard``, a tensor's strategy): device matrix ``[n / product] + counts`` (the repeat
        left out when 1; ``repeat_right``: ``counts + [n / product]``, an operator's), dimension
        i on the device-matrix dimension of its count; ``lead``: the counts of device-matrix
        dimensions before the tensor's own (a Gather's index splits), none of them its own."""
        counts, lead = tuple(counts), tuple(lead)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
            raise LayoutError(f"{what}: strategy {counts} must hold integer split counts >= 1.")
        used = math.prod(counts) * math.prod(lead)
        if n % used:
            raise LayoutError(
                f"{what}: strategy {counts} splits into {used} parts, which does "
                f"not divide the {n} devices."
            )
        rep = (n // used,) if n > used else ()
        shift = len(rep) if repeat_right else 0
        return DeviceSpec(
            lead + counts + rep if repeat_right else rep + lead + counts,
            tuple(len(counts) - 1 - i + shift if c > 1 else -1 for i, c in enumerate(counts)),
        )

    def __str__(self) -> str:
        return f"dev{list(self.dev_matrix)} map{[list(t) if isinstance(t, tuple) else t for t in self.tensor_map]}"

    def counts(self) -> tuple:
        """MindSpore's split tuple of the tensor."""
        dm = self.dev_matrix
        return tuple(
            math.prod(dm[len(dm) - 1 - k] for k in (t if isinstance(t, tuple) else (t,)) if k != -1)
            for t in self.tensor_map
        )

    def fits(self, mesh: LogicalMesh) -> bool:
        """Whether ``mesh`` refines the device matrix (``to_layout`` can place it)."""
        try:
            _runs(self.dev_matrix, mesh, "")
        except LayoutError:
            return False
        return True

    def to_layout(self, mesh: LogicalMesh, what: str = "layout") -> Layout:
        runs = _runs(self.dev_matrix, mesh, what)
        dm = self.dev_matrix
        return Layout(
            tuple(
                tuple(
                    a
                    for k in (t if isinstance(t, tuple) else (t,))
                    if k != -1
                    for a in runs[len(dm) - 1 - k]
                )
                for t in self.tensor_map
            )
        )


def _runs(dev_matrix, mesh: LogicalMesh, what) -> list:
    """Per device-matrix dimension, the mesh axes (in order) whose sizes multiply to it."""
    if math.prod(dev_matrix) != mesh.size:
        raise LayoutError(
            f"{what}: device matrix {tuple(dev_matrix)} holds "
            f"{math.prod(dev_matrix)} devices but the mesh {mesh} has {mesh.size}; "
            "a device matrix covers every device (MindSpore's repeat dimension "
            "included)."
        )
    axes = [(a, s) for a, s in zip(mesh.axis_names, mesh.shape) if s > 1]
    runs, i = [], 0
    for d in dev_matrix:
        run, size = [], 1
        while size < d and i < len(axes):
            run.append(axes[i][0])
            size *= axes[i][1]
            i += 1
        if size != d:
            raise LayoutError(
                f"{what}: device matrix {tuple(dev_matrix)} does not fit the mesh {mesh}: its "
                f"dimension of size {d} is not a run of whole mesh axes. Leave mesh_shape out "
                "(autopar then builds the mesh from the device matrices used) or choose one "
                "whose axes, in order, group into the device matrix's dimensions."
            )
        runs.append(tuple(run))
    return runs


def refining_mesh(matrices, n: int) -> tuple:
    """The coarsest mesh shape (outermost axis first) that every device matrix in
    ``matrices`` (each holding ``n`` devices) is a grouping of."""
    cuts = {1, n}
    for dm in matrices:
        if math.prod(dm) != n:
            raise LayoutError(
                f"device matrix {tuple(dm)} holds {math.prod(dm)} devices, not device_num={n}."
            )
        stride = 1
        for d in reversed(dm):
            stride *= d
            cuts.add(stride)
    chain = sorted(cuts)
    for a, b in zip(chain, chain[1:]):
        if b % a:
            raise LayoutError(
                f"device matrices {sorted({tuple(m) for m in matrices})} cut the {n} devices "
                f"at strides {a} and {b}, which no single mesh holds (neither divides the "
                "other); give mesh_shape and ap.Layouts naming its axes instead."
            )
    return tuple(b // a for a, b in reversed(list(zip(chain, chain[1:]))))


INTERLEAVED = "interleaved_parallel"  # MindSpore's alias for an in-device (virtual) split


@dataclass(frozen=True)
class MeshTemplate:
    """``ap.Layout(device_matrix, alias_names)``: call it with one entry per tensor
    dimension (an alias, "None", or a tuple of aliases) for that tensor's DeviceSpec."""

    dev_matrix: tuple
    names: tuple

    def __post_init__(self):
        object.__setattr__(self, "dev_matrix", tuple(self.dev_matrix))
        object.__setattr__(self, "names", tuple(self.names))
        if (
            len(self.names) != len(self.dev_matrix)
            or len(set(self.names)) != len(self.names)
            or "None" in self.names
            or not all(isinstance(a, str) for a in self.names)
        ):
            raise LayoutError(
                f"ap.Layout({self.dev_matrix}, {self.names}): give one distinct "
                "alias name (not 'None') per device-matrix dimension, e.g. "
                "ap.Layout((2, 4), ('dp', 'mp'))."
            )

    def __call__(self, *dims) -> DeviceSpec:
        """The tensor's DeviceSpec. MindSpore's ``interleaved_parallel`` alias is not a device
        axis: it splits an operator's work into that many slices run one after another on
        each device (to overlap their communication), so it is left out of the device matrix
        and a tensor dimension on it is not split across devices (autopar runs the operator
        whole on each device, which it says with a warning)."""
        names = tuple(a for a in self.names if a != INTERLEAVED)
        matrix = tuple(d for a, d in zip(self.names, self.dev_matrix) if a != INTERLEAVED)
        n = len(names)
        tmap = []
        for d in dims:
            parts = d if isinstance(d, (tuple, list)) else (d,)
            ks = []
            for a in parts:
                if a == "None":
                    continue
                if a not in self.names:
                    raise LayoutError(
                        f"ap.Layout{(self.dev_matrix, self.names)}{dims}: {a!r} "
                        f"is not one of its aliases {self.names} (or 'None')."
                    )
                if a == INTERLEAVED:
                    import warnings

                    from .errors import AutoparWarning

                    warnings.warn(
                        f"ap.Layout{(self.dev_matrix, self.names)}{dims}: in "
                        "MindSpore, interleaved_parallel runs the operator in "
                        f"{self.dev_matrix[self.names.index(a)]} slices one after "
                        "another on each device to overlap their communication; "
                        "autopar runs it whole (the layout across devices is the "
                        "same).",
                        AutoparWarning,
                        stacklevel=2,
                    )
                    continue
                ks.append(n - 1 - names.index(a))
            tmap.append(-1 if not ks else ks[0] if len(ks) == 1 else tuple(ks))
        return DeviceSpec(matrix, tuple(tmap), names)


@dataclass(frozen=True)
class OperatorSpec:
    """One operand of an operator annotated with MindSpore split tuples (module docstring),
    as ``ap.shard(fn, in_strategy, out_strategy)`` records it. ``counts``: the split tuple of
    each operand (None: not annotated); ``operand``: which one this is (-1: the output, whose
    tuple is ``out``); ``group``: the annotation it belongs to. Planning fills in ``letters``
    (per operand, one letter per dimension, "" for a dimension no loop splits) and
    ``out_letters`` from the one operator reading the operands (``with_letters``); an
    annotation around more than one operator keeps one letter per dimension of each operand,
    each operand then on its own device matrix (its tuple + [repeat], as the one MindSpore
    operator such a function stands for, a Softmax say, lays it out)."""

    counts: tuple
    operand: int
    group: int
    out: tuple | None = None
    letters: tuple | None = None
    out_letters: tuple = ()
    repeat_left: bool = False  # the repeat leftmost (MindSpore's Gather splitting its axis)
    lead: tuple = ()  # device-matrix dimensions before this operand's own (a
    # Gather's index splits, for its table)

    def __str__(self) -> str:
        tuples = self.out if self.operand < 0 else self.counts[self.operand]
        return f"{'out' if self.operand < 0 else 'in'}_strategy {tuples} of {self.counts}"

    def with_letters(self, letters, out_letters=(), repeat_left=False) -> OperatorSpec:
        return replace(
            self,
            letters=tuple(tuple(l) for l in letters),
            out_letters=tuple(out_letters),
            repeat_left=repeat_left,
        )

    def resolve(self, n: int, what: str = "strategy") -> DeviceSpec:
        """The operand's DeviceSpec on ``n`` devices (letters filled in)."""
        if self.letters is None:  # this operand alone: tuple + [repeat]
            return DeviceSpec.of_tuple(
                self.out if self.operand < 0 else self.counts[self.operand],
                n,
                what,
                repeat_right=not self.repeat_left,
                lead=self.lead,
            )
        split: dict[str, int] = {}
        order: list[str] = []
        for letters, counts in zip(self.letters, self.counts):
            if counts is None:
                continue
            for letter, c in zip(letters, counts):
                if not letter:
                    if c != 1:
                        raise LayoutError(
                            f"{what}: split count {c} on a dimension the operator "
                            "cannot split; use 1 there."
                        )
                    continue
                if split.setdefault(letter, c) != c:
                    raise LayoutError(
                        f"{what}: {self.counts} splits one loop of the operator "
                        f"two ways ({split[letter]} and {c}); the operands' "
                        "dimensions it shares must have equal counts (MindSpore "
                        "checks the same)."
                    )
                if letter not in order:
                    order.append(letter)
        order = [l for l in order if split[l] > 1] or order[:1]
        used = math.prod(split[l] for l in order)
        if n % used:
            raise LayoutError(
                f"{what}: {self.counts} splits into {used} parts, which does not "
                f"divide the {n} devices."
            )
        rep, loops = ((n // used,) if n > used else ()), tuple(split[l] for l in order)
        right = not self.repeat_left
        dm = loops + rep if right else rep + loops
        index = {l: len(order) - 1 - i + (len(rep) if right else 0) for i, l in enumerate(order)}
        if self.operand >= 0:
            return DeviceSpec(
                dm,
                tuple(index[l] if l and split[l] > 1 else -1 for l in self.letters[self.operand]),
            )
        return DeviceSpec(dm, self._out_map(split, index, what))

    def _out_map(self, split, index, what) -> tuple:
        """Each output dimension's count: its loop's count (that loop's device dimension), or
        that times the count of a loop the output does not have (MindSpore's reduce-scattered
        output: the reduced loop's devices split the dimension too)."""
        assert self.out is not None  # the output's spec (operand -1) holds its tuple
        spare = [l for l in index if l not in self.out_letters]
        tmap = []
        for letter, c in zip(self.out_letters, self.out):
            own = split.get(letter, 1) if letter else 1
            ks = [index[letter]] if own > 1 else []
            if c != own:
                extra = next((l for l in spare if own * split[l] == c), None)
                if extra is None:
                    raise LayoutError(
                        f"{what}: out_strategy {self.out} gives {c} where the "
                        f"operator's device matrix splits that dimension {own} "
                        "ways (or that times a reduced loop's count)."
                    )
                spare.remove(extra)
                ks.append(index[extra])
            tmap.append(-1 if not ks else ks[0] if len(ks) == 1 else tuple(ks))
        return tuple(tmap)
