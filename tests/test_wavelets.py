"""optax_gwt.wavelets against PyWavelets: shapes, order and values."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import pywt

from optax_gwt import wavelets

pytestmark = pytest.mark.usefixtures("x64")

WAVELETS = ["haar", "db2", "db3", "sym4", "coif1"]
# Length 1, the shortest axes each boundary mode treats apart, and a long one whose levels halve to odd and
# even lengths (37 -> 19 -> 10 with Haar): each PyWavelets comparison runs eagerly, shape by shape.
LENGTHS = [1, 2, 3, 5, 37]


def _pywt_wavedec(x, wavelet, mode, level, axis):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pywt warns about deep levels but computes them
        return pywt.wavedec(x, wavelet, mode=mode, level=level, axis=axis)


@pytest.mark.slow
@pytest.mark.parametrize("wavelet", WAVELETS)
@pytest.mark.parametrize("mode", wavelets.MODES)
def test_wavedec_waverec_equal_pywt(wavelet, mode):
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        for level in (1, 2, 3):
            x = rng.standard_normal((2, n, 3))
            try:
                ref = _pywt_wavedec(x, wavelet, mode, level, axis=1)
            except ValueError:  # PyWavelets refuses it (length 1 in reflect modes): so do we
                with pytest.raises(ValueError):
                    wavelets.wavedec(jnp.asarray(x), wavelet, mode, level, axis=1)
                continue
            got = wavelets.wavedec(jnp.asarray(x), wavelet, mode, level, axis=1)
            assert len(got) == len(ref)
            for r, g in zip(ref, got, strict=True):
                assert g.shape == r.shape, (n, level)
                np.testing.assert_allclose(np.asarray(g), r, rtol=1e-12, atol=1e-12)
            assert [c.shape[1] for c in ref] == wavelets.coeff_lengths(n, wavelet, level, mode)
            rec_ref = pywt.waverec(ref, wavelet, mode=mode, axis=1)
            rec = wavelets.waverec([jnp.asarray(c) for c in ref], wavelet, mode, axis=1)
            assert rec.shape == rec_ref.shape
            np.testing.assert_allclose(np.asarray(rec), rec_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_any_axis_any_rank(axis):
    x = np.random.default_rng(1).standard_normal((6, 7, 9))
    for wavelet in ("haar", "db2"):
        ref = _pywt_wavedec(x, wavelet, "symmetric", 2, axis)
        got = wavelets.wavedec(jnp.asarray(x), wavelet, "symmetric", 2, axis)
        for r, g in zip(ref, got, strict=True):
            np.testing.assert_allclose(np.asarray(g), r, rtol=1e-12, atol=1e-12)
    x1 = np.random.default_rng(2).standard_normal(11)
    ref = _pywt_wavedec(x1, "db2", "zero", 2, -1)
    for r, g in zip(ref, wavelets.wavedec(jnp.asarray(x1), "db2", "zero", 2), strict=True):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-12, atol=1e-12)


def test_default_level_is_pywt_max_level():
    x = np.random.default_rng(3).standard_normal(100)
    ref = pywt.wavedec(x, "db2")  # pywt's default mode is symmetric
    got = wavelets.wavedec(jnp.asarray(x), "db2", "symmetric")
    assert len(got) == len(ref) == wavelets.dwt_max_level(100, "db2") + 1


def test_pywavelets_defaults_and_wavelet_objects():
    x = np.random.default_rng(6).standard_normal((3, 21))
    ref = pywt.wavedec(x, pywt.Wavelet("sym3"), level=2)  # pywt's default mode: symmetric, axis -1
    got = wavelets.wavedec(jnp.asarray(x), pywt.Wavelet("sym3"), level=2)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        np.asarray(wavelets.waverec(got, "sym3")), pywt.waverec(ref, "sym3"), rtol=1e-12, atol=1e-12
    )


def test_single_level_and_partial_inverse():
    x = np.random.default_rng(4).standard_normal((5, 9))
    ca, cd = pywt.dwt(x, "db2", mode="reflect", axis=-1)
    gca, gcd = wavelets.dwt(jnp.asarray(x), "db2", "reflect")
    np.testing.assert_allclose(np.asarray(gca), ca, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(gcd), cd, rtol=1e-12, atol=1e-12)
    for a, d in ((ca, None), (None, cd)):
        ref = pywt.idwt(a, d, "db2", mode="reflect")
        got = wavelets.idwt(
            None if a is None else jnp.asarray(a), None if d is None else jnp.asarray(d), "db2", "reflect"
        )
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-12, atol=1e-12)


def test_haar_has_no_convolution():
    jaxpr = str(
        jax.make_jaxpr(lambda x: wavelets.waverec(wavelets.wavedec(x, "haar", "zero", 3, 0), "haar", "zero", 0))(
            jnp.ones((64, 4))
        )
    )
    for op in ("conv_general_dilated", "dot_general", "gather"):
        assert op not in jaxpr


@pytest.mark.slow
def test_jit_vmap_grad():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 21)))

    def f(v):
        return wavelets.wavedec(v, "sym4", "periodization", 2)

    for a, b in zip(jax.jit(f)(x), jax.vmap(f)(x), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    # Orthonormal periodization transform of an even length preserves the norm:
    # d/dx ||wavedec(x)||^2 = 2x.
    x = x[:, :16]
    g = jax.grad(lambda v: sum(jnp.sum(c**2) for c in wavelets.wavedec(v, "db3", "periodization", 2)))(x)
    np.testing.assert_allclose(g, 2 * x, rtol=1e-10, atol=1e-10)


def test_float32_stays_float32():
    x = jnp.ones((8, 8), jnp.float32)
    assert all(c.dtype == jnp.float32 for c in wavelets.wavedec(x, "db2", "zero", 2, 0))
    assert wavelets.waverec(wavelets.wavedec(x, "db2", "zero", 2, 0), "db2", "zero", 0).dtype == jnp.float32


def test_errors():
    with pytest.raises(ValueError, match="Unknown or unsupported wavelet"):
        wavelets.wavedec(jnp.ones(8), "nope")
    with pytest.raises(ValueError, match="Unknown or unsupported wavelet"):
        wavelets.wavedec(jnp.ones(8), "bior1.3")  # biorthogonal: not supported
    with pytest.raises(ValueError, match="mode"):
        wavelets.wavedec(jnp.ones(8), "haar", "circular")
    with pytest.raises(ValueError, match="out of range"):
        wavelets.wavedec(jnp.ones((4, 4)), "haar", "zero", 1, axis=2)
