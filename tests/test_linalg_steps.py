"""Training steps written with linear algebra and FFTs, as users write them, run sharded and give
the single-device step's values: a batch of Gaussian processes fitted by their marginal
likelihood (Cholesky, triangular solves, a log-determinant), a Shampoo-like preconditioned update
(symmetric eigendecompositions, ``jnp.linalg.solve``) and a Fourier neural operator layer
(``rfft`` / ``irfft`` with complex spectral weights)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap

RTOL, ATOL = 2e-4, 2e-5


def assert_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=RTOL, atol=ATOL), a, b)


def gp_step(params, batch):
    """Negative log marginal likelihood of 8 independent GPs (RBF kernel), one SGD step."""
    x, y = batch                                        # (8, 16, 2), (8, 16)

    def nll(p):
        d2 = jnp.sum((x[:, :, None, :] - x[:, None, :, :]) ** 2, -1)
        k = jnp.exp(p["log_amp"]) * jnp.exp(-0.5 * d2 / jnp.exp(2 * p["log_len"]))
        k = k + (jnp.exp(p["log_noise"]) + 1e-3) * jnp.eye(x.shape[1])
        chol = jnp.linalg.cholesky(k)
        alpha = jax.scipy.linalg.cho_solve((chol, True), y[..., None])[..., 0]
        logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), -1)
        return jnp.mean(0.5 * jnp.sum(y * alpha, -1) + 0.5 * logdet)
    value, grads = jax.value_and_grad(nll)(params)
    return value, jax.tree.map(lambda a, g: a - 0.05 * g, params, grads)


def shampoo_step(params, batch):
    """A linear model whose gradient is preconditioned by the inverse fourth roots of its
    row and column statistics (eigh), plus a ridge solve (custom_linear_solve)."""
    x, y = batch

    def loss(p):
        return jnp.mean((x @ p["w"] - y) ** 2)
    value, g = jax.value_and_grad(loss)(params)
    g = g["w"]

    def inv_root(m):
        w, v = jnp.linalg.eigh(m + 1e-2 * jnp.eye(m.shape[0]))
        return (v * jnp.maximum(w, 1e-6) ** -0.25) @ v.T
    update = inv_root(g @ g.T) @ g @ inv_root(g.T @ g)
    ridge = jnp.linalg.solve(x.T @ x + jnp.eye(x.shape[1]), x.T @ y)
    return value, {"w": params["w"] - 0.01 * update - 0.001 * (params["w"] - ridge)}


def fno_step(params, batch):
    """One Fourier layer over a 1-d signal: keep 8 modes, mix channels per mode, back."""
    x, y = batch                                        # (16, 64, 4), (16, 64, 4)

    def loss(p):
        spec = jnp.fft.rfft(x, axis=1)[:, :8, :]        # (16, 8, 4) complex
        w = jax.lax.complex(p["w_re"], p["w_im"])        # (8, 4, 4)
        mixed = jnp.einsum("bmi,mio->bmo", spec, w)
        full = jnp.zeros((x.shape[0], x.shape[1] // 2 + 1, 4), mixed.dtype).at[:, :8].set(mixed)
        out = jnp.fft.irfft(full, n=x.shape[1], axis=1) + x @ p["skip"]
        return jnp.mean((jax.nn.gelu(out) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)


def _cases():
    r = np.random.default_rng(0)
    f = lambda *s: r.normal(size=s).astype(np.float32)     # noqa: E731
    gp = ({"log_amp": np.float32(0.1), "log_len": np.float32(-0.2),
           "log_noise": np.float32(-2.0)}, (f(8, 16, 2), f(8, 16)))
    shampoo = ({"w": 0.1 * f(12, 6)}, (f(32, 12), f(32, 6)))
    fno = ({"w_re": 0.2 * f(8, 4, 4), "w_im": 0.2 * f(8, 4, 4), "skip": 0.3 * f(4, 4)},
           (f(16, 64, 4), f(16, 64, 4)))
    return {"gp": (gp_step, gp), "shampoo": (shampoo_step, shampoo), "fno": (fno_step, fno)}


@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
@pytest.mark.parametrize("name", ["gp", "shampoo", "fno"])
def test_linear_algebra_steps_match_single_device_over_two_steps(name, mode):
    step, (p, b) = _cases()[name]
    cfg = ap.ParallelConfig(parallel_mode=mode, device_num=4, backend="jax", progress=False)
    c = ap.compile(step, p, b, config=cfg)
    got, want = c(p, b), jax.jit(step)(p, b)
    assert_close(got, want)
    assert_close(c(got[1], b), jax.jit(step)(want[1], b))
    if name == "gp" and mode == "data_parallel":   # each device factors its own GPs' kernels
        chol = [op for op in c.strategy.ops if op.prim == "cholesky"]
        assert chol and all(str(op.in_layouts[0]) == "[x,_,_]" for op in chol)


@pytest.mark.native
def test_a_gaussian_process_step_on_native_ranks_matches_single_device():
    step, (p, b) = _cases()["gp"]
    cfg = ap.ParallelConfig(parallel_mode="data_parallel", device_num=2, backend="native",
                            progress=False)
    with ap.compile(step, p, b, config=cfg) as c:
        assert_close(c(p, b), jax.jit(step)(p, b))


def power_iteration_step(params, batch):
    """Spectral normalisation by power iteration until converged (``lax.while_loop``, a trip
    count known only at run time), then an SGD step of the normalised layer."""
    x, y = batch

    def top_singular(w):
        def cond(c):
            return (c[2] < 50) & (c[1] > 1e-6)

        def body(c):
            v, _, i = c
            nv = w.T @ (w @ v)
            nv = nv / jnp.linalg.norm(nv)
            return nv, jnp.abs(nv - v).max(), i + 1
        v, _, _ = jax.lax.while_loop(cond, body, (jnp.ones(w.shape[1]) / w.shape[1] ** 0.5,
                                                  jnp.float32(1.0), 0))
        return jnp.linalg.norm(w @ v)

    def loss(p):
        sigma = jax.lax.stop_gradient(top_singular(p["w"]))
        return jnp.mean((x @ (p["w"] / sigma) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)


@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
def test_a_while_loop_runs_whole_on_every_device_and_matches_single_device(mode):
    r = np.random.default_rng(1)
    p = {"w": r.normal(size=(12, 8)).astype(np.float32)}
    b = (r.normal(size=(32, 12)).astype(np.float32), r.normal(size=(32, 8)).astype(np.float32))
    cfg = ap.ParallelConfig(parallel_mode=mode, device_num=4, backend="jax", progress=False)
    c = ap.compile(power_iteration_step, p, b, config=cfg)
    assert_close(c(p, b), jax.jit(power_iteration_step)(p, b))
    loops = [op for op in c.strategy.ops if op.prim == "while"]
    assert loops and all(lay.is_replicated() for op in loops
                         for lay in (*op.in_layouts, *op.out_layouts))


def newton_cg_step(params, batch):
    """A damped Gauss-Newton step of a linear model solved by conjugate gradients
    (``jax.scipy.sparse.linalg.cg``: a while loop, ``device_put`` of its operands)."""
    x, y = batch
    g = jax.grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)["w"]
    gram = x.T @ x / x.shape[0] + 0.1 * jnp.eye(x.shape[1])
    d, _ = jax.scipy.sparse.linalg.cg(lambda v: gram @ v, g, maxiter=20)
    return {"w": params["w"] - 0.5 * d}


def test_a_conjugate_gradient_step_matches_single_device():
    r = np.random.default_rng(2)
    p = {"w": r.normal(size=(6, 3)).astype(np.float32)}
    b = (r.normal(size=(16, 6)).astype(np.float32), r.normal(size=(16, 3)).astype(np.float32))
    for mode in ("data_parallel", "auto_parallel"):
        cfg = ap.ParallelConfig(parallel_mode=mode, device_num=4, backend="jax", progress=False)
        assert_close(ap.compile(newton_cg_step, p, b, config=cfg)(p, b),
                     jax.jit(newton_cg_step)(p, b))


def spectrum_step(w, x):
    """A complex filter (an argument) on each row's spectrum; the batch's mean filtered
    spectrum (a complex result: its partial sums cross the ranks)."""
    return (jnp.fft.rfft(x) * w).mean(0), jnp.mean(jnp.abs(jnp.fft.rfft(x) * w) ** 2)


@pytest.mark.native
@pytest.mark.parametrize("whole", ["0", "1"])
@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
def test_complex_arguments_results_and_collectives_on_native_ranks(monkeypatch, mode, whole):
    """The native collectives move and sum real numbers: complex values cross the ranks as
    (real, imaginary) pairs, and travel packed to and from a whole step the same way."""
    monkeypatch.setenv("AUTOPAR_WHOLE_STEP", whole)
    r = np.random.default_rng(3)
    w = (r.normal(size=9) + 1j * r.normal(size=9)).astype(np.complex64)
    x = r.normal(size=(8, 16)).astype(np.float32)
    cfg = ap.ParallelConfig(parallel_mode=mode, device_num=2, backend="native", progress=False)
    with ap.compile(spectrum_step, w, x, config=cfg) as c:
        got = c(w, x)
        assert got[0].dtype == np.complex64
        assert_close(got, jax.jit(spectrum_step)(w, x))
