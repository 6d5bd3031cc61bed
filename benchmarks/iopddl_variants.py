"""Harder variants of the IOPDDL problems, so a solver is measured beyond the instances it saw.

In: problem files (IOPDDL JSON, optionally gzipped), an output folder, the kinds of variant
(``--kinds``) and a seed. Out: one ``NAME-KIND.json.gz`` per problem and kind, each a valid
IOPDDL problem with a feasible least-memory choice:
- ``tight``: the usage limit halfway between the least-memory choice's peak and the limit;
- ``perturbed``: every node and edge cost times a log-normal factor (sigma 0.2);
- ``edges``: the same graph and node costs, edge costs scaled by a per-edge factor in [0.25, 4]
  (communication priced differently);
- ``wider``: every node with more than one strategy gets half as many more, copies of its
  strategies with cost and usage times factors in [0.9, 1.2] and their edge rows/columns times
  [0.9, 1.1].
Problems are read and written with the standard library and numpy only (no autopar code).

    python benchmarks/iopddl_variants.py ../shared/iopddl/asplos-2025-iopddl-G.json.gz -o /tmp/v
    python benchmarks/iopddl.py --files /tmp/v/*.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path

import numpy as np

KINDS = ("tight", "perturbed", "edges", "wider")


def read(path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _least_memory_peak(p: dict) -> int:
    nodes = p["nodes"]
    events = {}
    for (a, b), u in zip(nodes["intervals"], nodes["usages"]):
        if b > a and u:
            m = min(u)
            events[a] = events.get(a, 0) + m
            events[b] = events.get(b, 0) - m
    live = peak = 0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak


def _scale(values, factors) -> list:
    return [v * f if math.isfinite(v) else v for v, f in zip(values, factors)]


def variant(data: dict, kind: str, rng: np.random.Generator) -> dict:
    data = json.loads(json.dumps(data))                # a deep copy
    p = data.get("problem", data)
    nodes, edges = p["nodes"], p.setdefault("edges", {"nodes": [], "costs": []})
    if kind == "tight":
        if p.get("usage_limit") is not None:
            low = _least_memory_peak(p)
            p["usage_limit"] = int(low + (p["usage_limit"] - low) // 2)
    elif kind == "perturbed":
        nodes["costs"] = [[round(x, 3) for x in _scale(c, rng.lognormal(0, 0.2, len(c)))]
                          for c in nodes["costs"]]
        edges["costs"] = [[round(x, 3) for x in _scale(c, rng.lognormal(0, 0.2, len(c)))]
                          for c in edges["costs"]]
    elif kind == "edges":
        edges["costs"] = [[round(x * f, 3) if math.isfinite(x) else x for x in c]
                          for c, f in zip(edges["costs"], 4.0 ** rng.uniform(-1, 1, len(edges["costs"])))]
    elif kind == "wider":
        extra = []                                  # per node: indices of the copied strategies
        for i, c in enumerate(nodes["costs"]):
            k = len(c) // 2 if len(c) > 1 else 0
            src = sorted(rng.choice(len(c), k, replace=False).tolist()) if k else []
            extra.append(src)
            nodes["costs"][i] = c + [c[s] * rng.uniform(0.9, 1.2) if math.isfinite(c[s]) else c[s]
                                     for s in src]
            u = nodes["usages"][i]
            nodes["usages"][i] = u + [int(u[s] * rng.uniform(0.9, 1.2)) for s in src]
        old = [len(c) - len(e) for c, e in zip(nodes["costs"], extra)]
        for e, (a, b) in enumerate(edges["nodes"]):
            m = np.array(edges["costs"][e], float).reshape(old[a], old[b])
            m = np.vstack([m, m[extra[a]] * rng.uniform(0.9, 1.1, (len(extra[a]), 1))])
            m = np.hstack([m, m[:, extra[b]] * rng.uniform(0.9, 1.1, (1, len(extra[b])))])
            edges["costs"][e] = [round(x, 3) if math.isfinite(x) else x for x in m.ravel().tolist()]
    else:
        raise ValueError(f"unknown variant {kind!r}; choose from {KINDS}")
    if "name" in p:
        p["name"] = f"{p['name']}-{kind}"
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problems", nargs="+", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True, help="folder for the variants")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.problems:
        data = read(path)
        stem = path.name.split(".")[0]
        for kind in args.kinds.split(","):
            out = args.out / f"{stem}-{kind}.json.gz"
            with gzip.open(out, "wt") as f:
                json.dump(variant(data, kind, np.random.default_rng(args.seed)), f)
            print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
