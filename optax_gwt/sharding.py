"""Shardings of a GWT optimizer state, derived from the params' shardings.

GWT needs no collective of its own: the wavelet transform of a matrix runs
along one axis, so when the params are sharded along the *other* axes (data
parallel, FSDP, tensor parallel), every device transforms its own rows or
columns, and the compressed Adam moments can be sharded exactly like the
parameter they belong to. This module computes those shardings, for
``jax.jit(..., out_shardings=...)`` and for restoring checkpoints (Orbax), and
chooses a transform axis that avoids the sharded ones.

Layout rule, for every array of the state of ``optimizer.init(params)``:

* an array that belongs to a parameter (its path in the state ends with the
  parameter's path, as in ``state[0][1].inner_state.mu["w"]``) and has the
  parameter's rank gets the parameter's `PartitionSpec`;
* along an axis where its length differs from the parameter's (the
  compressed transform axis, ``ceil(n / 2^level)`` long for Haar) the mesh axes
  are kept only if they divide that length; otherwise the state is replicated
  along that axis (correct, but that axis then costs its full compressed size
  on every device: make ``n / 2^level`` a multiple of the mesh axes' size, or
  let `unsharded_axis` transform another axis);
* everything else (step counts, the norm-growth limiter's scalars, schedules'
  hyperparameters, states of other ranks) is replicated.

When the transform axis itself is sharded, GWT stays correct, but the
gradient is gathered along that axis for the transform (XLA does it under
automatic sharding; on meshes of explicit axes `scale_by_gwt` reshards
explicitly): `unsharded_axis` avoids that cost. The norm-growth limiter always
reduces one scalar per matrix across the devices that hold a piece of it (as a
global gradient norm does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax_gwt.memory import _owner

__all__ = [
    "state_partition_specs",
    "state_shardings",
    "unsharded_axis",
    "per_device_bytes",
    "zeros_following",
    "follow",
    "gather_axis",
]

Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def _as_spec(x: Any) -> PartitionSpec:
    if x is None:
        return PartitionSpec()
    if isinstance(x, NamedSharding):
        return x.spec
    if isinstance(x, PartitionSpec):
        return x
    raise TypeError(f"expected a PartitionSpec, NamedSharding or None, got {type(x).__name__}")


def _mesh_size(entry: Any, mesh: Mesh) -> int:
    """Number of devices a `PartitionSpec` entry splits an axis into."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[name] for name in names)


def _derive_spec(state_shape: tuple, param_shape: tuple, param_spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    if len(state_shape) != len(param_shape) or len(state_shape) == 0:
        return PartitionSpec()
    entries = tuple(param_spec) + (None,) * (len(param_shape) - len(param_spec))
    out = []
    for s, p, entry in zip(state_shape, param_shape, entries, strict=True):
        if s != p and s % _mesh_size(entry, mesh):
            entry = None
        out.append(entry)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def state_partition_specs(optimizer: optax.GradientTransformation, params: Any, param_specs: Any, mesh: Mesh) -> Any:
    """The `PartitionSpec` of every array of ``optimizer.init(params)``.

    Works for any Optax state; GWT's compressed moments (also inside
    `optax.chain`, `optax.multi_transform`, `optax.inject_hyperparams`) get
    their parameter's spec, following the rule of the module docstring.

    Args:
      optimizer: e.g. `optax_gwt.gwt_adamw(...)` or a chain containing it.
      params: the params, or their `jax.ShapeDtypeStruct` instances (nothing is
        allocated: the state is traced with `jax.eval_shape`).
      param_specs: a pytree like `params` of `PartitionSpec` (or
        `NamedSharding`, or None for replicated).
      mesh: the `Mesh` or `AbstractMesh` the specs refer to (its axis sizes
        decide whether a compressed axis can stay sharded).

    Returns:
      A pytree with the structure of the optimizer state, of `PartitionSpec`.
    """
    treedef: Any  # jaxlib ships no stubs for PyTreeDef
    param_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = [_as_spec(s) for s in treedef.flatten_up_to(param_specs)]
    param_paths = [path for path, _ in param_leaves]
    state = jax.eval_shape(optimizer.init, params)

    def one(path, leaf):
        owner = _owner(path, param_paths)
        if owner is None:
            return PartitionSpec()
        return _derive_spec(tuple(leaf.shape), tuple(param_leaves[owner][1].shape), specs[owner], mesh)

    return jax.tree_util.tree_map_with_path(one, state)


def state_shardings(optimizer: optax.GradientTransformation, params: Any, param_shardings: Any = None) -> Any:
    """The `NamedSharding` of every array of ``optimizer.init(params)``.

    Use them as ``jax.jit(optimizer.init, out_shardings=...)``, as the state's
    entry of a train step's ``in_shardings`` / ``out_shardings``, or to restore
    a checkpoint onto a (possibly different) mesh.

    Args:
      optimizer: any Optax transformation (see `state_partition_specs`).
      params: the params, or their `jax.ShapeDtypeStruct` instances.
      param_shardings: a pytree like `params` of `NamedSharding`, all on one
        mesh. None: the shardings carried by `params` themselves (sharded
        `jax.Array` instances, or `jax.ShapeDtypeStruct` instances with a ``sharding``).

    Returns:
      A pytree with the structure of the optimizer state, of `NamedSharding`
      on the params' mesh (replicated for scalars).
    """
    if param_shardings is None:
        param_shardings = jax.tree_util.tree_map(lambda p: p.sharding, params)
    treedef: Any = jax.tree_util.tree_structure(params)  # Any: jaxlib ships no stubs for PyTreeDef
    flat = treedef.flatten_up_to(param_shardings)
    meshes = {s.mesh for s in flat if isinstance(s, NamedSharding)}
    if len(meshes) != 1:
        raise ValueError(f"param_shardings must be NamedShardings on exactly one mesh, found {len(meshes)} meshes")
    (mesh,) = meshes
    specs = state_partition_specs(optimizer, params, param_shardings, mesh)
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def unsharded_axis(param_specs: Any, default: int = 0) -> Callable[[tuple, Any], int | None]:
    """An ``axis`` for `gwt_adamw` / `scale_by_gwt` that avoids sharded axes.

    Every array of rank >= 2 is transformed along `default`, unless the
    params' sharding splits that axis: then along its first axis that is not
    sharded (so the transform never crosses devices); if all of its axes are
    sharded, along `default` anyway (see the module docstring for the cost).
    Arrays of rank < 2 are not transformed, as with an int ``axis``.

    Args:
      param_specs: a pytree like the params of `PartitionSpec` /
        `NamedSharding` / None (replicated).
      default: the preferred axis.

    Returns:
      A callable ``(path, array) -> int | None``, to pass as ``axis=``.
    """
    flat = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=_is_spec_leaf)[0]
    by_path = {jax.tree_util.keystr(path): _as_spec(s) for path, s in flat}

    def choose(path: tuple, array: Any) -> int | None:
        ndim = len(array.shape)
        if ndim < 2:
            return None
        key = jax.tree_util.keystr(path)
        if key not in by_path:
            raise KeyError(f"unsharded_axis: no PartitionSpec for the parameter {key}")
        spec = by_path[key]
        entries = tuple(spec) + (None,) * (ndim - len(spec))
        preferred = default % ndim
        free = [d for d in range(ndim) if entries[d] is None]
        if preferred in free or not free:
            return preferred
        return free[0]

    return choose


def per_device_bytes(tree: Any, specs: Any, mesh: Mesh) -> int:
    """Bytes one device holds of `tree` laid out by `specs` on `mesh`.

    Args:
      tree: arrays or `jax.ShapeDtypeStruct` instances (e.g. ``jax.eval_shape(opt.init, params)``).
      specs: a pytree like `tree` of `PartitionSpec` (e.g. `state_partition_specs`).
      mesh: a `Mesh` or `AbstractMesh`; an axis split unevenly counts its
        largest shard.

    Returns:
      The sum over arrays of the shard size times the item size.
    """
    treedef: Any  # jaxlib ships no stubs for PyTreeDef
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    total = 0
    for leaf, spec in zip(leaves, treedef.flatten_up_to(specs), strict=True):
        spec = _as_spec(spec)
        entries = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
        shard = [-(-n // _mesh_size(e, mesh)) for n, e in zip(leaf.shape, entries, strict=True)]
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return int(total)


# ---------------------------------------------------------------------------
# Arrays that follow a parameter's sharding (used by the GWT stages).
# ---------------------------------------------------------------------------


def _explicit_sharding(x: Any) -> NamedSharding | None:
    """`x`'s sharding when it lives on a mesh with explicit axes (then ops that
    change a sharded axis's length must be told the output's sharding), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if any(t == jax.sharding.AxisType.Explicit for t in axis_types):
        return sharding
    return None


def _named_sharding_of(x: Any) -> NamedSharding | None:
    """The `NamedSharding` of a concrete array, or of a traced one on an explicit mesh; else None."""
    if isinstance(x, jax.core.Tracer):
        return _explicit_sharding(x)
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def _following(shape: tuple, param: Any) -> NamedSharding | None:
    """The sharding an array of `shape` derived from `param` gets (the module docstring's rule)."""
    sharding = _named_sharding_of(param)
    if sharding is None:
        return None
    spec = _derive_spec(tuple(shape), tuple(param.shape), sharding.spec, sharding.mesh)
    return NamedSharding(sharding.mesh, spec)


def zeros_following(param: Any, shape: tuple, dtype: Any) -> jax.Array:
    """Zeros of `shape` laid out like `param`, as an optimizer state derived from it.

    A parameter sharded over a mesh gives zeros sharded by the module
    docstring's rule (replicated along a compressed axis the mesh does not
    divide, and for scalars); otherwise the zeros are not committed to a
    device, as ``jnp.zeros`` makes them. This is what makes an eager ``tx.init(params)`` (as
    ``nnx.Optimizer`` calls it) spread the compressed moments over the mesh
    instead of leaving them on the default device.
    """
    sharding = _following(shape, param)
    if sharding is not None:
        if isinstance(param, jax.core.Tracer):
            return jnp.zeros(shape, dtype, out_sharding=sharding)
        return jnp.zeros(shape, dtype, device=sharding)
    return jnp.zeros(shape, dtype)


def follow(x: jax.Array, param: jax.Array) -> jax.Array:
    """`x` (derived from `param`, e.g. its approximation) resharded as `zeros_following`
    lays it out, on meshes of explicit axes; a no-op elsewhere (XLA propagates)."""
    if _explicit_sharding(param) is None:
        return x
    target = _following(x.shape, param)
    if target is None or _explicit_sharding(x) == target:
        return x
    return jax.sharding.reshard(x, target.spec)


def gather_axis(x: jax.Array, axis: int) -> jax.Array:
    """`x` with `axis` unsharded, when it lives on a mesh of explicit axes.

    Under explicit sharding, ops that change the length of a sharded axis (the
    wavelet transform's pads, strided slices and repeats) must be told how to
    shard an output whose length may not divide by the mesh: gathering the
    transform axis first (what XLA does by itself under automatic sharding)
    keeps GWT correct for any length. Other axes keep their sharding.
    """
    sharding = _explicit_sharding(x)
    if sharding is None or sharding.spec[axis : axis + 1] in ((), (None,)):
        return x
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    spec[axis] = None
    return jax.sharding.reshard(x, PartitionSpec(*spec))


def reshard_to(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """`x` resharded to `sharding` on a mesh of explicit axes (a no-op for None, or if it is there)."""
    if sharding is None or _explicit_sharding(x) == sharding:
        return x
    return jax.sharding.reshard(x, sharding.spec)
