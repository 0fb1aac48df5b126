"""Adam-mini: Adam with one second-moment value per block of parameters.

Zhang et al., "Adam-mini: Use Fewer Learning Rates To Gain More", arXiv
2406.16793 (ICLR 2025). The first moment stays full-size; the second moment is
one number per block, the mean of the squared gradient over the block. The
blocks are a function of each array's path and shape (`adam_mini_blocks` is
the paper's partition for transformers), so the transformation works alone or
as GWT's base on the approximation coefficients (`scale_by_gwt`), whose
transform axis (the input axis of a Flax kernel) is averaged over anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "BlockFn",
    "Blocks",
    "ScaleByAdamMiniState",
    "adam_mini_blocks",
    "head_blocks",
    "output_blocks",
    "path_names",
    "scale_by_adam_mini",
]


class Blocks(NamedTuple):
    """How an array is cut into blocks that share one second-moment value.

    Attributes:
      axes: the axes averaged over: a block spans each of them whole. ``()``
        makes every entry its own block (Adam's per-entry second moment).
      heads: when > 1, `head_axis` is cut into `heads` equal contiguous groups
        (attention heads) and each group is averaged over as well: one value
        per head (and per index of the axes not in `axes`).
      head_axis: the axis that `heads` cuts (not one of `axes`).

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> per_head = lambda path, x: optax_gwt.Blocks(axes=(0,), heads=2, head_axis=1)
      >>> optax_gwt.scale_by_adam_mini(block_axes=per_head).init({"q": jnp.zeros((4, 6))}).nu["q"].shape
      (1, 2, 1)
    """

    axes: tuple[int, ...] = ()
    heads: int = 1
    head_axis: int = -1


#: A partition: ``(path, array) -> Blocks`` (or a sequence of axes to average
#: over, or None for per-entry blocks). The array may be a
#: `jax.ShapeDtypeStruct`: only its shape may be read.
BlockFn = Callable[[tuple, Any], Blocks | Sequence[int] | None]

#: Path names of the arrays that `adam_mini_blocks` leaves at Adam's per-entry
#: second moment by default: token embeddings and the output head.
EMBEDDING_NAMES = ("embed", "embedding", "embeddings", "wte", "tok_embeddings", "lm_head")

#: Path names of the query and key projections (blocked by head).
QUERY_KEY_NAMES = ("q_proj", "k_proj", "query", "key", "wq", "wk")


def output_blocks(x: Any, output_axis: int = -1) -> Blocks:
    """One block per output neuron: every axis but `output_axis` averaged over.

    For a Flax ``(in, out)`` kernel, one value per column; a vector (or a
    scalar) is one block.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> optax_gwt.output_blocks(jnp.zeros((8, 3)))
      Blocks(axes=(0,), heads=1, head_axis=-1)
    """
    ndim = len(x.shape)
    if ndim <= 1:
        return Blocks(axes=tuple(range(ndim)))
    keep = output_axis % ndim
    return Blocks(axes=tuple(a for a in range(ndim) if a != keep))


def head_blocks(x: Any, num_heads: int, head_axis: int = -1) -> Blocks:
    """One block per attention head: `head_axis` (heads x head_dim) cut into
    `num_heads` groups, every other axis averaged over.

    For a Flax query kernel ``(hidden, heads * head_dim)``, one value per head.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> optax_gwt.head_blocks(jnp.zeros((8, 6)), num_heads=2)
      Blocks(axes=(0,), heads=2, head_axis=1)
    """
    ndim = len(x.shape)
    keep = head_axis % ndim
    return Blocks(axes=tuple(a for a in range(ndim) if a != keep), heads=num_heads, head_axis=keep)


def path_names(path: tuple) -> set[str]:
    """The names in a pytree path (dict keys, attributes, sequence indices), as strings.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> [path_names(p) == {"attn", "kernel"} for p, _ in jax.tree_util.tree_leaves_with_path({"attn": {"kernel": 0}})]
      [True]
    """
    names = set()
    for key in path:
        attr = next((a for a in ("key", "name", "idx") if hasattr(key, a)), None)
        names.add(str(getattr(key, attr) if attr else key))
    return names


def adam_mini_blocks(
    num_heads: int | None = None,
    *,
    query_key: Sequence[str] = QUERY_KEY_NAMES,
    full_adam: Sequence[str] = EMBEDDING_NAMES,
    output_axis: int = -1,
) -> BlockFn:
    """The paper's partition for transformers, as a `BlockFn`.

    An array whose path has a name in `full_adam` (token embeddings, output
    head) keeps Adam's per-entry second moment, as the paper's final version
    does (pass ``full_adam=()`` to block them by output neuron too); one whose
    path has a name in `query_key` gets one value per attention head
    (`head_blocks` along `output_axis`) when `num_heads` is given, else per
    output neuron; every other array one value per output neuron
    (`output_blocks`), a vector (norm scale, bias) one value in all.

    Args:
      num_heads: attention heads of the query/key projections (None: block
        them by output neuron, as every other matrix).
      query_key: path names of the query and key projections.
      full_adam: path names of the arrays kept at per-entry Adam.
      output_axis: the output axis of the kernels (-1 for Flax's ``(in, out)``,
        0 for PyTorch's ``(out, in)`` layout).

    Example:
      >>> import jax, jax.numpy as jnp, optax_gwt
      >>> blocks = optax_gwt.adam_mini_blocks(num_heads=2)
      >>> params = {"q_proj": {"kernel": jnp.zeros((4, 6))}, "lm_head": {"kernel": jnp.zeros((4, 9))}}
      >>> [blocks(path, x) for path, x in jax.tree_util.tree_leaves_with_path(params)]
      [Blocks(axes=(), heads=1, head_axis=-1), Blocks(axes=(0,), heads=2, head_axis=1)]
    """
    full, qk = frozenset(full_adam), frozenset(query_key)

    def partition(path: tuple, x: Any) -> Blocks:
        names = path_names(path)
        if names & full:
            return Blocks()
        if names & qk and num_heads is not None and len(x.shape) >= 2:
            return head_blocks(x, num_heads, output_axis)
        return output_blocks(x, output_axis)

    return partition


def _resolve(spec: Blocks | Sequence[int] | None, shape: tuple, path: tuple) -> Blocks:
    """`spec` as a `Blocks` with non-negative axes, checked against `shape`."""
    blocks = spec if isinstance(spec, Blocks) else Blocks(axes=tuple(spec or ()))
    ndim = len(shape)
    axes = tuple(sorted({a % ndim for a in blocks.axes})) if ndim else ()
    if blocks.heads <= 1 or not ndim:
        return Blocks(axes=axes)
    head_axis = blocks.head_axis % ndim
    if head_axis in axes or shape[head_axis] % blocks.heads:
        raise ValueError(
            f"scale_by_adam_mini: {jax.tree_util.keystr(path)} of shape {shape}: cannot cut axis "
            f"{head_axis} into {blocks.heads} heads while averaging over axes {axes}"
        )
    return Blocks(axes=axes, heads=blocks.heads, head_axis=head_axis)


def _split_shape(shape: tuple, blocks: Blocks) -> tuple:
    """`shape` with the head axis cut into ``(heads, size // heads)`` (unchanged without heads)."""
    if blocks.heads <= 1:
        return tuple(shape)
    h = blocks.head_axis
    return (*shape[:h], blocks.heads, shape[h] // blocks.heads, *shape[h + 1 :])


def _reduce_axes(blocks: Blocks) -> tuple[int, ...]:
    """The averaged axes of the split array: `axes` renumbered, and the within-head axis."""
    if blocks.heads <= 1:
        return blocks.axes
    h = blocks.head_axis
    return tuple(sorted([a if a < h else a + 1 for a in blocks.axes] + [h + 1]))


def _nu_shape(shape: tuple, blocks: Blocks) -> tuple:
    """The second moment's shape: the split shape with the averaged axes kept as size 1."""
    averaged = set(_reduce_axes(blocks))
    return tuple(1 if a in averaged else n for a, n in enumerate(_split_shape(shape, blocks)))


def _block_mean_square(g: jax.Array, blocks: Blocks, dtype) -> jax.Array:
    """``mean(g^2)`` over each block, in `dtype`, shaped `_nu_shape`."""
    split = g.reshape(_split_shape(g.shape, blocks)).astype(dtype)
    return jnp.mean(jnp.square(split), axis=_reduce_axes(blocks), keepdims=True)


def _scaled(m_hat: jax.Array, v_hat: jax.Array, blocks: Blocks, eps: float, eps_root: float) -> jax.Array:
    """``m_hat / (sqrt(v_hat + eps_root) + eps)``, each block's `v_hat` broadcast over the block."""
    split = m_hat.reshape(_split_shape(m_hat.shape, blocks))
    return (split / (jnp.sqrt(v_hat + eps_root) + eps)).reshape(m_hat.shape)


class ScaleByAdamMiniState(NamedTuple):
    """State of `scale_by_adam_mini`.

    Attributes:
      count: steps taken (int32 scalar).
      mu: the first moment, shaped like the params.
      nu: per array, one second-moment value per block, shaped like the array
        (its head axis cut into ``(heads, head_dim)``) with the averaged axes
        of size 1.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> state = optax_gwt.scale_by_adam_mini().init({"w": jnp.zeros((4, 3))})
      >>> state.mu["w"].shape, state.nu["w"].shape  # m full-size, v one per column
      ((4, 3), (1, 3))
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states
    mu: optax.Updates
    nu: optax.Updates


def _moment_dtype(dtype) -> jnp.dtype:
    """Float32 at least (a bfloat16 gradient's block means are taken in float32)."""
    return jnp.promote_types(dtype, jnp.float32)


def scale_by_adam_mini(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    block_axes: BlockFn | None = None,
    mu_dtype: Any | None = None,
) -> optax.GradientTransformation:
    """Adam-mini: Adam whose second moment is one value per block.

    For a gradient ``g`` cut into blocks ``b`` by `block_axes`, at step ``t``::

        m_t     = b1 * m_{t-1} + (1 - b1) * g_t                   (full size)
        v_t[b]  = b2 * v_{t-1}[b] + (1 - b2) * mean_{i in b} g_t[i]^2
        u_t[i]  = m_hat_t[i] / (sqrt(v_hat_t[b(i)] + eps_root) + eps)

    with ``m_hat = m / (1 - b1^t)`` and ``v_hat = v / (1 - b2^t)``, as
    `optax.scale_by_adam` (which this is when every entry is its own block).
    The second moment costs one number per block instead of one per entry:
    about half of Adam's state. Chain with ``optax.scale_by_learning_rate``
    (and ``optax.add_decayed_weights`` for AdamW-style decay).

    As GWT's base, ``scale_by_gwt(scale_by_adam_mini(...), detail_rule=
    "norm_ratio")``, it runs on the approximation coefficients: their paths
    are the params', and blocks by output neuron or head (axes the wavelet
    transform leaves alone) keep their meaning. Under
    ``optax.inject_hyperparams`` pass ``static_args=("block_axes", "mu_dtype")``
    (a partition is a callable, not a schedule).

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the bias-corrected root of the second moment.
      eps_root: added to the second moment inside the root.
      block_axes: the partition, ``(path, array) -> Blocks`` (or the axes to
        average over; None or ``()``: per entry). None: ``adam_mini_blocks()``
        (per output neuron; embeddings and output head at per-entry Adam; pass
        ``adam_mini_blocks(num_heads=...)`` for the paper's per-head query and
        key blocks).
      mu_dtype: dtype of the first moment (None: the params').

    Returns:
      An `optax.GradientTransformation` with state `ScaleByAdamMiniState`.

    References:
      Zhang et al., "Adam-mini: Use Fewer Learning Rates To Gain More", arXiv
      2406.16793; Kingma and Ba, "Adam: A Method for Stochastic Optimization",
      arXiv 1412.6980.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, optax_gwt
      >>> tx = optax_gwt.scale_by_adam_mini(block_axes=optax_gwt.adam_mini_blocks(num_heads=2))
      >>> params = {"attn": {"q_proj": {"kernel": jnp.zeros((4, 6))}}, "mlp": {"kernel": jnp.zeros((2, 3))}}
      >>> state = tx.init(params)
      >>> state.nu["attn"]["q_proj"]["kernel"].shape, state.nu["mlp"]["kernel"].shape
      ((1, 2, 1), (1, 3))
      >>> g = {"attn": {"q_proj": {"kernel": jnp.ones((4, 6))}},
      ...      "mlp": {"kernel": jnp.array([[3.0], [4.0]]) * jnp.ones((2, 3))}}
      >>> u, state = tx.update(g, state)
      >>> [round(float(x), 3) for x in u["mlp"]["kernel"][:, 0]]  # a column's block: [3, 4] / sqrt(mean(9, 16))
      [0.849, 1.131]
      >>> gwt = optax_gwt.scale_by_gwt(optax_gwt.scale_by_adam_mini(), level=1, detail_rule="norm_ratio")
      >>> gwt.init({"w": jnp.zeros((8, 3))})[1].inner_state.nu["w"].shape  # (8 -> 4) x 3, one per column
      (1, 3)
    """
    partition = adam_mini_blocks() if block_axes is None else block_axes

    def layout(tree: Any) -> tuple[list[Blocks], Any]:
        with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
        return [_resolve(partition(p, x), tuple(x.shape), p) for p, x in with_path], treedef

    def init_fn(params):
        blocks, treedef = layout(params)
        leaves = treedef.flatten_up_to(params)
        nu = [jnp.zeros(_nu_shape(x.shape, b), _moment_dtype(x.dtype)) for x, b in zip(leaves, blocks, strict=True)]
        mu = jax.tree.map(lambda x: jnp.zeros_like(x, dtype=mu_dtype), params)
        return ScaleByAdamMiniState(count=jnp.zeros([], jnp.int32), mu=mu, nu=treedef.unflatten(nu))

    def update_fn(updates, state, params=None):
        del params
        blocks, treedef = layout(updates)
        grads, nus = treedef.flatten_up_to(updates), treedef.flatten_up_to(state.nu)
        count = cast(jax.Array, optax.safe_increment(state.count))  # an array in, an array out
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = [b2 * v + (1 - b2) * _block_mean_square(g, b, v.dtype) for g, v, b in zip(grads, nus, blocks, strict=True)]
        m_hat = treedef.flatten_up_to(optax.tree.bias_correction(mu, b1, count))
        v_hat = optax.tree.bias_correction(nu, b2, count)
        out = [
            _scaled(m, v, b, eps, eps_root).astype(g.dtype)
            for m, v, b, g in zip(m_hat, v_hat, blocks, grads, strict=True)
        ]
        mu = optax.tree.cast(mu, mu_dtype)
        return treedef.unflatten(out), ScaleByAdamMiniState(count=count, mu=mu, nu=treedef.unflatten(nu))

    return optax.GradientTransformation(init_fn, update_fn)
