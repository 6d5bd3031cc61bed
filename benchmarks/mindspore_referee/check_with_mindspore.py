#!/usr/bin/env python
"""Check autopar-written strategy checkpoints against real MindSpore (CPU).

Usage: MINDSPORE_PYTHON check_with_mindspore.py DIR   (DIR from make_files.py; MindSpore 2.10
+ numpy<2 in that Python: pip install mindspore==2.10.0 "numpy<2")

For every strategy file (mlp_plain.ckpt, mlp_nested.ckpt, mlp_nested2.ckpt, mlp_plain.json, and
with the parallel optimizer mlp_opt.ckpt, mlp_opt_nested.ckpt, mlp_opt_dp.ckpt, whose expected
slices are what each rank stores of a parameter: its update's):
  [read]   mindspore.parallel.build_searched_strategy(path) and
           mindspore.parallel._parallel_serialization._convert_to_list (the list form that all
           MindSpore checkpoint-transform code consumes) -> dev_matrix / tensor_map / opt shard fields.
  [slice]  per parameter, per rank 0..7: slice computed with MindSpore's slice helpers
           (mindspore.parallel._tensor: _expand_layout for nested maps, _get_tensor_strategy,
           _get_tensor_slice_index, _load_tensor on an index-encoded global tensor) -> compared with
           expected_slices.json.
  [xform]  per parameter, per rank 0..7: slice produced by MindSpore's public checkpoint transform
           mindspore.transform_checkpoint_by_rank(rank, {0: full.ckpt}, out.ckpt, None, strategy_file)
           from an unsharded checkpoint whose values encode the global flat index -> compared with
           expected_slices.json (also checks element order inside the slice).
  [merge]  mindspore.merge_pipeline_strategys on a dir holding the file as a single stage; every
           parameter must survive (as "<stage>-<name>") with the same layout.
  [ranks]  mindspore.rank_list_for_transform between mlp_plain.ckpt and mlp_nested.ckpt (both ways),
           compared with the set of source ranks whose slice overlaps the destination rank's slice
           (from expected_slices.json).
"""
import json
import os
import shutil
import sys
import tempfile
import traceback

import numpy as np
import mindspore as ms
from mindspore.parallel._parallel_serialization import _convert_to_list
from mindspore.parallel._tensor import (_construct_tensor_layout_for_opt_shard, _expand_layout,
                                        _get_tensor_strategy, _get_tensor_slice_index, _load_tensor)

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)

DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
FILES = ["mlp_plain.ckpt", "mlp_nested.ckpt", "mlp_nested2.ckpt", "mlp_plain.json",
         "mlp_opt.ckpt", "mlp_opt_nested.ckpt", "mlp_opt_dp.ckpt"]
NRANKS = 8
EXPECTED = json.load(open(os.path.join(DIR, "expected_slices.json")))
RESULTS = []  # (ok, text)


def report(ok, text):
    RESULTS.append((ok, text))
    print(("PASS " if ok else "FAIL ") + text, flush=True)


def stem_of(fname):
    return os.path.splitext(fname)[0]


def box_from_local(local, shape):
    """Given a local slice whose values are global flat indices, return [[start,stop),...] and
    whether local == global[box] exactly (same elements, same order)."""
    glob = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    coords = np.unravel_index(local.reshape(-1).astype(np.int64), shape)
    box = [[int(c.min()), int(c.max()) + 1] for c in coords]
    sub = glob[tuple(slice(a, b) for a, b in box)]
    exact = sub.shape == local.shape and np.array_equal(sub, local.astype(np.int64))
    return box, exact


def parse_layout_text(text):
    """autopar layout text like '[_,(x,y)]' -> tuple for mindspore.Layout: ('None', ('x','y'))."""
    body = text.strip()[1:-1]
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == ",":
            i += 1
        elif c == "(":
            j = body.index(")", i)
            out.append(tuple(t.strip() for t in body[i + 1:j].split(",")))
            i = j + 1
        else:
            j = body.find(",", i)
            j = len(body) if j < 0 else j
            tok = body[i:j].strip()
            out.append("None" if tok == "_" else tok)
            i = j
    return tuple(out)


def norm_map(tmap):
    """[[-1], [1, 0]] / (-1, (1, 0)) -> comparable form; a 1-element sub-list is a plain entry."""
    res = []
    for d in tmap:
        if isinstance(d, (list, tuple)):
            d = list(d)
            res.append(d[0] if len(d) == 1 else d)
        else:
            res.append(d)
    return res


def ms_slice_helpers(dev_matrix, tensor_map, shape, rank, step=0, size=0):
    """Slice of `rank` using MindSpore's slice helpers.  Nested tensor maps are expanded the way
    MindSpore's checkpoint transform does it (_expand_layout), an optimizer shard (step, size)
    the way it does that (_construct_tensor_layout_for_opt_shard), then the flat helpers are
    used."""
    has_nested = any(isinstance(d, (list, tuple)) for d in tensor_map)
    if size:
        dm, flat_map, exp_shape = _construct_tensor_layout_for_opt_shard(
            list(dev_matrix), list(tensor_map), step, size, list(shape))
    elif has_nested:
        dm, flat_map, exp_shape = _expand_layout(list(dev_matrix), list(tensor_map), list(shape))
    else:
        dm, flat_map, exp_shape = list(dev_matrix), list(tensor_map), list(shape)
    if len(flat_map) != len(exp_shape):
        raise ValueError(f"tensor_map {tensor_map} (expanded {flat_map}) does not match shape {shape}")
    strategy = _get_tensor_strategy(dm, flat_map)
    idx = int(_get_tensor_slice_index(dm, strategy, flat_map, rank))
    glob = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(exp_shape)
    local = _load_tensor(ms.Tensor(glob), dm, flat_map, full_shape=exp_shape, rank_id=rank)
    # MindSpore reshapes an expanded slice back to the per-dim slice shape
    # (_insert_expand_layout_reshape); do the same via the original tensor_map's strategy.
    slice_shape = [s // k for s, k in zip(shape, _get_tensor_strategy(list(dev_matrix), list(tensor_map)))]
    slice_shape[0] //= size or 1
    local = np.asarray(local).reshape(slice_shape)
    box, exact = box_from_local(local, shape)
    return box, exact, strategy, idx, flat_map, exp_shape


def main():
    print("MindSpore", ms.__version__, "device", ms.get_context("device_target"))
    work = tempfile.mkdtemp(prefix="ms_check_")
    layouts = {}
    for fname in FILES:
        path = os.path.join(DIR, fname)
        stem = stem_of(fname)
        exp = EXPECTED.get(stem)
        print("\n" + "=" * 70 + f"\n{fname}  (expected entry: {stem})")
        # ---------------- [read] ----------------
        try:
            strat = ms.parallel.build_searched_strategy(path)
            lst = _convert_to_list(strat)
        except Exception as e:  # noqa
            report(False, f"{fname} [read] MindSpore rejected the file: {type(e).__name__}: {e}")
            continue
        report(len(lst) > 0, f"{fname} [read] build_searched_strategy -> {len(lst)} parameters {sorted(lst)}")
        layouts[fname] = lst
        for name in sorted(lst):
            dev, tmap, split, field, step, size, stages = lst[name]
            raw = strat[name]
            raw_maps = [list(t.dim) for t in raw.tensor_map]
            print(f"    {name}: dev_matrix={dev} tensor_map={tmap} (raw TensorMap entries {raw_maps}) "
                  f"param_split_shape={split} field={field} opt_weight_shard_step={step} "
                  f"opt_weight_shard_size={size} pipeline_stages={stages}")
        if exp is None:
            report(False, f"{fname} no entry '{stem}' in expected_slices.json")
            continue
        missing = sorted(set(exp) - set(lst))
        extra = sorted(set(lst) - set(exp))
        report(not missing and not extra, f"{fname} [read] parameter set vs expected: missing={missing} extra={extra}")

        # ---------------- [layout] ----------------
        # autopar's layout text, rebuilt with MindSpore's own mindspore.Layout(device_matrix, alias_name)
        # (alias 'x' = dev axis 0 (size 2), 'y' = dev axis 1 (size 4)), must give the tensor_map read.
        for name in sorted(exp):
            if name not in lst:
                continue
            try:
                dev = lst[name][0]
                aliases = ("x", "y") if len(dev) == 2 else tuple(f"a{i}" for i in range(len(dev)))
                spec = parse_layout_text(exp[name]["layout"])
                want = ms.Layout(tuple(dev), aliases)(*spec).to_dict()["tensor_map"]
                ok = norm_map(want) == norm_map(lst[name][1])
                report(ok, f"{fname} [layout] {name} {exp[name]['layout']} -> mindspore.Layout tensor_map "
                       f"{norm_map(want)} vs read {norm_map(lst[name][1])}")
            except Exception as e:  # noqa
                report(False, f"{fname} [layout] {name}: {type(e).__name__}: {e}")

        # ---------------- [slice] ----------------
        for name in sorted(exp):
            if name not in lst:
                continue
            dev, tmap, _, _, step, size = lst[name][:6]
            shape = exp[name]["shape"]
            bad = []
            try:
                for r in range(NRANKS):
                    box, exact, strategy, idx, fm, es = ms_slice_helpers(dev, tmap, shape, r, step, size)
                    want = exp[name]["rank_slices"][r]
                    if box != want or not exact:
                        bad.append(f"rank{r}: mindspore={box} exact_box={exact} expected={want}")
                detail = f"strategy={_get_tensor_strategy(dev, tmap)}"
                report(not bad, f"{fname} [slice] {name} layout={exp[name]['layout']} ms_tensor_map={tmap} "
                       f"{detail}" + ("" if not bad else " :: " + "; ".join(bad)))
            except Exception as e:  # noqa
                report(False, f"{fname} [slice] {name}: MindSpore helper error {type(e).__name__}: {e}")

        # ---------------- [xform] ----------------
        src_ckpt = os.path.join(work, f"{stem}_full.ckpt")
        params = [{"name": n, "data": ms.Tensor(np.arange(int(np.prod(exp[n]["shape"])), dtype=np.int32)
                                                  .reshape(exp[n]["shape"]))} for n in sorted(exp)]
        ms.save_checkpoint(params, src_ckpt)
        per_rank = {}
        xform_err = None
        for r in range(NRANKS):
            out = os.path.join(work, f"{stem}_rank{r}.ckpt")
            try:
                ms.transform_checkpoint_by_rank(r, {0: src_ckpt}, out, None, path)
                per_rank[r] = {k: v.asnumpy() for k, v in ms.load_checkpoint(out).items()}
            except Exception as e:  # noqa
                xform_err = f"rank{r}: {type(e).__name__}: {e}"
                break
        if xform_err:
            report(False, f"{fname} [xform] transform_checkpoint_by_rank failed: {xform_err}")
        else:
            for name in sorted(exp):
                shape = exp[name]["shape"]
                bad = []
                for r in range(NRANKS):
                    if name not in per_rank[r]:
                        bad.append(f"rank{r}: missing")
                        continue
                    box, exact = box_from_local(per_rank[r][name], shape)
                    want = exp[name]["rank_slices"][r]
                    if box != want or not exact:
                        bad.append(f"rank{r}: mindspore={box} local_shape={list(per_rank[r][name].shape)} "
                                   f"exact_box={exact} expected={want}")
                report(not bad, f"{fname} [xform] {name}" + ("" if not bad else " :: " + "; ".join(bad)))

        # ---------------- [merge] ----------------
        try:
            sdir = os.path.join(work, "merge_src_" + fname.replace(".", "_"))
            os.makedirs(sdir, exist_ok=True)
            shutil.copy(path, sdir)
            dst = os.path.join(work, f"merged_{stem}{os.path.splitext(fname)[1]}")
            ms.merge_pipeline_strategys(sdir, dst)
            merged = ms.parallel.build_searched_strategy(dst)
            mlist = _convert_to_list(merged)
            print(f"    merged keys: {sorted(merged)}")
            for name in sorted(lst):
                keys = [k for k in merged if k.split("-", 1)[-1] == name]
                same = name in mlist and mlist[name][:6] == lst[name][:6]
                report(bool(keys) and same, f"{fname} [merge] {name} -> merged keys {keys} "
                       f"layout {'unchanged' if same else 'CHANGED: ' + str(mlist.get(name))}")
        except Exception as e:  # noqa
            report(False, f"{fname} [merge] merge_pipeline_strategys failed: {type(e).__name__}: {e}")

    # ---------------- [json==ckpt] ----------------
    if "mlp_plain.ckpt" in layouts and "mlp_plain.json" in layouts:
        a, b = layouts["mlp_plain.ckpt"], layouts["mlp_plain.json"]
        report(a == b, f"[json==ckpt] mlp_plain.json and mlp_plain.ckpt give identical MindSpore layouts: {a == b}")

    # ---------------- [ranks] ----------------
    print("\n" + "=" * 70 + "\nrank_list_for_transform")

    def overlap(a, b):
        return all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b))

    pairs = [("mlp_plain.ckpt", "mlp_nested.ckpt"), ("mlp_nested.ckpt", "mlp_plain.ckpt"),
             ("mlp_plain.ckpt", "mlp_nested2.ckpt"), ("mlp_nested2.ckpt", "mlp_plain.ckpt"),
             ("mlp_opt.ckpt", "mlp_plain.ckpt"), ("mlp_plain.ckpt", "mlp_opt.ckpt"),
             ("mlp_opt_nested.ckpt", "mlp_opt_dp.ckpt")]
    for src, dst in pairs:
        es, ed = EXPECTED[stem_of(src)], EXPECTED[stem_of(dst)]
        for r in [0, 1, 3, 4, 7]:
            try:
                got = ms.rank_list_for_transform(r, os.path.join(DIR, src), os.path.join(DIR, dst))
                # MindSpore may return any one replica per needed slice; check coverage instead of equality.
                covered = True
                for name in ed:
                    want_box = ed[name]["rank_slices"][r]
                    # every needed piece of the dst slice must be held by some returned src rank
                    pieces = [es[name]["rank_slices"][sr] for sr in got]
                    cells = np.zeros([b - a for a, b in want_box], dtype=bool)
                    for p in pieces:
                        sl = tuple(slice(max(pa, wa) - wa, max(min(pb, wb) - wa, 0))
                                   for (pa, pb), (wa, wb) in zip(p, want_box))
                        cells[sl] = True
                    covered &= bool(cells.all())
                report(covered, f"[ranks] {src} -> {dst} rank{r}: mindspore={sorted(got)} "
                       f"(together hold every dst slice of rank{r}: {covered})")
            except Exception as e:  # noqa
                report(False, f"[ranks] {src} -> {dst} rank{r}: {type(e).__name__}: {e}")

    # ---------------- [reshard] ----------------
    # Real sharded -> sharded transform: per-rank checkpoints produced above under the src plan are
    # converted by MindSpore to the dst plan; each dst rank must end up with autopar's dst slice.
    print("\n" + "=" * 70 + "\nsharded -> sharded transform_checkpoint_by_rank")
    for src, dst in pairs:
        ed = EXPECTED[stem_of(dst)]
        for r in range(NRANKS):
            try:
                rl = ms.rank_list_for_transform(r, os.path.join(DIR, src), os.path.join(DIR, dst))
                fmap = {sr: os.path.join(work, f"{stem_of(src)}_rank{sr}.ckpt") for sr in rl}
                out = os.path.join(work, f"reshard_{stem_of(src)}_to_{stem_of(dst)}_rank{r}.ckpt")
                ms.transform_checkpoint_by_rank(r, fmap, out, os.path.join(DIR, src), os.path.join(DIR, dst))
                got = {k: v.asnumpy() for k, v in ms.load_checkpoint(out).items()}
                bad = []
                for name in sorted(ed):
                    box, exact = box_from_local(got[name], ed[name]["shape"])
                    if box != ed[name]["rank_slices"][r] or not exact:
                        bad.append(f"{name}: mindspore={box} exact_box={exact} "
                                   f"expected={ed[name]['rank_slices'][r]}")
                report(not bad, f"[reshard] {src} -> {dst} rank{r} (from src ranks {sorted(rl)})"
                       + ("" if not bad else " :: " + "; ".join(bad)))
            except Exception as e:  # noqa
                report(False, f"[reshard] {src} -> {dst} rank{r}: {type(e).__name__}: {e}")

    shutil.rmtree(work, ignore_errors=True)
    nfail = sum(1 for ok, _ in RESULTS if not ok)
    print("\n" + "=" * 70)
    print(f"SUMMARY: {len(RESULTS) - nfail} PASS, {nfail} FAIL")
    return 1 if nfail else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa
        traceback.print_exc()
        sys.exit(2)
