"""Which arrays GWT transforms, the coefficients it carries, and the per-array DWT.

`WaveletProjection` says which arrays of a pytree are wavelet-transformed and
how (`LeafSpec` per array). Between the stages `wavelet_project` and
`wavelet_inverse` of a GWT chain, each transformed array travels as a
`WaveletCoefficients` node: its approximation (the part the base optimizer
sees), its details, and what the stages in between learn about it.
`project_leaf` and `inverse_leaf` are the per-array DWT and inverse DWT; for
Haar without boundary effects they use the closed form of `optax_gwt.haar`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from optax_gwt import haar, sharding as sharding_lib, wavelets
from optax_gwt.kernels.rules import FastPath

__all__ = ["LeafSpec", "WaveletProjection", "WaveletCoefficients", "AdamTerms", "project_leaf", "inverse_leaf"]

AxisSpec = None | int | Callable[[tuple, jax.Array], int | None] | Any
BatchSpec = int | Callable[[tuple, jax.Array], int | tuple[int, ...]] | Any
MaskSpec = None | Any | Callable[[Any], Any]


# ---------------------------------------------------------------------------
# Which parameters are transformed, along which axis.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """How one array is transformed: static, hashable.

    Attributes:
      path: the array's path in its pytree (``jax.tree_util.keystr``).
      shape: the full-size array's shape.
      dtype: the full-size array's dtype name.
      axis: the (non-negative) transform axis; ``length`` is ``shape[axis]``.
      level: the DWT's number of levels.
      wavelet: the DWT's wavelet (PyWavelets' name).
      mode: the DWT's boundary mode.
      batch_axes: how many leading axes are a batch of matrices, or the tuple of the batch
        axes where they are not all leading (`WaveletProjection`).
      fast_path: the formulations its transform may take (`WaveletProjection`).

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> specs, _ = optax_gwt.WaveletProjection(level=2).leaf_specs({"w": jnp.zeros((10, 3))})
      >>> specs[0].approx_shape, specs[0].closed_form
      ((3, 3), True)
    """

    path: str
    shape: tuple
    dtype: str
    axis: int
    level: int
    wavelet: str
    mode: str
    batch_axes: int | tuple[int, ...] = 0
    fast_path: FastPath = FastPath()

    def __post_init__(self):
        object.__setattr__(self, "fast_path", FastPath.of(self.fast_path))

    @property
    def length(self) -> int:
        return self.shape[self.axis]

    @property
    def block(self) -> int:
        return 2**self.level

    @property
    def closed_form(self) -> bool:
        """Haar with no boundary effect: the block formula is exact."""
        return self.wavelet == "haar" and (self.mode == "zero" or self.length % self.block == 0)

    @property
    def batch_dims(self) -> tuple[int, ...]:
        """The batch axes, in order."""
        return tuple(range(self.batch_axes)) if isinstance(self.batch_axes, int) else self.batch_axes

    @property
    def leading_batch_axes(self) -> int:
        """How many leading axes stack matrices: 0 where the batch axes are not all leading (the
        formulations that walk a stack take the leading ones only)."""
        return self.batch_axes if isinstance(self.batch_axes, int) else 0

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The batch axes' shape: one norm-growth limiter scalar per matrix."""
        return tuple(self.shape[d] for d in self.batch_dims)

    @property
    def per_matrix_shape(self) -> tuple[int, ...]:
        """The shape of one value per matrix that broadcasts against the array (length 1 along
        every axis of the matrices)."""
        return tuple(n if d in self.batch_dims else 1 for d, n in enumerate(self.shape))

    @property
    def approx_shape(self) -> tuple[int, ...]:
        """The approximation's shape: ``shape`` with the transform axis compressed."""
        n = wavelets.coeff_lengths(self.length, self.wavelet, self.level, self.mode)[0]
        return self.shape[: self.axis] + (n,) + self.shape[self.axis + 1 :]


def _is_array_like(x) -> bool:
    try:
        return hasattr(x, "shape") and hasattr(x, "dtype")
    except (ValueError, TypeError):  # a container whose shape fails (a haliax NamedArray around a masked node)
        return False


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
        (prefix) of ints / None matching the params, or a function
        ``(path, array) -> int | None``; None leaves the array untransformed.
        A callable pytree with children (an Equinox module) is a prefix tree,
        not a function.
      mask: optional pytree of bools (or callable params -> pytree) choosing the
        arrays that may be transformed, on top of `axis`.
      batch_axes: how many leading axes of an array are a batch of matrices
        (stacked, scanned layers: ``(layers, in, out)`` has 1): an int for
        every array, a pytree prefix of ints, or a function ``(path, array) ->
        int | tuple``; a tuple, which only a function may give (a tuple passed
        directly is a pytree prefix), names the batch axes where they are not all
        leading (MaxText's ``(embed, layers, mlp)`` has ``(1,)``). An int `axis`
        then counts among each matrix's own axes (axis 0 of ``(layers, in,
        out)`` is ``in``), an array is selected when it has two axes besides its
        batch axes, and the norm-growth limiter (and the ``"norm_ratio"`` rule)
        take one norm per matrix, as the authors do for separate matrices.
        Default 0.
      min_dim_size: arrays shorter than this along the axis are left to the base
        optimizer at full size. None (default): every selected array is
        transformed, and an axis too short for `level` is an error (too short:
        fewer than ``2^level`` samples, or an approximation that would not be
        shorter than the axis, as happens with long filters on short axes).
      fast_path: which chip-specific formulations the Haar closed form may take
        (`optax_gwt.kernels`): ``"auto"`` (default), ``"xla"`` or a
        `optax_gwt.kernels.FastPath`. The stages read it from each array's `LeafSpec`.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> proj = optax_gwt.WaveletProjection(level=1, wavelet="db2", mode="symmetric", axis=1)
      >>> [s and s.approx_shape for s in proj.leaf_specs({"b": jnp.zeros(5), "w": jnp.zeros((4, 9))})[0]]
      [None, (4, 6)]
    """

    level: int = 2
    wavelet: str = "haar"
    mode: str = "zero"
    axis: AxisSpec = 0
    mask: MaskSpec = None
    min_dim_size: int | None = None
    batch_axes: BatchSpec = 0
    fast_path: str | FastPath = "auto"

    def __post_init__(self):
        object.__setattr__(self, "fast_path", FastPath.of(self.fast_path))
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

    def leaf_specs(self, tree: Any) -> tuple[list[LeafSpec | None], Any]:
        """Per leaf of `tree` (flattened order), its `LeafSpec` or None; and the treedef.

        Raises:
          ValueError / TypeError naming the leaf's path for an axis out of range
          (or among the batch axes), a level too deep for the axis, or a dtype
          that cannot be optimized.
        """
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
        batches = [
            _batch_dims(jax.tree_util.keystr(path), x, b)
            for (path, x), b in zip(
                leaves_with_path,
                self._per_leaf(self.batch_axes, tree, leaves_with_path, treedef, "batch_axes"),
                strict=True,
            )
        ]
        axes = self._axes(tree, leaves_with_path, treedef, batches)
        selected = self._mask(tree, treedef)
        specs = [
            self._leaf_spec(jax.tree_util.keystr(path), leaf, axis if sel else None, batch)
            for (path, leaf), axis, sel, batch in zip(leaves_with_path, axes, selected, batches, strict=True)
        ]
        return specs, treedef

    def _leaf_spec(self, name: str, leaf: Any, axis: Any, batch: Any) -> LeafSpec | None:
        """One leaf's `LeafSpec` (None: not transformed), or the error that names it."""
        if not _is_array_like(leaf):
            raise TypeError(f"{name}: expected an array, got {type(leaf).__name__}")
        dtype = jnp.dtype(leaf.dtype)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(f"{name}: GWT optimizes floating-point arrays only, got dtype {dtype}")
        if axis is None or leaf.ndim == 0:
            return None
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(f"{name}: complex arrays cannot be wavelet-transformed (dtype {dtype})")
        if not isinstance(axis, (int, np.integer)) or not -leaf.ndim <= axis < leaf.ndim:
            raise ValueError(f"{name}: transform axis {axis!r} is out of range for shape {tuple(leaf.shape)}")
        axis = int(axis) % leaf.ndim
        if axis in batch or leaf.ndim - len(batch) < 2:
            raise ValueError(
                f"{name}: the batch axes {batch!r} (from batch_axes) must leave the transform axis {axis} "
                f"and another axis among the matrix's own axes (shape {tuple(leaf.shape)})"
            )
        n = int(leaf.shape[axis])
        if self.min_dim_size is not None and n < self.min_dim_size:
            return None
        if not _level_fits(n, self.level, self.wavelet, self.mode):
            deepest = max([lv for lv in range(1, self.level) if _level_fits(n, lv, self.wavelet, self.mode)], default=0)
            raise ValueError(
                f"{name}: level {self.level} is too deep for length {n} along axis {axis} with "
                f"wavelet {self.wavelet!r} (at most {deepest}); lower the level, or leave such "
                "arrays to the base optimizer with min_dim_size, mask or axis."
            )
        spec = (name, tuple(leaf.shape), dtype.name, axis, self.level, self.wavelet, self.mode)
        leading = batch == tuple(range(len(batch)))
        return LeafSpec(*spec, batch_axes=len(batch) if leading else batch, fast_path=FastPath.of(self.fast_path))

    def _per_leaf(self, value, tree, leaves_with_path, treedef, what: str) -> list:
        """`value` for each leaf: itself (None or an int), a function's answer, or a prefix tree's entry."""
        if value is None or isinstance(value, (int, np.integer)):
            return [value] * len(leaves_with_path)
        if _is_function(value):
            return [value(p, x) for p, x in leaves_with_path]
        return _broadcast_prefix(value, tree, treedef, what)

    def _axes(self, tree, leaves_with_path, treedef, batches: list) -> list:
        """The absolute transform axis of each leaf (an int `axis` counts among a matrix's own axes)."""
        if self.axis is not None and not isinstance(self.axis, (int, np.integer)):
            return self._per_leaf(self.axis, tree, leaves_with_path, treedef, "axis")
        axes: list[Any] = []
        for (_, x), batch in zip(leaves_with_path, batches, strict=True):
            own = [d for d in range(getattr(x, "ndim", 0)) if d not in batch]
            if self.axis is None or len(own) < 2:
                axes.append(None)  # not a matrix besides its batch axes
            elif -len(own) <= self.axis < len(own):
                axes.append(own[self.axis])
            else:  # out of range among the own axes: kept out of range, so that the error names it
                axes.append(len(batch) + self.axis if self.axis >= 0 else self.axis - len(batch))
        return axes

    def _mask(self, tree, treedef) -> list:
        if self.mask is None:
            return [True] * treedef.num_leaves
        mask = self.mask(tree) if _is_function(self.mask) else self.mask
        return [bool(m) for m in _broadcast_prefix(mask, tree, treedef, "mask")]


def _batch_dims(name: str, leaf: Any, batch: Any) -> tuple[int, ...]:
    """`batch_axes`' value for one leaf as the sorted tuple of its batch axes."""
    ndim = getattr(leaf, "ndim", 0)
    if batch is None:
        return ()
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, bool) and batch >= 0:
        return tuple(range(int(batch)))  # more than an array has: it is not transformed
    if isinstance(batch, tuple) and all(isinstance(d, (int, np.integer)) and -ndim <= d < ndim for d in batch):
        dims = tuple(sorted({int(d) % ndim for d in batch}))
        if len(dims) == len(batch):
            return dims
    raise ValueError(
        f"{name}: batch_axes {batch!r} must be a count of leading axes or a tuple of distinct axes of an "
        f"array of shape {tuple(getattr(leaf, 'shape', ()))}"
    )


def _is_function(x: Any) -> bool:
    """A callable that is not a pytree with children: an Equinox module is callable, but as
    an `axis` or `mask` it is a prefix tree of the params, not the function."""
    return callable(x) and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


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
# The coefficients carried between the stages.
# ---------------------------------------------------------------------------


class AdamTerms(NamedTuple):
    """One array's part of a `Preconditioner`: ``N = step * mu / (sqrt(nu) + eps)``."""

    mu: jax.Array
    nu: jax.Array
    step: jax.Array
    eps: jax.Array
    unbiased_step: jax.Array

    def denominator(self) -> jax.Array:
        """``sqrt(nu) + eps`` per approximation coefficient, in float32 at least."""
        return jnp.sqrt(self.nu.astype(jnp.promote_types(self.nu.dtype, jnp.float32))) + self.eps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WaveletCoefficients:
    """One transformed array between `wavelet_project` and `wavelet_inverse`.

    A pytree node: the stages of a GWT chain pass it on as the "updates" of a
    transformed leaf, each filling in what it computes. Nothing here is
    optimizer state: it lives for one update.

    Attributes:
      approx: the approximation coefficients (`LeafSpec.approx_shape`, in the
        compute dtype): ``cA`` from `wavelet_project`, the base optimizer's
        step ``N`` after `on_approximation`, ``N / lam`` after
        `limit_norm_growth`.
      details: ``(cD_level, ..., cD_1)`` in PyWavelets' order; ``()`` in Haar
        closed form, where they are implicit in `signal`.
      signal: in Haar closed form the full-size gradient itself (its details
        are the gradient minus its block means), else None.
      grad_approx: the gradient's approximation ``cA`` (kept after `approx`
        becomes the step; laid out like the gradient on an explicit mesh).
      adam: from `on_approximation` with a base that states a `Preconditioner`:
        its step as a diagonal Adam step, ``(mu, nu, step, eps, unbiased_step)``
        for this array (``N = step * mu / (sqrt(nu) + eps)``), else None.
      step_scale: from `on_approximation`: the scalar the base multiplied its
        step by that the norm-growth limiter does not see (1 but for the
        reference Adam's ``sqrt(1 - b2^t) / (1 - b1^t)``).
      sq_norm: from `on_approximation` with a `GWTBase`: the squared norm of
        ``approx / step_scale`` (the limiter's input), else None.
      limit: from `limit_norm_growth`: the factor ``lam`` the step was divided by.
      spec: static: how the array was transformed.
      sharding: static: the gradient's sharding on a mesh of explicit axes, else None.
      exact: static: whether ``approx`` equals the `adam` formula (the base is a
        `GWTBase`), so that `wavelet_inverse` may rebuild it from the moments.
      signal_dtype: static: the gradient's own dtype, which `signal` (upcast to the
        compute dtype) converts back to exactly; None without a signal.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> tx = optax_gwt.wavelet_project(optax_gwt.WaveletProjection(level=1, wavelet="db2", mode="zero"))
      >>> node = tx.update({"w": jnp.ones((8, 2))}, tx.init(None))[0]["w"]
      >>> node.approx.shape, [d.shape for d in node.details], node.spec.path
      ((5, 2), [(5, 2)], "['w']")
    """

    approx: jax.Array
    details: tuple[jax.Array, ...] = ()
    signal: jax.Array | None = None
    grad_approx: jax.Array | None = None
    adam: AdamTerms | None = None
    step_scale: jax.Array | None = None
    sq_norm: jax.Array | None = None
    limit: jax.Array | None = None
    # Always given (by `project_leaf`); the None default only lets it follow the defaulted fields.
    spec: LeafSpec = dataclasses.field(default=cast(LeafSpec, None), metadata=dict(static=True))
    sharding: Any = dataclasses.field(default=None, metadata=dict(static=True))
    exact: bool = dataclasses.field(default=False, metadata=dict(static=True))
    signal_dtype: Any = dataclasses.field(default=None, metadata=dict(static=True))

    def replace(self, **changes) -> WaveletCoefficients:
        return dataclasses.replace(self, **changes)


def is_coefficients(x: Any) -> bool:
    """Whether `x` is a `WaveletCoefficients` node (an ``is_leaf`` for tree functions)."""
    return isinstance(x, WaveletCoefficients)


def compute_dtype(dtype) -> np.dtype:
    """float32 for half-precision arrays (bfloat16, float16), else the dtype itself."""
    return jnp.promote_types(dtype, jnp.float32)


def project_leaf(g: jax.Array, spec: LeafSpec) -> WaveletCoefficients:
    """The multi-level DWT of `g` along ``spec.axis``, in `compute_dtype`.

    In Haar closed form the approximation is ``block_sums(g) / sqrt(B)`` and
    `g` itself is carried as the signal. On a mesh of explicit axes the
    transform axis is gathered first (`sharding.gather_axis`), and `approx`
    is laid out as the base optimizer's state derived from `g`.
    """
    x = sharding_lib.gather_axis(g, spec.axis).astype(compute_dtype(g.dtype))
    details: tuple[jax.Array, ...]
    signal: jax.Array | None
    if spec.closed_form:
        cA = haar.block_sums(x, spec.axis, spec.block, spec.fast_path) * jnp.asarray(1 / math.sqrt(spec.block), x.dtype)
        details, signal = (), x
    else:
        cA, *rest = wavelets.wavedec(x, spec.wavelet, spec.mode, spec.level, spec.axis)
        details, signal = tuple(rest), None
    return WaveletCoefficients(
        approx=sharding_lib.follow(cA, g),
        details=details,
        signal=signal,
        grad_approx=cA,
        spec=spec,
        sharding=sharding_lib._explicit_sharding(g),
        signal_dtype=None if signal is None else jnp.dtype(g.dtype),
    )


def inverse_leaf(node: WaveletCoefficients, weight: jax.Array | None, clip: float | None = None) -> jax.Array:
    """``waverec([node.approx, D_l * w, ..., D_1 * w])`` cut to the array's length.

    `weight` ``w`` is per approximation coefficient (approx's shape; repeated
    in place twice per level to meet each level's details), a scalar or one
    value per matrix (length 1 along the axis), or None (details dropped). With `clip`, the details' part of the result,
    ``waverec([0, D_l * w, ..., D_1 * w])``, is clipped to ``[-clip, clip]``.
    Computed in the compute dtype of `node.approx`.
    """
    if clip is not None and weight is not None:
        low = inverse_leaf(node, None)
        high = inverse_leaf(node.replace(approx=jnp.zeros_like(node.approx)), weight)
        return low + jnp.clip(high, -clip, clip)
    if node.spec.closed_form:
        return _haar_inverse(node, weight)
    spec, dtype = node.spec, node.approx.dtype
    coeffs = [node.approx]
    if weight is None:
        # Zeros, not None: waverec trims each level to the next details' length.
        coeffs += [jnp.zeros_like(d, dtype) for d in node.details]
    elif _broadcasts(weight, spec.axis):
        coeffs += [d * weight.astype(dtype) for d in node.details]
    else:
        w = weight.astype(dtype)
        for d in node.details:
            coeffs.append(d * jax.lax.slice_in_dim(w, 0, d.shape[spec.axis], axis=spec.axis))
            w = jnp.repeat(w, 2, axis=spec.axis)
    full = wavelets.waverec(coeffs, spec.wavelet, spec.mode, spec.axis)
    return jax.lax.slice_in_dim(full, 0, spec.length, axis=spec.axis)


def _haar_inverse(node: WaveletCoefficients, weight: jax.Array | None) -> jax.Array:
    """`inverse_leaf` in Haar closed form: ``(G - mean) * w + N / sqrt(B)`` per block.

    Written ``G * w + (N - A * w) / sqrt(B)``: one full-size multiply-add of
    the gradient ``G`` with two per-block values, repeated in place.
    """
    spec, dtype = node.spec, node.approx.dtype
    s = jnp.asarray(1 / math.sqrt(spec.block), dtype)

    def repeat(x):
        return haar.repeat_blocks(x, spec.axis, spec.block, spec.length, spec.fast_path)

    if weight is None:
        return repeat(node.approx * s)
    # In closed form `project_leaf` carries both the gradient and its approximation.
    assert node.signal is not None and node.grad_approx is not None
    w = weight.astype(dtype)
    offset = (node.approx - node.grad_approx * w) * s
    return node.signal * (w if _broadcasts(w, spec.axis) else repeat(w)) + repeat(offset)


def _broadcasts(weight: jax.Array, axis: int) -> bool:
    """A weight that is one value along the transform axis (a scalar, or one per matrix of a
    batch), not one per approximation coefficient: it multiplies without being repeated."""
    return jnp.ndim(weight) == 0 or weight.shape[axis] == 1


def matrix_sq_norms(x: jax.Array, batch_dims: tuple[int, ...]) -> jax.Array:
    """Each matrix's squared norm: ``x^2`` summed over all but the batch axes `batch_dims`
    (`LeafSpec.batch_dims`), kept with length 1 so that the result broadcasts against `x`, in
    float32 at least."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return jnp.sum(jnp.square(x), axis=tuple(d for d in range(x.ndim) if d not in batch_dims), keepdims=True)
