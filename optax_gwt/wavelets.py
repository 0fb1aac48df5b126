"""Discrete wavelet transforms in JAX along one axis, equal to PyWavelets.

`wavedec` and `waverec` reproduce `pywt.wavedec` / `pywt.waverec` (same
coefficient order ``[cA_n, cD_n, ..., cD_1]``, same lengths, same values) for
the orthogonal families haar, dbN, symN, coifN and the boundary modes listed in
`MODES`, along any single axis of an array of any rank.

Filter banks are taken from PyWavelets at trace time (no table is copied here).
Haar, the default of GWT, has its own path made of reshapes, adds and
subtracts; the other families are computed as a sum of strided slices, one per
filter tap, which is exact, works for any rank and is jit-, vmap- and
grad-compatible.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pywt

__all__ = [
    "MODES",
    "FAMILIES",
    "Wavelet",
    "get_wavelet",
    "dwt_max_level",
    "coeff_lengths",
    "dwt",
    "idwt",
    "wavedec",
    "waverec",
]

#: Boundary modes supported, with PyWavelets' names.
MODES = (
    "zero",
    "constant",
    "symmetric",
    "reflect",
    "periodic",
    "smooth",
    "antisymmetric",
    "antireflect",
    "periodization",
)
#: Wavelet families supported (orthogonal, as in PyWavelets' short names).
FAMILIES = ("haar", "db", "sym", "coif")


class Wavelet:
    """An orthogonal wavelet filter bank, read from PyWavelets.

    Attributes:
      name: PyWavelets' name, e.g. ``"haar"`` or ``"db2"``.
      dec_lo: the decomposition low-pass filter (float64 NumPy array).
      dec_hi: the decomposition high-pass filter.
      rec_lo: the reconstruction low-pass filter.
      rec_hi: the reconstruction high-pass filter.
      length: the number of taps F.
    """

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise TypeError(f"wavelet must be a name (str), got {type(name).__name__}")
        family = name.rstrip("0123456789")
        if family not in FAMILIES or name not in pywt.wavelist(kind="discrete"):
            raise ValueError(
                f"Unknown or unsupported wavelet {name!r}: supported are 'haar' and the "
                f"PyWavelets orthogonal families dbN, symN, coifN "
                f"(e.g. 'db2', 'sym4', 'coif1')."
            )
        w = pywt.Wavelet(name)
        self.name = name
        self.dec_lo = np.asarray(w.dec_lo, dtype=np.float64)
        self.dec_hi = np.asarray(w.dec_hi, dtype=np.float64)
        self.rec_lo = np.asarray(w.rec_lo, dtype=np.float64)
        self.rec_hi = np.asarray(w.rec_hi, dtype=np.float64)
        self.length = len(self.dec_lo)

    @property
    def is_haar(self) -> bool:
        return self.length == 2

    def __repr__(self) -> str:
        return f"Wavelet({self.name!r})"


def get_wavelet(wavelet) -> Wavelet:
    """The (cached) `Wavelet` of a PyWavelets name, `pywt.Wavelet` or `Wavelet`; raises on unknown names."""
    if isinstance(wavelet, Wavelet):
        return wavelet
    if isinstance(wavelet, pywt.Wavelet):
        wavelet = wavelet.name
    return _wavelet_by_name(wavelet)


@functools.cache
def _wavelet_by_name(name: str) -> Wavelet:
    return Wavelet(name)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"Unknown or unsupported mode {mode!r}; supported: {', '.join(MODES)}.")


def dwt_max_level(length: int, wavelet: str) -> int:
    """The deepest useful level for a signal of `length`, as `pywt.dwt_max_level`."""
    return pywt.dwt_max_level(length, get_wavelet(wavelet).length)


def _dwt_len(n: int, f: int, mode: str) -> int:
    if mode == "periodization":
        return -(-n // 2)
    return (n + f - 1) // 2


def coeff_lengths(length: int, wavelet: str, level: int, mode: str = "symmetric") -> list[int]:
    """Lengths of ``[cA_level, cD_level, ..., cD_1]`` for a signal of `length`."""
    _check_mode(mode)
    f = get_wavelet(wavelet).length
    lengths, n = [], length
    for _ in range(level):
        n = _dwt_len(n, f, mode)
        lengths.append(n)
    return [lengths[-1]] + lengths[::-1]


# --------------------------------------------------------------------------
# Signal extension (the boundary modes), along one axis.
# --------------------------------------------------------------------------


def _take(x: jax.Array, idx: np.ndarray, axis: int) -> jax.Array:
    return jnp.take(x, jnp.asarray(idx), axis=axis)


def _extend(x: jax.Array, left: int, right: int, mode: str, axis: int) -> jax.Array:
    """Extends `x` along `axis` by `left` and `right` samples as PyWavelets does."""
    if mode == "zero":
        pad = [(0, 0)] * x.ndim
        pad[axis] = (left, right)
        return jnp.pad(x, pad)
    # Both are linear extrapolations from the edges; they are built from index
    # arithmetic so that they also hold for extensions longer than n.
    if mode == "smooth":
        return _extend_smooth(x, left, right, axis)
    if mode == "antireflect":
        return _extend_antireflect(x, left, right, axis)
    idx, sign = _source_indices(x.shape[axis], left, right, mode)
    out = _take(x, idx, axis)
    if sign is not None:
        shape = [1] * x.ndim
        shape[axis] = len(sign)
        out = out * jnp.asarray(sign, dtype=x.dtype).reshape(shape)
    return out


def _extend_smooth(x: jax.Array, left: int, right: int, axis: int) -> jax.Array:
    """`_extend` in mode ``"smooth"``: the first-order extrapolation from each edge."""
    n = x.shape[axis]
    if n == 1:
        return _extend(x, left, right, "constant", axis)
    first = jax.lax.slice_in_dim(x, 0, 1, axis=axis)
    last = jax.lax.slice_in_dim(x, n - 1, n, axis=axis)
    d0 = first - jax.lax.slice_in_dim(x, 1, 2, axis=axis)
    d1 = last - jax.lax.slice_in_dim(x, n - 2, n - 1, axis=axis)
    shape = [1] * x.ndim
    shape[axis] = left
    lsteps = jnp.arange(left, 0, -1, dtype=x.dtype).reshape(shape)
    shape[axis] = right
    rsteps = jnp.arange(1, right + 1, dtype=x.dtype).reshape(shape)
    return jnp.concatenate([first + lsteps * d0, x, last + rsteps * d1], axis=axis)


def _extend_antireflect(x: jax.Array, left: int, right: int, axis: int) -> jax.Array:
    """`_extend` in mode ``"antireflect"``: reflections about the edge samples, repeated."""
    out = x
    while left > 0 or right > 0:
        m = out.shape[axis]
        lk, rk = min(left, m - 1), min(right, m - 1)
        if m == 1:
            return _extend(out, left, right, "constant", axis)
        f0 = jax.lax.slice_in_dim(out, 0, 1, axis=axis)
        fl = jax.lax.slice_in_dim(out, m - 1, m, axis=axis)
        lpart = 2 * f0 - _take(out, np.arange(lk, 0, -1), axis)
        rpart = 2 * fl - _take(out, np.arange(m - 2, m - 2 - rk, -1), axis)
        out = jnp.concatenate([lpart, out, rpart], axis=axis)
        left, right = left - lk, right - rk
    return out


def _source_indices(n: int, left: int, right: int, mode: str) -> tuple[np.ndarray, np.ndarray | None]:
    """For the index-based modes: the source sample of each output sample, and its sign (or None)."""
    idx = np.arange(-left, n + right)
    sign = None
    if mode == "constant":
        idx = np.clip(idx, 0, n - 1)
    elif mode == "periodic":
        idx = np.mod(idx, n)
    elif mode in ("symmetric", "antisymmetric"):
        period = 2 * n
        r = np.mod(idx, period)
        idx = np.where(r >= n, period - 1 - r, r)
        if mode == "antisymmetric":
            sign = np.where(np.mod(np.floor_divide(np.arange(-left, n + right), n), 2) == 1, -1.0, 1.0)
    elif mode == "reflect":
        if n == 1:
            idx = np.zeros_like(idx)
        else:
            period = 2 * n - 2
            r = np.mod(idx, period)
            idx = np.where(r >= n, period - r, r)
    else:  # pragma: no cover - guarded by _check_mode
        raise ValueError(mode)
    return idx, sign


# --------------------------------------------------------------------------
# One level.
# --------------------------------------------------------------------------


def _strided(x: jax.Array, start: int, count: int, axis: int) -> jax.Array:
    """``x[start : start + 2 * count : 2]`` along `axis`."""
    return jax.lax.slice_in_dim(x, start, start + 2 * count - 1, stride=2, axis=axis)


def _haar_pairs(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Splits an even-length axis into its even and odd samples by a reshape."""
    n = x.shape[axis]
    pairs = x.reshape(x.shape[:axis] + (n // 2, 2) + x.shape[axis + 1 :])
    return (
        jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False),
        jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False),
    )


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def dwt(x: jax.Array, wavelet: str = "haar", mode: str = "symmetric", axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Single-level DWT along `axis`, as `pywt.dwt(x, wavelet, mode, axis=axis)`.

    Args:
      x: array of any rank, length n >= 1 along `axis`.
      wavelet: PyWavelets name (see `Wavelet`).
      mode: boundary mode (see `MODES`).
      axis: the transformed axis.

    Returns:
      ``(cA, cD)``, each of length ``(n + F - 1) // 2`` along `axis`
      (``ceil(n / 2)`` in periodization mode), F being the filter length;
      the other axes are unchanged.
    """
    _check_mode(mode)
    w = get_wavelet(wavelet)
    axis = _normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    if n < 1:
        raise ValueError("cannot transform an empty axis")
    if n < 2 and mode in ("reflect", "antireflect"):
        raise ValueError(f"mode {mode!r} needs a length of at least 2 along the axis, got {n}")
    f = w.length
    if mode == "periodization" and n % 2:
        # PyWavelets makes an odd signal even by repeating its last sample.
        x = _extend(x, 0, 1, "constant", axis)
        n += 1
    if w.is_haar:
        # F = 2: cA[k] = (x[2k] + x[2k+1]) / sqrt(2); only the right edge can need a sample.
        if n % 2:
            x = _extend(x, 0, 1, mode, axis)
        even, odd = _haar_pairs(x, axis)
        s = jnp.asarray(1 / math.sqrt(2), dtype=x.dtype)
        return (even + odd) * s, (even - odd) * s
    if mode == "periodization":
        # cA[k] = sum_j dec_lo[j] * x[(2k + F/2 - j) mod n]
        out_len, left = n // 2, f
        ext = _extend(x, left, f // 2, "periodic", axis)
        starts = [f // 2 - j + left for j in range(f)]
    else:
        # cA[k] = sum_j dec_lo[j] * x[2k + 1 - j], x extended by F - 1 on both sides.
        out_len = (n + f - 1) // 2
        ext = _extend(x, f - 1, f - 1, mode, axis)
        starts = [f - j for j in range(f)]
    ca = cd = None
    for j, start in enumerate(starts):
        tap = _strided(ext, start, out_len, axis)
        lo = tap * jnp.asarray(w.dec_lo[j], dtype=x.dtype)
        hi = tap * jnp.asarray(w.dec_hi[j], dtype=x.dtype)
        ca = lo if ca is None else ca + lo
        cd = hi if cd is None else cd + hi
    assert ca is not None and cd is not None  # a wavelet has at least two taps
    return ca, cd


def _interleave(even: jax.Array, odd: jax.Array, axis: int) -> jax.Array:
    """``out[2p] = even[p], out[2p + 1] = odd[p]`` along `axis`."""
    stacked = jnp.stack([even, odd], axis=axis + 1)
    shape = even.shape[:axis] + (2 * even.shape[axis],) + even.shape[axis + 1 :]
    return stacked.reshape(shape)


def idwt(
    ca: jax.Array | None,
    cd: jax.Array | None,
    wavelet: str = "haar",
    mode: str = "symmetric",
    axis: int = -1,
) -> jax.Array:
    """Single-level inverse DWT along `axis`, as `pywt.idwt(ca, cd, wavelet, mode, axis=axis)`.

    Either coefficient array may be None (taken as zeros). For a coefficient
    length L the output has length ``2L - F + 2`` (``2L`` in periodization mode).
    """
    _check_mode(mode)
    if ca is not None:
        ref = ca
    elif cd is not None:
        ref = cd
    else:
        raise ValueError("idwt needs at least one of ca and cd")
    if ca is not None and cd is not None and ca.shape != cd.shape:
        raise ValueError(f"ca and cd must have the same shape, got {ca.shape} and {cd.shape}")
    w = get_wavelet(wavelet)
    axis = _normalize_axis(axis, ref.ndim)
    f = w.length
    if w.is_haar:
        s = jnp.asarray(1 / math.sqrt(2), dtype=ref.dtype)
        if ca is None:  # then ref is cd
            return _interleave(ref * s, -ref * s, axis)
        if cd is None:
            return _interleave(ca * s, ca * s, axis)
        return _interleave((ca + cd) * s, (ca - cd) * s, axis)
    length = ref.shape[axis]
    # out[2p + r] = sum_i g[2i + r'] c[p + q - i], (q, r') = divmod(r + shift, 2)
    if mode == "periodization":
        shift, left, count = f // 2 - 1, f // 2, length
    else:
        shift, left, count = f - 2, 0, length - f // 2 + 1
        if count < 1:
            raise ValueError(f"coefficients of length {length} are too short for {wavelet!r}")
    phases: list[jax.Array] = []
    for r in range(2):
        q, rr = divmod(r + shift, 2)
        acc: jax.Array | None = None
        for c, g in ((ca, w.rec_lo), (cd, w.rec_hi)):
            if c is None:
                continue
            ext = _extend(c, left, left, "periodic", axis) if left else c
            for i in range(f // 2):
                start = q - i + left
                part = jax.lax.slice_in_dim(ext, start, start + count, axis=axis)
                part = part * jnp.asarray(g[2 * i + rr], dtype=c.dtype)
                acc = part if acc is None else acc + part
        assert acc is not None  # one of ca and cd is given, and f // 2 >= 1
        phases.append(acc)
    return _interleave(phases[0], phases[1], axis)


def wavedec(
    x: jax.Array, wavelet: str = "haar", mode: str = "symmetric", level: int | None = None, axis: int = -1
) -> list[jax.Array]:
    """Multi-level DWT along `axis`, as `pywt.wavedec(x, wavelet, mode, level, axis)`.

    Returns:
      ``[cA_level, cD_level, cD_level-1, ..., cD_1]``; the lengths along `axis`
      are `coeff_lengths(n, wavelet, level, mode)`. ``level=None`` means
      `dwt_max_level`. Like PyWavelets, a level deeper than that is computed
      (the boundary effects then dominate); `scale_by_gwt` refuses it.

    Example:
      >>> import jax.numpy as jnp, numpy as np, pywt, optax_gwt
      >>> x = np.arange(10.0)
      >>> ours = optax_gwt.wavedec(jnp.asarray(x), "db2", "symmetric", level=2)
      >>> [c.shape for c in ours]
      [(4,), (4,), (6,)]
      >>> all(np.allclose(a, b, atol=1e-5) for a, b in zip(ours, pywt.wavedec(x, "db2", "symmetric", level=2)))
      True
    """
    axis = _normalize_axis(axis, x.ndim)
    if level is None:
        level = dwt_max_level(x.shape[axis], wavelet)
    if not isinstance(level, (int, np.integer)) or level < 0:
        raise ValueError(f"level must be a non-negative int, got {level!r}")
    details = []
    a = x
    for _ in range(level):
        a, d = dwt(a, wavelet, mode, axis)
        details.append(d)
    return [a] + details[::-1]


def waverec(
    coeffs: Sequence[jax.Array | None], wavelet: str = "haar", mode: str = "symmetric", axis: int = -1
) -> jax.Array:
    """Multi-level inverse DWT along `axis`, as `pywt.waverec(coeffs, wavelet, mode, axis)`.

    Args:
      coeffs: ``[cA_n, cD_n, ..., cD_1]`` as returned by `wavedec`; detail
        entries may be None (zeros).

    Returns:
      The reconstruction; its length along `axis` may exceed the original
      signal's by one per level (PyWavelets' convention): cut it to size.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> coeffs = optax_gwt.wavedec(x, "haar", "zero", level=2, axis=0)
      >>> bool(jnp.allclose(optax_gwt.waverec(coeffs, "haar", "zero", axis=0), x, atol=1e-6))
      True
    """
    if len(coeffs) < 1 or coeffs[0] is None:
        raise ValueError("waverec needs at least the approximation coefficients")
    a = coeffs[0]
    axis = _normalize_axis(axis, a.ndim)
    for d in coeffs[1:]:
        if d is not None and a.shape[axis] == d.shape[axis] + 1:
            a = jax.lax.slice_in_dim(a, 0, d.shape[axis], axis=axis)
        a = idwt(a, d, wavelet, mode, axis)
    return a
