"""Per-group diagnostics of the optimizer's update, recorded by ``train --diagnostics``.

The LLaMA's parameters fall into four groups (`param_group`): ``qk`` (the
attention's query and key kernels), ``vo`` (value and output kernels), ``mlp``
(gate, up and down kernels) and ``other`` (embedding, norms, output head).
Per group and step, `collect` returns, as flat keys of the step's metrics:

- ``update_norm/<group>``: the norm of the applied update (`update_norms`);
- ``highfreq_share/<group>``: the share of the update's energy outside its
  block means along the transform axis (`highfreq_shares`), defined for every
  optimizer; for Haar GWT at the same level and axis, the share carried by the
  detail coefficients;
- ``limiter_scale_mean/<group>``, ``limiter_scale_max/<group>``: the factor
  GWT's `optax_gwt.limit_norm_growth` divided the step by (`limiter_scales`),
  only for optimizers with that limiter.

All are pure functions of pytrees, traced inside the jitted train step. They
are diagnostics, not the hot path: plain reshapes and means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

import optax_gwt
from optax_gwt import haar
from optax_gwt.adam_mini import path_names

__all__ = [
    "GROUPS",
    "collect",
    "group_leaves",
    "highfreq_shares",
    "limiter_scales",
    "limiter_states",
    "lowpass",
    "param_group",
    "update_norms",
]

#: The parameter groups, in the order the metrics list them.
GROUPS = ("qk", "vo", "mlp", "other")

_KERNELS = {"qk": {"q_proj", "k_proj"}, "vo": {"v_proj", "o_proj"}, "mlp": {"gate_proj", "up_proj", "down_proj"}}


def param_group(path: tuple) -> str:
    """The group of the parameter at pytree `path` (e.g. ``layers/0/attn/q_proj/kernel``).

    ``qk``: a ``kernel`` under ``q_proj`` or ``k_proj``; ``vo``: under
    ``v_proj`` or ``o_proj``; ``mlp``: under ``gate_proj``, ``up_proj`` or
    ``down_proj``; ``other``: everything else (embedding, norms, ``lm_head``).
    """
    names = path_names(path)
    if "kernel" in names:
        for group, modules in _KERNELS.items():
            if names & modules:
                return group
    return "other"


def group_leaves(tree: Any) -> dict[str, list[jax.Array]]:
    """The arrays of a params-shaped `tree`, listed per `param_group` of their paths.

    Works on any tree whose paths are the params' paths: the params, the
    updates, or a state field that mirrors them (`optax.MaskedNode`
    placeholders of `optax.multi_transform` hold no arrays and are skipped).
    Groups without arrays are absent.
    """
    out: dict[str, list[jax.Array]] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        out.setdefault(param_group(path), []).append(x)
    return {g: out[g] for g in GROUPS if g in out}


def _sq(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def update_norms(updates: Any) -> dict[str, jax.Array]:
    """Per group, ``sqrt(sum of squares)`` of the update over all the group's arrays (float32).

    `updates` is the optimizer's output as `optax.apply_updates` applies it:
    new params minus old params.
    """
    return {g: jnp.sqrt(sum(_sq(x) for x in xs)) for g, xs in group_leaves(updates).items()}


def lowpass(u: jax.Array, axis: int = 0, level: int = 2) -> jax.Array:
    """`u`'s block means along `axis`, each repeated over its block (same shape as `u`).

    Blocks are ``B = 2**level`` consecutive entries; a short last block is
    zero-padded, so its mean is its sum / B (Haar's mode ``"zero"``). For
    Haar at `level`, this is the reconstruction from the approximation alone
    (`optax_gwt.haar`'s block sums and repeats).
    """
    block, axis = 2**level, axis % u.ndim
    means = haar.block_sums(u, axis, block) / block
    return haar.repeat_blocks(means, axis, block, u.shape[axis])


def highfreq_shares(updates: Any, axis: int | Mapping[str, int] = 0, level: int = 2) -> dict[str, jax.Array]:
    """Per group, ``sum ||U - lowpass(U)||^2 / sum ||U||^2`` over the group's matrices (0 if U = 0).

    `lowpass` runs along `axis` (one for all groups, or a ``{group: axis}``
    mapping; default 0, GWT's axis) at `level`. Only arrays of rank >= 2 count
    (norm scales are left out); groups without any are absent. For Haar GWT
    at the same axis and level, with lengths divisible by ``2**level``, this is
    the share of the update carried by the detail coefficients.
    """
    out = {}
    for g, xs in group_leaves(updates).items():
        mats = [x.astype(jnp.float32) for x in xs if x.ndim >= 2]
        if not mats:
            continue
        ax = axis[g] if isinstance(axis, Mapping) else axis
        high = sum(_sq(x - lowpass(x, ax, level)) for x in mats)
        total = sum(_sq(x) for x in mats)
        out[g] = jnp.where(total > 0, high / jnp.where(total > 0, total, 1.0), 0.0)
    return out


def limiter_states(opt_state: Any) -> list[optax_gwt.LimitNormGrowthState]:
    """Every `optax_gwt.LimitNormGrowthState` inside a (nested) optimizer state."""

    def is_limiter(x):
        return isinstance(x, optax_gwt.LimitNormGrowthState)

    return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_limiter) if is_limiter(x)]


def limiter_scales(opt_state: Any) -> dict[str, jax.Array]:
    """Per group, the mean and the max of the limiter's last factor ``lam`` (``>= 1``).

    ``lam`` is read from the ``scale`` field of each `limiter_states` entry:
    per array the limiter saw, the factor its last step was divided by (1.0
    before the first step). Its tree mirrors the params' paths, so arrays are
    grouped by `param_group`; in the modular optimizers the limiter sees
    exactly the transformed matrices (the rest are `optax.MaskedNode`). Keys
    ``limiter_scale_mean/<group>`` and ``limiter_scale_max/<group>``; none
    without a limiter.
    """
    per_group: dict[str, list[jax.Array]] = {}
    for state in limiter_states(opt_state):
        for g, xs in group_leaves(state.scale).items():
            per_group.setdefault(g, []).extend(xs)
    out = {}
    for g in (g for g in GROUPS if g in per_group):
        lam = jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in per_group[g]])
        out[f"limiter_scale_mean/{g}"], out[f"limiter_scale_max/{g}"] = lam.mean(), lam.max()
    return out


def collect(updates: Any, opt_state: Any, axis: int | Mapping[str, int] = 0, level: int = 2) -> dict[str, jax.Array]:
    """All diagnostics of one step as flat metric keys (see the module docstring).

    Args:
      updates: the update the step applied (new params - old params).
      opt_state: the optimizer state after the step (for the limiter's factors).
      axis, level: `highfreq_shares`'s transform axis and level.
    """
    out = {f"update_norm/{g}": v for g, v in update_norms(updates).items()}
    out.update({f"highfreq_share/{g}": v for g, v in highfreq_shares(updates, axis, level).items()})
    out.update(limiter_scales(opt_state))
    return out
