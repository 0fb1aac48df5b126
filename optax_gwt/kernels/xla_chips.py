"""Chip-specific XLA formulations of Haar GWT's block operations (rows of `rules.RULES`).

Each builder takes the `rules.Case` and the plain formulation and returns a function with
the plain one's arguments that computes the same values in a form a chip's compiler
fuses better: block sums and repeats as small contractions with 0/1 matrices (a TPU's
matrix unit and lane tiles), block means taken from the gradient where the full-size pass
reads it anyway (GPUs and TPUs), and the limiter's norms as one vector (the CPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_gwt.kernels.rules import Case, FastPath

__all__ = ["TPU_CHUNK", "TPU_REPEAT_CHUNK", "chunked_block_sums", "chunked_repeat"]

#: The longest run of the axis that `chunked_block_sums` contracts at once: one tile of a
#: TPU's 128 lanes (and the 128 rows of a v5e matrix unit).
TPU_CHUNK = 128
#: The longest run of the result that `chunked_repeat` computes at once on one device.
TPU_REPEAT_CHUNK = 32
_HIGHEST = jax.lax.Precision.HIGHEST


def chunked_block_sums(x: jax.Array, axis: int, block: int, max_chunk: int = TPU_CHUNK) -> jax.Array:
    """`haar.block_sums` as a contraction, for a length ``n`` along `axis` that `block` divides.

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
    """`haar.repeat_blocks` as a contraction (the transpose of `chunked_block_sums`'s): runs of
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
    """The ``(chunk / block, chunk)`` matrix whose row ``i`` is 1 on block ``i``.

    Built from iotas inside the program: a NumPy array would be a constant that JAX (0.12 and
    up) passes to every call as one more argument per call site.
    """
    shape = (chunk // block, chunk)
    column = jax.lax.broadcasted_iota(jnp.int32, shape, 1) // block
    return (column == jax.lax.broadcasted_iota(jnp.int32, shape, 0)).astype(dtype)


def block_sums_by_contraction(case: Case, plain: Callable, fast_path: FastPath) -> Callable:
    """Row ``tpu-block-sums``: ``f(x)``."""
    return functools.partial(chunked_block_sums, axis=case.axis, block=case.block)


def repeat_in_runs_of_32(case: Case, plain: Callable, fast_path: FastPath) -> Callable:
    """Row ``tpu-repeat-one-device``: ``f(x)``."""
    return functools.partial(chunked_repeat, axis=case.axis, block=case.block)


def repeat_in_runs_of_128(case: Case, plain: Callable, fast_path: FastPath) -> Callable:
    """Row ``tpu-repeat-partitioned``: ``f(x)``."""
    return functools.partial(chunked_repeat, axis=case.axis, block=case.block, max_chunk=TPU_CHUNK)


def means_from_gradient(case: Case, plain: Callable, fast_path: FastPath) -> Callable:
    """Rows ``*-means-from-gradient``: ``f(g, means)``, the block means of `g` computed from `g`
    alone where `g` is one matrix, and the ``means`` given (the same values, from the
    approximation) where `g` is a batch of matrices under `jax.vmap` (the planner's
    ``over_layers``), whose compiled step would read `g` once more for them. Its derivative
    is that of the means of `g` (the means given are taken as computed from `g`), forward
    and backward."""
    from optax_gwt.haar import block_means

    axis, block = case.axis, case.block

    @jax.custom_batching.custom_vmap
    def means(g, given):
        return block_means(g, axis, block, fast_path)

    @means.def_vmap
    def batched(axis_size, in_batched, g, given):
        return given, in_batched[1]

    @jax.custom_jvp
    def f(g, given):
        return means(g, given)

    @f.defjvp
    def tangents(primals, dots):  # linear in g: its own derivative, plain (reverse mode transposes it)
        return f(*primals), block_means(dots[0], axis, block, "xla")

    return f


def one_limiter_vector(case: Case, plain: Callable, fast_path: FastPath) -> Callable:
    """Row ``cpu-one-limiter-vector``: ``f(nodes, r_prev, count, gamma)``, the limiter's
    `stages.limit_vector` on every array's scalars at once (the plain formulation: per array)."""
    from optax_gwt.stages import limit_vector

    return limit_vector


def update_unguarded(case: Case, plain: Callable, fast_path: FastPath) -> Callable:
    """Rows ``*-update-unguarded``: ``f(g, approx, mu, nu, factors, options)``, `haar.adam_update`
    without the ``0 * G`` under its square root (`haar.update_from_factors`)."""
    from optax_gwt.haar import update_from_factors

    def f(g, approx, mu, nu, factors, options):
        return update_from_factors(g, approx, mu, nu, factors, guard=False, **options)

    return f


def update_layer_by_layer(case: Case, plain: Callable, fast_path: FastPath) -> Callable:
    """Row ``tpu-update-layer-by-layer``: ``f(g, approx, mu, nu, factors, options)``, `haar.adam_update`
    of a stack of matrices as a loop over them, each matrix's update written over its gradient."""
    from optax_gwt.haar import adam_update

    batch = case.shape[: case.batch_axes]
    layers = math.prod(batch)

    def flat(x):  # a per-matrix array with the stack's axes as one; a scalar stays
        x = jnp.asarray(x)
        return x.reshape((layers, *x.shape[case.batch_axes :])) if x.shape[: case.batch_axes] == batch else x

    def f(g, approx, mu, nu, factors, options):
        out = jnp.dtype(options["out"])
        per_block, factors = [flat(x) for x in (approx, mu, nu)], [flat(x) for x in factors]
        # The loop's carry starts as the gradient (in place, where the gradient is not needed after).
        carry = flat(g) if g.dtype == out else jnp.zeros((layers, *case.shape[case.batch_axes :]), out)

        def one(i, carry):
            take = lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)  # noqa: E731
            gi = take(carry) if g.dtype == out else take(flat(g))
            fi = [take(x).reshape(()) if x.ndim and x.shape[0] == layers else x.reshape(()) for x in factors]
            eps, approx_factor, detail_factor, rho, scale = fi
            u = adam_update(
                gi.astype(options["compute"]), *[take(x) for x in per_block], axis=case.axis - case.batch_axes,
                block=case.block, eps=eps, approx_factor=approx_factor, detail_factor=detail_factor,
                residual=rho if options["residual"] else None, scale=scale, out_dtype=out, storage_dtype=g.dtype,
                fast_path=fast_path,
            )  # fmt: skip
            return jax.lax.dynamic_update_index_in_dim(carry, u, i, 0)

        return jax.lax.fori_loop(0, layers, one, carry).reshape(case.shape)

    return f
