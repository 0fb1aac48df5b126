"""`optax_gwt.kernels.lowering`: the choice made when a program is lowered (8 devices: multidevice_checks)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from optax_gwt.kernels.lowering import one_device_or


def _plus(k, x):
    return x + k


choose = functools.partial(one_device_or, functools.partial(_plus, 1.0), functools.partial(_plus, 2.0))


def test_one_device_takes_single():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jax.jit(choose)(x), x + 1)
    np.testing.assert_array_equal(choose(x), x + 1)


def test_vmap_and_derivatives():
    """Under `jax.vmap` both functions are vmapped (one device: single's); derivatives are partitioned's."""
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jax.jit(jax.vmap(choose))(x), x + 1)
    np.testing.assert_array_equal(jax.vmap(choose, in_axes=1)(x), (x + 1).T)
    np.testing.assert_array_equal(jax.grad(lambda v: jnp.sum(jnp.square(choose(v))))(x), 2 * (x + 2))
    primal, tangent = jax.jvp(choose, (x,), (jnp.ones_like(x),))
    np.testing.assert_array_equal(primal, x + 2)
    np.testing.assert_array_equal(tangent, jnp.ones_like(x))
