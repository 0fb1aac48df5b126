"""Accelerators to compile for without having one (deviceless, compile-only targets).

JAX compiles for a GPU or a TPU on a machine that has neither, given the backend's
compiler: ``jax.experimental.topologies.get_topology_desc`` describes the chip, and
``jax.jit(f).lower(<jax.ShapeDtypeStruct on one of its devices>).compile()`` returns
the program the chip would run, with its optimized HLO (`optax_gwt.hlo_traffic`)
and XLA's ``memory_analysis()``. Nothing runs, so the bytes, kernels and memory read
from it are the chip's; wall times are not.

It needs JAX's compile-only plugins at the installed JAX's version (about 2 GB; no
NVIDIA library or TPU is needed to compile)::

    pip install "jax[cuda12-local,tpu]==$(python -c 'import jax; print(jax.__version__)')"

and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` for the GPU targets (set by `device`).

Example (not run in the docs' tests: it needs the plugins)::

    import jax, jax.numpy as jnp
    from optax_gwt import targets

    sharding = jax.sharding.SingleDeviceSharding(targets.device("v5e"))
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=sharding)
    compiled = jax.jit(lambda a: a * 2).lower(x).compile()
    compiled.memory_analysis().temp_size_in_bytes
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax

__all__ = ["Target", "TARGETS", "device", "devices", "missing_compiler"]


class Target(NamedTuple):
    """How to compile for one accelerator (its peak, bandwidth and memory: `optax_gwt.plan.ACCELERATORS`).

    Attributes:
      platform: ``"cuda"`` or ``"tpu"``.
      chip: the TPU generation as libtpu names it (``"v5e"``); unused for GPUs.
      gpu: for a GPU, the facts XLA's GPU compiler is given (a ``GpuTargetConfig``).
    """

    platform: str
    chip: str = ""
    gpu: dict[str, Any] | None = None


# The GPUs' published figures (NVIDIA's data sheets and CUDA occupancy tables).
_H100_SXM = {
    "name": "NVIDIA H100 80GB HBM3", "major": 9, "minor": 0, "core_count": 132, "clock_rate_ghz": 1.98,
    "memory_bandwidth": 3_352_320_000_000, "l2_cache_size": 50 * 2**20, "device_memory_size": 80 * 2**30,
    "shared_memory_per_core": 228 * 1024, "shared_memory_per_block_optin": 227 * 1024,
}  # fmt: skip
_A100_SXM = {
    "name": "NVIDIA A100-SXM4-80GB", "major": 8, "minor": 0, "core_count": 108, "clock_rate_ghz": 1.41,
    "memory_bandwidth": 2_039_000_000_000, "l2_cache_size": 40 * 2**20, "device_memory_size": 80 * 2**30,
    "shared_memory_per_core": 164 * 1024, "shared_memory_per_block_optin": 163 * 1024,
}  # fmt: skip

TARGETS: dict[str, Target] = {
    "h100": Target("cuda", gpu=_H100_SXM),
    "a100": Target("cuda", gpu=_A100_SXM),
    "v5e": Target("tpu", "v5e"),
    "v6e": Target("tpu", "v6e"),
    "v5p": Target("tpu", "v5p"),
}


def _gpu_target_config(facts: dict[str, Any]) -> str:
    """A ``stream_executor.GpuTargetConfigProto`` text from a GPU's facts (the common CUDA limits added)."""
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * 1024,
        "threads_per_core_limit": 2048, "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }  # fmt: skip
    info.update({k: v for k, v in facts.items() if k not in ("name", "major", "minor")})
    lines = [f"  {k}: {v}" for k, v in info.items()]
    lines.append(f"  cuda_compute_capability {{ major: {facts['major']} minor: {facts['minor']} }}")
    return "\n".join(
        ["gpu_device_info {", *lines, "}", 'platform_name: "CUDA"', "dnn_version_info { major: 9 minor: 1 }",
         f'device_description_str: "{facts["name"]}"']
    )  # fmt: skip


def _topology(target: Target, n: int) -> str:
    """The smallest slice of `n` chips or more: ``"v5e:2x2"``, ``"v5e:8x8"``, ``"v5p:2x2x4"``; GPUs ``"1x1x<n>"``
    (one host of `n`)."""
    if target.platform == "cuda":
        return f"1x1x{n}"
    if target.chip == "v5p":  # 3-D: 2 x 2 x z
        return f"v5p:2x2x{max(1, -(-n // 4))}"
    chips = max(4, 1 << (n - 1).bit_length())  # 2-D slices of 4, 8, 16, ... chips
    x = 1 << (chips.bit_length() // 2)  # 4 -> 2x2, 8 -> 4x2, 64 -> 8x8
    return f"{target.chip}:{x}x{chips // x}"


def missing_compiler(name: str) -> str | None:
    """None if JAX can compile for target `name` here; else one line saying what to install."""
    import importlib.util

    target = TARGETS[name]
    module, extra = ("jax_plugins.xla_cuda12", "cuda12-local") if target.platform == "cuda" else ("libtpu", "tpu")
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if found:
        return None
    requirement = f"jax[{extra}]=={jax.__version__}"
    return f'compiling for {name} needs JAX\'s {target.platform} compiler: pip install "{requirement}"'


@functools.cache
def devices(name: str, n: int = 1) -> tuple[jax.Device, ...]:
    """`n` compile-only devices of target `name` (a key of `TARGETS`), for shardings and meshes.

    Raises:
      ValueError: an unknown name.
      RuntimeError: JAX's plugin for the target's platform is not installed (one line
        saying which to install).
    """
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {sorted(TARGETS)}")
    target = TARGETS[name]
    from jax.experimental import topologies

    missing = missing_compiler(name)
    if missing:
        raise RuntimeError(missing)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: other processes may too
    topology = _topology(target, n)
    if target.platform == "cuda":
        assert target.gpu is not None
        config = _gpu_target_config(target.gpu)
        desc = topologies.get_topology_desc(name, "cuda", target_config=config, topology=topology)
    else:
        desc = topologies.get_topology_desc(topology, "tpu")
    if len(desc.devices) < n:
        raise ValueError(f"{name}: topology {topology} has {len(desc.devices)} devices, {n} wanted")
    return tuple(desc.devices[:n])


def device(name: str) -> jax.Device:
    """One compile-only device of target `name` (see `devices`)."""
    return devices(name, 1)[0]
