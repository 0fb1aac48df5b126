"""FOAM, the GWT authors' follow-up: the same chain of stages with two rules changed.

Wen et al., "FOAM: Blocked State Folding for Memory-Efficient LLM Training",
arXiv 2512.07112 (ICML 2026). Per matrix and block of ``B = 2^level``
entries along the transform axis, FOAM keeps Adam's moments at block size, as
GWT with Haar does, and changes two things:

1. the second moment averages the block's energy (the block mean of ``g^2``)
   instead of the square of its mean: `scale_by_reference_adam` with
   ``second_moment="energy"``;
2. every step, the residual ``R = g - mean`` (the details) is added to the
   repeated first moment and ``R^2`` to the repeated second moment before the
   division: `wavelet_inverse` with ``detail_rule="residual"``.

So `scale_by_foam` is `scale_by_gwt` with those two options and no limiter,
and `foam_adamw` is `gwt_adamw` with them: one chain of stages, each idea in
one place, and each idea also usable alone in a GWT chain.
"""

from __future__ import annotations

from typing import Any

import optax

from optax_gwt.kernels.rules import FastPath
from optax_gwt.projection import AxisSpec, BatchSpec, MaskSpec
from optax_gwt.transform import STATIC_ARGS, gwt_adamw, scale_by_gwt

__all__ = ["FOAM_STATIC_ARGS", "scale_by_foam", "foam_adamw"]

#: `STATIC_ARGS` for `foam_adamw` (whose wavelet and mode are fixed): pass them as
#: ``optax.inject_hyperparams(foam_adamw, static_args=FOAM_STATIC_ARGS)``.
FOAM_STATIC_ARGS = tuple(name for name in STATIC_ARGS if name not in ("wavelet", "mode"))


def scale_by_foam(
    *,
    level: int = 2,
    scale: float = 0.25,
    residual_scale: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    norm_growth_limit: float | None = None,
    axis: AxisSpec = 0,
    batch_axes: BatchSpec = 0,
    mask: MaskSpec = None,
    min_dim_size: int | None = None,
    mu_dtype: Any | None = None,
    nu_dtype: Any | None = None,
    fast_path: str | FastPath = "auto",
) -> optax.GradientTransformation:
    """FOAM's update direction as one transformation: the GWT chain with FOAM's rules.

    For each array of rank >= 2, with ``mean`` its block means along `axis`
    (the last block zero-padded), ``R = g - mean`` repeated in place, ``m``
    and ``v`` Adam's moments of ``mean`` and of the block mean of ``g^2``
    (state of ``1 / 2^level`` of the array), and ``c_t = sqrt(1 - b2^t) /
    (1 - b1^t)``::

        U = scale * c_t * (m + residual_scale * R)
            / (sqrt(v + residual_scale^2 * R^2) + eps)

    (``m`` and ``v`` repeated in place); other arrays get the same Adam at
    full size (``R = 0``). Computed as ``scale_by_gwt(level=level,
    wavelet="haar", mode="zero", second_moment="energy",
    detail_rule="residual", norm_growth_limit=None, ...)``, in the Haar
    approximation's units (``sqrt(B)`` times the block mean), which the
    division cancels.

    Args:
      level: ``B = 2^level`` entries per block (FOAM's fold level).
      scale: the factor of the transformed arrays' update (FOAM's ``scale``).
      residual_scale: FOAM's ``res_scale``.
      b1, b2, eps: Adam's constants (eps is added to ``sqrt(v + ...)`` in the
        gradient's units, as FOAM's).
      norm_growth_limit: None (FOAM) or gamma of GWT's limiter.
      axis, batch_axes, mask, min_dim_size: see `WaveletProjection` (axis 0 of a Flax
        kernel is the last axis of the PyTorch weight, FOAM's fold axis).
      mu_dtype, nu_dtype: the moments' dtypes.
      fast_path: see `scale_by_gwt`.

    Returns:
      An `optax.GradientTransformation`, the state of `scale_by_gwt`'s chain.

    References:
      Wen et al., "FOAM: Blocked State Folding for Memory-Efficient LLM
      Training", arXiv 2512.07112.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> tx = optax_gwt.scale_by_foam(level=2)
      >>> state = tx.init({"w": jnp.zeros((8, 3))})
      >>> u, state = tx.update({"w": jnp.ones((8, 3))}, state)
      >>> u["w"].shape, state[1].inner_state.nu["w"].shape
      ((8, 3), (2, 3))
    """
    return scale_by_gwt(
        None,
        level=level,
        wavelet="haar",
        mode="zero",
        scale=scale,
        norm_growth_limit=norm_growth_limit,
        detail_rule="residual",
        b1=b1,
        b2=b2,
        eps=eps,
        second_moment="energy",
        residual_scale=residual_scale,
        axis=axis,
        batch_axes=batch_axes,
        mask=mask,
        min_dim_size=min_dim_size,
        mu_dtype=mu_dtype,
        nu_dtype=nu_dtype,
        fast_path=fast_path,
    )


def foam_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: MaskSpec = None,
    *,
    level: int = 2,
    scale: float = 0.25,
    residual_scale: float = 1.0,
    norm_growth_limit: float | None = None,
    axis: AxisSpec = 0,
    batch_axes: BatchSpec = 0,
    wavelet_mask: MaskSpec = None,
    min_dim_size: int | None = None,
    mu_dtype: Any | None = None,
    nu_dtype: Any | None = None,
    fast_path: str | FastPath = "auto",
) -> optax.GradientTransformation:
    """FOAM-AdamW, the optimizer of the FOAM paper (the authors' ``FOAM``).

    ``p <- (p - lr_t * U) * (1 - lr_t * weight_decay)`` with ``U`` the
    output of `scale_by_foam`: `gwt_adamw` with FOAM's second moment and
    residual rule and no limiter. The defaults are those of the authors'
    optimizer class (betas 0.9 and 0.999, eps 1e-8, ``res_scale`` 1) and of
    their training scripts (level 2, scale 0.25; the scripts also set
    beta2 0.95 and lr 1e-2). Under ``optax.inject_hyperparams`` pass
    ``static_args=optax_gwt.FOAM_STATIC_ARGS``.

    Args:
      learning_rate: a float or an Optax schedule.
      b1, b2, eps, weight_decay, mask: as `gwt_adamw`'s.
      level, scale, residual_scale, norm_growth_limit: see `scale_by_foam`.
      axis, batch_axes, min_dim_size, mu_dtype, nu_dtype, fast_path: see `scale_by_foam`.
      wavelet_mask: which params may be folded (`scale_by_foam`'s mask).

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> tx = optax_gwt.foam_adamw(1e-2, weight_decay=0.1)
      >>> params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
      >>> u, state = tx.update({"w": jnp.ones((8, 4)), "b": jnp.ones(4)}, tx.init(params), params)
      >>> optax.apply_updates(params, u)["w"].shape
      (8, 4)
    """
    return gwt_adamw(
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        mask,
        level=level,
        wavelet="haar",
        mode="zero",
        scale=scale,
        norm_growth_limit=norm_growth_limit,
        detail_rule="residual",
        second_moment="energy",
        residual_scale=residual_scale,
        axis=axis,
        batch_axes=batch_axes,
        wavelet_mask=wavelet_mask,
        min_dim_size=min_dim_size,
        mu_dtype=mu_dtype,
        nu_dtype=nu_dtype,
        fast_path=fast_path,
    )
