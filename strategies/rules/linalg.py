"""Linear algebra and FFT primitives (``jnp.linalg``, ``jax.scipy.linalg``, ``jnp.fft``: a
Gaussian process's Cholesky, a Shampoo or SOAP optimizer's eigendecompositions, a Fourier
neural operator's FFTs).

In: a node of one of ``CORE``'s primitives. Out: its ``OpSpec``. Each works on the trailing
dimensions of its operands (a matrix, a vector of pivots, the transformed axes), separately for
every index of the leading (batch) dimensions, which every operand and result shares: the
batch dimensions may be split (a device factors its own matrices), the trailing ones never (a
factorisation, a solve or a transform reads all of its matrix). ``CORE`` gives how many
trailing dimensions the first operand has; a batch dimension whose size differs between two
operands is ``_``. No local params change (``fft_lengths`` are trailing sizes).

``flops(node)`` prices one: the usual counts per matrix (Cholesky n^3/3, LU 2n^3/3, QR
2mn^2 - 2n^3/3, symmetric eigendecomposition 9n^3, SVD 4mn^2 + 8n^3 for m >= n, a triangular
solve m^2 n, FFT 5 N log2 N), times the batch.
"""

from __future__ import annotations

import math

from .spec import OpSpec, Rule

# primitive -> trailing (core) dimensions of its first operand
CORE = {
    "cholesky": 2,
    "eigh": 2,
    "eig": 2,
    "qr": 2,
    "svd": 2,
    "lu": 2,
    "schur": 2,
    "hessenberg": 2,
    "householder_product": 2,
    "triangular_solve": 2,
    "symmetric_product": 2,
    "lu_pivots_to_permutation": 1,
    "tridiagonal_solve": 1,
}


def _core(node) -> int:
    if node.prim == "fft":
        return len(node.params["fft_lengths"])
    return CORE[node.prim]


def batched_spec(node):
    """``b0 b1 .. _ _`` on every operand and result: the shared leading dimensions split."""
    shape = node.inputs[0].shape
    batch = len(shape) - _core(node)
    letters = tuple(
        f"b{i}"
        if all(len(v.shape) > i and v.shape[i] == shape[i] for v in (*node.inputs, *node.outputs))
        else None
        for i in range(batch)
    )

    def dims(v):
        return letters + (None,) * (len(v.shape) - batch)

    return OpSpec(
        tuple(dims(x) for x in node.inputs), tuple(dims(y) for y in node.outputs), frozenset(), ()
    )


def flops(node) -> float:
    """Floating-point operations of the whole operator (see the module docstring)."""
    shape = node.inputs[0].shape
    core = _core(node)
    batch = math.prod(shape[: len(shape) - core])
    if node.prim == "fft":
        n = math.prod(node.params["fft_lengths"])
        return batch * 5.0 * n * max(1.0, math.log2(n))
    if core == 1:  # a tridiagonal solve, pivots to a permutation
        return batch * 8.0 * math.prod(node.outputs[0].shape[len(shape) - 1 :])
    m, n = shape[-2:]
    if node.prim == "triangular_solve":
        b = node.inputs[1].shape
        return batch * float(m) * m * (b[-1] if node.params["left_side"] else b[-2])
    lo, hi = min(m, n), max(m, n)
    per = {
        "cholesky": n**3 / 3,
        "lu": 2 * lo * lo * hi - 2 * lo**3 / 3,
        "qr": 2 * hi * lo * lo - 2 * lo**3 / 3,
        "svd": 4 * hi * lo * lo + 8 * lo**3,
        "householder_product": 4 * hi * lo * lo,
        "symmetric_product": 2 * m * n * m,
    }
    return batch * float(per.get(node.prim, 9 * n**3))


RULES = {name: Rule(batched_spec) for name in (*CORE, "fft")}
