"""Alpha-beta time of one collective over one group of devices, for the algorithms the native
runtime runs (``autopar._native``, native/src/algorithms/), under the runtime's own names.

In: the collective kind, the per-device input bytes, the group size and the topology level the
group's links belong to (``alpha`` s/message, ``beta`` s/byte); for a group that spans two
levels, also ``inner = (L, alpha_in, beta_in)``: the group is H = n/L blocks of L ranks (one
block per host, consecutive in group order) joined inside a block by the faster inner level,
``alpha``/``beta`` being the outer (slowest) level's; ``shared``: the group's ranks share one
host's memory (its axes lie in the topology's innermost level), which offers the direct
all-reduce. Out: ``(seconds, algorithm)`` for the cheapest algorithm of that kind (price ties
go to the first in ``ALL_REDUCE``).

Model (single-port, as in Thakur, Rabenseifner & Gropp 2005): a rank sends one message and
receives one at a time, both at once; an m-byte message costs a + m b; steps in sequence add;
a pipelined forward pays a per hop and its bytes once. Flat algorithms on a two-level group are
priced on the outer level (each of their steps waits for a slow link), except halving_doubling
when n and L are powers of two: its step j (partner p/2^j positions away, B/2^j bytes) is on the
outer level only if p/2^j >= L. n ranks, B input bytes per rank:

| kind           | algorithm        | time                                                         |
|----------------|------------------|--------------------------------------------------------------|
| all_reduce     | direct           | (n + ceil(log2 n))a + 1.5 (n-1)/n B b  (shared memory only:  |
|                |                  | the buffers' addresses, then each rank reads its block of    |
|                |                  | every peer, reduces it and writes the sums back itself, a    |
|                |                  | barrier; its 2(n-1) copy calls count half a hand-off each,   |
|                |                  | the write-back half a copy: it leaves from cache)            |
| all_reduce     | ring             | 2(n-1)a + 2(n-1)/n B b                                       |
| all_reduce     | halving_doubling | 2(k+e)a + 2((p-1)/p + e) B b; p = 2^k <= n < 2p, e = [n > p] |
|                |                  | (the 2(n-p) extra ranks fold into pairs first, unfold last)  |
| all_reduce     | recursive_doubl. | (k+2e)(a + B b)  (whole buffer each step; fold as above)     |
| all_reduce     | tree             | 4fDa + f(D+1) B b; D = floor(log2 n), f = min(2, n-1): two   |
|                |                  | binary trees of B/2, one after the other, each reduced up    |
|                |                  | (f children per parent) and pipelined down                   |
| all_reduce     | 2d_ring          | 3(L-1)a_i + (3L-2)/L B b_i + 2(H-1)a_o + 2(H-1)/H B b_o      |
|                |                  | (ring reduce-scatter, gather to leader, chain broadcast in   |
|                |                  | the host; ring all-reduce of B between leaders)              |
| all_reduce     | 2d_torus         | 2(L-1)a_i + 2(L-1)/L B b_i + 2(H-1)a_o + 2(H-1)/(HL) B b_o   |
| all_reduce     | 2d_mesh          | as 2d_torus (a direct step to k peers is k messages)         |
| all_gather     | ring             | (n-1)a + (n-1) B b                                           |
| reduce_scatter | ring             | (n-1)a + (n-1)/n B b                                         |
| all_to_all     | pairwise         | (n-1)a + (n-1)/n B b                                         |
| broadcast      | chain            | (n-1)a + B b  (pipelined)                                    |
| all_reduce     | reduction_server | 2a + max(L, n/R) B b  (R reducer processes on hosts of their |
|                |                  | own, NICs like the outer level's: a worker sends its buffer  |
|                |                  | once and receives the sums once, its host's NIC carrying its |
|                |                  | L ranks' and a reducer's n/R shards of B/R, both ways at once,|
|                |                  | pipelined; each reducer reduces (n-1)/R of B)                |
| send / recv    | direct           | a + B b                                                      |

The 2D rows (a_i, b_i: inner level; a_o, b_o: outer) are offered only with ``inner``;
reduction_server only where the topology has reducers and the group spans every device.
Reductions add R B gamma (gamma: seconds per reduced byte; the planner uses 1 / memory bandwidth),
R being the buffers each rank reduces: direct, ring, reduce_scatter (n-1)/n; halving_doubling
(p-1)/p + e; recursive_doubling k + e; tree f D / 2; 2d_torus and 2d_mesh (L-1)/L + (H-1)/(HL);
2d_ring (L-1)/L + (H-1)/H. It is what keeps recursive doubling, which reduces the whole buffer
every step, to small messages.
Consequences of the model: tree never beats halving_doubling and 2d_ring never beats 2d_torus
(they are priced so that their names stay honest); only all_reduce has a choice. In shared
memory direct takes over from the ring or halving-doubling above 80 KB (2 ranks) to 230 KB
(8 ranks); measured here (``python -m autopar.tools.bench --op all_reduce --algorithm ring
direct``) it is ahead from 16 KB at 2 ranks and from between 64 KB and 1 MB at 3 to 8, with
1.2-1.8x the ring's bus bandwidth from 1 MB.
"""

from __future__ import annotations

# the native all-reduces (``_native.ALLREDUCE_ALGORITHMS`` and the Reduction Server's), in the
# order that breaks price ties
ALL_REDUCE = (
    "ring",
    "halving_doubling",
    "recursive_doubling",
    "tree",
    "direct",
    "2d_torus",
    "2d_mesh",
    "2d_ring",
    "reduction_server",
)


def collective_time(
    kind: str,
    nbytes: int,
    n: int,
    alpha: float,
    beta: float,
    inner=None,
    gamma: float = 0.0,
    shared: bool = False,
    reducers: int = 0,
):
    """``(seconds, algorithm)`` of the cheapest algorithm for ``kind`` (see the module table);
    ``inner = (L, alpha_in, beta_in)`` adds the 2D all-reduces for a group of n/L hosts of L;
    ``gamma``: seconds per byte a rank reduces (the table's bandwidth terms plus ``R B gamma``);
    ``shared``: the ranks share one host's memory (adds the direct all-reduce); ``reducers``:
    Reduction Server processes the group may reduce through (adds reduction_server)."""
    if n <= 1 or kind == "slice":
        return 0.0, "local"
    if kind == "all_reduce":
        times = all_reduce_times(nbytes, n, alpha, beta, inner, gamma, shared, reducers)
        best = min(times, key=lambda a: (times[a], ALL_REDUCE.index(a)))
        return times[best], best
    B = float(nbytes)
    if kind == "all_gather":
        return (n - 1) * alpha + (n - 1) * B * beta, "ring"
    if kind == "reduce_scatter":
        return (n - 1) * alpha + (n - 1) / n * B * (beta + gamma), "ring"
    if kind == "all_to_all":
        return (n - 1) * alpha + (n - 1) / n * B * beta, "pairwise"
    if kind == "broadcast":
        return (n - 1) * alpha + B * beta, "chain"
    if kind in ("send", "recv"):
        return alpha + B * beta, "direct"
    raise ValueError(f"unknown collective kind {kind!r}")


def all_reduce_times(
    nbytes: int,
    n: int,
    alpha: float,
    beta: float,
    inner=None,
    gamma: float = 0.0,
    shared: bool = False,
    reducers: int = 0,
) -> dict:
    """Seconds of every native all-reduce (name -> seconds) over ``n >= 2`` ranks, as in the
    module table; the 2D ones only when ``inner = (L, alpha_in, beta_in)`` has 1 < L < n, L | n,
    direct only when ``shared``, reduction_server only with ``reducers`` and not ``shared``."""
    B = float(nbytes)
    L, ai, bi = inner if inner else (1, alpha, beta)
    two = 1 < L < n and n % L == 0
    k = n.bit_length() - 1
    p, e = 1 << k, int(n & (n - 1) != 0)
    D, f = k, min(2, n - 1)
    if two and not e and L & (L - 1) == 0:  # halving-doubling, step by step
        hd = 0.0
        for j in range(1, k + 1):  # partner p/2^j away, B/2^j bytes, twice
            a, b = (alpha, beta) if p >> j >= L else (ai, bi)
            hd += 2 * (a + B / (1 << j) * b)
    else:
        hd = 2 * (k + e) * alpha + 2 * ((p - 1) / p + e) * B * beta
    G = B * gamma  # reducing the whole buffer once
    out = {
        "ring": 2 * (n - 1) * alpha + 2 * (n - 1) / n * B * beta + (n - 1) / n * G,
        "halving_doubling": hd + ((p - 1) / p + e) * G,
        "recursive_doubling": (k + 2 * e) * (alpha + B * beta) + (k + e) * G,
        "tree": 4 * f * D * alpha + f * (D + 1) * B * beta + f * D / 2 * G,
    }
    if shared:
        out["direct"] = (
            (n + (n - 1).bit_length()) * alpha + 1.5 * (n - 1) / n * B * beta + (n - 1) / n * G
        )
    if two:
        H = n // L
        torus = (
            2 * (L - 1) * ai
            + 2 * (L - 1) / L * B * bi
            + 2 * (H - 1) * alpha
            + 2 * (H - 1) / (H * L) * B * beta
        )
        torus += ((L - 1) / L + (H - 1) / (H * L)) * G
        out["2d_torus"] = out["2d_mesh"] = torus
        out["2d_ring"] = (
            3 * (L - 1) * ai
            + (3 * L - 2) / L * B * bi
            + 2 * (H - 1) * alpha
            + 2 * (H - 1) / H * B * beta
            + ((L - 1) / L + (H - 1) / H) * G
        )
    if reducers and not shared:
        R, Lh = reducers, (L if two else 1)
        out["reduction_server"] = 2 * alpha + max(Lh, n / R) * B * beta + (n - 1) / R * G
    return out
