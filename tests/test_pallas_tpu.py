"""optax_gwt.kernels.pallas_tpu (row ``tpu-pallas-update``) in Pallas's interpreter on the CPU, against the XLA path of
`haar.adam_update` (what every other backend runs) and a float64 NumPy formula.
Its compiled form for the TPUs is checked in tests/test_targets.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_gwt import haar
from optax_gwt.kernels import Case, FastPath, pallas_tpu, rules, select

SCALE = 0.25


def _case(shape, block, dtype, state_dtype, seed=0):
    """A gradient in `dtype`, its Haar approximation (float32) and moments in `state_dtype`."""
    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.normal(size=shape), dtype)
    approx = haar.block_sums(g.astype(jnp.float32), 0, block) * block**-0.5
    mu = jnp.asarray(0.1 * rng.normal(size=approx.shape), state_dtype)
    nu = jnp.asarray(0.01 * rng.random(size=approx.shape), state_dtype)
    return g, approx, mu, nu


def _factors(residual):
    return dict(eps=1e-8, approx_factor=jnp.float32(1.3), detail_factor=jnp.float32(0.7), residual=residual)


def _kernel(g, approx, mu, nu, block, residual, interpret=True):
    f = _factors(residual)
    scalars = jnp.asarray(
        [f["eps"], f["approx_factor"], f["detail_factor"], residual or 0.0, SCALE], jnp.float32
    )  # fmt: skip
    return pallas_tpu.haar_adam_update(
        g, approx, mu, nu, scalars, block=block, residual=residual is not None, compute=jnp.float32,
        out=g.dtype, fallback=haar.update_from_scalars, interpret=interpret, fast_path=FastPath(),
    )  # fmt: skip


def _xla(g, approx, mu, nu, block, residual):
    """`haar.adam_update` on the CPU (its XLA path), from the gradient upcast as GWT carries it."""
    return haar.adam_update(
        g.astype(jnp.float32), approx, mu, nu, axis=0, block=block, scale=SCALE, out_dtype=g.dtype,
        storage_dtype=g.dtype, **_factors(residual),
    )  # fmt: skip


def _numpy(g, approx, mu, nu, block, residual):
    """The update in float64: ``scale * (d * (G - mean) + a * mu / sqrt(B)) / (sqrt(nu + r^2) + eps)``."""

    def rep(x):  # cut to the gradient's rows (a short last block)
        return np.repeat(np.asarray(x, np.float64), block, axis=0)[: g.shape[0]]

    detail = np.asarray(g.astype(jnp.float32), np.float64) - rep(approx) / np.sqrt(block)
    r2 = 0.0 if residual is None else (residual * detail) ** 2
    return SCALE * (0.7 * detail + 1.3 * rep(mu) / np.sqrt(block)) / (np.sqrt(rep(nu) + r2) + 1e-8)


CASES = [
    ((64, 256), 2, jnp.float32, jnp.float32, None),
    ((128, 1280), 4, jnp.float32, jnp.float32, 0.5),
    ((256, 512), 4, jnp.bfloat16, jnp.bfloat16, None),
    ((64, 128), 2, jnp.bfloat16, jnp.float32, 1.0),
    ((256, 384), 8, jnp.float32, jnp.float32, None),
    ((4096, 128), 2, jnp.float32, jnp.float32, None),  # two tiles of 2048 rows
    ((2157, 200), 4, jnp.float32, jnp.float32, None),  # a short last block, partial tiles both ways
    ((37, 130), 2, jnp.bfloat16, jnp.bfloat16, 0.5),
]


@pytest.mark.parametrize("shape,block,dtype,state_dtype,residual", CASES)
def test_kernel_equals_the_xla_path(shape, block, dtype, state_dtype, residual):
    """The same arithmetic op by op: float32 bit for bit; 16-bit within one rounding of the result
    (the two compilers may round a float32 value on a tie differently)."""
    args = (*_case(shape, block, dtype, state_dtype), block, residual)
    out = jax.jit(_kernel, static_argnums=(4, 5))(*args)
    ref = jax.jit(_xla, static_argnums=(4, 5))(*args)
    assert out.dtype == ref.dtype == dtype and out.shape == shape
    if dtype == jnp.float32:
        np.testing.assert_array_equal(out, ref)
    else:
        np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), rtol=2**-8, atol=0)
    exact = _numpy(*args)
    tol = 1e-6 if dtype == jnp.float32 else 2**-8
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=tol, atol=tol * np.abs(exact).max())


def test_vmap_and_jvp_take_the_xla_path():
    """Under `jax.vmap` and `jax.jvp` the kernel's primitive computes with its fallback, to the
    same values."""
    cases = [_case((64, 256), 2, jnp.float32, jnp.float32, seed) for seed in (0, 1)]
    g, approx, mu, nu = (jnp.stack(x) for x in zip(*cases, strict=True))
    batched = jax.jit(jax.vmap(lambda *a: _kernel(*a, 2, None)))(g, approx, mu, nu)
    for i in range(2):
        np.testing.assert_allclose(batched[i], _xla(g[i], approx[i], mu[i], nu[i], 2, None), rtol=1e-6)
    one = (g[0], approx[0], mu[0], nu[0])
    tangent = tuple(jnp.ones_like(x) for x in one)
    _, dk = jax.jvp(lambda *a: _kernel(*a, 2, None), one, tangent)
    _, dx = jax.jvp(lambda *a: _xla(*a, 2, None), one, tangent)
    np.testing.assert_allclose(dk, dx, rtol=1e-6)


@pytest.mark.parametrize(
    "shape,block,axis,fits",
    [
        ((4096, 2048), 4, 0, True),
        ((5461, 2048), 4, 0, True),  # a short last block; 5461 = 2 tiles of 2048 rows and a part
        ((2**16, 200), 2, 0, True),  # columns not whole 128-lane tiles
        ((4096, 2048), 4, 1, False),  # along the lanes
        ((4096, 2048, 2), 4, 0, False),  # not a matrix
        ((4096, 2048), 1, 0, False),
    ],
)
def test_row_takes_matrices_along_their_rows(shape, block, axis, fits):
    small = list(shape)
    small[axis] = -(-shape[axis] // block)
    case = Case("update", shape, np.float32, axis, block, state_dtype=np.float32, per_block_shape=tuple(small))
    row = select(case, "tpu")[0]
    assert (row is not None and row.name == "tpu-pallas-update") == fits


def test_tiles_are_whole_blocks_of_tpu_tiles():
    assert pallas_tpu.tile_rows(4096, 2, 4) == pallas_tpu.MAX_ROWS
    assert pallas_tpu.tile_rows(48, 4, 4) == 64  # one tile, past the array's end
    assert pallas_tpu.tile_rows(11008, 4, 2) % 64 == 0  # 16-bit per-block tiles: 16 rows


@pytest.mark.parametrize(
    "shape,block,dtype,fast_path,taken",
    [
        ((2048, 4096), 4, jnp.float32, "auto", True),
        ((2048, 4096), 2, jnp.bfloat16, "auto", True),
        ((2048, 4096), 8, jnp.float32, "auto", False),  # level 3: XLA's pass
        ((2048, 2048), 4, jnp.float32, "auto", False),  # small: XLA keeps it on chip
        ((2048, 4096), 4, jnp.float32, FastPath(pallas=False), False),
        ((2048, 4096), 4, jnp.float32, "xla", False),
    ],
)
def test_where_adam_update_takes_the_kernel_on_a_tpu(shape, block, dtype, fast_path, taken):
    g = jax.ShapeDtypeStruct(shape, dtype)
    small = (jax.ShapeDtypeStruct((shape[0] // block, shape[1]), dtype),) * 3
    with rules.recording() as chosen:
        jax.eval_shape(
            lambda g, a, m, v: haar.adam_update(
                g, a, m, v, axis=0, block=block, eps=1e-8, approx_factor=jnp.float32(1.0),
                detail_factor=jnp.float32(1.0), scale=0.25, fast_path=fast_path,
            ),
            g, *small,
        )  # fmt: skip
    assert ("tpu-pallas-update" in chosen) == taken
