"""The opt-in compiled CPU kernel (`optax_gwt.kernels.cpu_ffi`, row ``cpu-ffi-moments``) against NumPy,
and GWT with it against its XLA path.

The kernel's moments and norm are checked against an independent NumPy
computation of its formulas; whole `gwt_adamw` trajectories with the kernel
against the XLA path (float32) and the NumPy reference of the algorithm
(float64, `tests/reference.py`); the compiled step's HLO for the custom call
and for the XLA moment computations it replaces; and the cases where the
kernel must not be used.
"""

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt
from optax_gwt.hlo_traffic import entry_instructions
from optax_gwt.kernels import Case, FastPath, cpu_ffi, select
from reference import ReferenceGWTAdamW

pytestmark = pytest.mark.skipif(
    not cpu_ffi.available(),
    reason="the optax_gwt CPU kernel could not be built here (no C++ compiler)",
)

TARGET = {np.float32: "optax_gwt_haar_adam_moments_f32", np.float64: "optax_gwt_haar_adam_moments_f64"}
B1, B2, EPS = 0.9, 0.999, 1e-6
KERNEL = FastPath(cpu_kernel=True)


def fast(flag: bool):
    return KERNEL if flag else "auto"


# ---------------------------------------------------------------------------
# haar_adam_moments against NumPy.
# ---------------------------------------------------------------------------


def numpy_moments(g, mu, nu, *, axis, block, b1, b2, eps):
    """The kernel's formulas in float64: zero-pad `axis` to a multiple of `block`, sum the blocks."""
    g, mu, nu = (np.asarray(x, np.float64) for x in (g, mu, nu))
    g = np.moveaxis(g, axis, 0)
    blocks = -(-g.shape[0] // block)
    padded = np.pad(g, [(0, blocks * block - g.shape[0])] + [(0, 0)] * (g.ndim - 1))
    a = padded.reshape((blocks, block) + g.shape[1:]).sum(axis=1) / np.sqrt(block)
    a = np.moveaxis(a, 0, axis)
    m = (1 - b1) * a + b1 * mu
    v = (1 - b2) * a * a + b2 * nu
    return m, v, np.sum((m / (np.sqrt(v) + eps)) ** 2)


def random_inputs(shape, axis, block, dtype, seed=0):
    rng = np.random.default_rng(seed)
    approx = list(shape)
    approx[axis] = -(-shape[axis] // block)
    g = rng.standard_normal(shape).astype(dtype)
    mu = (0.3 * rng.standard_normal(approx)).astype(dtype)
    nu = rng.uniform(0.01, 2.0, approx).astype(dtype)
    return g, mu, nu


def assert_moments_close(got, want, rtol):
    """Elementwise relative to each array's scale (block sums can cancel), the norm relative to itself."""
    (m, v, sq), (m_ref, v_ref, sq_ref) = got, want
    for name, x, ref in (("m", m, m_ref), ("v", v, v_ref)):
        assert x.shape == ref.shape, name
        atol = rtol * np.abs(ref).max()
        np.testing.assert_allclose(np.asarray(x, np.float64), ref, rtol=rtol, atol=atol, err_msg=name)
    assert jnp.shape(sq) == ()
    np.testing.assert_allclose(float(sq), sq_ref, rtol=rtol, err_msg="sq")


# (shape, axis, block)
CASES = [
    ((37, 6), 0, 4),  # n not a multiple of B
    ((3, 10), 0, 4),  # n < B: one short block
    ((50, 37), 1, 4),  # last axis: inner = 1
    ((6, 2101), 1, 4),  # last axis, more blocks per row than a tile
    ((40, 3001), 1, 2),  # last axis, work chunks that end within a row
    ((4099,), 0, 8),  # 1-D
    ((16, 9), 0, 2),
    ((64, 5), 0, 8),
    ((4, 21, 6), 1, 8),  # middle axis of a 3-D array, outer > 1
    ((3, 4, 21, 5), 2, 2),  # middle axis of a 4-D array
    ((2, 19, 3, 7), 1, 4),
    ((24, 1000), 0, 4),  # inner not a multiple of the kernel's 256-column tile
    ((5, 37, 600), 1, 4),  # several work chunks whose bounds cut through an outer index
    ((2048, 1024), 0, 4),  # split over the thread pool
]


@pytest.mark.parametrize("shape,axis,block", CASES, ids=[f"{s}-ax{a}-B{b}" for s, a, b in CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_moments_equal_numpy(shape, axis, block, dtype, x64):
    g, mu, nu = random_inputs(shape, axis, block, dtype)
    got = cpu_ffi.haar_adam_moments(
        jnp.asarray(g), jnp.asarray(mu), jnp.asarray(nu), axis=axis, block=block, b1=B1, b2=B2, eps=EPS
    )
    assert all(x.dtype == dtype for x in got)
    want = numpy_moments(g, mu, nu, axis=axis, block=block, b1=B1, b2=B2, eps=EPS)
    assert_moments_close(got, want, rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_inputs_are_not_overwritten():
    # mu and nu alias the outputs in the custom call; without donation XLA must copy them.
    g, mu, nu = random_inputs((37, 6), 0, 4, np.float32)
    jg, jmu, jnu = jnp.asarray(g), jnp.asarray(mu), jnp.asarray(nu)
    m, v, _ = cpu_ffi.haar_adam_moments(jg, jmu, jnu, axis=0, block=4, b1=B1, b2=B2, eps=EPS)
    assert not np.allclose(m, mu) and not np.allclose(v, nu)
    np.testing.assert_array_equal(jmu, mu)
    np.testing.assert_array_equal(jnu, nu)
    np.testing.assert_array_equal(jg, g)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_traced_hyperparameters(dtype, x64):
    g, mu, nu = random_inputs((37, 300), 0, 8, dtype, seed=1)

    @jax.jit
    def f(g, mu, nu, b1, b2, eps):
        return cpu_ffi.haar_adam_moments(g, mu, nu, axis=0, block=8, b1=b1, b2=b2, eps=eps)

    for b1, b2, eps in [(0.9, 0.999, 1e-6), (0.5, 0.9, 1e-3), (0.0, 0.0, 1e-8)]:
        got = f(g, mu, nu, jnp.asarray(b1, dtype), jnp.asarray(b2, dtype), jnp.asarray(eps, dtype))
        # The traced ``1 - b`` is computed in `dtype`, so compare with b rounded to it.
        b1r, b2r, epsr = (float(np.asarray(x, dtype)) for x in (b1, b2, eps))
        want = numpy_moments(g, mu, nu, axis=0, block=8, b1=b1r, b2=b2r, eps=epsr)
        assert_moments_close(got, want, rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_vmap_equals_per_example():
    batch, axis, block = 3, 1, 4
    gs, mus, nus = zip(
        *(random_inputs((5, 37, 11), axis, block, np.float32, seed=s) for s in range(batch)), strict=True
    )
    g, mu, nu = (jnp.asarray(np.stack(x)) for x in (gs, mus, nus))

    def moments(g, mu, nu):
        return cpu_ffi.haar_adam_moments(g, mu, nu, axis=axis, block=block, b1=B1, b2=B2, eps=EPS)

    m, v, sq = jax.jit(jax.vmap(moments))(g, mu, nu)
    assert m.shape == mu.shape and v.shape == nu.shape and sq.shape == (batch,)
    for i in range(batch):
        one = moments(g[i], mu[i], nu[i])
        np.testing.assert_array_equal(m[i], one[0])
        np.testing.assert_array_equal(v[i], one[1])
        np.testing.assert_array_equal(sq[i], one[2])
        want = numpy_moments(gs[i], mus[i], nus[i], axis=axis, block=block, b1=B1, b2=B2, eps=EPS)
        assert_moments_close((m[i], v[i], sq[i]), want, rtol=1e-6)
    # Unbatched moments are shared by every example.
    m2, v2, sq2 = jax.vmap(moments, in_axes=(0, None, None))(g, mu[0], nu[0])
    for i in range(batch):
        want = numpy_moments(gs[i], mus[0], nus[0], axis=axis, block=block, b1=B1, b2=B2, eps=EPS)
        assert_moments_close((m2[i], v2[i], sq2[i]), want, rtol=1e-6)


def test_wrong_dtypes_are_refused():
    g, mu, nu = (jnp.asarray(x) for x in random_inputs((16, 4), 0, 4, np.float32))
    half = [x.astype(jnp.bfloat16) for x in (g, mu, nu)]
    for args in [half, (g, half[1], nu)]:
        with pytest.raises(TypeError, match="float32 or all float64"):
            cpu_ffi.haar_adam_moments(*args, axis=0, block=4, b1=B1, b2=B2, eps=EPS)


def test_row_applies_only_to_float32_and_float64_of_one_dtype():
    def row(g, state, fast_path=KERNEL, **kw):
        return select(Case("moments", (8, 4), g, 0, 4, state_dtype=state, **kw), "cpu", fast_path)[0]

    assert row(np.float32, np.float32).name == row(np.float64, np.float64).name == "cpu-ffi-moments"
    assert row(jnp.bfloat16, jnp.bfloat16) is None and row(np.float16, np.float16) is None
    assert row(np.float32, jnp.bfloat16) is None and row(np.float64, np.float32) is None
    assert row(np.float32, np.float32, energy=True) is None and row(np.float32, np.float32, devices=8) is None
    assert row(np.float32, np.float32, fast_path="auto") is None  # opt-in


# ---------------------------------------------------------------------------
# gwt_adamw with the kernel.
# ---------------------------------------------------------------------------

SHAPES = {"w": (37, 6), "v": (16, 5), "t": (8, 3, 4), "bias": (7,)}
MATRICES = [k for k, s in SHAPES.items() if len(s) >= 2]


def make_params(dtype, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s).astype(dtype)) for k, s in shapes.items()}, rng


def make_grads(rng, params):
    # A changing scale so that the norm-growth limiter acts on some steps.
    scale = rng.uniform(0.2, 5.0)
    return {k: jnp.asarray((scale * rng.standard_normal(p.shape)).astype(p.dtype)) for k, p in params.items()}


def train_step(opt):
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def run(opt, params, rng, steps=6, on_step=None):
    """`steps` jitted steps on random gradients; returns the params, the state and the lowered step's text."""
    step = jax.jit(train_step(opt))
    state = opt.init(params)
    for i in range(steps):
        grads = make_grads(rng, params)
        if on_step is not None:
            on_step(params, grads)
        if i == 0:
            text = step.lower(params, state, grads).as_text()
        params, state = step(params, state, grads)
    return params, state, text


def custom_calls(text, dtype=np.float32):
    """Number of calls to the kernel in lowered (StableHLO) or compiled (HLO) text."""
    return len(re.findall(rf'custom_call @{TARGET[dtype]}\b|custom_call_target="{TARGET[dtype]}"', text))


def any_custom_call(text):
    return custom_calls(text, np.float32) + custom_calls(text, np.float64)


def assert_trajectories_close(got, want, start, rtol):
    """Close relative to how far the params moved (the quantity the step computes), for
    half-precision params up to one rounding of the param."""
    for k in want:
        x, ref = (np.asarray(t[k], np.float64) for t in (got, want))
        moved = np.abs(ref - np.asarray(start[k], np.float64)).max()
        assert moved > 0, k
        rounding = 0.0 if want[k].dtype in (jnp.float32, jnp.float64) else float(jnp.finfo(want[k].dtype).eps)
        np.testing.assert_allclose(x, ref, rtol=rounding, atol=rtol * moved, err_msg=k)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_trajectory_float32_equals_xla_path(level):
    start, _ = make_params(np.float32)
    out = {}
    for flag in (True, False):
        opt = optax_gwt.gwt_adamw(3e-2, weight_decay=0.1, level=level, fast_path=fast(flag))
        out[flag] = run(opt, start, np.random.default_rng(1))
    (p_kernel, s_kernel, text_kernel), (p_xla, s_xla, text_xla) = out[True], out[False]
    assert custom_calls(text_kernel) == len(MATRICES)
    assert any_custom_call(text_xla) == 0
    assert_trajectories_close(p_kernel, p_xla, start, rtol=1e-5)
    # The state the kernel wrote: the approximation's moments and the limiter's norms.
    gwt_kernel, gwt_xla = s_kernel[0], s_xla[0]
    for k in MATRICES:
        for field in ("mu", "nu"):
            x, ref = getattr(gwt_kernel[1].inner_state, field)[k], getattr(gwt_xla[1].inner_state, field)[k]
            np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=f"{field}[{k}]")
        np.testing.assert_allclose(gwt_kernel[2].norm_prev[k], gwt_xla[2].norm_prev[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_trajectory_float64_equals_reference(level, x64):
    start, rng = make_params(np.float64)
    opt = optax_gwt.gwt_adamw(3e-2, weight_decay=0.1, level=level, fast_path=KERNEL)
    ref = ReferenceGWTAdamW(lr=3e-2, weight_decay=0.1, level=level)
    want = {k: np.asarray(p) for k, p in start.items()}

    def reference_step(params, grads):
        nonlocal want
        want = ref.step(want, {k: np.asarray(g) for k, g in grads.items()})

    got, state, text = run(opt, start, rng, on_step=reference_step)
    assert custom_calls(text, np.float64) == len(MATRICES)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-12, err_msg=k)
    # The state the kernel wrote: the approximation's moments and the limiter's norm.
    gwt = state[0]
    for k in MATRICES:
        np.testing.assert_allclose(gwt[1].inner_state.mu[k], ref.state[k]["m"], rtol=1e-9, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(gwt[1].inner_state.nu[k], ref.state[k]["v"], rtol=1e-9, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(gwt[2].norm_prev[k], ref.state[k]["r"], rtol=1e-9, err_msg=k)
        np.testing.assert_allclose(gwt[2].scale[k], ref.state[k]["lam"], rtol=1e-9, err_msg=k)


# ---------------------------------------------------------------------------
# The compiled step keeps none of XLA's moment computations.
# ---------------------------------------------------------------------------


def compiled_step(cpu_kernel_flag, params):
    """The entry instructions of the compiled donated train step, and the parameter number of the first gradient."""
    opt = optax_gwt.gwt_adamw(1e-2, weight_decay=0.1, level=2, fast_path=fast(cpu_kernel_flag))
    state = opt.init(params)
    step = jax.jit(train_step(opt), donate_argnums=(0, 1), keep_unused=True)
    text = step.lower(params, state, params).compile().as_text()
    return text, entry_instructions(text), len(jax.tree_util.tree_leaves((params, state)))


def test_compiled_step_keeps_no_xla_moments():
    params, _ = make_params(np.float32)
    readers, approx_producers = {}, {}
    for flag in (True, False):
        text, instructions, first_grad = compiled_step(flag, params)
        assert custom_calls(text) == (len(MATRICES) if flag else 0)
        parameters = {i.parameter: i.name for i in instructions if i.opcode == "parameter"}
        for i, k in enumerate(sorted(params)):  # the order of a dict's leaves
            grad = parameters[first_grad + i]
            readers[flag, k] = sorted(i.opcode for i in instructions if grad in i.operands)
            approx = (-(-SHAPES[k][0] // 4),) + SHAPES[k][1:]
            approx_type = f"f32[{','.join(map(str, approx))}]"
            approx_producers[flag, k] = [
                i.opcode
                for i in instructions
                if i.result_type.startswith(approx_type) and i.opcode not in ("parameter", "get-tuple-element")
            ]
    for k in MATRICES:
        # With the kernel: one custom call for the moments and the norm, one fusion for the update.
        assert readers[True, k] == ["custom-call", "fusion"], (k, readers[True, k])
        # XLA's path reads the gradient in more places (m, v and the update) ...
        assert len(readers[False, k]) > len(readers[True, k]), (k, readers[False, k])
        # ... and computes the moments in fusions, which the kernel's program no longer has.
        assert approx_producers[False, k], k
        assert approx_producers[True, k] == [], (k, approx_producers[True, k])


# ---------------------------------------------------------------------------
# Where the kernel is not used.
# ---------------------------------------------------------------------------


def test_default_takes_no_kernel_and_a_missing_compiler_falls_back(monkeypatch, tmp_path):
    start, _ = make_params(np.float32)
    make_opt = functools.partial(optax_gwt.gwt_adamw, 3e-2, weight_decay=0.1)
    want, _, text = run(make_opt(), start, np.random.default_rng(1), steps=3)
    assert any_custom_call(text) == 0
    with monkeypatch.context() as env:
        env.setenv("CXX", str(tmp_path / "no-such-compiler"))
        env.setenv("OPTAX_GWT_CACHE_DIR", str(tmp_path))
        cpu_ffi.available.cache_clear()
        try:
            with pytest.warns(UserWarning, match="could not be built"):
                assert not cpu_ffi.available()
            x = jnp.ones((8, 4))
            with pytest.raises(RuntimeError, match="not available"):
                cpu_ffi.haar_adam_moments(x, x, x, axis=0, block=4, b1=B1, b2=B2, eps=EPS)
            got, _, text = run(make_opt(fast_path=KERNEL), start, np.random.default_rng(1), steps=3)
        finally:
            cpu_ffi.available.cache_clear()  # recomputed with the environment restored
    assert any_custom_call(text) == 0
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert cpu_ffi.available()  # restored for the other tests


def kernel_calls_and_agreement(make_opt, params, steps=3):
    """The kernel's custom calls in the step of ``make_opt(fast_path=KERNEL)``; asserts it equals the XLA path."""
    got, _, text = run(make_opt(fast_path=KERNEL), params, np.random.default_rng(2), steps)
    want, _, text_xla = run(make_opt(), params, np.random.default_rng(2), steps)
    assert any_custom_call(text_xla) == 0
    assert_trajectories_close(got, want, params, rtol=1e-5)
    return any_custom_call(text)


NOT_APPLIED = {
    "bfloat16 mu": {"mu_dtype": jnp.bfloat16},
    "bfloat16 nu": {"nu_dtype": jnp.bfloat16},
    "db2": {"wavelet": "db2"},
    "haar with boundary effects": {"mode": "symmetric"},  # 37 is not a multiple of 4
    "detail_clip": {"detail_clip": 2.0},
    "norm_ratio": {"detail_rule": "norm_ratio"},
    "no limiter": {"norm_growth_limit": None},  # XLA alone is as fast there (see scale_by_gwt)
}


@pytest.mark.parametrize("options", NOT_APPLIED.values(), ids=NOT_APPLIED.keys())
def test_not_applied(options):
    params, _ = make_params(np.float32, shapes={"w": (37, 6), "bias": (7,)})
    make_opt = functools.partial(optax_gwt.gwt_adamw, 3e-2, weight_decay=0.1, **options)
    assert kernel_calls_and_agreement(make_opt, params) == 0


def test_given_base_optimizer_does_not_use_the_kernel():
    params, _ = make_params(np.float32, shapes={"w": (37, 6)})
    make_opt = functools.partial(optax_gwt.scale_by_gwt, optax.scale_by_adam())
    assert kernel_calls_and_agreement(make_opt, params) == 0


@pytest.mark.slow
def test_bfloat16_gradients_skip_the_kernel_per_array():
    # A bfloat16 matrix is left to XLA, a float32 one next to it still uses the kernel.
    params, _ = make_params(np.float32, shapes={"w": (37, 6), "h": (16, 5), "bias": (7,)})
    params["h"] = params["h"].astype(jnp.bfloat16)
    make_opt = functools.partial(optax_gwt.gwt_adamw, 3e-2, weight_decay=0.1)
    assert kernel_calls_and_agreement(make_opt, params) == 1
    params["w"] = params["w"].astype(jnp.bfloat16)
    assert kernel_calls_and_agreement(make_opt, params) == 0
    # Also with float32 moments: the kernel would need a float32 copy of the gradient.
    make_opt = functools.partial(make_opt, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
    assert kernel_calls_and_agreement(make_opt, params) == 0


# ---------------------------------------------------------------------------
# The result does not depend on the number of threads.
# ---------------------------------------------------------------------------

_SQ_SCRIPT = """
import jax, numpy as np, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
from optax_gwt.kernels import Case, FastPath, cpu_ffi, select
rng = np.random.default_rng(3)
g, mu = rng.standard_normal((2048, 1024)), rng.standard_normal((512, 1024))
nu = rng.uniform(0.01, 2.0, (512, 1024))
for dtype in (np.float32, np.float64):
    m, v, sq = cpu_ffi.haar_adam_moments(
        *(jnp.asarray(x, dtype) for x in (g, mu, nu)), axis=0, block=4, b1=0.9, b2=0.999, eps=1e-6
    )
    print(float(sq).hex(), float(np.asarray(m, np.float64).sum()).hex())
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ CPUs, Linux"
)
def test_one_thread_gives_identical_bits():
    # The norm is summed per fixed chunk, in chunk order: a process pinned to one
    # CPU (where XLA's thread pool, which the kernel uses, has one thread) must
    # give the same bits as one with several.
    pinned = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"

    def run(script):
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout

    several, one = run(_SQ_SCRIPT), run(pinned + _SQ_SCRIPT)
    assert several.split() and several == one
