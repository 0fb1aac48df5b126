"""GWT: the Gradient Wavelet Transform as Optax gradient transformations.

Wen et al., "Breaking Memory Limits: Gradient Wavelet Transform Enhances LLMs
Training", arXiv 2501.07237. For a transformed matrix with gradient ``G`` (length
``n`` along the transform axis) at step ``t``:

1. ``[A, D_l, ..., D_1] = wavedec(G, wavelet, level, mode)`` along the axis;
2. the base optimizer runs on ``A`` only (with Adam: ``m``, ``v`` have A's shape,
   ``denom = sqrt(v) + eps``, ``N = m / denom``);
3. a norm-growth limiter ``lam = max(||N|| / (r_prev + 1e-8), gamma) / gamma``
   (``lam = 1`` on step 1), ``N <- N / lam``, ``r_prev <- ||N||``;
4. the details are rescaled (rule ``"adam"``: each divided by the denominator of
   its approximation coefficient and by ``lam``, coarsest first, the
   denominator repeated in place twice per level);
5. ``U = scale * waverec([N, D_l, ..., D_1])[:n]``;
6. with the built-in Adam the whole update is multiplied by
   ``sqrt(1 - b2^t) / (1 - b1^t)``.

The optimizer state of a transformed matrix has ``1 / 2^level`` of its size
along the axis. For Haar, steps 1-5 collapse to a closed form on blocks of
``B = 2^level`` samples: with ``mu`` the block means (zero-padded),
``U = scale * ((G - mu) * w + N / sqrt(B))`` where ``w`` is the per-block detail
factor of step 4 and everything is broadcast over its block; that form is used
whenever it is exact (zero mode, or ``B`` divides ``n``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_gwt import cpu_kernel as _cpu_kernel
from optax_gwt import kernels, wavelets

__all__ = [
    "DETAIL_RULES",
    "STATIC_ARGS",
    "GWTState",
    "WaveletProjection",
    "Projected",
    "wavelet_project",
    "wavelet_inverse",
    "scale_by_gwt",
    "scale_by_reference_adam",
    "gwt_adamw",
    "decay_weights_after_step",
    "DecayAfterStepState",
]

DETAIL_RULES = ("auto", "adam", "norm_ratio", "zero")
#: Arguments of `gwt_adamw` / `scale_by_gwt` that fix shapes or dtypes, or may
#: be callables that are not schedules (dtypes such as ``jnp.bfloat16`` are
#: callable): pass them as
#: ``optax.inject_hyperparams(gwt_adamw, static_args=STATIC_ARGS)``.
STATIC_ARGS = ("level", "axis", "min_dim_size", "wavelet", "mode", "mu_dtype", "nu_dtype", "mask", "wavelet_mask")

AxisSpec = Union[None, int, Callable[[tuple, jax.Array], Optional[int]], Any]
MaskSpec = Union[None, Any, Callable[[Any], Any]]


# ---------------------------------------------------------------------------
# Which parameters are transformed, along which axis.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _LeafSpec:
    """How one array is transformed: static, hashable."""

    path: str
    axis: int
    length: int
    level: int
    wavelet: str
    mode: str

    @property
    def block(self) -> int:
        return 2**self.level

    @property
    def closed_form(self) -> bool:
        """Haar with no boundary effect: the block formula is exact."""
        return self.wavelet == "haar" and (self.mode == "zero" or self.length % self.block == 0)

    def approx_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        n = wavelets.coeff_lengths(self.length, self.wavelet, self.level, self.mode)[0]
        return tuple(shape[: self.axis]) + (n,) + tuple(shape[self.axis + 1 :])


def _is_array_like(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


@dataclasses.dataclass(frozen=True)
class WaveletProjection:
    """Which arrays of a pytree are wavelet-transformed, and how.

    Attributes:
      level: number of DWT levels (>= 1); the optimizer state of a transformed
        array keeps ``1 / 2^level`` of it along the axis.
      wavelet: PyWavelets name: ``"haar"``, ``"dbN"``, ``"symN"``, ``"coifN"``.
      mode: boundary mode (see `optax_gwt.wavelets.MODES`).
      axis: the transform axis. An int applies to every array of rank >= 2
        (default 0: the input axis of a Flax kernel, ``(in, out)``, which is
        the axis the authors transform in PyTorch's ``(out, in)`` layout, and on
        CPU the fast one since a block is made of whole rows). Or a pytree
        (prefix) of ints / None matching the params, or a callable
        ``(path, array) -> int | None``; None leaves the array untransformed.
      mask: optional pytree of bools (or callable params -> pytree) choosing the
        arrays that may be transformed, on top of `axis`.
      min_dim_size: arrays shorter than this along the axis are left to the base
        optimizer at full size. None (default): every selected array is
        transformed, and an axis too short for `level` is an error (too short:
        fewer than ``2^level`` samples, or an approximation that would not be
        shorter than the axis, as happens with long filters on short axes).
    """

    level: int = 2
    wavelet: str = "haar"
    mode: str = "zero"
    axis: AxisSpec = 0
    mask: MaskSpec = None
    min_dim_size: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.level, bool) or not isinstance(self.level, (int, np.integer)):
            raise TypeError(
                f"level must be a static Python int, got {self.level!r}; with "
                "optax.inject_hyperparams pass static_args=optax_gwt.STATIC_ARGS"
            )
        if self.level < 1:
            raise ValueError(f"level must be >= 1, got {self.level}")
        object.__setattr__(self, "wavelet", wavelets.get_wavelet(self.wavelet).name)
        wavelets._check_mode(self.mode)
        if self.min_dim_size is not None and not isinstance(self.min_dim_size, (int, np.integer)):
            raise TypeError(f"min_dim_size must be a static int or None, got {self.min_dim_size!r}")

    def leaf_specs(self, tree: Any) -> tuple[list[Optional[_LeafSpec]], Any]:
        """Per leaf of `tree` (flattened order), its `_LeafSpec` or None; and the treedef.

        Raises:
          ValueError / TypeError naming the leaf's path for an axis out of range,
          a level too deep for the axis, or a dtype that cannot be optimized.
        """
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
        axes = self._axes(tree, leaves_with_path, treedef)
        selected = self._mask(tree, treedef)
        specs = []
        for (path, leaf), axis, sel in zip(leaves_with_path, axes, selected):
            name = jax.tree_util.keystr(path)
            if not _is_array_like(leaf):
                raise TypeError(f"{name}: expected an array, got {type(leaf).__name__}")
            dtype = jnp.dtype(leaf.dtype)
            if not jnp.issubdtype(dtype, jnp.inexact):
                raise TypeError(f"{name}: GWT optimizes floating-point arrays only, got dtype {dtype}")
            if axis is None or not sel or leaf.ndim == 0:
                specs.append(None)
                continue
            if jnp.issubdtype(dtype, jnp.complexfloating):
                raise TypeError(f"{name}: complex arrays cannot be wavelet-transformed (dtype {dtype})")
            if not isinstance(axis, (int, np.integer)) or not -leaf.ndim <= axis < leaf.ndim:
                raise ValueError(f"{name}: transform axis {axis!r} is out of range for shape {tuple(leaf.shape)}")
            axis = int(axis) % leaf.ndim
            n = int(leaf.shape[axis])
            if self.min_dim_size is not None and n < self.min_dim_size:
                specs.append(None)
                continue
            if not _level_fits(n, self.level, self.wavelet, self.mode):
                deepest = max([l for l in range(1, self.level) if _level_fits(n, l, self.wavelet, self.mode)], default=0)
                raise ValueError(
                    f"{name}: level {self.level} is too deep for length {n} along axis {axis} with "
                    f"wavelet {self.wavelet!r} (at most {deepest}); lower the level, or leave such "
                    "arrays to the base optimizer with min_dim_size, mask or axis."
                )
            specs.append(_LeafSpec(name, axis, n, self.level, self.wavelet, self.mode))
        return specs, treedef

    def _axes(self, tree, leaves_with_path, treedef) -> list:
        if self.axis is None or isinstance(self.axis, (int, np.integer)):
            return [None if self.axis is None or getattr(l, "ndim", 0) < 2 else self.axis for _, l in leaves_with_path]
        if callable(self.axis):
            return [self.axis(p, l) for p, l in leaves_with_path]
        return _broadcast_prefix(self.axis, tree, treedef, "axis")

    def _mask(self, tree, treedef) -> list:
        if self.mask is None:
            return [True] * treedef.num_leaves
        mask = self.mask(tree) if callable(self.mask) else self.mask
        return [bool(m) for m in _broadcast_prefix(mask, tree, treedef, "mask")]


def _level_fits(n: int, level: int, wavelet: str, mode: str) -> bool:
    """A level fits a length when each level halves at least one sample and the state shrinks."""
    return n >= 2**level and wavelets.coeff_lengths(n, wavelet, level, mode)[0] < n


def _broadcast_prefix(prefix, tree, treedef, what: str) -> list:
    """The value of `prefix` (None included) that covers each leaf of `tree`, in flattened order."""
    try:
        return treedef.flatten_up_to(jax.tree.broadcast(prefix, tree, is_leaf=lambda x: x is None))
    except ValueError as e:
        raise ValueError(f"{what} must be a pytree prefix of the params: {e}") from None


# ---------------------------------------------------------------------------
# The two stages: projection to the approximation, and back.
# ---------------------------------------------------------------------------


class Projected(NamedTuple):
    """A pytree split by `wavelet_project`.

    Attributes:
      approx: same structure as the input; a transformed leaf is replaced by its
        approximation coefficients ``cA_level`` (shape `approx_shape`), the
        others are kept whole.
      details: same structure; a transformed leaf becomes the tuple
        ``(cD_level, ..., cD_1)`` in PyWavelets' order, the others ``()``.
    """

    approx: Any
    details: Any


def wavelet_project(tree: Any, projection: WaveletProjection = WaveletProjection()) -> Projected:
    """Stage 1 of GWT: the multi-level DWT of each selected array along its axis.

    Args:
      tree: a pytree of arrays (gradients or updates).
      projection: which arrays are transformed, and how.

    Returns:
      A `Projected` with the approximation and detail coefficients.
    """
    specs, treedef = projection.leaf_specs(tree)
    approx, details = [], []
    for leaf, spec in zip(treedef.flatten_up_to(tree), specs):
        if spec is None:
            approx.append(leaf)
            details.append(())
            continue
        coeffs = wavelets.wavedec(leaf, spec.wavelet, spec.mode, spec.level, spec.axis)
        approx.append(coeffs[0])
        details.append(tuple(coeffs[1:]))
    return Projected(treedef.unflatten(approx), treedef.unflatten(details))


def wavelet_inverse(projected: Projected, like: Any, projection: WaveletProjection = WaveletProjection()) -> Any:
    """Stage 3 of GWT: the inverse DWT of `wavelet_project`'s output, cut to size.

    Args:
      projected: approximation and details, as `wavelet_project` returns them
        (possibly changed by an optimizer in between).
      like: the pytree that was projected, or its shapes
        (`jax.ShapeDtypeStruct`), to know each array's length along the axis.
      projection: the same projection as for `wavelet_project`.

    Returns:
      A pytree with the structure and shapes of `like`.
    """
    specs, treedef = projection.leaf_specs(like)
    approx = treedef.flatten_up_to(projected.approx)
    details = treedef.flatten_up_to(projected.details)
    out = []
    for a, d, spec in zip(approx, details, specs):
        if spec is None:
            out.append(a)
            continue
        full = wavelets.waverec([a, *d], spec.wavelet, spec.mode, spec.axis)
        out.append(jax.lax.slice_in_dim(full, 0, spec.length, axis=spec.axis))
    return treedef.unflatten(out)


# ---------------------------------------------------------------------------
# Per-leaf kernels of the combinator.
# ---------------------------------------------------------------------------


def _compute_dtype(dtype) -> np.dtype:
    """float32 for half-precision arrays (bfloat16, float16), else the dtype itself."""
    return jnp.promote_types(dtype, jnp.float32)


def _project_leaf(g: jax.Array, spec: _LeafSpec) -> tuple[jax.Array, Any]:
    """``(cA, rest)``: rest is the details tuple, or ``(g, cA)`` in closed form.

    Computed in `_compute_dtype` (float32 for half-precision gradients).
    """
    g = g.astype(_compute_dtype(g.dtype))
    if spec.closed_form:
        approx = kernels.block_sums(g, spec.axis, spec.block) * jnp.asarray(1 / math.sqrt(spec.block), g.dtype)
        return approx, (g, approx)
    coeffs = wavelets.wavedec(g, spec.wavelet, spec.mode, spec.level, spec.axis)
    return coeffs[0], tuple(coeffs[1:])


def _inverse_leaf(
    approx_update: jax.Array,
    rest: Any,
    weight: Optional[jax.Array],
    spec: _LeafSpec,
    dtype,
    clip: Optional[float] = None,
) -> jax.Array:
    """``waverec([approx_update, D_l * w, ..., D_1 * w])[:n]``, w repeated in place per level.

    `weight` is per approximation coefficient (A's shape), a scalar, or None
    (details dropped). With `clip`, the details' part of the result,
    ``waverec([0, D_l * w, ..., D_1 * w])``, is clipped to ``[-clip, clip]``.
    """
    axis = spec.axis
    if clip is not None and weight is not None:
        low = _inverse_leaf(approx_update, rest, None, spec, dtype)
        high = _inverse_leaf(jnp.zeros_like(approx_update, dtype), rest, weight, spec, dtype)
        return low + jnp.clip(high, -clip, clip)
    if spec.closed_form:
        # (G - mean) * w + N / sqrt(B) = G * w + (N - A * w) / sqrt(B), per block:
        # one full-size multiply-add of G with two per-block values.
        g, approx = rest
        s = jnp.asarray(1 / math.sqrt(spec.block), dtype)
        n_upd = approx_update.astype(dtype)
        if weight is None:
            return kernels.repeat_blocks(n_upd * s, axis, spec.block, spec.length)
        w = weight.astype(dtype)
        offset = (n_upd - approx * w) * s
        if jnp.ndim(w) != 0:
            w = kernels.repeat_blocks(w, axis, spec.block, spec.length)
        return g * w + kernels.repeat_blocks(offset, axis, spec.block, spec.length)
    coeffs = [approx_update.astype(dtype)]
    if weight is None:
        # Zeros, not None: waverec trims each level to the next details' length.
        coeffs += [jnp.zeros_like(d, dtype) for d in rest]
    elif jnp.ndim(weight) == 0:
        coeffs += [d * weight.astype(dtype) for d in rest]
    else:
        w = weight.astype(dtype)
        for d in rest:
            coeffs.append(d * jax.lax.slice_in_dim(w, 0, d.shape[axis], axis=axis))
            w = jnp.repeat(w, 2, axis=axis)
    full = wavelets.waverec(coeffs, spec.wavelet, spec.mode, axis)
    return jax.lax.slice_in_dim(full, 0, spec.length, axis=axis)


def _scalar_dtype(tree: Any) -> np.dtype:
    """The real dtype of the optimizer's scalars: float32, or float64 if the arrays hold it."""
    dtype = np.dtype(np.float32)
    for leaf in jax.tree_util.tree_leaves(tree):
        leaf_dtype = jnp.dtype(leaf.dtype)
        if jnp.issubdtype(leaf_dtype, jnp.inexact):
            dtype = jnp.promote_types(dtype, jnp.finfo(leaf_dtype).dtype)
    return dtype


def _sq_norm(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(_scalar_dtype(x))))


def _find_field(state: Any, field: str, treedef) -> Any:
    """The first `field` of a NamedTuple in a (nested) optimizer state whose tree matches `treedef`."""
    if isinstance(state, tuple) and hasattr(state, "_fields") and field in state._fields:
        value = getattr(state, field)
        if jax.tree_util.tree_structure(value) == treedef:
            return value
    if isinstance(state, (tuple, list)):
        children = state
    elif isinstance(state, dict):
        children = state.values()
    else:
        return None
    for child in children:
        found = _find_field(child, field, treedef)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------
# Transformations.
# ---------------------------------------------------------------------------


def scale_by_reference_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    mu_dtype: Optional[Any] = None,
    bias_correction: bool = True,
    nu_dtype: Optional[Any] = None,
) -> optax.GradientTransformation:
    """Adam in the form of the GWT reference (Hugging Face's AdamW).

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` and the output is
    ``c_t * m / (sqrt(v) + eps)`` with ``c_t = sqrt(1 - b2^t) / (1 - b1^t)``
    (``c_t = 1`` when `bias_correction` is False). It differs from
    `optax.scale_by_adam` only in where eps enters: here it is added to the
    uncorrected ``sqrt(v)`` (Kingma & Ba's "efficient" ordering). The state is
    `optax.ScaleByAdamState`: ``mu`` in `mu_dtype`, ``nu`` in `nu_dtype` (None:
    the params' dtype). The moments are updated and the output computed in
    float32 for half-precision inputs or moments, then cast: the output to the
    updates' dtype, the moments to their state dtype.
    """
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    nu_dtype = None if nu_dtype is None else jnp.dtype(nu_dtype)

    def init_fn(params):
        mu = optax.tree.zeros_like(params, dtype=mu_dtype)
        nu = optax.tree.zeros_like(params, dtype=nu_dtype)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def moment(g, prev, decay, order):
        dt = jnp.promote_types(_compute_dtype(g.dtype), _compute_dtype(prev.dtype))
        g = g.astype(dt)
        return (1 - decay) * (g if order == 1 else jnp.square(g)) + decay * prev.astype(dt)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        mu = jax.tree_util.tree_map(lambda g, m: moment(g, m, b1, 1), updates, state.mu)
        nu = jax.tree_util.tree_map(lambda g, v: moment(g, v, b2, 2), updates, state.nu)
        if bias_correction:
            dt = _scalar_dtype(updates)
            t = count.astype(dt)
            factor = jnp.sqrt(1 - jnp.asarray(b2, dt) ** t) / (1 - jnp.asarray(b1, dt) ** t)
        else:
            factor = 1.0
        out = jax.tree_util.tree_map(
            lambda m, v, g: (factor * m / (jnp.sqrt(v) + eps)).astype(g.dtype), mu, nu, updates
        )
        mu = jax.tree_util.tree_map(lambda m, old: m.astype(old.dtype), mu, state.mu)
        nu = jax.tree_util.tree_map(lambda v, old: v.astype(old.dtype), nu, state.nu)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


class GWTState(NamedTuple):
    """State of `scale_by_gwt`.

    Attributes:
      count: steps taken (int32 scalar).
      base_state: the base optimizer's state, built on the approximation
        coefficients (compressed shapes) of transformed arrays and on the
        other arrays at full size.
      norm_prev: per array, the scalar ``r_prev`` of the norm-growth limiter
        (float32, or float64 for float64 params) (unused, zero, for arrays that are not transformed).
    """

    count: jax.Array
    base_state: optax.OptState
    norm_prev: Any


def scale_by_gwt(
    base_optimizer: Optional[optax.GradientTransformation] = None,
    *,
    level: int = 2,
    wavelet: str = "haar",
    mode: str = "zero",
    scale: float = 0.25,
    norm_growth_limit: Optional[float] = 1.01,
    detail_rule: str = "auto",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    bias_correct_details: bool = True,
    detail_clip: Optional[float] = None,
    axis: AxisSpec = 0,
    mask: MaskSpec = None,
    min_dim_size: Optional[int] = None,
    mu_dtype: Optional[Any] = None,
    nu_dtype: Optional[Any] = None,
    cpu_kernel: bool = True,
) -> optax.GradientTransformation:
    """The chain wavelet_project -> base optimizer -> wavelet_inverse, as one transform.

    A plain `optax.chain` of three transforms cannot express GWT: its ``init``
    hands the full-size params to every stage (the base state would be full
    size), and the detail coefficients would have to be carried from the first
    stage to the last in the state. This combinator initialises the base on the
    approximation shapes and keeps the details as temporaries of one update.

    Args:
      base_optimizer: an Optax transformation, run on the approximation
        coefficients (and at full size on the arrays that are not transformed).
        If it reads params, it gets their approximation coefficients (enough
        for shapes and for Adafactor's parameter-scale RMS). None (default): the reference Adam
        (`scale_by_reference_adam` with `b1`, `b2`, `eps`, `mu_dtype`), whose
        bias correction ``sqrt(1 - b2^t) / (1 - b1^t)`` then multiplies the whole
        update (step 6 of the algorithm): with it this reproduces the authors'
        WaveAdamW exactly.
      level, wavelet, mode, axis, mask, min_dim_size: see `WaveletProjection`.
      scale: alpha, the factor of the transformed arrays' update.
      norm_growth_limit: gamma of the norm-growth limiter (None disables it).
      detail_rule: what the detail coefficients become: ``"adam"`` (divided by
        the Adam denominator of their approximation coefficient and by the
        limiter; needs a second moment ``nu`` in the base state), ``"norm_ratio"``
        (multiplied by ``||base output|| / ||A||``), ``"zero"`` (dropped: a pure
        low-pass update), or ``"auto"``: ``"adam"`` when the base state holds a
        ``nu`` of the approximation's shapes, else ``"norm_ratio"``.
      b1, b2, eps: Adam's constants: those of the built-in base, and with a
        given base and rule ``"adam"`` the ones used for the details'
        denominator ``sqrt(nu / (1 - b2^t)) + eps`` and bias correction
        ``1 / (1 - b1^t)``: set them to the base's (``b1 = b2 = 0`` for a base
        without bias correction, such as `optax.scale_by_rms`).
      bias_correct_details: False applies Adam's ``1 / (1 - b1^t)`` to the
        approximation's path only, not to the raw detail coefficients (the
        reference multiplies both, which amplifies the first steps' high
        frequencies by up to ``1 / (1 - b1)``). Only for rule ``"adam"``.
      detail_clip: None (default, the reference algorithm) or a bound: each
        element of the details' part of the update (before `scale`, in units
        of a bias-corrected Adam step, whose size is about 1 at most) is
        clipped to ``[-detail_clip, detail_clip]``. A safeguard for
        approximation coefficients near zero under large details: rule
        ``"adam"`` divides the details by ``sqrt(v) + eps``, up to ``|D| / eps``.
      mu_dtype, nu_dtype: dtypes of the built-in Adam's first and second
        moments (None: the params' dtype). ``jnp.bfloat16`` for both halves
        the state of float32 params.
      cpu_kernel: True (default): where it applies (the built-in Adam with
        rule ``"adam"``, the limiter on and no `detail_clip`, Haar in closed form, float32 or
        float64 gradients and moments, the CPU backend with one device), the
        moments and the limiter's norm come from the compiled kernel of
        `optax_gwt.cpu_kernel` (one read of the gradient instead of three), if
        it could be built. False: always the XLA path. Both compute the same
        values; the kernel is not differentiable (set False to differentiate
        through the update).

    Half-precision (bfloat16, float16) gradients are transformed, and the
    update computed, in float32; the base optimizer gets the approximation in
    the gradient's dtype, and every update has its gradient's dtype.

    Returns:
      An `optax.GradientTransformation` with state `GWTState`.
    """
    if detail_rule not in DETAIL_RULES:
        raise ValueError(f"detail_rule must be one of {DETAIL_RULES}, got {detail_rule!r}")
    projection = WaveletProjection(level, wavelet, mode, axis, mask, min_dim_size)
    reference = base_optimizer is None
    base = scale_by_reference_adam(b1, b2, eps, mu_dtype, bias_correction=False, nu_dtype=nu_dtype) if reference else base_optimizer

    def approx_tree(tree):
        specs, treedef = projection.leaf_specs(tree)
        shapes = [
            l if s is None else jax.ShapeDtypeStruct(s.approx_shape(l.shape), l.dtype)
            for l, s in zip(treedef.flatten_up_to(tree), specs)
        ]
        return specs, treedef, shapes

    def init_fn(params):
        specs, treedef, shapes = approx_tree(params)
        zeros = [l if s is None else jnp.zeros(a.shape, a.dtype) for l, s, a in zip(treedef.flatten_up_to(params), specs, shapes)]
        base_state = base.init(treedef.unflatten(zeros))
        norm_prev = treedef.unflatten([jnp.zeros([], _scalar_dtype(l)) for l in treedef.flatten_up_to(params)])
        return GWTState(count=jnp.zeros([], jnp.int32), base_state=base_state, norm_prev=norm_prev)

    def update_fn(updates, state, params=None):
        specs, treedef = projection.leaf_specs(updates)
        state_treedef = jax.tree_util.tree_structure(state.norm_prev)
        if treedef != state_treedef:
            raise ValueError(
                "scale_by_gwt: the updates do not match the optimizer state (initialised for another "
                f"params tree).\n  updates: {treedef}\n  state:   {state_treedef}"
            )
        grads = treedef.flatten_up_to(updates)
        count = optax.safe_increment(state.count)
        projected = [(g, None) if s is None else _project_leaf(kernels.gather_axis(g, s.axis), s) for g, s in zip(grads, specs)]
        base_in = treedef.unflatten(
            [kernels.reshard_like(p[0].astype(g.dtype), m) for p, g, m in zip(projected, grads, _base_moments(state.base_state, treedef))]
        )
        # A base that reads params (for their shapes, or an RMS as in Adafactor) sees
        # the params' approximation; XLA drops this when the base does not use it.
        base_params = None
        if params is not None and not reference:
            base_params = treedef.unflatten(
                [p if s is None else _project_leaf(p, s)[0].astype(p.dtype) for p, s in zip(treedef.flatten_up_to(params), specs)]
            )
        base_out, base_state = base.update(base_in, state.base_state, base_params)
        base_out = treedef.flatten_up_to(base_out)
        # Squared norms of the base outputs, for the limiter; the CPU kernel gives
        # its own with the moments, and XLA drops the XLA moments it replaces.
        # Without the limiter XLA alone is as fast: it needs no norm, and the
        # kernels lose the order the limiter's all-array step imposes (all kernels,
        # then all final passes), without which XLA CPU's executor starts final
        # passes beside kernels and leaves threads waiting (measured 0.94x
        # AdamW's step on LLaMA-60M's matrices, against 0.78x for XLA alone).
        sq_norms = [None if s is None else _sq_norm(u) for u, s in zip(base_out, specs)]
        if (
            reference and cpu_kernel and norm_growth_limit is not None
            and detail_rule in ("auto", "adam") and detail_clip is None
        ):
            base_state, sq_norms = _moments_on_cpu_kernel(
                specs, projected, grads, state.base_state, base_state, sq_norms, treedef, b1=b1, b2=b2, eps=eps
            )

        nu = _find_field(base_state, "nu", treedef)
        rule = detail_rule
        if rule == "auto":
            rule = "adam" if nu is not None and _shapes_match(nu, base_in) else "norm_ratio"
        if rule == "adam":
            if nu is None or not _shapes_match(nu, base_in):
                raise ValueError(
                    "detail_rule='adam' needs a second moment 'nu' with the approximation's shapes in the "
                    "base optimizer's state (as optax.scale_by_adam has); use 'norm_ratio' or 'zero'."
                )
            nu = treedef.flatten_up_to(nu)

        dt = _scalar_dtype(updates)
        t = count.astype(dt)
        bc1 = 1 - jnp.asarray(b1, dt) ** t
        bc2 = 1 - jnp.asarray(b2, dt) ** t
        one = jnp.ones([], dt)
        step_factor = jnp.sqrt(bc2) / bc1 if reference else one
        if reference:
            detail_factor = step_factor if bias_correct_details else jnp.sqrt(bc2)
        else:
            detail_factor = 1 / bc1 if bias_correct_details else one
        first = state.count == 0

        # Built-in Adam with Haar: the whole update in one fused full-size expression
        # of G and the new moments (`kernels.haar_adam_update`).
        fused_haar = reference and rule == "adam" and detail_clip is None
        mu = treedef.flatten_up_to(base_state.mu) if fused_haar else None
        lams, norm_prev = _limit_norm_growth(sq_norms, treedef.flatten_up_to(state.norm_prev), norm_growth_limit, first, dt)
        out = []
        for i, (g, spec, n_upd, lam) in enumerate(zip(grads, specs, base_out, lams)):
            if spec is None:
                out.append((n_upd * step_factor.astype(n_upd.dtype)) if reference else n_upd)
                continue
            approx, rest = projected[i]
            cdt = _compute_dtype(g.dtype)
            n_upd = n_upd.astype(cdt)
            if fused_haar and spec.closed_form and mu[i].dtype == approx.dtype:
                u = kernels.haar_adam_update(
                    rest[0], approx, mu[i], nu[i], axis=spec.axis, block=spec.block, eps=eps,
                    approx_factor=step_factor / lam, detail_factor=detail_factor / lam,
                )
            else:
                n_upd = n_upd * (step_factor / lam).astype(n_upd.dtype)
                if rule == "adam":
                    v = nu[i].astype(_scalar_dtype(nu[i]))
                    den = jnp.sqrt(v) + eps if reference else jnp.sqrt(v / bc2) + eps
                    weight = detail_factor / (den * lam)
                elif rule == "norm_ratio":
                    a_norm = jnp.sqrt(_sq_norm(approx))
                    u_norm = jnp.sqrt(_sq_norm(n_upd))
                    weight = jnp.where(a_norm > 0, u_norm / jnp.where(a_norm > 0, a_norm, 1.0), 0.0)
                else:
                    weight = None
                u = _inverse_leaf(n_upd, rest, weight, spec, cdt, detail_clip)
            out.append(kernels.reshard_like((u * jnp.asarray(scale, cdt)).astype(g.dtype), g))
        new_state = GWTState(count=count, base_state=base_state, norm_prev=treedef.unflatten(norm_prev))
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _moments_on_cpu_kernel(specs, projected, grads, old_state, base_state, sq_norms, treedef, *, b1, b2, eps):
    """`base_state` (the built-in Adam's, computed by XLA) and `sq_norms`, with
    the moments and squared norms of the arrays where
    `cpu_kernel.haar_adam_moments` applies replaced by the kernel's."""
    mus, nus = treedef.flatten_up_to(old_state.mu), treedef.flatten_up_to(old_state.nu)
    new_mu, new_nu = treedef.flatten_up_to(base_state.mu), treedef.flatten_up_to(base_state.nu)
    sq_norms = list(sq_norms)
    for i, spec in enumerate(specs):
        if spec is None or not spec.closed_form:
            continue
        g = projected[i][1][0]
        # (not for half-precision gradients, which the XLA path casts in its fusions)
        if g.dtype == grads[i].dtype and _cpu_kernel.applies(g, mus[i], nus[i]):
            new_mu[i], new_nu[i], sq_norms[i] = _cpu_kernel.haar_adam_moments(
                g, mus[i], nus[i], axis=spec.axis, block=spec.block, b1=b1, b2=b2, eps=eps
            )
    return base_state._replace(mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu)), sq_norms


def _limit_norm_growth(
    sq_norms: list, r_prev: list, gamma: Optional[float], first: jax.Array, dtype
) -> tuple[list, list]:
    """The norm-growth limiter of every transformed array at once.

    For each array ``k`` with the squared norm ``||N_k||^2`` of its
    approximation's update (None where not transformed):
    ``lam_k = max(||N_k|| / (r_prev_k + 1e-8), gamma) / gamma`` (1 on the first
    step) and the new ``r_prev_k = ||N_k|| / lam_k``. The scalar math runs on one
    stacked vector: XLA would otherwise compile each array's few scalar ops into
    kernels of their own, hundreds of launches per step for a LLaMA model.

    Returns:
      ``(lam, new_r_prev)``: per array, the factor (None where not transformed)
      and the new state scalar (the old one where not transformed).
    """
    index = [k for k, sq in enumerate(sq_norms) if sq is not None]
    lam = [None] * len(sq_norms)
    new_r = list(r_prev)
    if not index:
        return lam, new_r
    if gamma is None:
        return [None if sq is None else jnp.ones([], dtype) for sq in sq_norms], new_r
    r = jnp.sqrt(jnp.stack([sq_norms[k].astype(dtype) for k in index]))
    prev = jnp.stack([r_prev[k].astype(dtype) for k in index])
    factor = jnp.where(first, 1.0, jnp.maximum(r / (prev + 1e-8), gamma) / gamma).astype(dtype)
    stepped = r / factor
    for j, k in enumerate(index):
        lam[k] = factor[j]
        new_r[k] = stepped[j].astype(r_prev[k].dtype)
    return lam, new_r


def _base_moments(base_state: Any, treedef) -> list:
    """Per leaf, a moment of the base state (the approximation's shape and the
    sharding it should meet), or None where the base keeps none."""
    for field in ("mu", "nu"):
        found = _find_field(base_state, field, treedef)
        if found is not None:
            return treedef.flatten_up_to(found)
    return [None] * treedef.num_leaves


def _shapes_match(a: Any, b: Any) -> bool:
    return [jnp.shape(x) for x in jax.tree_util.tree_leaves(a)] == [jnp.shape(x) for x in jax.tree_util.tree_leaves(b)]


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
    norm_growth_limit: Optional[float] = 1.01,
    detail_rule: str = "auto",
    bias_correct_details: bool = True,
    detail_clip: Optional[float] = None,
    axis: AxisSpec = 0,
    wavelet_mask: MaskSpec = None,
    min_dim_size: Optional[int] = None,
    mu_dtype: Optional[Any] = None,
    nu_dtype: Optional[Any] = None,
    cpu_kernel: bool = True,
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
      level, wavelet, mode, scale, norm_growth_limit, detail_rule,
      bias_correct_details, detail_clip, axis, min_dim_size, mu_dtype, nu_dtype,
      cpu_kernel: see `scale_by_gwt`.
      wavelet_mask: which params may be transformed (`scale_by_gwt`'s mask).
    """
    stages = [
        scale_by_gwt(
            None,
            level=level,
            wavelet=wavelet,
            mode=mode,
            scale=scale,
            norm_growth_limit=norm_growth_limit,
            detail_rule=detail_rule,
            b1=b1,
            b2=b2,
            eps=eps,
            bias_correct_details=bias_correct_details,
            detail_clip=detail_clip,
            axis=axis,
            mask=wavelet_mask,
            min_dim_size=min_dim_size,
            mu_dtype=mu_dtype,
            nu_dtype=nu_dtype,
            cpu_kernel=cpu_kernel,
        )
    ]
    stages.append(optax.scale_by_learning_rate(learning_rate))
    if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
        decay = decay_weights_after_step(learning_rate, weight_decay)
        stages.append(decay if mask is None else optax.masked(decay, mask))
    return _in_gradient_dtype(optax.chain(*stages))


class DecayAfterStepState(NamedTuple):
    """State of `decay_weights_after_step`: the step count, for a schedule."""

    count: jax.Array


def decay_weights_after_step(
    learning_rate: optax.ScalarOrSchedule, weight_decay: float
) -> optax.GradientTransformation:
    """Decoupled weight decay applied to the stepped parameter, as PyTorch's AdamW does.

    Placed after the learning-rate scaling: for an incoming update ``u`` (the
    step ``p -> p + u``), returns ``u - lr_t * weight_decay * (p + u)``, so that
    ``p_new = (p + u) * (1 - lr_t * weight_decay)``. (`optax.add_decayed_weights`
    decays the parameter before the step instead; the two differ by
    ``lr_t^2 * weight_decay * |U|``.)
    """

    def init_fn(params):
        del params
        return DecayAfterStepState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("decay_weights_after_step needs the params: pass them to update().")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        out = jax.tree_util.tree_map(lambda u, p: u - lr * weight_decay * (p + u), updates, params)
        return out, DecayAfterStepState(count=optax.safe_increment(state.count))

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
