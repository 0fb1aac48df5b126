"""Per-device optimizer-state memory of LLaMA-1B with Adam and GWT, sharded FSDP-style.

Nothing is allocated: the params are `jax.ShapeDtypeStruct`s of the LLaMA-1B
shapes (Flax ``(in, out)`` kernels), the optimizer state comes from
``jax.eval_shape(optimizer.init, params)``, its layout from
`optax_gwt.sharding.state_partition_specs` on an `AbstractMesh` of 1, 8 or 64
devices, and the bytes per device from the shard shapes.

Layout: every parameter is split over all devices (one ``fsdp`` mesh axis)
along its output axis when that divides, else along its input axis, else
kept whole; GWT transforms each matrix along an unsharded axis
(`optax_gwt.sharding.unsharded_axis`), so its compressed moments shard like
the parameter.

    python benchmarks/memory_table.py            # Markdown table
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, PartitionSpec as P

import optax_gwt
from optax_gwt.sharding import per_device_bytes, state_partition_specs, unsharded_axis

LLAMA_1B = dict(hidden=2048, intermediate=5461, heads=32, layers=24, vocab=32000)
DEVICES = (1, 8, 64)
GIB = 2**30


def llama_param_shapes(hidden: int, intermediate: int, heads: int, layers: int, vocab: int) -> dict:
    """The params of a LLaMA with an untied head, as float32 `ShapeDtypeStruct`s."""
    del heads  # q, k, v, o are (hidden, hidden) whatever the head count
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    layer = {
        "attn": {name: f32(hidden, hidden) for name in ("q", "k", "v", "o")},
        "mlp": {"gate": f32(hidden, intermediate), "up": f32(hidden, intermediate), "down": f32(intermediate, hidden)},
        "attn_norm": f32(hidden),
        "mlp_norm": f32(hidden),
    }
    return {
        "embed": f32(vocab, hidden),
        "layers": [layer] * layers,
        "final_norm": f32(hidden),
        "lm_head": f32(hidden, vocab),
    }


def fsdp_specs(params, devices: int):
    """Each array split over ``fsdp`` along its last axis that `devices` divides (else whole)."""

    def spec(x):
        for axis in reversed(range(len(x.shape))):
            if x.shape[axis] % devices == 0:
                return P(*([None] * axis), "fsdp")
        return P()

    return jax.tree_util.tree_map(spec, params)


def optimizers(specs) -> dict:
    out = {"Adam": optax.adamw(1e-3)}
    for level in (1, 2, 3):
        out[f"GWT-{level}"] = optax_gwt.gwt_adamw(1e-3, level=level, axis=unsharded_axis(specs))
    return out


def table(config: dict = LLAMA_1B, devices: Sequence[int] = DEVICES) -> dict:
    """``{optimizer: {devices: bytes of optimizer state per device}}``."""
    params = llama_param_shapes(**config)
    rows: dict = {}
    for n in devices:
        mesh = AbstractMesh((n,), ("fsdp",))
        specs = fsdp_specs(params, n)
        for name, opt in optimizers(specs).items():
            state = jax.eval_shape(opt.init, params)
            rows.setdefault(name, {})[n] = per_device_bytes(
                state, state_partition_specs(opt, params, specs, mesh), mesh
            )
    return rows


def markdown(rows: dict, devices: Sequence[int] = DEVICES) -> str:
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(llama_param_shapes(**LLAMA_1B)))
    head = "| optimizer | " + " | ".join(f"{n} device{'s' if n > 1 else ''}" for n in devices) + " |"
    lines = [
        f"Optimizer state per device, GiB (float32; LLaMA-1B, {n_params / 1e9:.2f} B params; FSDP over all devices)",
        "",
        head,
        "|" + "---|" * (len(devices) + 1),
    ]
    adam = rows["Adam"]
    for name, per in rows.items():
        cells = [f"{per[n] / GIB:.3f}" + ("" if name == "Adam" else f" ({per[n] / adam[n]:.0%})") for n in devices]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(markdown(table()))


if __name__ == "__main__":
    main()
