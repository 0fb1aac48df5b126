"""Haar GWT in closed form: block sums and block repeats.

With Haar, ``level`` DWT levels along an axis reduce to blocks of
``B = 2^level`` consecutive samples: the approximation is each block's sum over
``sqrt(B)``, and the inverse of an update that is constant per block (plus the
rescaled details) repeats a per-block value ``B`` times in place. These helpers
express both as strided slices and a broadcast that XLA fuses into the
neighbouring elementwise work, so that a GWT step reads each full-size array at
most twice and writes no full-size temporary. (A reshape to ``(n / B, B, ...)``
with a reduction or a broadcast along the middle axis computes the same values
but compiles, on XLA CPU, to a separate reduction pass and a slow strided loop.)

Where a chip compiles another formulation better, the rows of
`optax_gwt.kernels.rules.RULES` take over (`optax_gwt.kernels.switch`, chosen when the
program is lowered); each function here takes the ``fast_path`` option for that.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from optax_gwt.kernels.rules import Case, FastPath, switch
from optax_gwt.sharding import _explicit_sharding

__all__ = ["block_sums", "repeat_blocks", "block_means", "adam_update", "update_from_factors", "scaled"]


def block_sums(x: jax.Array, axis: int, block: int, fast_path: str | FastPath = "auto") -> jax.Array:
    """Sums of consecutive blocks of `block` entries along `axis`.

    Args:
      x: any array; its length ``n`` along `axis` is zero-padded to a multiple
        of `block`.
      axis: a non-negative axis of `x`.
      block: the block length ``B``.
      fast_path: the rows of op ``"block_sums"`` it may take (`optax_gwt.kernels`).

    Returns:
      An array shaped like `x` with ``ceil(n / B)`` along `axis`: entry ``i`` is
      ``sum(x[i * B : (i + 1) * B])`` along that axis.
    """
    case = Case("block_sums", x.shape, x.dtype, axis, block)
    return switch(case, fast_path, functools.partial(_sliced_block_sums, axis=axis, block=block), x)


def _sliced_block_sums(x: jax.Array, axis: int, block: int) -> jax.Array:
    """`block_sums` as ``B`` strided slices, the last block zero-padded."""
    n = x.shape[axis]
    blocks = -(-n // block)
    total = None
    for k in range(min(block, n)):
        part = jax.lax.slice_in_dim(x, k, n, stride=block, axis=axis)
        if part.shape[axis] != blocks:
            # The last block is short: pad this per-block slice, not the full-size x
            # (a padded copy of x would be materialised, as several fusions read it).
            pad = [(0, 0, 0)] * x.ndim
            pad[axis] = (0, blocks - part.shape[axis], 0)
            part = jax.lax.pad(part, jnp.zeros([], x.dtype), pad)
        total = part if total is None else total + part
    assert total is not None, f"block_sums of an empty axis (shape {x.shape}, axis {axis})"
    return total


def repeat_blocks(x: jax.Array, axis: int, block: int, length: int, fast_path: str | FastPath = "auto") -> jax.Array:
    """Each entry of `x` along `axis` repeated `block` times in place, cut to `length`.

    The inverse layout of `block_sums`: for ``x`` with ``ceil(length / B)``
    entries along `axis`, returns an array with `length` entries along it whose
    entry ``j`` is ``x[j // B]``. A broadcast, or the rows of op ``"repeat"`` that
    `fast_path` allows (`optax_gwt.kernels`).
    """
    case = Case("repeat", x.shape, x.dtype, axis, block, length=length, explicit_mesh=_explicit_sharding(x) is not None)
    return switch(case, fast_path, functools.partial(_broadcast_repeat, axis=axis, block=block, length=length), x)


def _broadcast_repeat(x: jax.Array, axis: int, block: int, length: int) -> jax.Array:
    out = jnp.repeat(x, block, axis=axis, out_sharding=_explicit_sharding(x))
    if out.shape[axis] != length:
        out = jax.lax.slice_in_dim(out, 0, length, axis=axis)
    return out


def block_means(g: jax.Array, axis: int, block: int, fast_path: str | FastPath = "auto") -> jax.Array:
    """Each entry of `g` replaced by the mean of its block along `axis` (``repeat_blocks`` of
    ``block_sums(g) / B``), computed from `g` alone. The barrier keeps XLA from sharing
    these block sums with the approximation's."""
    sums = block_sums(jax.lax.optimization_barrier(g), axis, block, fast_path)
    return repeat_blocks(sums * jnp.asarray(1 / block, g.dtype), axis, block, g.shape[axis], fast_path)


def adam_update(
    g: jax.Array,
    approx: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    *,
    axis: int,
    block: int,
    eps: jax.Array | float,
    approx_factor: jax.Array,
    detail_factor: jax.Array,
    residual: float | jax.Array | None = None,
    scale: float = 1.0,
    out_dtype: Any = None,
    storage_dtype: Any = None,
    batch_axes: int = 0,
    fast_path: str | FastPath = "auto",
) -> jax.Array:
    """Haar GWT's update of one array with a diagonal Adam step on its approximation.

    The closed form of `wavelet_inverse` after `on_approximation` with a
    `GWTBase` Adam: an explicit fusion of the two stages' math, whose plain
    chain (the step materialised per block, then `inverse_leaf`) is its
    reference.

    With ``den = sqrt(nu) + eps`` and everything per block repeated in place,
    returns ``(G - mean) * d / den + (a * mu / den) / sqrt(B)`` where ``mean =
    approx / sqrt(B)``, ``a = approx_factor`` and ``d = detail_factor`` (the
    closed form of ``waverec([a * mu / den, D * d / den, ...])``). The moments
    are repeated *before* the square root and the division, so XLA compiles the
    whole expression into the one loop that also applies the update to the
    params: no per-block temporary is written (a per-block denominator would be
    materialised, as XLA does not duplicate a square root into a broadcast).

    Args:
      g: the gradient, length ``n`` along `axis`.
      approx: its Haar approximation (block sums over ``sqrt(B)``), ``ceil(n / B)`` along `axis`.
      mu, nu: Adam's moments of `approx`, same shape as it.
      axis, block: the transform axis and ``B = 2^level``.
      eps: added to ``sqrt(nu)``.
      approx_factor, detail_factor: scalars (bias correction, limiter).
      residual: ``rho``, or None: adds ``(rho * (G - mean))^2`` to the
        repeated ``nu`` under the square root (FOAM's residual in the second
        moment).
      scale, out_dtype: the result is ``(scale * update).astype(out_dtype)``
        (default: `g`'s dtype).
      storage_dtype: a dtype `g` converts to exactly (it was upcast from it), or
        None: a kernel that takes over (op ``"update"``) reads `g` in it.
      batch_axes: how many leading axes of `g` are a stack of matrices (the factors may
        then hold one value per matrix, shaped to broadcast).
      fast_path: the rows of ops ``"update"``, ``"block_means"`` and ``"repeat"`` it
        may take (`optax_gwt.kernels`).
    """
    # A barrier (no copy, no work): without it XLA shares this pass's cast of the moments
    # with the limiter's norm, and XLA CPU then writes float32 copies of half-precision
    # moments for that reduction instead of reading them directly.
    mu, nu = jax.lax.optimization_barrier((mu, nu))
    out_dtype = jnp.dtype(g.dtype if out_dtype is None else out_dtype)
    fp = FastPath.of(fast_path)
    factors = (eps, approx_factor, detail_factor, 0.0 if residual is None else residual, scale)
    stored = g if storage_dtype is None else g.astype(storage_dtype)  # XLA drops the round trip
    wide = any(jnp.dtype(a.dtype).itemsize > 4 for a in (g, approx, mu, nu, *factors) if hasattr(a, "dtype"))
    case = Case(
        "update", g.shape, g.dtype, axis, block, state_dtype=mu.dtype, wide=wide, per_block_shape=mu.shape,
        batch_axes=batch_axes,
    )  # fmt: skip
    options = dict(axis=axis, block=block, residual=residual is not None, compute=g.dtype, out=out_dtype, fast_path=fp)

    def xla(*_):
        u = _xla_update(
            g, approx, mu, nu, axis=axis, block=block, eps=eps, approx_factor=approx_factor,
            detail_factor=detail_factor, residual=residual, fast_path=fp,
        )  # fmt: skip
        return scaled(u, scale, out_dtype)

    return switch(case, fp, xla, stored, approx, mu, nu, factors, options)


def update_from_factors(
    g, approx, mu, nu, factors, *, axis: int, block: int, residual: bool, compute, out, fast_path, guard: bool = True
):
    """`adam_update` from its arrays (`g` in any dtype, computed in `compute`), its factors
    ``(eps, approx_factor, detail_factor, rho, scale)`` and its options (the rows' arguments).
    ``guard=False`` leaves out the ``0 * G`` that keeps the square root after the repeat."""
    eps, approx_factor, detail_factor, rho, scale = factors
    u = _xla_update(
        g.astype(compute), approx, mu, nu, axis=axis, block=block, eps=eps, approx_factor=approx_factor,
        detail_factor=detail_factor, residual=rho if residual else None, fast_path=fast_path, guard=guard,
    )  # fmt: skip
    return scaled(u, scale, out)


def update_from_scalars(g, approx, mu, nu, scalars, *, block: int, residual: bool, compute, out, fast_path):
    """`adam_update` along axis 0 with its factors in one array (the Pallas kernel's fallback)."""
    factors = [scalars[i] for i in range(5)]
    return update_from_factors(
        g, approx, mu, nu, factors, axis=0, block=block, residual=residual, compute=compute, out=out,
        fast_path=fast_path,
    )  # fmt: skip


def scaled(u: jax.Array, scale: float | jax.Array, dtype: Any) -> jax.Array:
    """``(scale * u).astype(dtype)``, the scale rounded to `u`'s dtype first (`wavelet_inverse`'s
    last step, and so `adam_update`'s)."""
    return (u * jnp.asarray(scale, u.dtype)).astype(dtype)


def _xla_update(g, approx, mu, nu, *, axis, block, eps, approx_factor, detail_factor, residual, fast_path, guard=True):
    """`adam_update`'s expression for XLA to fuse (the block values repeated in place)."""
    n = g.shape[axis]
    dtype = g.dtype

    def rep(x):
        return repeat_blocks(x.astype(dtype), axis, block, n, fast_path)

    s = jnp.asarray(block**-0.5, dtype)
    means = Case("block_means", g.shape, dtype, axis, block, state_dtype=mu.dtype)
    mean = switch(means, fast_path, lambda g, from_approx: from_approx, g, rep(approx) * s)
    detail = g - mean
    # ``+ 0 * g`` (exact: a non-finite G already makes the whole update NaN) keeps
    # XLA from hoisting the square root before the repeat, where it would be
    # materialised per block instead of fused.
    zero = jnp.zeros([], dtype) * g if guard else jnp.zeros([], dtype)
    added = zero if residual is None else jnp.square(jnp.asarray(residual, dtype) * detail)
    den = jnp.sqrt(rep(nu) + added) + jnp.asarray(eps, dtype)
    numerator = detail * detail_factor.astype(dtype) + rep(mu) * (approx_factor.astype(dtype) * s)
    return numerator / den
