"""Adam as GWT's base optimizer, and what GWT's detail rule needs to know of an Adam.

The one Adam of this package is `scale_by_reference_adam`, the form of the
authors' WaveAdamW (Hugging Face's AdamW: eps added to the uncorrected
``sqrt(v)``). `adam_preconditioner` reads the denominator of any Adam whose
state is an `optax.ScaleByAdamState` (this one's, or `optax.scale_by_adam`'s),
for the ``"adam"`` detail rule of `wavelet_inverse`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_gwt import haar
from optax_gwt.kernels.rules import Case, FastPath, switch

__all__ = ["SECOND_MOMENTS", "Preconditioner", "GWTBase", "adam_preconditioner", "scale_by_reference_adam"]

#: What the second moment of `scale_by_reference_adam` averages for a Haar approximation.
SECOND_MOMENTS = ("approx", "energy")


class Preconditioner(NamedTuple):
    """A base optimizer's step on the approximation as a diagonal Adam step.

    ``N = step * mu / (sqrt(nu) + eps)`` per coefficient, so that the
    ``"adam"`` detail rule can divide each detail by the denominator
    ``sqrt(nu) + eps`` of its approximation coefficient.

    Attributes:
      mu: a pytree like the base's params (the approximation): its first
        moment after the step.
      nu: its second moment after the step, like `mu`.
      step: the scalar ``a`` above, first-moment bias correction included.
      eps: the scalar ``eps`` above, in units of the uncorrected ``sqrt(nu)``.
      unbiased_step: ``step`` without the first moment's bias correction
        ``1 / (1 - b1^t)`` (for details without it).
      step_scale: the scalar the base multiplied its step by that the
        norm-growth limiter does not see (the reference Adam's
        ``sqrt(1 - b2^t) / (1 - b1^t)``; 1 for `optax.scale_by_adam`).

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> adam = optax_gwt.scale_by_reference_adam(eps=1e-6)
      >>> _, state = adam.update({"w": jnp.ones(2)}, adam.init({"w": jnp.zeros(2)}))
      >>> pre = adam.preconditioner(state)
      >>> step = pre.step * pre.mu["w"] / (jnp.sqrt(pre.nu["w"]) + pre.eps)  # == Adam's output
      >>> [round(float(x), 4) for x in step]
      [1.0, 1.0]
    """

    mu: Any
    nu: Any
    step: jax.Array
    eps: jax.Array
    unbiased_step: jax.Array
    step_scale: jax.Array


class GWTBase(NamedTuple):
    """An Optax transformation that GWT's stages know more of: its `Preconditioner`.

    ``init`` and ``update`` are an ordinary `optax.GradientTransformation`.
    `on_approximation` reads ``preconditioner(new_state)`` after each step
    (its step must equal the `Preconditioner`'s formula, so that
    `wavelet_inverse` may rebuild it from the moments fused with the inverse
    transform), and calls ``update_on_approximation(updates, state,
    haar_signals)`` instead of ``update``: the same step, given per leaf the
    full gradient of a Haar closed-form approximation as ``(G, axis, B)`` (or
    None), from which a compiled kernel may compute the moments in one read;
    it returns ``(updates, state, sq_norms)``, with per leaf the squared norm
    of the step divided by its ``step_scale`` (the norm-growth limiter's
    input; the kernel computes it in the same read), or None. A base with
    ``block_energy`` True reads each block's energy from the gradients: it
    gets them for every Haar closed-form leaf, in the compute dtype, and
    `on_approximation` refuses transforms that have none (other wavelets).

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> adam = optax_gwt.scale_by_reference_adam()
      >>> isinstance(adam, optax_gwt.GWTBase)
      True
      >>> out, state, sq_norms = adam.update_on_approximation({"w": jnp.ones(4)}, adam.init({"w": jnp.zeros(4)}), None)
      >>> round(float(sq_norms["w"]), 2)  # ||m / (sqrt(v) + eps)||^2 = 4 * (0.1 / 0.0316)^2
      40.0
    """

    init: optax.TransformInitFn
    update: optax.TransformUpdateExtraArgsFn
    preconditioner: Callable[[optax.OptState], Preconditioner | None]
    update_on_approximation: Callable[[Any, optax.OptState, Any], tuple[Any, optax.OptState, Any]]
    block_energy: bool = False


def _scalar_dtype(tree: Any) -> np.dtype:
    """float32, or float64 if the arrays of `tree` hold it."""
    dtype = np.dtype(np.float32)
    for leaf in jax.tree_util.tree_leaves(tree):
        if jnp.issubdtype(jnp.dtype(leaf.dtype), jnp.inexact):
            dtype = jnp.promote_types(dtype, jnp.finfo(leaf.dtype).dtype)
    return dtype


def _adam_state(state: Any) -> optax.ScaleByAdamState | None:
    """The one `optax.ScaleByAdamState` in a (nested) optimizer state, or None."""
    found = [
        s
        for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    if len(found) > 1:
        raise ValueError(
            f"adam_preconditioner: the base state holds {len(found)} Adam states; pass preconditioner= explicitly"
        )
    return found[0] if found else None


def adam_preconditioner(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, reference: bool = False, bias_correction: bool = True
) -> Callable[[optax.OptState], Preconditioner | None]:
    """The `Preconditioner` of an Adam base, read from its `optax.ScaleByAdamState`.

    With ``t`` the state's count, ``bc1 = 1 - b1^t`` and ``bc2 = 1 - b2^t``
    (both 1 without `bias_correction`), both forms of Adam's step are
    ``sqrt(bc2) / bc1 * mu / (sqrt(nu) + e)``:

    * `optax.scale_by_adam` (``reference=False``), ``mu_hat / (sqrt(nu_hat) + eps)``:
      ``e = eps * sqrt(bc2)``, ``step_scale = 1``;
    * `scale_by_reference_adam` (``reference=True``): ``e = eps``,
      ``step_scale = sqrt(bc2) / bc1`` (the reference's limiter sees the
      uncorrected step).

    Pass the base's own `b1`, `b2`, `eps`. A state without an Adam state gives
    None (then ``"auto"`` picks the ``"norm_ratio"`` rule).

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> read = optax_gwt.adam_preconditioner(eps=1e-6)
      >>> adam = optax.scale_by_adam(eps=1e-6)
      >>> _, state = adam.update({"w": jnp.ones(2)}, adam.init({"w": jnp.zeros(2)}))
      >>> [round(float(x), 4) for x in read(state).nu["w"]]
      [0.001, 0.001]
    """

    def read(state: optax.OptState) -> Preconditioner | None:
        adam = _adam_state(state)
        if adam is None:
            return None
        dt = _scalar_dtype(adam.nu)
        t = jnp.asarray(adam.count).astype(dt)
        one = jnp.ones([], dt)
        bc1 = 1 - jnp.asarray(b1, dt) ** t if bias_correction else one
        root_bc2 = jnp.sqrt(1 - jnp.asarray(b2, dt) ** t) if bias_correction else one
        step = root_bc2 / bc1
        e = jnp.asarray(eps, dt) * (one if reference else root_bc2)
        return Preconditioner(adam.mu, adam.nu, step, e, root_bc2, step if reference else one)

    return read


def _moment(g: jax.Array, prev: jax.Array, decay: float, order: int) -> jax.Array:
    """``decay * prev + (1 - decay) * g^order``, in float32 at least."""
    dt = jnp.promote_types(jnp.promote_types(g.dtype, jnp.float32), jnp.promote_types(prev.dtype, jnp.float32))
    g = g.astype(dt)
    return (1 - decay) * (g if order == 1 else jnp.square(g)) + decay * prev.astype(dt)


def _xla_moments(g, m, v, signal, b1, b2, eps, *, energy: bool, fast_path: str | FastPath = "auto"):
    """``(m, v, ||m / (sqrt(v) + eps)||^2)`` of one leaf, the moments in their state dtypes
    and the limiter's input computed from them."""
    if energy and signal is not None:
        gradient, axis, block = signal
        v = _moment(haar.block_sums(jnp.square(gradient), axis, block, fast_path), v, b2, 1).astype(v.dtype)
    else:
        v = _moment(g, v, b2, 2).astype(v.dtype)
    m = _moment(g, m, b1, 1).astype(m.dtype)
    return m, v, jnp.sum(jnp.square(_adam_step(m, v, eps)))


def _adam_step(m: jax.Array, v: jax.Array, eps: float) -> jax.Array:
    """``m / (sqrt(v) + eps)`` from the moments as stored, in float32 at least."""
    dt = jnp.promote_types(jnp.promote_types(m.dtype, v.dtype), jnp.float32)
    return m.astype(dt) / (jnp.sqrt(v.astype(dt)) + eps)


def scale_by_reference_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    mu_dtype: Any | None = None,
    bias_correction: bool = True,
    nu_dtype: Any | None = None,
    second_moment: str = "approx",
    fast_path: str | FastPath = "auto",
) -> GWTBase:
    """Adam in the form of the GWT reference (Hugging Face's AdamW).

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` and the output is
    ``c_t * m / (sqrt(v) + eps)`` with ``c_t = sqrt(1 - b2^t) / (1 - b1^t)``
    (``c_t = 1`` when `bias_correction` is False). It differs from
    `optax.scale_by_adam` only in where eps enters: here it is added to the
    uncorrected ``sqrt(v)`` (Kingma & Ba's "efficient" ordering). The state is
    `optax.ScaleByAdamState`: ``mu`` in `mu_dtype`, ``nu`` in `nu_dtype` (None:
    the params' dtype). The moments are computed in float32 at least and
    rounded to their dtypes; the output is computed from the moments as
    stored (as the authors' PyTorch optimizer does with bfloat16 state; with
    float32 moments nothing is rounded), in float32 at least, then cast to the
    updates' dtype. So the step always equals its `Preconditioner`'s formula.

    Args:
      b1, b2, eps, bias_correction: Adam's constants, as above.
      mu_dtype, nu_dtype: the moments' dtypes.
      second_moment: what ``v`` averages for a Haar approximation, as GWT's
        base. ``"approx"`` (GWT's reference): the square of the coefficient,
        ``a^2``. ``"energy"`` (FOAM's, Wen et al., arXiv 2512.07112): the
        block's energy ``sum(g^2)`` over its ``B`` entries, which by
        Parseval is ``a^2`` plus the squares of the block's detail
        coefficients, so ``v`` sees the high frequencies too (for the
        reference, the block mean of ``g^2``, in the approximation's units).
        Arrays that are not transformed get ``g^2`` either way.
      fast_path: the rows of op ``"moments"`` (and ``"block_sums"``) it may take as GWT's
        base (`optax_gwt.kernels`); ``FastPath(cpu_kernel=True)`` computes the moments of a
        Haar approximation from its full gradient with a compiled CPU kernel. In a chain
        built by hand, give it the `WaveletProjection`'s (the builders do).

    Returns:
      A `GWTBase` (an Optax transformation that states its `Preconditioner`).

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", arXiv 1412.6980.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> adam = optax_gwt.scale_by_reference_adam(eps=1e-6)
      >>> state = adam.init({"w": jnp.zeros(3)})
      >>> out, state = adam.update({"w": jnp.array([1.0, -2.0, 0.0])}, state)
      >>> [round(float(x), 3) for x in out["w"]]
      [1.0, -1.0, 0.0]
    """
    if second_moment not in SECOND_MOMENTS:
        raise ValueError(f"second_moment must be one of {SECOND_MOMENTS}, got {second_moment!r}")
    energy = second_moment == "energy"
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    nu_dtype = None if nu_dtype is None else jnp.dtype(nu_dtype)

    def init_fn(params):
        mu = optax.tree.zeros_like(params, dtype=mu_dtype)
        nu = optax.tree.zeros_like(params, dtype=nu_dtype)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def moments(g, m, v, signal):
        if signal is None:
            return _xla_moments(g, m, v, None, b1, b2, eps, energy=False)
        gradient, axis, block = signal
        case = Case("moments", gradient.shape, gradient.dtype, axis, block, state_dtype=m.dtype, energy=energy,
                    mixed_state=m.dtype != v.dtype, devices=jax.device_count())  # fmt: skip
        plain = functools.partial(_xla_moments, energy=energy, fast_path=fast_path)
        return switch(case, fast_path, plain, g, m, v, signal, b1, b2, eps)

    def step(updates, state, haar_signals):
        count = jnp.asarray(optax.safe_increment(state.count))
        leaves, treedef_ = jax.tree_util.tree_flatten(updates)  # None (an absent bias) is no leaf
        treedef: Any = treedef_  # Any: jaxlib ships no stubs for PyTreeDef
        signals = [None] * len(leaves) if haar_signals is None else treedef.flatten_up_to(haar_signals)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        new = [moments(*leaf) for leaf in zip(leaves, mus, nus, signals, strict=True)]
        mu, nu, sq_norms = (treedef.unflatten([x[i] for x in new]) for i in range(3))
        factor: float | jax.Array = 1.0
        if bias_correction:
            t = count.astype(_scalar_dtype(updates))
            factor = jnp.sqrt(1 - b2**t) / (1 - b1**t)
        out = jax.tree.map(lambda m, v, g: (factor * _adam_step(m, v, eps)).astype(g.dtype), mu, nu, updates)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu), sq_norms

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return step(updates, state, None)[:2]

    precond = adam_preconditioner(b1, b2, eps, reference=True, bias_correction=bias_correction)
    return GWTBase(init_fn, update_fn, precond, step, block_energy=energy)
