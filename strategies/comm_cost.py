"""Alpha-beta time of one collective over one group of devices.

In: the collective kind, the per-device input bytes, the group size and the topology level the
group's links belong to (``alpha`` s/message, ``beta`` s/byte). Out: ``(seconds, algorithm)``
for the cheapest algorithm this module knows for that kind. Formulas (n ranks, B input bytes):

| kind           | algorithm          | time                                  |
|----------------|--------------------|---------------------------------------|
| all_reduce     | ring               | 2(n-1)a + 2(n-1)/n B b                |
| all_reduce     | halving_doubling   | 2 log2(n) a + 2(n-1)/n B b  (n = 2^k) |
| all_reduce     | recursive_doubling | log2(n) (a + B b)           (n = 2^k) |
| all_reduce     | tree               | 2 log2(n) a + 2 log2(n) B b (small B) |
| all_gather     | ring               | (n-1)a + (n-1) B b                    |
| all_gather     | recursive_doubling | log2(n) a + (n-1) B b       (n = 2^k) |
| reduce_scatter | ring               | (n-1)a + (n-1)/n B b                  |
| reduce_scatter | recursive_halving  | log2(n) a + (n-1)/n B b     (n = 2^k) |
| all_to_all     | pairwise           | (n-1)a + (n-1)/n B b                  |
| all_to_all     | bruck              | log2(n) a + log2(n)/2 B b   (n = 2^k) |
| broadcast      | tree / ring        | log2(n) (a + B b)  or (n-1)a + 2B b   |
| send / recv    | direct             | a + B b                               |
"""
from __future__ import annotations

import math


def collective_time(kind: str, nbytes: int, n: int, alpha: float, beta: float):
    if n <= 1 or kind == "slice":
        return 0.0, "local"
    B = float(nbytes)
    lg = math.ceil(math.log2(n))
    if kind == "all_reduce":
        opts = [(2 * (n - 1) * alpha + 2 * (n - 1) / n * B * beta, "ring"),
                (2 * lg * alpha + 2 * lg * B * beta, "tree")]
        if n & (n - 1) == 0:
            opts.append((2 * lg * alpha + 2 * (n - 1) / n * B * beta, "halving_doubling"))
            opts.append((lg * (alpha + B * beta), "recursive_doubling"))
        return min(opts)
    pow2 = n & (n - 1) == 0
    if kind == "all_gather":
        ring = (n - 1) * alpha + (n - 1) * B * beta
        return min((ring, "ring"), (lg * alpha + (n - 1) * B * beta, "recursive_doubling")) \
            if pow2 else (ring, "ring")
    if kind == "reduce_scatter":
        ring = (n - 1) * alpha + (n - 1) / n * B * beta
        return min((ring, "ring"), (lg * alpha + (n - 1) / n * B * beta, "recursive_halving")) \
            if pow2 else (ring, "ring")
    if kind == "all_to_all":
        pairwise = (n - 1) * alpha + (n - 1) / n * B * beta
        return min((pairwise, "pairwise"), (lg * alpha + lg / 2 * B * beta, "bruck")) \
            if pow2 else (pairwise, "pairwise")
    if kind == "broadcast":
        return min((lg * (alpha + B * beta), "tree"), ((n - 1) * alpha + 2 * B * beta, "ring"))
    if kind in ("send", "recv"):
        return alpha + B * beta, "direct"
    raise ValueError(f"unknown collective kind {kind!r}")
