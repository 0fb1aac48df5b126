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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optax_gwt.sharding import _explicit_sharding

__all__ = ["block_sums", "repeat_blocks"]


def block_sums(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Sums of consecutive blocks of `block` entries along `axis`.

    Args:
      x: any array; its length ``n`` along `axis` is zero-padded to a multiple
        of `block`.
      axis: a non-negative axis of `x`.
      block: the block length ``B``.

    Returns:
      An array shaped like `x` with ``ceil(n / B)`` along `axis`: entry ``i`` is
      ``sum(x[i * B : (i + 1) * B])`` along that axis.
    """
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
    return total


def repeat_blocks(x: jax.Array, axis: int, block: int, length: int) -> jax.Array:
    """Each entry of `x` along `axis` repeated `block` times in place, cut to `length`.

    The inverse layout of `block_sums`: for ``x`` with ``ceil(length / B)``
    entries along `axis`, returns an array with `length` entries along it whose
    entry ``j`` is ``x[j // B]``.
    """
    out = jnp.repeat(x, block, axis=axis, out_sharding=_explicit_sharding(x))
    if out.shape[axis] != length:
        out = jax.lax.slice_in_dim(out, 0, length, axis=axis)
    return out
