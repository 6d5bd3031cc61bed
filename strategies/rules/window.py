"""Sliding-window primitives: convolutions and pooling (``nnx.Conv``, ``eqx.nn.Conv2d``,
``nnx.avg_pool``/``max_pool``, ``eqx.nn.MaxPool2d``, and their derivatives).

In: a node of ``conv_general_dilated``, ``reduce_window_sum``/``max``/``min`` or
``select_and_scatter_add``. Out: its ``OpSpec``. A window's spatial dimensions are never split
(a block would need its neighbours' halo), so they are ``_``:

- ``conv_general_dilated``: with ``dimension_numbers`` naming the batch (n), feature (c) and
  output-feature (o) dimensions, ``"n c+ _.., o c+ _.. -> n o _.."`` (laid out in the operands'
  own dimension order): the batch and output features split the result, the input features
  leave a partial sum; linear in each operand. Grouped convolutions (``feature_group_count``
  > 1, e.g. depthwise) interleave groups with features, so there only the batch may be split;
  with ``batch_group_count`` > 1 (the kernel gradient of a grouped convolution) the batch is
  grouped, so there only the input features may be split (a partial sum, as for data-parallel
  gradients).
- ``reduce_window_*``: a dimension the window does not touch (size 1, stride 1, no padding or
  dilation) carries a letter, every other one is ``_``; ``reduce_window_sum`` is linear.
- ``select_and_scatter_add(source, operand)`` (max pooling's derivative): the same letters on
  the source, the operand and the result; linear in the source.
No local params change: windows, strides, padding and group counts do not depend on the
split dimensions' sizes.
"""

from __future__ import annotations

from .spec import OpSpec, Rule


def conv_spec(node):
    lhs_spec, rhs_spec, out_spec = node.params["dimension_numbers"]
    groups = node.params["feature_group_count"]
    batch_groups = node.params["batch_group_count"]
    L = [None] * len(node.inputs[0].shape)
    R = [None] * len(node.inputs[1].shape)
    O = [None] * len(node.outputs[0].shape)
    reduce = frozenset()
    if batch_groups == 1:
        L[lhs_spec[0]] = O[out_spec[0]] = "n"
    if groups == 1 and batch_groups == 1:
        R[rhs_spec[0]] = O[out_spec[1]] = "o"
    if groups == 1:
        L[lhs_spec[1]] = R[rhs_spec[1]] = "c"
        reduce = frozenset({"c"})
    return OpSpec((tuple(L), tuple(R)), (tuple(O),), reduce, ((0,), (1,)))


def _untouched(node, i):
    """Whether the window leaves dimension ``i`` alone (each output element reads one input
    element of that dimension, at the same index)."""
    p = node.params
    pad = p.get("padding", ((0, 0),) * len(p["window_dimensions"]))[i]
    return (
        p["window_dimensions"][i] == 1
        and p["window_strides"][i] == 1
        and tuple(pad) == (0, 0)
        and p.get("base_dilation", (1,) * (i + 1))[i] == 1
        and p.get("window_dilation", (1,) * (i + 1))[i] == 1
    )


def _window(linear: bool):
    def spec(node):
        dims = tuple(
            f"d{i}" if _untouched(node, i) else None
            for i in range(len(node.params["window_dimensions"]))
        )
        return OpSpec(
            tuple(dims for _ in node.inputs),
            tuple(dims for _ in node.outputs),
            frozenset(),
            ((0,),) if linear else (),
        )

    return Rule(spec)


RULES = {
    "conv_general_dilated": Rule(conv_spec),
    "reduce_window_sum": _window(linear=True),
    "reduce_window_max": _window(linear=False),
    "reduce_window_min": _window(linear=False),
    "select_and_scatter_add": _window(linear=True),
}
