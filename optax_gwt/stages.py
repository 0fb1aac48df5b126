"""The four stages of GWT, each an Optax transformation, chained in this order.

Wen et al., "Breaking Memory Limits: Gradient Wavelet Transform Enhances LLMs
Training", arXiv 2501.07237. For a transformed matrix with gradient ``G``::

    optax.chain(
        wavelet_project(projection),           # 1. [A, D_l..D_1] = wavedec(G)
        on_approximation(base, projection),    # 2. N = base(A); its state has A's shape
        limit_norm_growth(1.01),               # 3. N <- N / lam  (Fira's limiter)
        wavelet_inverse(scale=0.25),           # 4-5. U = scale * waverec([N, D * w])
        optax.scale_by_learning_rate(lr),
    )

Between the first and the last stage a transformed leaf of the updates is a
`WaveletCoefficients` node, each stage filling in its part; arrays that are
not transformed pass through, the base optimizer stepping them at full size.
The stages check that they are chained in this order and built with the same
projection.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gwt import haar, kernels, sharding as sharding_lib
from optax_gwt.adam import GWTBase, Preconditioner, _scalar_dtype
from optax_gwt.projection import (
    AdamTerms,
    WaveletCoefficients,
    WaveletProjection,
    _is_array_like,
    compute_dtype,
    inverse_leaf,
    is_coefficients,
    matrix_sq_norms,
    project_leaf,
)

__all__ = [
    "DETAIL_RULES",
    "SAFE_DETAIL_CLIP",
    "OnApproximationState",
    "LimitNormGrowthState",
    "wavelet_project",
    "on_approximation",
    "limit_norm_growth",
    "wavelet_inverse",
]

DETAIL_RULES = ("auto", "adam", "norm_ratio", "zero", "residual")
#: The `wavelet_inverse` ``detail_clip`` that the trainer integrations give by default (Levanter's
#: ``type: gwt``, the MaxText recipe): a bound on near-constant gradients' details (thousands of
#: Adam steps per entry without it) that ordinary training after the first steps hardly reaches
#: (docs/guides/numerics.md).
SAFE_DETAIL_CLIP = 10.0


_NEEDS_BLOCKS = (
    "{path}: {what} needs Haar blocks (wavelet 'haar', mode 'zero' or lengths divisible by "
    "2^level); this array is transformed with {x.spec.wavelet!r} in mode {x.spec.mode!r}"
)


def _flatten(tree: Any) -> tuple[list, Any]:
    """Leaves and treedef of updates that may hold `WaveletCoefficients` nodes (kept whole)."""
    return jax.tree_util.tree_flatten(tree, is_leaf=is_coefficients)


def _require(ok: bool, stage: str, message: str) -> None:
    if not ok:
        raise ValueError(
            f"{stage}: {message} (the GWT chain is wavelet_project -> on_approximation -> "
            "[limit_norm_growth ->] wavelet_inverse)"
        )


# ---------------------------------------------------------------------------
# 1. wavelet_project
# ---------------------------------------------------------------------------


def wavelet_project(projection: WaveletProjection = WaveletProjection()) -> optax.GradientTransformation:
    """Stage 1 of GWT: each selected gradient becomes its wavelet coefficients.

    For every array that `projection` selects, with gradient ``G`` of length
    ``n`` along the transform axis, ``[A, D_level, ..., D_1] = wavedec(G)``
    (PyWavelets' multi-level DWT, in float32 at least). The updates passed on
    hold a `WaveletCoefficients` node per transformed array (``A`` has
    ``ceil(n / 2^level)`` entries along the axis for Haar); other arrays pass
    through unchanged. Stateless.

    Args:
      projection: which arrays are transformed, and how.

    Returns:
      An `optax.GradientTransformation` (state `optax.EmptyState`).

    References:
      Wen et al., arXiv 2501.07237, Algorithm 1.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> tx = optax_gwt.wavelet_project(optax_gwt.WaveletProjection(level=1))
      >>> out, _ = tx.update({"w": jnp.ones((4, 3))}, tx.init(None))
      >>> out["w"].approx.shape
      (2, 3)
    """

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = _flatten(updates)
        _require(not any(map(is_coefficients, leaves)), "wavelet_project", "the updates are already projected")
        specs, _ = projection.leaf_specs(updates)
        out = [g if s is None else project_leaf(g, s) for g, s in zip(leaves, specs, strict=True)]
        return treedef.unflatten(out), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# ---------------------------------------------------------------------------
# 2. on_approximation
# ---------------------------------------------------------------------------


class OnApproximationState(NamedTuple):
    """State of `on_approximation`: the base optimizer's, on the compressed shapes.

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> tx = optax_gwt.on_approximation(optax.scale_by_adam(), optax_gwt.WaveletProjection(level=3))
      >>> tx.init({"w": jnp.zeros((64, 4))}).inner_state.nu["w"].shape
      (8, 4)
    """

    inner_state: optax.OptState


def _approx_zeros(params: Any, projection: WaveletProjection) -> Any:
    """`params` with each transformed array replaced by zeros of its approximation's
    shape, laid out like the param (`sharding.zeros_following`)."""
    specs, treedef = projection.leaf_specs(params)
    leaves = treedef.flatten_up_to(params)
    return treedef.unflatten(
        [
            p if s is None else sharding_lib.zeros_following(p, s.approx_shape, p.dtype)
            for p, s in zip(leaves, specs, strict=True)
        ]
    )


def _check_projection(leaves: list, treedef, projection: WaveletProjection) -> None:
    """That the incoming nodes are where, and as, `projection` would have made them."""
    shapes = [jax.ShapeDtypeStruct(x.spec.shape, x.spec.dtype) if is_coefficients(x) else x for x in leaves]
    expected, _ = projection.leaf_specs(treedef.unflatten(shapes))
    for x, spec in zip(leaves, expected, strict=True):
        got = x.spec if is_coefficients(x) else None
        if spec is not None and got is None:
            _require(False, "on_approximation", f"{spec.path} is not projected: wavelet_project must come before")
        if got is not None and _projection_key(got) != _projection_key(spec):
            _require(
                False,
                "on_approximation",
                f"{got.path} was projected as {got} but this stage's projection "
                f"makes {spec}: build both stages with the same WaveletProjection",
            )


def _projection_key(spec) -> tuple | None:
    """A `LeafSpec` without its path (the path differs under optax.masked and multi_transform)."""
    return None if spec is None else (spec.shape, spec.axis, spec.level, spec.wavelet, spec.mode, spec.batch_axes)


def _check_state(inner: optax.GradientTransformation | GWTBase, inner_in: Any, inner_state: Any) -> None:
    """A clear error when the updates' (compressed) shapes are not those the state was built for."""
    want = jax.tree_util.tree_flatten_with_path(jax.eval_shape(inner.init, inner_in))
    have = jax.tree_util.tree_flatten_with_path(inner_state)
    # jaxlib ships no stub for PyTreeDef (mypy sees an unresolved type), which does define __ne__.
    if want[1] != have[1]:  # type: ignore[operator]
        raise ValueError(
            "on_approximation: the updates do not match the optimizer state (initialised for "
            f"another params tree).\n  updates give: {want[1]}\n  state holds:  {have[1]}"
        )
    for (path, w), (_, h) in zip(want[0], have[0], strict=True):
        if jnp.shape(w) != jnp.shape(h):
            raise ValueError(
                f"on_approximation: state leaf {jax.tree_util.keystr(path)} was built with shape "
                f"{jnp.shape(h)} at init, but these updates give {jnp.shape(w)} (compressed shapes)"
            )


def on_approximation(
    inner: optax.GradientTransformation | GWTBase,
    projection: WaveletProjection = WaveletProjection(),
    *,
    preconditioner: Callable[[optax.OptState], Preconditioner | None] | None = None,
) -> optax.GradientTransformation:
    """Stage 2 of GWT: a base optimizer on the approximation coefficients only.

    ``N = inner(A)`` for each transformed array, and ``inner(G)`` at full size
    for the others; the details pass through. `inner` is initialised on the
    approximation's shapes (its state, e.g. Adam's ``m`` and ``v``, has
    ``1 / 2^level`` of the array along the axis), each laid out like its
    parameter on a mesh. If `inner` reads params, it gets their approximation.

    What the detail rule of `wavelet_inverse` needs travels on in each node:
    the base's `Preconditioner` (its step as ``step * mu / (sqrt(nu) + eps)``,
    whence the denominator of each coefficient), from `preconditioner` (a
    function of the base's new state), by default the one a `GWTBase` such as
    `scale_by_reference_adam` states; for `optax.scale_by_adam` pass
    `optax_gwt.adam_preconditioner(b1, b2, eps)`. Without one, ``"auto"``
    uses the ``"norm_ratio"`` rule.

    Args:
      inner: any Optax transformation (`optax.scale_by_adam`, `scale_by_lion`,
        `contrib.scale_by_muon`, `scale_by_factored_rms`, ...).
      projection: the same `WaveletProjection` as `wavelet_project`'s.
      preconditioner: see above.

    Returns:
      An `optax.GradientTransformation` with state `OnApproximationState`.

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> proj = optax_gwt.WaveletProjection(level=2)
      >>> tx = optax_gwt.on_approximation(optax.scale_by_lion(), proj)
      >>> tx.init({"w": jnp.zeros((8, 3))}).inner_state.mu["w"].shape
      (2, 3)
    """
    if preconditioner is None and isinstance(inner, GWTBase):
        preconditioner = inner.preconditioner
    # The step equals its Preconditioner's formula only for a GWTBase's own.
    exact = isinstance(inner, GWTBase) and preconditioner is inner.preconditioner

    def init_fn(params):
        return OnApproximationState(inner.init(_approx_zeros(params, projection)))

    def update_fn(updates, state, params=None):
        leaves, treedef = _flatten(updates)
        _check_projection(leaves, treedef, projection)
        # A `GWTBase` computes in float32 at least: it gets the approximation unrounded (no
        # half-precision copy of it is written between the block sums and the moments).
        rounded = not isinstance(inner, GWTBase)
        inner_in = treedef.unflatten(
            [(x.approx.astype(x.spec.dtype) if rounded else x.approx) if is_coefficients(x) else x for x in leaves]
        )
        _check_state(inner, inner_in, state.inner_state)
        if isinstance(inner, GWTBase):
            steps, inner_state, sq_norms = inner.update_on_approximation(
                inner_in, state.inner_state, _haar_signals(leaves, treedef, inner.block_energy)
            )
            sq_norms = treedef.flatten_up_to(sq_norms)
        else:
            steps, inner_state = inner.update(inner_in, state.inner_state, _approx_params(params, projection))
            sq_norms = [None] * len(leaves)
        pre = preconditioner(inner_state) if preconditioner is not None else None
        out = _carry(leaves, treedef.flatten_up_to(steps), pre, treedef, exact)
        out = [x.replace(sq_norm=sq) if is_coefficients(x) else x for x, sq in zip(out, sq_norms, strict=True)]
        return treedef.unflatten(out), OnApproximationState(inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _approx_params(params: Any, projection: WaveletProjection) -> Any:
    """The params with each transformed array replaced by its approximation (XLA
    drops this when the base does not read params)."""
    if params is None:
        return None
    specs, treedef = projection.leaf_specs(params)
    leaves = treedef.flatten_up_to(params)
    return treedef.unflatten(
        [p if s is None else project_leaf(p, s).approx.astype(p.dtype) for p, s in zip(leaves, specs, strict=True)]
    )


def _haar_signals(leaves: list, treedef, block_energy: bool) -> Any:
    """Per leaf, ``(G, axis, B)`` where a Haar closed-form node carries its gradient
    in the gradient's own dtype (the CPU kernel's input), or in any dtype for a base
    that reads the blocks' energy; else None."""

    def one(x):
        if not is_coefficients(x):
            return None
        if x.signal is None and block_energy:
            raise ValueError(_NEEDS_BLOCKS.format(path=x.spec.path, what="a base with second_moment='energy'", x=x))
        if x.signal is not None and (block_energy or x.signal.dtype == x.spec.dtype):
            return (x.signal, x.spec.axis, x.spec.block)
        return None

    return treedef.unflatten([one(x) for x in leaves])


def _carry(leaves: list, steps: list, pre: Preconditioner | None, treedef, exact: bool) -> list:
    """The base's steps put into the nodes, with its preconditioner's terms for each."""
    mus = treedef.flatten_up_to(pre.mu) if pre is not None else [None] * len(leaves)
    nus = treedef.flatten_up_to(pre.nu) if pre is not None else [None] * len(leaves)
    out = []
    for x, n, mu, nu in zip(leaves, steps, mus, nus, strict=True):
        if not is_coefficients(x):
            out.append(n)
            continue
        approx = n.astype(compute_dtype(x.spec.dtype))
        if pre is None:
            out.append(x.replace(approx=approx, step_scale=jnp.ones([], _scalar_dtype(n))))
            continue
        terms = AdamTerms(mu, nu, pre.step, pre.eps, pre.unbiased_step)
        out.append(dataclasses.replace(x, approx=approx, adam=terms, step_scale=pre.step_scale, exact=exact))
    return out


# ---------------------------------------------------------------------------
# 3. limit_norm_growth
# ---------------------------------------------------------------------------


class LimitNormGrowthState(NamedTuple):
    """State of `limit_norm_growth`.

    Attributes:
      count: steps taken (int32 scalar); the first step is not limited.
      norm_prev: per array, the previous step's norm ``r_prev`` (a scalar in
        float32, float64 for float64 params; 0 where not transformed).
      scale: per array, the factor ``lam`` the last step computed (a scalar
        like ``norm_prev``; 1 before the first step and where not transformed):
        the last step was divided by it, or, with ``delayed=True``, this step
        is.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> optax_gwt.limit_norm_growth().init({"w": jnp.zeros((8, 2))}).norm_prev["w"].shape
      ()
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states
    norm_prev: Any
    scale: Any


def limit_norm_growth(
    gamma: float = 1.01, projection: WaveletProjection | None = None, *, delayed: bool = False
) -> optax.GradientTransformation:
    """Stage 3 of GWT: Fira's norm-growth limiter on each approximation step.

    For each transformed array, with ``r = ||N|| / step_scale`` (the norm of
    the base's step before the reference's bias correction):
    ``lam = max(r / (r_prev + 1e-8), gamma) / gamma`` (``lam = 1`` on the
    first step), ``N <- N / lam`` and ``r_prev <- r / lam``: the step's norm
    grows by at most a factor `gamma` per step. The details are divided by
    ``lam`` too (`wavelet_inverse` reads it from the node). The scalar math
    runs per array (with ``fast_path="auto"``, as one vector of all the arrays'
    scalars on a CPU: op ``"limiter"`` of `optax_gwt.kernels`).

    With ``delayed=True`` (not the paper's: an option) the same factors are
    computed, but each step is divided by the previous step's ``lam`` (1 on
    the first two steps), so that no array's full-size pass waits for a norm
    of its own step: under FSDP that norm is a reduction across the devices
    that hold the matrix, and the pass that waits for it keeps its inputs
    in memory meanwhile (``python -m benchmarks.target_compile --fsdp 64``).

    Args:
      gamma: the largest growth factor per step.
      projection: the chain's `WaveletProjection`, needed where it has batch
        axes (stacked matrices): then ``r``, ``lam`` and ``r_prev`` are one per
        matrix, in the array's batch shape. None: one per array.
      delayed: divide each step by the factor computed at the previous step.

    Returns:
      An `optax.GradientTransformation` with state `LimitNormGrowthState`.

    References:
      Chen et al., "Fira: Can We Achieve Full-rank Training of LLMs Under
      Low-rank Constraint?", arXiv 2410.01623; Wen et al., arXiv 2501.07237.

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> tx = optax.chain(optax_gwt.wavelet_project(), optax_gwt.on_approximation(optax.scale_by_sign()),
      ...                  optax_gwt.limit_norm_growth(1.01), optax_gwt.wavelet_inverse(scale=1.0))
      >>> state = tx.init({"w": jnp.zeros((8, 2))})
      >>> u1, state = tx.update({"w": jnp.ones((8, 2))}, state)
      >>> u2, state = tx.update({"w": 3 * jnp.ones((8, 2))}, state)
      >>> round(float(jnp.abs(u2["w"]).max() / jnp.abs(u1["w"]).max()), 2)
      1.0
    """

    def init_fn(params):
        return _limiter_init(params, projection)

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = _flatten(updates)
        index = [k for k, x in enumerate(leaves) if is_coefficients(x)]
        for k in index:
            _require(
                leaves[k].step_scale is not None and leaves[k].limit is None,
                "limit_norm_growth",
                f"{leaves[k].spec.path} has not been through on_approximation, or was limited twice",
            )
        prev_leaves, prev_def = jax.tree_util.tree_flatten(state.norm_prev)
        prev_treedef: Any = prev_def  # Any: jaxlib ships no stubs for PyTreeDef
        owner = _scalar_owners(updates, state.norm_prev)
        new_prev, new_scale = list(prev_leaves), jax.tree_util.tree_leaves(state.scale)
        out = list(leaves)
        if index:
            nodes, r_prev = [leaves[k] for k in index], [prev_leaves[owner[k]] for k in index]
            lams, rs = _limit_factors(nodes, r_prev, state.count, gamma)
            for k, x, lam, r, prev in zip(index, nodes, lams, rs, r_prev, strict=True):
                applied = new_scale[owner[k]].astype(lam.dtype) if delayed else lam
                limit = applied if not x.spec.batch_dims else applied.reshape(x.spec.per_matrix_shape)
                out[k] = x.replace(approx=x.approx / limit.astype(x.approx.dtype), limit=limit)
                new_prev[owner[k]] = (r / lam).astype(prev.dtype)
                new_scale[owner[k]] = lam.astype(new_scale[owner[k]].dtype)
        new_state = LimitNormGrowthState(
            jnp.asarray(optax.safe_increment(state.count)),
            prev_treedef.unflatten(new_prev),
            prev_treedef.unflatten(new_scale),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _limiter_init(params: Any, projection: WaveletProjection | None) -> LimitNormGrowthState:
    """The limiter's state: a zero norm and a unit factor per array (per matrix of a batch)."""
    batch_shapes = _batch_shapes(params, projection)

    def scalar(path, p):
        # One plain array per array (of its batch shape: one scalar per matrix), also where
        # the array is wrapped in a container pytree (a haliax NamedArray): never the container.
        shape = next((v for k, v in batch_shapes.items() if k[: len(path)] == tuple(path)), ())
        return sharding_lib.zeros_following(jax.tree_util.tree_leaves(p)[0], shape, _scalar_dtype(p))

    norm_prev = jax.tree_util.tree_map_with_path(scalar, params, is_leaf=_is_array_like)
    scale = jax.tree.map(jnp.ones_like, norm_prev)
    return LimitNormGrowthState(jnp.zeros([], jnp.int32), norm_prev, scale)


def _batch_shapes(params: Any, projection: WaveletProjection | None) -> dict[tuple, tuple]:
    """Per path of a transformed array with batch axes, its batch shape (one limiter scalar per matrix)."""
    if projection is None:
        return {}
    specs, _ = projection.leaf_specs(params)
    paths = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return {p: s.batch_shape for p, s in zip(paths, specs, strict=True) if s is not None and s.batch_dims}


def _limit_factors(nodes: list, r_prev: list, count: jax.Array, gamma: float) -> tuple[list, list]:
    """Fira's ``lam`` and the norm ``r`` of each node's step (per matrix, in its batch shape).

    ``r = ||approx / step_scale||`` per matrix, from the base's squared norm where it gave
    one. Each array's scalars are computed on their own (op ``"limiter"`` of
    `optax_gwt.kernels`: on a CPU they are one vector), so that no array's full-size pass
    waits for another array's norm. The values are the same either way.
    """

    def per_array(nodes, r_prev, count, gamma):
        lams, rs = [], []
        for x, p in zip(nodes, r_prev, strict=True):
            lam, r = limit_vector([x], [p], count, gamma)
            lams += lam
            rs += r
        return lams, rs

    return kernels.switch(kernels.Case("limiter"), nodes[0].spec.fast_path, per_array, nodes, r_prev, count, gamma)


def limit_vector(nodes: list, r_prev: list, count: jax.Array, gamma: float) -> tuple[list, list]:
    """`_limit_factors` of `nodes` with all their scalars in one vector: ``r = sqrt(sq) / scale``
    and ``lam = max(r / r_prev, gamma) / gamma`` (1 at the first step)."""
    dt = _scalar_dtype(r_prev)
    sq, scale, prev = zip(*(_limit_inputs(x, p, dt) for x, p in zip(nodes, r_prev, strict=True)), strict=True)
    r = jnp.sqrt(jnp.concatenate(sq).astype(dt)) / jnp.concatenate(scale)
    lam = jnp.where(count == 0, 1.0, jnp.maximum(r / (jnp.concatenate(prev) + 1e-8), gamma) / gamma).astype(dt)
    bounds = list(itertools.accumulate(x.shape[0] for x in sq))[:-1]
    shapes = [x.spec.batch_shape for x in nodes]
    split = lambda v: [part.reshape(shape) for part, shape in zip(jnp.split(v, bounds), shapes, strict=True)]  # noqa: E731
    return split(lam), split(r)


def _limit_inputs(x: WaveletCoefficients, p: jax.Array, dt: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One node's squared norms, step scales and previous norms, one entry per matrix."""
    b = x.spec.batch_dims
    if not b:
        sq = (x.sq_norm if x.sq_norm is not None else jnp.sum(jnp.square(x.approx)))[None]
    else:
        sq = matrix_sq_norms(x.approx, b).reshape(-1)
    _require(
        jnp.shape(p) == x.spec.batch_shape,
        "limit_norm_growth",
        f"{x.spec.path} has {len(b)} batch axes {b}: build limit_norm_growth(gamma, projection) with the projection",
    )
    ones = jnp.ones(sq.shape, dt)
    assert x.step_scale is not None  # limit_norm_growth checked it
    scale = ones if not b and x.sq_norm is not None else ones * x.step_scale.astype(dt)
    return sq, scale, p.astype(dt).reshape(-1)


def _scalar_owners(updates: Any, scalars: Any) -> list[int]:
    """Per leaf of `updates`, the index of its scalar in `scalars` (the limiter's state): the
    scalar whose path is the longest prefix of the leaf's (equal for plain pytrees; the
    container's path for an array wrapped in a container pytree)."""
    leaf_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_coefficients)[0]]
    scalar_paths = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(scalars)[0]]
    where = {p: i for i, p in enumerate(scalar_paths)}
    owners: list[int] = []
    taken: set[int] = set()
    for path in leaf_paths:
        prefixes = [tuple(path[:n]) for n in range(len(path), -1, -1)]
        found = next((where[p] for p in prefixes if p in where), None)
        if found is None or found in taken:
            raise ValueError(
                f"limit_norm_growth: {jax.tree_util.keystr(tuple(path))} has no scalar of its own in the state "
                "(initialised for another params tree, or a container holding several arrays)"
            )
        owners.append(found)
        taken.add(found)
    return owners


# ---------------------------------------------------------------------------
# 4. wavelet_inverse
# ---------------------------------------------------------------------------


def _detail_weight(x: WaveletCoefficients, rule: str, bias_correct_details: bool) -> jax.Array | None:
    """The factor of the details (per approximation coefficient, a scalar, or None)."""
    if rule == "zero":
        return None
    if rule == "norm_ratio":

        def norm(a):  # per matrix where the array is a batch of them
            if x.spec.batch_dims:
                return jnp.sqrt(matrix_sq_norms(a, x.spec.batch_dims))
            return jnp.sqrt(jnp.sum(jnp.square(a.astype(_scalar_dtype(a)))))

        a_norm = norm(x.grad_approx)
        return jnp.where(a_norm > 0, norm(x.approx) / jnp.where(a_norm > 0, a_norm, 1.0), 0.0)
    assert x.adam is not None  # rule "adam": checked by _resolve_rule
    return _adam_detail_factor(x, bias_correct_details) / (x.adam.denominator() * _limit(x))


def _adam_detail_factor(x: WaveletCoefficients, bias_correct_details: bool) -> jax.Array:
    assert x.adam is not None  # rule "adam": checked by _resolve_rule
    return x.adam.step if bias_correct_details else x.adam.unbiased_step


def _limit(x: WaveletCoefficients) -> jax.Array:
    return jnp.ones([], x.approx.dtype) if x.limit is None else x.limit


def _resolve_rule(x: WaveletCoefficients, rule: str) -> str:
    _require(x.step_scale is not None, "wavelet_inverse", f"{x.spec.path} has not been through on_approximation")
    if rule == "auto":
        return "adam" if x.adam is not None else "norm_ratio"
    _require(
        rule not in ("adam", "residual") or x.adam is not None,
        "wavelet_inverse",
        f"detail_rule={rule!r} needs the base's "
        "denominator: give on_approximation a preconditioner (optax_gwt.adam_preconditioner for "
        "optax.scale_by_adam), or use 'norm_ratio' or 'zero'",
    )
    if rule == "residual" and x.signal is None:
        raise ValueError(_NEEDS_BLOCKS.format(path=x.spec.path, what="detail_rule='residual'", x=x))
    return rule


def _adam_update(
    x: WaveletCoefficients, bias_correct_details: bool, residual_scale: float | None, scale: float
) -> jax.Array:
    """The full-size update of one Haar node times `scale`, rebuilt from the base's moments,
    in the node's dtype.

    One full-size pass (`haar.adam_update`) for both rules that read the moments:

    * ``"adam"`` (`residual_scale` None): the explicit fusion of a `GWTBase` Adam's step
      with the Haar inverse, the details divided by the denominator;
    * ``"residual"`` (FOAM): with ``R = G - mean`` (the details in Haar closed form),
      ``r = residual_scale * sqrt(B) * R`` in the approximation's units and ``c`` the
      step's factor, ``(c * mu + c_d * r) / (lam * (sqrt(nu + r^2) + sqrt(B) * eps))``,
      ``mu`` and ``nu`` repeated in place (``eps`` in the gradient's units, as FOAM's).
    """
    assert x.adam is not None and x.signal is not None and x.grad_approx is not None  # _resolve_rule
    lam = _limit(x)
    units = 1.0 if residual_scale is None else math.sqrt(x.spec.block)
    rho = None if residual_scale is None else residual_scale * units
    return haar.adam_update(
        x.signal,
        x.grad_approx,
        x.adam.mu,
        x.adam.nu,
        axis=x.spec.axis,
        block=x.spec.block,
        eps=x.adam.eps * units,
        approx_factor=x.adam.step * units / lam,
        detail_factor=_adam_detail_factor(x, bias_correct_details) * (1.0 if rho is None else rho) / lam,
        residual=rho,
        scale=scale,
        out_dtype=x.spec.dtype,
        storage_dtype=x.signal_dtype,
        batch_axes=x.spec.leading_batch_axes,
        fast_path=x.spec.fast_path,
    )


def _inverse_node(
    x: WaveletCoefficients, rule: str, bias_correct_details: bool, clip: float | None, residual_scale: float,
    scale: float,
) -> jax.Array:  # fmt: skip
    """The full-size update of one node times `scale`, in the node's dtype."""
    rule = _resolve_rule(x, rule)
    if rule == "residual":
        return _adam_update(x, bias_correct_details, residual_scale, scale)
    # A `GWTBase` Adam's step equals its moments' formula: in Haar closed form (where
    # project_leaf carries the gradient) it is rebuilt inside the full-size pass.
    if rule == "adam" and clip is None and x.exact and x.spec.closed_form:
        return _adam_update(x, bias_correct_details, None, scale)
    return haar.scaled(inverse_leaf(x, _detail_weight(x, rule, bias_correct_details), clip), scale, x.spec.dtype)


def wavelet_inverse(
    scale: float = 0.25,
    detail_rule: str = "auto",
    *,
    bias_correct_details: bool = True,
    detail_clip: float | None = None,
    residual_scale: float = 1.0,
) -> optax.GradientTransformation:
    """Stages 4-5 of GWT: the details rescaled, and the full-size update rebuilt.

    For each `WaveletCoefficients` node, ``U = scale * waverec([N, D_l * w,
    ..., D_1 * w])[:n]`` in the gradient's dtype, where ``w`` follows
    `detail_rule`:

    * ``"adam"`` (the reference): ``w = c / (denominator * lam)`` per
      approximation coefficient, repeated in place twice per level, with ``c``
      the base's ``1 / (1 - b1^t)`` (1 if not `bias_correct_details`) and
      ``lam`` the limiter's factor: each detail is divided by the Adam
      denominator of its approximation coefficient;
    * ``"norm_ratio"``: ``w = ||N|| / ||A||`` (any base: Lion, Muon, ...);
    * ``"zero"``: the details are dropped (a pure low-pass update);
    * ``"auto"``: ``"adam"`` when the base stated a denominator, else ``"norm_ratio"``;
    * ``"residual"`` (FOAM's, Haar blocks only): the details enter Adam's
      moments instead of being divided by them. With ``R = G - mean`` (the
      gradient minus its block means, which waverec of the details is) and
      ``r = residual_scale * sqrt(B) * R``, per entry ``U = scale * (c * mu +
      c_d * r) / (lam * (sqrt(nu + r^2) + sqrt(B) * eps))``, ``mu`` and ``nu``
      the base's moments repeated in place, ``c`` its step factor and ``c_d``
      the details' (``eps`` in the gradient's units). The approximation step
      ``N`` is not used but through ``lam``.

    Other arrays pass through. Stateless.

    Args:
      scale: alpha, the factor of the transformed arrays' update.
      detail_rule: see above.
      bias_correct_details: False keeps Adam's ``1 / (1 - b1^t)`` off the raw
        details (the reference applies it, amplifying the first steps' high
        frequencies by up to ``1 / (1 - b1)``).
      detail_clip: None (the reference) or a bound: the details' part of the
        update (before `scale`) is clipped to ``[-detail_clip, detail_clip]``
        (not with ``"residual"``).
      residual_scale: FOAM's ``res_scale``, the weight of the residual in the
        moments under ``"residual"`` (ignored by the other rules).

    Returns:
      An `optax.GradientTransformation` (state `optax.EmptyState`).

    References:
      Wen et al., arXiv 2501.07237, Algorithm 1; FOAM: Wen et al., arXiv 2512.07112.

    Example:
      >>> import jax.numpy as jnp, optax, optax_gwt
      >>> proj = optax_gwt.WaveletProjection(level=1)
      >>> tx = optax.chain(optax_gwt.wavelet_project(proj), optax_gwt.on_approximation(optax.identity(), proj),
      ...                  optax_gwt.wavelet_inverse(scale=1.0, detail_rule="norm_ratio"))
      >>> g = {"w": jnp.arange(8.0).reshape(4, 2)}
      >>> bool(jnp.allclose(tx.update(g, tx.init(g))[0]["w"], g["w"]))
      True
    """
    if detail_rule not in DETAIL_RULES:
        raise ValueError(f"detail_rule must be one of {DETAIL_RULES}, got {detail_rule!r}")
    if detail_rule == "residual" and detail_clip is not None:
        raise ValueError("detail_clip applies to the rules that add the details to the update, not to 'residual'")

    def one(x):
        if not is_coefficients(x):
            return x
        u = _inverse_node(x, detail_rule, bias_correct_details, detail_clip, residual_scale, scale)
        return sharding_lib.reshard_to(u, x.sharding)

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(one, updates, is_leaf=is_coefficients), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
