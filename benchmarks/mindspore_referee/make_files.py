"""Strategy files for MindSpore to referee: autopar plans an MLP (tests/models.py) for 8 devices
on a 2x4 mesh with plain layouts, with a dimension split over both mesh axes and with the
parallel optimizer (each rank storing its update's slice of a parameter), writes them
in MindSpore's formats (protobuf .ckpt, and JSON for the plain plan) and, in
expected_slices.json, the [start, stop) of every dimension each rank holds by autopar's own
``Layout.block``. ``check_with_mindspore.py`` (run with a MindSpore install) reads the files
with MindSpore's readers and checkpoint transforms and compares.

Run: ``python benchmarks/mindspore_referee/make_files.py OUT`` then
``MINDSPORE_PYTHON benchmarks/mindspore_referee/check_with_mindspore.py OUT``.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

import autopar as ap                    # noqa: E402
import models as m                      # noqa: E402
from autopar.mesh import LogicalMesh    # noqa: E402


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    p, b = m.mlp_params(), m.mlp_batch()
    cfg = ap.ParallelConfig(parallel_mode="semi_auto_parallel", device_num=8, mesh_shape=(2, 4))
    opt = cfg.replace(enable_parallel_optimizer=True, parallel_optimizer_threshold=0)
    plans = {
        "mlp_plain": ({"w1": (1, 4), "w2": (4, 1)}, cfg),
        "mlp_nested": ({"w1": ap.Layout.parse("[_,(x,y)]"), "w2": (4, 1)}, cfg),
        "mlp_nested2": ({"w1": (1, 4), "w2": ap.Layout.parse("[(y,x),_]")}, cfg),
        # the parallel optimizer: each rank stores its update's slice of a parameter
        "mlp_opt": ({"w1": (1, 4), "w2": (4, 1)}, opt),
        "mlp_opt_nested": ({"w1": ap.Layout.parse("[_,(y,x)]"), "w2": (2, 1)}, opt),
        "mlp_opt_dp": ({"w1": (1, 1), "w2": (1, 1)}, opt),
    }
    expect = {}
    for name, (w, config) in plans.items():
        s = ap.plan(m.mlp_sgd_step, p, b, config=config,
                    in_strategy=({"w1": w["w1"], "b1": None, "w2": w["w2"], "b2": None}, None))
        s.save(os.path.join(out, f"{name}.ckpt"))
        if name == "mlp_plain":
            s.save(os.path.join(out, f"{name}.json"), format="mindspore")
        mesh = LogicalMesh.create(s.mesh_shape, s.axis_names)
        expect[name] = {i.name: {
            "shape": list(i.shape), "layout": str(i.layout),
            "rank_slices": [[[sl.start or 0, dim if sl.stop is None else sl.stop]
                             for sl, dim in zip((i.update or i.layout).block(
                                 tuple(i.shape), mesh.coords(r), mesh), i.shape)]
                            for r in range(mesh.size)]}
            for i in s.inputs if i.is_param}
    with open(os.path.join(out, "expected_slices.json"), "w") as f:
        json.dump(expect, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mindspore_files")
