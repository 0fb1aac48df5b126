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
On TPUs the block sums, and at level 2 the repeats, are small contractions instead
(`chunked_block_sums`, `chunked_repeat`), chosen when JAX lowers the program for one,
and the full-size pass of a large matrix is a Pallas kernel (`optax_gwt.tpu_kernel`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_gwt import tpu_kernel
from optax_gwt.per_device import one_device_or
from optax_gwt.sharding import _explicit_sharding

__all__ = [
    "block_sums",
    "chunked_block_sums",
    "repeat_blocks",
    "chunked_repeat",
    "block_means",
    "adam_update",
    "scaled",
]


#: The longest run of `axis` that `block_sums` contracts with one small matrix on a TPU:
#: one tile of the chip's 128 lanes, and the 128 rows of a v5e MXU. Where a TPU lays the
#: transform axis on the lanes (a device's shard of LLaMA-7B's matrices under FSDP, such
#: as 4096 x 64, and 60M's 512 x 1376), runs of whole lane tiles need no relayout of the
#: gradient (``python -m benchmarks.target_compile --model 7b --fsdp 64``,
#: docs/performance.md). Runs of 256 (v6e's MXU) kept temporaries in 60M's GWT-1 step on v6e.
TPU_CHUNK = 128
#: The longest run of the result that `chunked_repeat` computes with one small matrix (at
#: level 2, 8 entries of the per-block array repeated to 32): longer runs measured more
#: kernels on 60M's 512 x 512 matrices.
TPU_REPEAT_CHUNK = 32
_HIGHEST = jax.lax.Precision.HIGHEST

#: The most entries of a float32 matrix at level 2 whose block means `adam_update` takes
#: from the gradient on a GPU (`block_means`). XLA for the H100 and the A100 fuses them into
#: the full-size pass up to about 1.87 M entries; above that it writes them as a quarter-size
#: array and reads the gradient once more for it (28-30 B/param on one 7B matrix, against
#: 25 with the means from the approximation). Measured deviceless (``python -m
#: benchmarks.target_compile``), JAX 0.10.2.
GPU_MEANS_FROM_G_MAX = 7 * 2**18


def block_sums(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Sums of consecutive blocks of `block` entries along `axis`.

    On a TPU, where `block` divides the axis, the sums are a contraction of runs
    of at most ``TPU_CHUNK`` (128) entries with a 0/1 matrix (`chunked_block_sums`),
    which XLA fuses there with the work around it; elsewhere, strided slices.

    Args:
      x: any array; its length ``n`` along `axis` is zero-padded to a multiple
        of `block`.
      axis: a non-negative axis of `x`.
      block: the block length ``B``.

    Returns:
      An array shaped like `x` with ``ceil(n / B)`` along `axis`: entry ``i`` is
      ``sum(x[i * B : (i + 1) * B])`` along that axis.
    """
    if block > 1 and x.shape[axis] % block == 0:
        return jax.lax.platform_dependent(
            tpu=lambda: chunked_block_sums(x, axis, block), default=lambda: _sliced_block_sums(x, axis, block)
        )
    return _sliced_block_sums(x, axis, block)


def chunked_block_sums(x: jax.Array, axis: int, block: int, max_chunk: int = TPU_CHUNK) -> jax.Array:
    """`block_sums` as a contraction, for a length ``n`` along `axis` that `block` divides.

    ``n`` is cut into runs of ``C`` entries (`_chunk`), and each run is multiplied by the
    ``(C / B, C)`` matrix whose row ``i`` is 1 on block ``i``: ``2 C / B`` flops per
    entry, at the backend's highest precision (bfloat16 gradients summed exactly in
    float32; float32 sums rounded in another order than the slices').
    """
    n, shape = x.shape[axis], x.shape
    assert n % block == 0, f"chunked_block_sums needs {block} to divide {n}"
    chunk = _chunk(n, block, max_chunk)
    runs = x.reshape(shape[:axis] + (n // chunk, chunk) + shape[axis + 1 :])
    sums = jnp.tensordot(runs, _block_ones(chunk, block, x.dtype), axes=([axis + 1], [1]), precision=_HIGHEST)
    return jnp.moveaxis(sums, -1, axis + 1).reshape(shape[:axis] + (n // block,) + shape[axis + 1 :])


def chunked_repeat(x: jax.Array, axis: int, block: int, max_chunk: int = TPU_REPEAT_CHUNK) -> jax.Array:
    """`repeat_blocks` as a contraction (the transpose of `chunked_block_sums`'s): runs of
    ``C / B`` entries of `x` along `axis` times the ``(C / B, C)`` 0/1 matrix, ``2 C / B``
    flops per entry of the result, ``B`` times as long along `axis`.

    Exact at the backend's highest precision (each entry is one entry of `x` times 1
    plus zeros; on a TPU a float32 entry is split into three exact bfloat16 parts). An
    infinite entry of `x` makes its whole run NaN (``inf * 0``), as it does the step.
    """
    n, shape = x.shape[axis] * block, x.shape
    chunk = _chunk(n, block, max_chunk)
    runs = x.reshape(shape[:axis] + (n // chunk, chunk // block) + shape[axis + 1 :])
    out = jnp.tensordot(runs, _block_ones(chunk, block, x.dtype), axes=([axis + 1], [0]), precision=_HIGHEST)
    return jnp.moveaxis(out, -1, axis + 1).reshape(shape[:axis] + (n,) + shape[axis + 1 :])


def _chunk(n: int, block: int, max_chunk: int) -> int:
    """The longest multiple of `block` up to ``max(max_chunk, block)`` that divides `n`."""
    return max(c for c in range(block, max(max_chunk, block) + 1, block) if n % c == 0)


def _block_ones(chunk: int, block: int, dtype: Any) -> jax.Array:
    """The ``(chunk / block, chunk)`` matrix whose row ``i`` is 1 on block ``i``."""
    return jnp.asarray(np.arange(chunk)[None, :] // block == np.arange(chunk // block)[:, None], dtype)


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


def repeat_blocks(x: jax.Array, axis: int, block: int, length: int) -> jax.Array:
    """Each entry of `x` along `axis` repeated `block` times in place, cut to `length`.

    The inverse layout of `block_sums`: for ``x`` with ``ceil(length / B)``
    entries along `axis`, returns an array with `length` entries along it whose
    entry ``j`` is ``x[j // B]``.

    A broadcast, except on a TPU at level 2 (blocks of 4 along the second last axis):
    there a broadcast over 4 rows is a shuffle inside the chip's 8-row tiles, which XLA
    writes out before the fusion that uses it (two on-chip copies, or HBM for a stack too
    large for VMEM), and the repeat is a contraction instead (`chunked_repeat`, one
    fusion) where it measured better: where the program runs as written on each device
    (`optax_gwt.per_device`), in runs of 32 if the last axis fills whole tiles of the
    chip's 128 lanes (its layout puts `axis` on the sublanes); in a program partitioned
    over devices (FSDP), for a stack of matrices, in runs of 128 (one tile of lanes, which
    also cuts a device's shard cleanly where its last axis is narrower than the lanes and
    the layout puts `axis` on them). Blocks of 2 gained as much on one device, but
    LLaMA-60M's GWT-1 step on v6e then kept temporaries; blocks of 8 fill a tile, which
    XLA broadcasts in its fusion. Not on a mesh of explicit axes, whose
    reshapes of a sharded axis need their output's sharding.
    """
    broadcast = functools.partial(_broadcast_repeat, axis=axis, block=block, length=length)
    on_tpu = _tpu_repeat(x, axis, block, length, broadcast)
    return broadcast(x) if on_tpu is None else jax.lax.platform_dependent(x, tpu=on_tpu, default=broadcast)


def _tpu_repeat(x: jax.Array, axis: int, block: int, length: int, broadcast: Callable) -> Callable | None:
    """`repeat_blocks` on a TPU (its docstring's rule), or None where it is the broadcast."""
    if block != 4 or axis != x.ndim - 2 or length != x.shape[axis] * block or _explicit_sharding(x) is not None:
        return None
    rows, stack = x.shape[-1] % tpu_kernel.LANES == 0, x.ndim > 2
    if not (rows or stack):
        return None
    on_one_device = functools.partial(chunked_repeat, axis=axis, block=block) if rows else broadcast
    partitioned = functools.partial(chunked_repeat, axis=axis, block=block, max_chunk=TPU_CHUNK) if stack else broadcast
    return functools.partial(one_device_or, on_one_device, partitioned)


def _broadcast_repeat(x: jax.Array, axis: int, block: int, length: int) -> jax.Array:
    out = jnp.repeat(x, block, axis=axis, out_sharding=_explicit_sharding(x))
    if out.shape[axis] != length:
        out = jax.lax.slice_in_dim(out, 0, length, axis=axis)
    return out


def block_means(g: jax.Array, axis: int, block: int) -> jax.Array:
    """Each entry of `g` replaced by the mean of its block along `axis` (``repeat_blocks`` of
    ``block_sums(g) / B``), computed from `g` alone.

    `adam_update` uses it on TPUs and GPUs for float32 gradients and moments at levels 1
    and 2 of a plain matrix (not a stack of them; on a GPU at level 2 only up to
    `GPU_MEANS_FROM_G_MAX` entries), where the compiled step (``python -m
    benchmarks.target_compile``) then keeps no approximation in memory for its full-size
    pass, which reads `g` anyway. The barrier keeps XLA from sharing these block sums
    with the approximation's. Elsewhere the means come from the approximation, which
    fuses better there.
    """
    sums = block_sums(jax.lax.optimization_barrier(g), axis, block)
    return repeat_blocks(sums * jnp.asarray(1 / block, g.dtype), axis, block, g.shape[axis])


def _block_means_of_one_matrix(axis: int, block: int):
    """``f(g, means)``: `block_means` of `g` for one matrix, and the given ``means`` (the same
    values, from the approximation) where `g` is a batch of matrices under `jax.vmap` (the
    planner's ``over_layers``), whose compiled step would read `g` once more for them. Its
    derivative is that of `block_means` (the means given are taken as computed from `g`)."""

    @jax.custom_batching.custom_vmap
    def means(g, given):
        return block_means(g, axis, block)

    @means.def_vmap
    def batched(axis_size, in_batched, g, given):
        return given, in_batched[1]

    @jax.custom_vjp
    def f(g, given):
        return means(g, given)

    def forward(g, given):
        return f(g, given), None

    def backward(_, cotangent):  # block_means is symmetric: its transpose is itself
        return block_means(cotangent, axis, block), jnp.zeros_like(cotangent)

    f.defvjp(forward, backward)
    return f


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
    materialised, as XLA does not duplicate a square root into a broadcast), and
    the temporary buffers, freshly mapped on every call on CPU, stay empty.

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
        None: on a TPU, where `tpu_kernel` computes the update of a matrix, the
        kernel reads `g` in it.

    On a TPU a matrix of at least ``tpu_kernel.MIN_ENTRIES`` entries transformed
    along its rows at levels 1 or 2 goes to `tpu_kernel` (the same arithmetic, in
    VMEM tiles); XLA elsewhere.
    """
    # A barrier (no copy, no work): without it XLA shares this pass's cast of the moments
    # with the limiter's norm, and XLA CPU then writes float32 copies of half-precision
    # moments for that reduction instead of reading them directly.
    mu, nu = jax.lax.optimization_barrier((mu, nu))
    out_dtype = jnp.dtype(g.dtype if out_dtype is None else out_dtype)

    def xla():
        u = _xla_update(
            g, approx, mu, nu, axis=axis, block=block, eps=eps, approx_factor=approx_factor,
            detail_factor=detail_factor, residual=residual,
        )  # fmt: skip
        return scaled(u, scale, out_dtype)

    factors = (eps, approx_factor, detail_factor, 0.0 if residual is None else residual, scale)
    if not _tpu_kernel_applies(g, (approx, mu, nu), axis, block, factors):
        return xla()

    def kernel():
        scalars = jnp.stack([jnp.asarray(f, jnp.float32) for f in factors])
        stored = g if storage_dtype is None else g.astype(storage_dtype)  # XLA drops the round trip
        return tpu_kernel.haar_adam_update(
            stored, approx, mu, nu, scalars, block=block, residual=residual is not None, compute=g.dtype,
            out=out_dtype, fallback=_update_from_scalars,
        )  # fmt: skip

    return jax.lax.platform_dependent(tpu=kernel, default=xla)


def _tpu_kernel_applies(g, small: tuple, axis: int, block: int, factors: tuple) -> bool:
    """Whether `adam_update` takes `tpu_kernel` on a TPU: a matrix of at least
    ``tpu_kernel.MIN_ENTRIES`` along its rows at levels 1 or 2 (blocks of 8 rows are the TPU's
    own tiles, which XLA handles), arrays of at most 32 bits (its float32 scalars then round
    as the XLA path's casts do), and not switched off (``OPTAX_GWT_TPU_KERNEL=0``)."""
    if os.environ.get("OPTAX_GWT_TPU_KERNEL", "1").lower() in ("0", "false", "no", "off"):
        return False
    arrays = (g, *small, *factors)  # Python numbers are cast as the XLA path casts them
    if any(jnp.dtype(a.dtype).itemsize > 4 for a in arrays if hasattr(a, "dtype")):
        return False
    big = math.prod(g.shape) >= tpu_kernel.MIN_ENTRIES
    return big and block in (2, 4) and tpu_kernel.applies(g, small, axis, block)


def _update_from_scalars(g, approx, mu, nu, scalars, *, block: int, residual: bool, compute, out) -> jax.Array:
    """`adam_update` by XLA along axis 0 with its scalars ``[eps, approx_factor,
    detail_factor, rho, scale]`` in one array (`tpu_kernel`'s fallback)."""
    rho = scalars[3] if residual else None
    u = _xla_update(
        g.astype(compute), approx, mu, nu, axis=0, block=block, eps=scalars[0], approx_factor=scalars[1],
        detail_factor=scalars[2], residual=rho,
    )  # fmt: skip
    return scaled(u, scalars[4], out)


def scaled(u: jax.Array, scale: float | jax.Array, dtype: Any) -> jax.Array:
    """``(scale * u).astype(dtype)``, the scale rounded to `u`'s dtype first (`wavelet_inverse`'s
    last step, and so `adam_update`'s)."""
    return (u * jnp.asarray(scale, u.dtype)).astype(dtype)


def _xla_update(g, approx, mu, nu, *, axis, block, eps, approx_factor, detail_factor, residual) -> jax.Array:
    """`adam_update`'s expression for XLA to fuse (the block values repeated in place)."""
    n = g.shape[axis]
    dtype = g.dtype

    def rep(x):
        return repeat_blocks(x.astype(dtype), axis, block, n)

    s = jnp.asarray(block**-0.5, dtype)
    mean = from_approx = rep(approx) * s
    if jnp.dtype(mu.dtype) == jnp.float32 and dtype == jnp.float32 and block <= 4 and g.ndim == 2:
        from_g = _block_means_of_one_matrix(axis, block)
        big = block == 4 and math.prod(g.shape) > GPU_MEANS_FROM_G_MAX
        mean = jax.lax.platform_dependent(
            cpu=lambda: from_approx,
            tpu=lambda: from_g(g, from_approx),
            default=lambda: from_approx if big else from_g(g, from_approx),
        )
    detail = g - mean
    # ``+ 0 * g`` (exact: a non-finite G already makes the whole update NaN) keeps
    # XLA from hoisting the square root before the repeat, where it would be
    # materialised per block instead of fused.
    added = jnp.zeros([], dtype) * g if residual is None else jnp.square(jnp.asarray(residual, dtype) * detail)
    den = jnp.sqrt(rep(nu) + added) + jnp.asarray(eps, dtype)
    numerator = detail * detail_factor.astype(dtype) + rep(mu) * (approx_factor.astype(dtype) * s)
    return numerator / den
