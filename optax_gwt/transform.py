"""GWT's builders: the chain of its stages, as the paper's optimizer.

`scale_by_gwt` is ``optax.chain(wavelet_project, on_approximation(base),
limit_norm_growth, wavelet_inverse)`` (`optax_gwt.stages`) with one set of
arguments; `gwt_adamw` adds the learning rate and the authors' decoupled
weight decay. Neither computes anything itself: every step of the algorithm
lives in one stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gwt.adam import GWTBase, adam_preconditioner, scale_by_reference_adam
from optax_gwt.kernels.rules import FastPath
from optax_gwt.projection import AxisSpec, BatchSpec, MaskSpec, WaveletProjection
from optax_gwt.stages import DETAIL_RULES, limit_norm_growth, on_approximation, wavelet_inverse, wavelet_project

__all__ = [
    "STATIC_ARGS",
    "scale_by_gwt",
    "gwt_adamw",
    "decay_weights_after_step",
    "DecayAfterStepState",
]

#: Arguments of `gwt_adamw` / `scale_by_gwt` that fix shapes or dtypes, or may
#: be callables that are not schedules (dtypes such as ``jnp.bfloat16`` are
#: callable): pass them as
#: ``optax.inject_hyperparams(gwt_adamw, static_args=STATIC_ARGS)``.
STATIC_ARGS = (
    "level",
    "axis",
    "batch_axes",
    "min_dim_size",
    "wavelet",
    "mode",
    "mu_dtype",
    "nu_dtype",
    "mask",
    "wavelet_mask",
    "fast_path",
)


def scale_by_gwt(
    base_optimizer: optax.GradientTransformation | None = None,
    *,
    level: int = 2,
    wavelet: str = "haar",
    mode: str = "zero",
    scale: float = 0.25,
    norm_growth_limit: float | None = 1.01,
    norm_growth_delayed: bool = False,
    detail_rule: str = "auto",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    bias_correct_details: bool = True,
    detail_clip: float | None = None,
    second_moment: str = "approx",
    residual_scale: float = 1.0,
    axis: AxisSpec = 0,
    batch_axes: BatchSpec = 0,
    mask: MaskSpec = None,
    min_dim_size: int | None = None,
    mu_dtype: Any | None = None,
    nu_dtype: Any | None = None,
    fast_path: str | FastPath = "auto",
) -> optax.GradientTransformation:
    """GWT as one transformation: the chain of its four stages.

    Returns ``optax.chain(wavelet_project(p), on_approximation(base, p),
    limit_norm_growth(norm_growth_limit, p), wavelet_inverse(scale,
    detail_rule, ...))`` with ``p = WaveletProjection(level, wavelet, mode,
    axis, mask, min_dim_size, batch_axes)``; the limiter is left out when
    `norm_growth_limit` is None.
    Its state is that chain's: a tuple of the four stages' states, the base's
    (compressed) state in ``state[1].inner_state``.

    Args:
      base_optimizer: an Optax transformation run on the approximation
        coefficients (and at full size on the arrays that are not
        transformed). None (default): `scale_by_reference_adam` with `b1`,
        `b2`, `eps`, `mu_dtype`, `nu_dtype`, whose bias correction
        ``sqrt(1 - b2^t) / (1 - b1^t)`` multiplies the whole update: the
        authors' WaveAdamW step exactly. A given base whose state holds an
        `optax.ScaleByAdamState` (`optax.scale_by_adam`) gets the ``"adam"``
        detail rule with ``adam_preconditioner(b1, b2, eps)``: pass it the
        base's own constants.
      level, wavelet, mode, axis, mask, min_dim_size, batch_axes: see `WaveletProjection`.
      scale, detail_rule, bias_correct_details, detail_clip, residual_scale: see `wavelet_inverse`.
      second_moment: the built-in Adam's (`scale_by_reference_adam`):
        ``"energy"`` is FOAM's second moment.
      norm_growth_limit: gamma of `limit_norm_growth` (None: no limiter).
      norm_growth_delayed: the limiter's ``delayed`` (not the paper's): each
        step divided by the factor of the step before, so that no full-size
        pass waits for its own step's norm (a reduction across devices under
        FSDP).
      b1, b2, eps, mu_dtype, nu_dtype: the built-in Adam's (see above).
      fast_path: which chip-specific formulations the step may take
        (`optax_gwt.kernels`): ``"auto"`` (default) the rows of the table for
        the platform the step is lowered for, all differentiable and computing
        the plain chain's values; ``"xla"`` the plain formulation everywhere; or an
        `optax_gwt.kernels.FastPath`. ``FastPath(cpu_kernel=True)`` adds the
        compiled CPU kernel for the built-in Adam's moments (with the limiter
        on, rule ``"adam"`` or ``"auto"`` and no `detail_clip`): it agrees with
        the XLA path to float rounding per step, and has no derivatives.

    Half-precision gradients are transformed, and the update computed, in
    float32; the base gets the approximation in the gradient's dtype, and
    every update has its gradient's dtype.

    References:
      Wen et al., "Breaking Memory Limits: Gradient Wavelet Transform Enhances
      LLMs Training", arXiv 2501.07237.

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> tx = optax_gwt.scale_by_gwt(optax.scale_by_lion(), level=1)
      >>> state = tx.init({"w": jnp.zeros((6, 4))})
      >>> u, state = tx.update({"w": jnp.ones((6, 4))}, state)
      >>> u["w"].shape, state[1].inner_state.mu["w"].shape
      ((6, 4), (3, 4))
    """
    fp = FastPath.of(fast_path)
    projection = WaveletProjection(level, wavelet, mode, axis, mask, min_dim_size, batch_axes, fast_path=fp)
    if detail_rule not in DETAIL_RULES:
        raise ValueError(f"detail_rule must be one of {DETAIL_RULES}, got {detail_rule!r}")
    base: optax.GradientTransformation | GWTBase
    if base_optimizer is None:
        kernel = norm_growth_limit is not None and detail_rule in ("auto", "adam") and detail_clip is None
        base_fp = fp if kernel else dataclasses.replace(fp, cpu_kernel=False)
        base = scale_by_reference_adam(
            b1, b2, eps, mu_dtype, nu_dtype=nu_dtype, second_moment=second_moment, fast_path=base_fp
        )
        preconditioner = None
    else:
        if second_moment != "approx":
            raise ValueError("second_moment chooses the built-in Adam's second moment: with a given base, leave it")
        base, preconditioner = base_optimizer, adam_preconditioner(b1, b2, eps)
    stages = [wavelet_project(projection), on_approximation(base, projection, preconditioner=preconditioner)]
    stages.append(
        limit_norm_growth(norm_growth_limit, projection, delayed=norm_growth_delayed)
        if norm_growth_limit is not None
        else optax.identity()
    )
    stages.append(
        wavelet_inverse(
            scale,
            detail_rule,
            bias_correct_details=bias_correct_details,
            detail_clip=detail_clip,
            residual_scale=residual_scale,
        )
    )
    return optax.chain(*stages)


def gwt_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask: MaskSpec = None,
    *,
    level: int = 2,
    wavelet: str = "haar",
    mode: str = "zero",
    scale: float = 0.25,
    norm_growth_limit: float | None = 1.01,
    norm_growth_delayed: bool = False,
    detail_rule: str = "auto",
    bias_correct_details: bool = True,
    detail_clip: float | None = None,
    second_moment: str = "approx",
    residual_scale: float = 1.0,
    axis: AxisSpec = 0,
    batch_axes: BatchSpec = 0,
    wavelet_mask: MaskSpec = None,
    min_dim_size: int | None = None,
    mu_dtype: Any | None = None,
    nu_dtype: Any | None = None,
    fast_path: str | FastPath = "auto",
) -> optax.GradientTransformation:
    """GWT-AdamW, the optimizer of the paper (the authors' WaveAdamW).

    ``p <- (p - lr_t * U) * (1 - lr_t * weight_decay)`` where ``U`` is
    `scale_by_gwt`'s output with the reference Adam (every array of rank >= 2
    transformed along `axis`, the rest plain Adam with the same bias-corrected
    step). Weight decay is decoupled and uses the full-size parameter after the
    step, exactly as the authors' PyTorch WaveAdamW (`decay_weights_after_step`;
    `optax.adamw` decays the parameter before the step, a difference of order
    ``lr^2``). Each update has its gradient's dtype, also
    under ``optax.inject_hyperparams`` (whose float32 hyperparameters would
    promote bfloat16 updates).

    Args:
      learning_rate: a float or an Optax schedule.
      b1, b2, eps: Adam's constants (eps is added to the uncorrected sqrt(v)).
      weight_decay: decoupled weight decay.
      mask: which params weight decay applies to (as in `optax.adamw`).
      level: DWT levels: the matrices' Adam state is ``1 / 2^level`` of AdamW's.
      scale: alpha, the factor of the transformed matrices' step (0.25 in the paper;
        the study's best was 0.125): tune the learning rate with it.
      axis: the axis of each matrix that is transformed (0: a Flax kernel's input axis).
      batch_axes: leading axes that stack matrices (1 for scanned layers ``(layers, in,
        out)``; `axis` then counts among each matrix's own axes), or a function of
        ``(path, array)`` giving a tuple of axes where the layers' axis is elsewhere
        (``(1,)`` for MaxText's ``(embed, layers, mlp)``).
      wavelet_mask: which params may be transformed (default: every array of rank 2 or
        more, embeddings and head included; the paper keeps those on AdamW).
      norm_growth_limit: Fira's limiter: the step's norm grows at most this factor per
        step (None: off).
      norm_growth_delayed: the limiter's factor applied a step late (not the paper's).
      wavelet, mode, min_dim_size, mu_dtype, nu_dtype, fast_path: as `scale_by_gwt`'s.
      detail_rule, bias_correct_details, detail_clip, second_moment, residual_scale: the
        details' options, as `scale_by_gwt` documents them.

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> tx = optax_gwt.gwt_adamw(1e-2, weight_decay=0.1)
      >>> params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
      >>> u, state = tx.update({"w": jnp.ones((8, 4)), "b": jnp.ones(4)}, tx.init(params), params)
      >>> optax.apply_updates(params, u)["w"].shape
      (8, 4)
    """
    stages = [
        scale_by_gwt(
            None,
            level=level,
            wavelet=wavelet,
            mode=mode,
            scale=scale,
            norm_growth_limit=norm_growth_limit,
            norm_growth_delayed=norm_growth_delayed,
            detail_rule=detail_rule,
            b1=b1,
            b2=b2,
            eps=eps,
            bias_correct_details=bias_correct_details,
            detail_clip=detail_clip,
            second_moment=second_moment,
            residual_scale=residual_scale,
            axis=axis,
            batch_axes=batch_axes,
            mask=wavelet_mask,
            min_dim_size=min_dim_size,
            mu_dtype=mu_dtype,
            nu_dtype=nu_dtype,
            fast_path=fast_path,
        )
    ]
    stages.append(optax.scale_by_learning_rate(learning_rate))
    if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
        decay = decay_weights_after_step(learning_rate, weight_decay)
        stages.append(decay if mask is None else optax.masked(decay, mask))
    return _in_gradient_dtype(optax.chain(*stages))


class DecayAfterStepState(NamedTuple):
    """State of `decay_weights_after_step`: the step count, for a schedule.

    Example:
      >>> import optax_gwt
      >>> int(optax_gwt.decay_weights_after_step(1e-3, 0.1).init(None).count)
      0
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states


def decay_weights_after_step(
    learning_rate: optax.ScalarOrSchedule, weight_decay: float
) -> optax.GradientTransformation:
    """Decoupled weight decay applied to the stepped parameter, as PyTorch's AdamW does.

    Placed after the learning-rate scaling: for an incoming update ``u`` (the
    step ``p -> p + u``), returns ``u - lr_t * weight_decay * (p + u)``, so that
    ``p_new = (p + u) * (1 - lr_t * weight_decay)``. (`optax.add_decayed_weights`
    decays the parameter before the step instead; the two differ by
    ``lr_t^2 * weight_decay * |U|``.)

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> tx = optax.chain(optax.scale(-0.5), optax_gwt.decay_weights_after_step(0.1, 1.0))
      >>> params = {"w": jnp.array([2.0])}
      >>> u, _ = tx.update({"w": jnp.array([1.0])}, tx.init(params), params)
      >>> optax.apply_updates(params, u)["w"]  # (2 - 0.5) * (1 - 0.1)
      Array([1.35], dtype=float32)
    """

    def init_fn(params):
        del params
        return DecayAfterStepState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("decay_weights_after_step needs the params: pass them to update().")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        out = jax.tree_util.tree_map(lambda u, p: u - lr * weight_decay * (p + u), updates, params)
        return out, DecayAfterStepState(count=jnp.asarray(optax.safe_increment(state.count)))

    return optax.GradientTransformation(init_fn, update_fn)


def _in_gradient_dtype(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner` with each update cast to its gradient's dtype.

    Hyperparameters held as float32 arrays (``optax.inject_hyperparams``) would
    otherwise promote half-precision updates to float32.
    """

    def update_fn(updates, state, params=None, **extra_args):
        out, state = inner.update(updates, state, params, **extra_args)
        return jax.tree_util.tree_map(lambda u, g: u.astype(g.dtype), out, updates), state

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)
