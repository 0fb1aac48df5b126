"""How many bytes an optimizer state takes, in total and per parameter."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax

__all__ = ["StateBytes", "optimizer_state_bytes", "tree_bytes"]


class StateBytes(NamedTuple):
    """Optimizer-state sizes in bytes.

    Attributes:
      total: bytes of every array in the state.
      per_param: a pytree shaped like the params: the bytes of the state arrays
        that belong to each parameter (their path in the state ends with the
        parameter's path, as in ``state.mu["layer"]["kernel"]``).
      shared: bytes not attributed to any parameter (step counters, schedules).

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_gwt
      >>> optax_gwt.optimizer_state_bytes(optax.adam(1e-3), {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)})
      StateBytes(total=132, per_param={'w': 128}, shared=4)
    """

    total: int
    per_param: Any
    shared: int


def tree_bytes(tree: Any) -> int:
    """Bytes of all arrays (or `jax.ShapeDtypeStruct` instances) in a pytree."""
    return int(
        sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
    )


def optimizer_state_bytes(optimizer: optax.GradientTransformation, params: Any) -> StateBytes:
    """Sizes the state of ``optimizer.init(params)`` without allocating it.

    Args:
      optimizer: any Optax transformation.
      params: the params, or their `jax.ShapeDtypeStruct` instances.

    Returns:
      A `StateBytes`. Compare with ``optimizer_state_bytes(optax.adam(1e-3), params)``
      to see GWT's saving.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_gwt
      >>> params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
      >>> adam = optax_gwt.optimizer_state_bytes(optax.adam(1e-3), params).per_param["w"]
      >>> gwt = optax_gwt.optimizer_state_bytes(optax_gwt.gwt_adamw(1e-3, level=2), params).per_param["w"]
      >>> adam, gwt  # m and v; a quarter of each, and the limiter's two scalars (norm, scale)
      (2097152, 524296)
    """
    state = jax.eval_shape(optimizer.init, params)
    param_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    per = [0] * len(param_paths)
    shared = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        nbytes = tree_bytes(leaf)
        owner = _owner(path, param_paths)
        if owner is None:
            shared += nbytes
        else:
            per[owner] += nbytes
    treedef: Any = jax.tree_util.tree_structure(params)  # Any: jaxlib ships no stubs for PyTreeDef
    return StateBytes(total=sum(per) + shared, per_param=treedef.unflatten(per), shared=shared)


def _owner(path: tuple, param_paths: list[tuple]) -> int | None:
    """Index of the longest parameter path that `path` ends with (None for scalars of no one).

    A parameter wrapped in a container pytree (a Flax ``Variable``'s ``.value``, a haliax
    ``NamedArray``'s ``.array``) also owns a state array at the container's path, such as
    the norm-growth limiter's per-array scalar.
    """
    for paths in (param_paths, [_container(p) for p in param_paths]):
        best, best_len = None, 0
        for i, p in enumerate(paths):
            if 0 < len(p) <= len(path) and tuple(path[-len(p) :]) == tuple(p) and len(p) > best_len:
                best, best_len = i, len(p)
        if best is not None:
            return best
    return None


def _container(path: tuple) -> tuple:
    """The path of the container around a parameter reached by an attribute (``.value``) or as a
    pytree's only child without a key (a haliax ``NamedArray``'s array), else ()."""
    container_keys = (jax.tree_util.GetAttrKey, jax.tree_util.FlattenedIndexKey)
    return tuple(path[:-1]) if path and isinstance(path[-1], container_keys) else ()
