"""Formulations chosen when a program is lowered: as written on each device, or partitioned.

Some forms of a computation compile well only where XLA sees each device's whole
arrays: a Pallas kernel (`optax_gwt.kernels.pallas_tpu`), or a contraction whose layout fits the
chip's tiles for the global shape but not for one device's shard of it. Whether a
program runs as written on each device (one device, or the body of a `jax.shard_map`
manual over all its mesh axes) or is partitioned by XLA's SPMD partitioner is known only
when JAX lowers it, not when it traces it (a traced array on a mesh of automatic axes
carries no sharding). `one_device_or` defers the choice to that moment.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

__all__ = ["batch_first", "jvp_of", "on_one_device", "one_device_or"]


def on_one_device(ctx) -> bool:
    """Whether the program that a lowering rule's `ctx` belongs to runs as it is on each
    device: one device, or the body of a `jax.shard_map` manual over every mesh axis (not
    an SPMD program that XLA partitions)."""
    axes = ctx.module_context.axis_context
    # Read by attribute: JAX's axis contexts are not public. An SPMD context names its mesh
    # and manual axes; a plain sharding context counts its devices.
    manual, mesh = getattr(axes, "manual_axes", None), getattr(axes, "mesh", None)
    if manual is not None and mesh is not None:
        return set(manual) == set(mesh.axis_names)
    return getattr(axes, "num_devices", None) == 1


def one_device_or(single: Callable, partitioned: Callable, *args: jax.Array) -> jax.Array:
    """``single(*args)`` where the program is lowered to run as written on each device
    (`on_one_device`), else ``partitioned(*args)``: two functions of the same arrays that
    compute the same array. Under `jax.vmap` both are vmapped; derivatives are
    ``partitioned``'s."""
    return _choice_p.bind(*args, single=single, partitioned=partitioned)


def _lowering(ctx, *args, single, partitioned):
    fun = single if on_one_device(ctx) else partitioned
    return mlir.lower_fun(fun, multiple_results=False)(ctx, *args)


def _abstract_eval(*avals, single, partitioned):
    out = jax.eval_shape(partitioned, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
    return jax.core.ShapedArray(out.shape, out.dtype)


def batch_first(args, dims) -> list:
    """A batching rule's operands with their batch axis first (`dims`: each one's batch
    axis, or None for an unbatched operand, which is broadcast)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    return [
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims, strict=True)
    ]


def _batched(args, dims, *, single, partitioned):
    return one_device_or(jax.vmap(single), jax.vmap(partitioned), *batch_first(args, dims)), 0


def jvp_of(fun: Callable, primals, tangents):
    """A jvp rule's result: `fun`'s derivatives (symbolic zero tangents made explicit)."""
    return jax.jvp(fun, tuple(primals), tuple(ad.instantiate_zeros(t) for t in tangents))


def _jvp(primals, tangents, *, single, partitioned):
    return jvp_of(partitioned, primals, tangents)


_choice_p = jax.extend.core.Primitive("optax_gwt_one_device_or")
_choice_p.def_abstract_eval(_abstract_eval)
_choice_p.def_impl(lambda *args, **params: jax.jit(functools.partial(_choice_p.bind, **params))(*args))
mlir.register_lowering(_choice_p, _lowering)
batching.primitive_batchers[_choice_p] = _batched
ad.primitive_jvps[_choice_p] = _jvp
