"""A Pallas (Mosaic) kernel for the full-size pass of Haar GWT with Adam on TPUs (row ``tpu-pallas-update``).

`haar.adam_update` repeats each per-block value (the block mean, Adam's moments)
``B = 2^level`` times along the transform axis. On a TPU, where an array's rows
sit in tiles of 8, a repeat over 2 or 4 rows is a shuffle inside a tile that XLA
does not fuse into the elementwise pass: for matrices of 1B and 7B models (from
about 2048 x 5461) it writes the repeated arrays to HBM at full size, and the step
moves more bytes than AdamW's.

`haar_adam_update` never forms the repeat. It computes the same expression in VMEM
over tiles of ``(rows, 128)`` of the gradient: with ``q = rows / B``, the ``(q, 128)``
tiles of the per-block arrays line up one to one with the gradient's rows
``k, k + B, k + 2B, ...`` for each ``k < B``, which a strided load reads and a
strided store writes back. Mosaic's strided accesses need 32-bit data on a
128-lane buffer, so a 16-bit gradient or update goes through a float32 copy in VMEM
(exact both ways); the arithmetic is the XLA path's, op by op, in the compute dtype
(float32 for a 16-bit gradient, as GWT computes everywhere).

It is a custom call, which XLA's SPMD partitioner cannot split: the kernel is taken
where the program runs as written on each device (one device, or the body of a
`jax.shard_map` manual over all its mesh axes), and its tiling fits; a program that
XLA partitions over a mesh, a batch under `jax.vmap` and derivatives take the same
update by XLA (`haar.update_from_scalars`, its ``fallback``). On other backends the
kernel runs in Pallas's interpreter (``interpret=True``, ``FastPath(emulate="tpu")``),
which is how the tests compare it with the XLA path on the CPU.

The update is written in full size once (XLA cannot fuse a custom call with the
``apply_updates`` that follows), in a buffer of its own: given the gradient's
(``input_output_aliases``), a train step would save that one buffer, but where the
gradient is an argument of the program (an update step, or `optax.MultiSteps`'s
accumulator) XLA copies every gradient first, and holds the copies at once.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import ad, batching, mlir

from optax_gwt.kernels.lowering import batch_first, jvp_of, on_one_device
from optax_gwt.kernels.rules import LANES, Case

__all__ = ["applies", "haar_adam_update", "update"]
#: The most gradient rows per tile (1 MiB of float32 per buffer, double-buffered in and out).
MAX_ROWS = 2048


def tile_rows(n: int, block: int, small_itemsize: int) -> int:
    """The rows of a tile of a gradient of `n` rows: whole TPU tiles of the per-block arrays
    (8 rows of 32-bit data, 16 of 16-bit, times `block` rows of the gradient), up to
    ``MAX_ROWS``. The last tile may reach past the array: Pallas pads what it reads there
    and drops what the kernel writes."""
    unit = block * (8 if small_itemsize >= 4 else 16)
    return min(-(-n // unit) * unit, max(unit, MAX_ROWS // unit * unit))


def applies(g: Any, small: tuple[Any, ...], axis: int, block: int) -> bool:
    """Whether the kernel computes this update: a matrix `g` transformed along its rows
    (axis 0) in blocks of 2 or more, its per-block arrays `small` shaped ``(ceil(n / B), m)``."""
    if g.ndim != 2 or axis != 0 or block < 2:
        return False
    return all(s.shape == (-(-g.shape[0] // block), g.shape[1]) for s in small)


def _body(block: int, residual: bool, compute: Any, scalars, g_ref, approx_ref, mu_ref, nu_ref, out_ref, *scratch):
    """One tile: `haar.adam_update`'s expression for each offset ``k`` of the blocks, in `compute`."""

    def scalar(i):  # through a vector: Mosaic casts vectors, not SMEM scalars
        return jnp.full((1, 1), scalars[i], jnp.float32).astype(compute)

    eps, approx_factor, detail_factor, rho, scale = (scalar(i) for i in range(5))
    s = jnp.asarray(block**-0.5, compute)
    mean = approx_ref[...].astype(compute) * s
    mu, nu = mu_ref[...].astype(compute), nu_ref[...].astype(compute)
    spare = list(scratch)
    src = g_ref if jnp.dtype(g_ref.dtype).itemsize == 4 else spare.pop(0)
    dst = out_ref if jnp.dtype(out_ref.dtype).itemsize == 4 else spare.pop(0)
    if src is not g_ref:
        src[...] = g_ref[...].astype(jnp.float32)
    q = mean.shape[0]
    for k in range(block):
        rows = pl.ds(k, q, stride=block)
        g = src[rows, :].astype(compute)
        detail = g - mean
        added = jnp.zeros([], compute) * g if not residual else jnp.square(rho * detail)
        den = jnp.sqrt(nu + added) + eps
        u = (detail * detail_factor + mu * (approx_factor * s)) / den
        dst[rows, :] = (u * scale).astype(out_ref.dtype).astype(dst.dtype)
    if dst is not out_ref:
        out_ref[...] = dst[...].astype(out_ref.dtype)


def _pallas_update(g, approx, mu, nu, scalars, *, block: int, residual: bool, compute: Any, out: Any, interpret: bool):
    """The kernel on one device's arrays (`applies` holds)."""
    n, m = g.shape
    rows = tile_rows(n, block, min(jnp.dtype(s.dtype).itemsize for s in (approx, mu, nu)))
    full = pl.BlockSpec((rows, LANES), lambda i, j: (i, j))
    per_block = pl.BlockSpec((rows // block, LANES), lambda i, j: (i, j))
    narrow = [d for d in (g.dtype, out) if jnp.dtype(d).itemsize != 4]
    return pl.pallas_call(
        functools.partial(_body, block, residual, compute),
        out_shape=jax.ShapeDtypeStruct(g.shape, out, manual_axis_type=jax.typeof(g).mat),
        grid=(pl.cdiv(n, rows), pl.cdiv(m, LANES)),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), full, per_block, per_block, per_block],
        out_specs=full,
        scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32) for _ in narrow],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(scalars, g, approx, mu, nu)


def _fallback_fun(fallback, block, residual, compute, out, fast_path, **_):
    return functools.partial(fallback, block=block, residual=residual, compute=compute, out=out, fast_path=fast_path)


def _lowering(ctx, *args, kernel: bool, **params):
    """The kernel where `kernel` (a TPU, or Pallas's interpreter) is asked for, the program
    runs on one device and its tiling fits; else the fallback."""
    g, *small = ctx.avals_in[:4]
    if kernel and on_one_device(ctx) and applies(g, tuple(small), 0, params["block"]):
        options = {k: params[k] for k in ("block", "residual", "compute", "out", "interpret")}
        fun = functools.partial(_pallas_update, **options)
    else:
        fun = _fallback_fun(**params)
    return mlir.lower_fun(fun, multiple_results=False)(ctx, *args)


_update_p = jax.extend.core.Primitive("optax_gwt_tpu_haar_adam_update")
_update_p.def_abstract_eval(lambda g, *_, out, **__: g.update(dtype=out, weak_type=False))
_update_p.def_impl(lambda *args, **params: jax.jit(functools.partial(_update_p.bind, **params))(*args))
mlir.register_lowering(_update_p, lambda ctx, *args, **p: _lowering(ctx, *args, kernel=p["interpret"], **p))
mlir.register_lowering(_update_p, functools.partial(_lowering, kernel=True), platform="tpu")


def _batched(args, dims, **params):
    """Under `jax.vmap`: the fallback, vmapped."""
    return jax.vmap(_fallback_fun(**params))(*batch_first(args, dims)), 0


def _jvp(primals, tangents, **params):
    """Derivatives: the fallback's."""
    return jvp_of(_fallback_fun(**params), primals, tangents)


batching.primitive_batchers[_update_p] = _batched
ad.primitive_jvps[_update_p] = _jvp


def haar_adam_update(
    g: jax.Array,
    approx: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    scalars: jax.Array,
    *,
    block: int,
    residual: bool,
    compute: Any,
    out: Any,
    fallback,
    fast_path: Any = "auto",
    interpret: bool = False,
) -> jax.Array:
    """`haar.adam_update`'s scaled update of an ``(n, m)`` matrix along axis 0, as a kernel.

    Args:
      g: the gradient, ``(n, m)``, float32 or 16-bit (its own dtype: the kernel
        converts it to `compute` in VMEM).
      approx, mu, nu: its Haar approximation and Adam's moments of it, ``(n / B, m)``.
      scalars: float32 ``[eps, approx_factor, detail_factor, rho, scale]`` (``rho``
        unused unless `residual`).
      block: ``B = 2^level``.
      residual: whether ``(rho * (G - mean))^2`` enters the square root (FOAM's rule).
      compute, out: the dtype of the arithmetic and of the result (``scale * update``).
      fallback: ``fallback(g, approx, mu, nu, scalars, block=, residual=, compute=,
        out=, fast_path=)``, the same by XLA (see the module's docstring for where it is
        taken); a module-level function (a parameter of the primitive, hashed).
      fast_path: the fallback's (hashable).
      interpret: run the kernel in Pallas's interpreter on any backend (for tests);
        without it only a TPU runs the kernel.

    Returns:
      ``scale * update`` in `out`, shaped like `g`.
    """
    return _update_p.bind(
        g, approx, mu, nu, scalars, block=block, residual=residual, compute=jnp.dtype(compute), out=jnp.dtype(out),
        interpret=interpret, fallback=fallback, fast_path=fast_path,
    )  # fmt: skip


def update(case: Case, plain: Any, fast_path: Any) -> Any:
    """Row ``tpu-pallas-update``: ``f(g, approx, mu, nu, factors, options)``, `haar.adam_update`'s
    arrays, its scalars ``(eps, approx_factor, detail_factor, rho, scale)`` and the options of
    `haar_adam_update`; ``f.emulated`` runs the kernel in Pallas's interpreter."""
    from optax_gwt.haar import update_from_scalars

    def on(interpret: bool):
        def f(g, approx, mu, nu, factors, options):
            scalars = jnp.stack([jnp.asarray(x, jnp.float32) for x in factors])
            kernel_options = {k: v for k, v in options.items() if k != "axis"}  # axis 0: the row's condition
            return haar_adam_update(
                g, approx, mu, nu, scalars, fallback=update_from_scalars, interpret=interpret, **kernel_options
            )

        return f

    kernel = on(False)
    kernel.emulated = on(True)
    return kernel
