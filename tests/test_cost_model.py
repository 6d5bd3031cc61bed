"""The cost model's layout copies against XLA's compiled CPU programs: which dot operands XLA
copies before its kernel reads them (``cost_model.dot_copies``), which transposes it folds into
a dot (``graph.fold_transposes``), and what the cost model charges for each."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autopar as ap
from autopar.mesh import LogicalMesh
from autopar.strategies.candidates import enumerate_candidates
from autopar.strategies.cost_model import compute_time, dot_copies
from autopar.strategies.rules import rule_for
from autopar.trace import trace


def copies(f, *args) -> list:
    """The transposes and copies in XLA's compiled program of ``f`` (HLO text lines)."""
    txt = jax.jit(f).lower(*args).compile().as_text()
    return [l for l in txt.splitlines() if re.search(r"= \S+ (transpose|copy)\(", l)]


def copied_operands(f, *args) -> set:
    """Names ("a", "b") of ``f``'s arguments that XLA copies before a dot reads them (its dot
    decomposition names each copy after the argument it copies)."""
    return set(re.findall(r'op_name="([ab])"', "\n".join(copies(f, *args))))


def contractions(seed: int, count: int):
    """Random dot_general operand shapes and dimension numbers: 0-2 batch, 1-2 contracting and
    0-2 free dimensions per operand, each operand's dimensions in a random order."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        nb, nc = rng.choice([0, 0, 1, 2]), rng.choice([1, 1, 2])
        nf = rng.choice([0, 1, 1, 2], size=2)
        out = []
        for side in range(2):
            roles = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + \
                    [("f", i) for i in range(nf[side])]
            order = list(rng.permutation(len(roles)))
            roles = [roles[k] for k in order]
            bpos = sorted(k for k, r in enumerate(roles) if r[0] == "b")   # batch kept in order
            for i, k in enumerate(bpos):
                roles[k] = ("b", i)
            size = {"b": 2, "c": 3, "f": 4 + side}
            out.append((roles, tuple(size[t] + i for t, i in roles)))
        (lr, ls), (rr, rs) = out
        dn = ((tuple(lr.index(("c", i)) for i in range(nc)),
               tuple(rr.index(("c", i)) for i in range(nc))),
              (tuple(lr.index(("b", i)) for i in range(nb)),
               tuple(rr.index(("b", i)) for i in range(nb))))
        yield ls, rs, dn


@pytest.mark.parametrize("seed", [0, 1])
def test_dot_copies_match_xla(seed):
    for ls, rs, dn in contractions(seed, 15):
        a, b = jnp.ones(ls, jnp.float32), jnp.ones(rs, jnp.float32)
        f = lambda a, b: lax.dot_general(a, b, dn)
        node, = [n for n in trace(f, a, b).nodes if n.prim == "dot_general"]
        want = {name for name, perm in zip("ab", dot_copies(node)) if perm is not None}
        assert copied_operands(f, a, b) == want, (ls, rs, dn)


def folded(f, *args) -> list:
    return [n.folded for n in trace(f, *args).nodes if n.prim == "transpose"]


def test_fold_transposes_match_xla():
    x, w = jnp.ones((16, 32), jnp.float32), jnp.ones((24, 32), jnp.float32)
    # read by a dot that then reads it in place: folded, XLA copies nothing
    f = lambda a, b: a @ b.T
    assert folded(f, x, w) == [True] and copies(f, x, w) == []
    # read by an elementwise operator: a strided copy
    g = lambda a, b: a.T + b
    assert folded(g, x, x.T) == [False] and copies(g, x, x.T) != []
    # a dot's result transposed for this reader alone: XLA writes it in that order
    h = lambda a, b: jnp.transpose(lax.dot_general(a, b, (((1,), (1,)), ((), ())))) * 3.0
    assert folded(h, x, w) == [True] and copies(h, x, w) == []
    # heads split by a transpose read by a batched dot: the dot copies it (batch not first)
    q = jnp.ones((2, 8, 4, 16), jnp.float32)
    heads = lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a.transpose(0, 2, 1, 3),
                                    b.transpose(0, 2, 1, 3))
    assert folded(heads, q, q) == [False, False]
    assert sum(" copy(" in l for l in copies(heads, q, q)) == 2


def cost(node, mesh) -> float:
    """Seconds of ``node`` replicated on the one device of ``mesh``."""
    cand, = enumerate_candidates(node, rule_for(node).spec(node), mesh)
    return compute_time(node, cand, mesh)


def test_copy_prices():
    topo = ap.Topology((ap.Level("host", 1, alpha=1e-6, beta=1e-9),), flops=1e12,
                       mem_bandwidth=40e9, transpose_bandwidth=2e9)
    mesh = LogicalMesh.create((1,), ("x",), topo)
    x = jnp.ones((256, 512), jnp.float32)
    nbytes = 2 * x.nbytes                      # read and written
    graph = trace(lambda a: jnp.transpose(a) * 2.0, x)
    t, = [n for n in graph.nodes if n.prim == "transpose"]
    assert cost(t, mesh) == pytest.approx(nbytes / 2e9)
    y = jnp.ones((8, 64, 4, 32), jnp.float32)  # whole rows of 32 move: the memory's rate
    t, = [n for n in trace(lambda a: a.transpose(0, 2, 1, 3) * 2.0, y).nodes
          if n.prim == "transpose"]
    assert cost(t, mesh) == pytest.approx(2 * y.nbytes / 40e9)
    t, = [n for n in trace(lambda a: a.reshape(256, 1, 512).transpose(1, 0, 2) * 2.0, x).nodes
          if n.prim == "transpose"]          # only a dimension of one moves: a relabelling
    assert cost(t, mesh) == 0.0
    w = jnp.ones((128, 512), jnp.float32)
    t, = [n for n in trace(lambda a, b: a @ b.T, x, w).nodes if n.prim == "transpose"]
    assert t.folded and cost(t, mesh) == 0.0
    # a weight gradient: the activations (batch, seq, d) copied to (d, batch x seq), strided
    a, g = jnp.ones((4, 64, 128), jnp.float32), jnp.ones((4, 64, 96), jnp.float32)
    dn = (((0, 1), (0, 1)), ((), ()))
    dot, = trace(lambda a, g: lax.dot_general(a, g, dn), a, g).nodes
    plain = in_kernel_order(dot)
    assert cost(dot, mesh) == pytest.approx(
        cost(plain, mesh) + 2 * a.nbytes / 2e9)


def in_kernel_order(dot):
    """The same contraction with its operands already in the kernel's order (no copy)."""
    a, g = dot.inputs
    k, m = a.shape[0] * a.shape[1], a.shape[2]
    return trace(lambda a, g: lax.dot_general(a, g, (((1,), (0,)), ((), ()))),
                 jnp.ones((m, k), jnp.float32),
                 jnp.ones((k, g.shape[2]), jnp.float32)).nodes[0]


def test_topology_keeps_transpose_bandwidth(tmp_path):
    topo = ap.Topology((ap.Level("host", 2, alpha=1e-6, beta=1e-9),), transpose_bandwidth=3e9)
    topo.save(tmp_path / "t.json")
    again = ap.Topology.load(tmp_path / "t.json")
    assert again == topo and again.copy_bandwidth(True) == 3e9
    assert again.copy_bandwidth(False) == topo.mem_bandwidth
    plain = ap.Topology.local(2)
    assert plain.copy_bandwidth(True) == plain.mem_bandwidth     # 0: no separate rate
    assert "transpose_bandwidth" not in plain.to_dict()
