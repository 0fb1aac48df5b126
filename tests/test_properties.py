"""Property tests over shapes, levels, wavelet families and boundary modes (hypothesis).

Each new shape compiles, so the examples are few (`max_examples`) and the
other axes small; `derandomize=True` keeps CI reproducible.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import pywt

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402  (after the importorskip)

import optax_gwt  # noqa: E402
from optax_gwt import wavelets  # noqa: E402
from reference import ReferenceGWTAdamW  # noqa: E402

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
WAVELETS = ["haar", "db2", "db3", "sym4", "coif1"]
PRIMES = [2, 3, 5, 7, 11, 13, 31, 127, 257, 509, 1021, 2039, 4093, 4097]

lengths = st.one_of(st.integers(1, 40), st.sampled_from(PRIMES + [64, 1024, 4096]), st.integers(41, 4097))
small = st.integers(1, 3)


@st.composite
def arrays_along_an_axis(draw, max_rank=4):
    """(shape, axis): one long axis (1..4097) and up to three short ones."""
    rank = draw(st.integers(1, max_rank))
    axis = draw(st.integers(0, rank - 1))
    shape = [draw(small) for _ in range(rank)]
    shape[axis] = draw(lengths)
    return tuple(shape), axis


def _levels(n, wavelet):
    return st.integers(1, max(1, pywt.dwt_max_level(n, pywt.Wavelet(wavelet).dec_len)))


# Jitted: one compilation per shape instead of one per primitive.
_wavedec = jax.jit(wavelets.wavedec, static_argnums=(1, 2, 3, 4))
_waverec = jax.jit(wavelets.waverec, static_argnums=(1, 2, 3))


@pytest.mark.slow
@settings(max_examples=30, **SETTINGS)
@given(arrays_along_an_axis(), st.sampled_from(WAVELETS), st.sampled_from(wavelets.MODES), st.data())
def test_wavedec_equals_pywavelets_and_reconstructs(shape_axis, wavelet, mode, data):
    shape, axis = shape_axis
    n = shape[axis]
    level = data.draw(_levels(n, wavelet), label="level")
    x = np.random.default_rng(n).standard_normal(shape).astype(np.float32)
    try:
        want = pywt.wavedec(x, wavelet, mode=mode, level=level, axis=axis)
    except ValueError:  # e.g. reflect modes on one sample: an error here too, not garbage
        with pytest.raises(ValueError, match="length"):
            wavelets.wavedec(jnp.asarray(x), wavelet, mode, level, axis)
        return
    got = _wavedec(jnp.asarray(x), wavelet, mode, level, axis)
    assert [c.shape for c in got] == [c.shape for c in want]
    assert [c.shape[axis] for c in got] == wavelets.coeff_lengths(n, wavelet, level, mode)
    scale = max(1.0, max(np.abs(c).max() for c in want))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-5 * scale)
    back = np.asarray(_waverec(got, wavelet, mode, axis))
    np.testing.assert_allclose(np.take(back, np.arange(n), axis=axis), x, atol=2e-5 * scale)


def _fits(n, level, wavelet, mode):
    """The documented rule: at least 2^level samples, and a state shorter than the axis."""
    try:
        approx = pywt.wavedec(np.zeros(n), wavelet, mode=mode, level=level)[0].shape[0]
    except ValueError:  # too short for the mode
        return False, None
    return n >= 2**level and approx < n, approx


@pytest.mark.slow
@settings(max_examples=30, **SETTINGS)
@given(
    arrays_along_an_axis(),
    st.integers(1, 4),
    st.sampled_from(["haar", "db2", "sym3"]),
    st.sampled_from(["zero", "symmetric", "periodization", "reflect"]),
    st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_gwt_state_and_update_shapes_or_a_clear_error(shape_axis, level, wavelet, mode, dtype):
    shape, axis = shape_axis
    n = shape[axis]
    params = {"p": jnp.zeros(shape, dtype)}
    opt = optax_gwt.gwt_adamw(1e-2, level=level, wavelet=wavelet, mode=mode, axis=axis)
    transformed = len(shape) >= 2  # an int axis applies to arrays of rank >= 2
    fits, approx = _fits(n, level, wavelet, mode)
    if transformed and not fits:
        with pytest.raises(ValueError, match=f"(level {level} is too deep for length {n})|(length of at least)"):
            opt.init(params)
        return
    state = opt.init(params)
    want_shape = list(shape)
    if transformed:
        want_shape[axis] = approx
    base = state[0][1].inner_state
    assert base.mu["p"].shape == tuple(want_shape) and base.nu["p"].shape == tuple(want_shape)
    assert (
        optax_gwt.optimizer_state_bytes(opt, params).per_param["p"]
        == 2 * np.prod(want_shape) * jnp.dtype(dtype).itemsize + 2 * 4  # m, v; the limiter's norm and lam
    )
    g = {"p": jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)}
    u, new_state = jax.jit(opt.update)(g, state, params)
    assert u["p"].shape == shape and u["p"].dtype == dtype
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), new_state) == jax.tree_util.tree_map(
        lambda x: (x.shape, x.dtype), state
    )
    assert np.all(np.isfinite(np.asarray(u["p"], np.float32)))


@pytest.mark.slow
@settings(max_examples=15, **SETTINGS)
@given(
    arrays_along_an_axis(max_rank=3).filter(lambda sa: len(sa[0]) >= 2),
    st.integers(1, 3),
    st.sampled_from(WAVELETS),
    st.sampled_from(wavelets.MODES),
    st.sampled_from(["adam", "norm_ratio", "zero"]),
)
def test_gwt_two_steps_equal_the_reference(shape_axis, level, wavelet, mode, rule):
    shape, axis = shape_axis
    n = shape[axis]
    hypothesis.assume(_fits(n, level, wavelet, mode)[0])
    rng = np.random.default_rng(n * 7 + level)
    params = {"p": rng.standard_normal(shape)}
    kw = dict(level=level, wavelet=wavelet, mode=mode, detail_rule=rule)
    ref = ReferenceGWTAdamW(lr=1e-2, axis=axis, **kw)
    with jax.enable_x64(True):
        opt = optax_gwt.gwt_adamw(1e-2, axis=axis, **kw)
        jp = {"p": jnp.asarray(params["p"])}
        state, want = opt.init(jp), params
        update = jax.jit(opt.update)
        for step in range(2):
            g = {"p": rng.standard_normal(shape) * (1 + 3 * step)}
            want = ref.step(want, g)
            u, state = update({"p": jnp.asarray(g["p"])}, state, jp)
            jp = optax.apply_updates(jp, u)
        np.testing.assert_allclose(np.asarray(jp["p"]), want["p"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "make, params, error, match",
    [
        (lambda: optax_gwt.gwt_adamw(1e-2), {"w": jnp.zeros((8, 8), jnp.int32)}, TypeError, "floating-point"),
        (lambda: optax_gwt.gwt_adamw(1e-2), {"w": jnp.zeros((8, 8), jnp.complex64)}, TypeError, "complex"),
        (lambda: optax_gwt.gwt_adamw(1e-2), {"w": [[0.0] * 8] * 8}, TypeError, "expected an array"),
        (lambda: optax_gwt.gwt_adamw(1e-2, axis=-3), {"w": jnp.zeros((8, 8))}, ValueError, "out of range"),
        (lambda: optax_gwt.gwt_adamw(1e-2, level=1), {"w": jnp.zeros((1, 8))}, ValueError, "too deep for length 1"),
        (lambda: optax_gwt.gwt_adamw(1e-2, level=1, wavelet="db4"), {"w": jnp.zeros((6, 3))}, ValueError, "too deep"),
        (lambda: optax_gwt.gwt_adamw(1e-2, level=1.5), {}, TypeError, "static Python int"),
        (lambda: optax_gwt.gwt_adamw(1e-2, wavelet="bior2.2"), {}, ValueError, "wavelet"),
    ],
)
def test_unsupported_inputs_raise_clear_errors(make, params, error, match):
    with pytest.raises(error, match=match):
        make().init(params)
