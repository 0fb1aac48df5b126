"""Device meshes for the training CLI: ``--mesh data=2,fsdp=4`` and multi-process runs.

The mesh always has the axes ``data`` and ``fsdp`` (size 1 when not given), so
the layouts, and with them GWT's transform axes and the state's shapes, are
the same on every mesh and a checkpoint restores on any of them. Every
parameter is split over ``fsdp`` along its last axis (the output axis of a
Flax kernel, the hidden axis of the embedding) when that divides, leaving
GWT's transform axis 0 whole on every device; the batch is split over
``data`` and ``fsdp``. The optimizer state's shardings come from
`optax_gwt.sharding.state_shardings`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

__all__ = ["AXES", "make_mesh", "param_shardings", "batch_sharding", "place", "initialize"]

AXES = ("data", "fsdp")


def make_mesh(text: str) -> jax.sharding.Mesh:
    """``"data=2,fsdp=4"`` -> a `Mesh` over all devices (of all processes), axes `AXES`."""
    sizes = dict.fromkeys(AXES, 1)
    for item in text.split(","):
        name, _, size = item.partition("=")
        if name.strip() not in sizes or not size.strip().isdigit():
            raise SystemExit(f"--mesh {text!r}: expected e.g. data=2,fsdp=4 with axes {AXES}")
        sizes[name.strip()] = int(size)
    shape = tuple(sizes[a] for a in AXES)
    if int(np.prod(shape)) != jax.device_count():
        raise SystemExit(f"--mesh {text!r} needs {int(np.prod(shape))} devices, found {jax.device_count()}")
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def param_shardings(params: Any, mesh: jax.sharding.Mesh) -> Any:
    """FSDP: each array split over ``fsdp`` along its last axis when divisible, else replicated."""
    n = mesh.shape["fsdp"]

    def one(x):
        if x.ndim and x.shape[-1] % n == 0:
            return NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "fsdp"))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, params)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXES))


def place(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global batch (identical in every process) as an array laid out by `sharding`."""
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def initialize(coordinator: str | None, num_processes: int, process_id: int | None) -> None:
    """`jax.distributed.initialize` when a coordinator is given (CPU collectives use gloo)."""
    if coordinator:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
