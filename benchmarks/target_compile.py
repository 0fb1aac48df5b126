"""GWT's update step as an H100 or a TPU compiles it, without the chip.

    python -m benchmarks.target_compile --out results/targets/update    # needs the compile-only plugins

For each target (`optax_gwt.targets`), dtype and optimizer, compiles the donated step
``(params, state, grads) -> (params, state)`` of ``optax.adamw`` or ``gwt_adamw(level=L)``
(the paper's limiter on; ``gwt2-nolimit``: off; ``gwt2-delayed``: a step late) on the
attention and MLP matrices of
LLaMA-60M (25.3 M parameters, all under the optimizer; ``-stacked``: the 8 layers'
matrices stacked, ``batch_axes=1``; ``-vmapped``: stacked, the update under
``jax.vmap``), or of another size's first layers (``--model 7b --layers 1``: one layer's
seven matrices, 202 M parameters), deviceless, and reads from the optimized HLO the
main-memory (HBM) bytes per parameter, the kernels and the scalar ops (each a launch on a
GPU; `optax_gwt.hlo_traffic`), and from ``memory_analysis()`` the temporaries and the
peak (arguments + outputs not aliased to them + temporaries). The state GWT saves is
AdamW's state minus GWT's. ``--step train`` compiles a train step instead, whose
gradients come from its own backward pass (`compile_train`): the peak is then what a
training run's step needs beyond its model's activations. ``--fsdp 64`` splits the
matrices over 64 chips as the planner does and reports per device.
Writes ``<out>.json`` and ``<out>.md``. Nothing runs on a chip: no wall times.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gwt
from benchmarks import write_results
from benchmarks.llama_shapes import is_attention_or_mlp, llama_shapes
from optax_gwt import plan, targets
from optax_gwt.hlo_traffic import entry_traffic
from optax_gwt.models.llama_config import CONFIGS

LEARNING_RATE, WEIGHT_DECAY = 1e-3, 0.01


def matrices(model: str = "60m", layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """The attention and MLP kernels' shapes, by path (of the first `layers` layers; None: all)."""
    shapes = llama_shapes(CONFIGS[model])
    leaves = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    out = {jax.tree_util.keystr(p): s for p, s in leaves if is_attention_or_mlp(p)}
    return {k: s for k, s in out.items() if layers is None or int(re.search(r"layer_(\d+)", k)[1]) < layers}


def stacked(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The same matrices stacked over the layers, ``(L, m, n)`` per kind (scanned layers)."""
    kinds: dict[str, list[tuple[int, ...]]] = {}
    for path, shape in shapes.items():
        kinds.setdefault(re.sub(r"\['layer_\d+'\]", "", path), []).append(shape)
    return {kind: (len(s), *s[0]) for kind, s in kinds.items()}


def _variants(name: str) -> tuple[str, set[str]]:
    """``("gwt2", {"stacked", "delayed"})`` for ``"gwt2-stacked-delayed"``."""
    base, *variants = name.split("-")
    return base, set(variants)


def _on_stacked_layers(name: str) -> bool:
    return bool(_variants(name)[1] & {"stacked", "vmapped"})


#: ``--fast-path``: the `optax_gwt.FastPath` of the GWT rows.
FAST_PATHS = {
    "auto": optax_gwt.FastPath(),
    "no-pallas": optax_gwt.FastPath(pallas=False),
    "xla": optax_gwt.FastPath(enabled=False),
}


def optimizer(name: str, fast_path: str = "auto") -> optax.GradientTransformation:
    """``adamw`` or ``gwt<level>``, plain or with variants joined by ``-``: ``nolimit``, GWT
    without the norm-growth limiter (whose bytes bound from below those of any limiter that
    needs no pass of its own); ``delayed``, the limiter's factor applied a step late
    (``norm_growth_delayed``); ``stacked``, on the layers stacked with ``batch_axes=1``;
    ``vmapped``, on them under ``jax.vmap`` over the layers (as the planner's ``over_layers``)."""
    base, variants = _variants(name)
    if base == "adamw":
        return optax.adamw(LEARNING_RATE, eps=1e-6, weight_decay=WEIGHT_DECAY)
    tx = optax_gwt.gwt_adamw(
        LEARNING_RATE,
        eps=1e-6,
        weight_decay=WEIGHT_DECAY,
        level=int(base.removeprefix("gwt")),
        norm_growth_limit=None if "nolimit" in variants else 1.01,
        norm_growth_delayed="delayed" in variants,
        batch_axes=1 if "stacked" in variants else 0,
        fast_path=FAST_PATHS[fast_path],
    )
    if "vmapped" in variants:
        from optax_gwt.plan.llama import over_layers  # needs Flax (the plan extra)

        return over_layers(tx)
    return tx


def abstract_params(shapes: dict, dtype: Any, device: jax.Device) -> dict:
    """The matrices as `jax.ShapeDtypeStruct` instances on `device` (a one-device mesh, as the planner takes)."""
    mesh = jax.sharding.Mesh(np.array([device]), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return {k: jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for k, s in shapes.items()}


def sharded_params(shapes: dict, dtype: Any, target: str, fsdp: int) -> dict:
    """The matrices on `fsdp` of the target's devices, split as the planner splits a LLaMA's
    (`optax_gwt.plan.llama.param_shardings`: each kernel's output axis over ``fsdp``,
    ``o_proj`` and ``down_proj`` their input axis)."""
    from optax_gwt.plan import llama as plan_llama  # needs Flax (the plan extra)

    mesh = plan_llama.make_mesh({"fsdp": fsdp}, targets.devices(target, fsdp))
    tree: dict = {}
    for path, shape in shapes.items():
        *outer, last = re.findall(r"\['(\w+)'\]", path)
        node = tree
        for key in outer:
            node = node.setdefault(key, {})
        node[last] = jax.ShapeDtypeStruct(shape, dtype)
    shardings = plan_llama.param_shardings(tree, mesh)
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    by_path = {jax.tree_util.keystr(p): s for p, s in flat}
    return {k: jax.ShapeDtypeStruct(s, dtype, sharding=by_path[k]) for k, s in shapes.items()}


#: Tokens of each matrix's input in the train step (`compile_train`).
TOKENS = 256


def compile_train(tx: optax.GradientTransformation, params: dict) -> Any:
    """The donated train step ``(params, state, inputs) -> (params, state)`` of the loss
    ``sum_W mean((x_W @ W)^2)``, each matrix ``W`` (or stack of them) with an input ``x_W``
    of `TOKENS` rows: the gradients are the backward pass's, inside the program."""
    state = plan.abstract_state(tx, params)

    def step(params, state, inputs):
        def loss(p):
            return sum(jnp.mean(jnp.square(inputs[k] @ w).astype(jnp.float32)) for k, w in p.items())

        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    def input_of(w):
        return jax.ShapeDtypeStruct((*w.shape[:-2], TOKENS, w.shape[-2]), w.dtype, sharding=w.sharding)

    inputs = {k: input_of(w) for k, w in params.items()}
    return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, inputs).compile()


def measure(
    target: str, dtype: Any, name: str, shapes: dict, step: str = "update", fsdp: int = 1, fast_path: str = "auto"
) -> dict:
    """One compile's figures (on the layers stacked for a stacked or vmapped variant) of the
    donated update step ``(params, state, grads) -> (params, state)`` or, for ``step="train"``,
    of `compile_train`'s step; with `fsdp` > 1, per device of a mesh that splits the matrices
    as the planner does (`sharded_params`)."""
    tx = optimizer(name, fast_path)
    if _on_stacked_layers(name):
        shapes = stacked(shapes)
    start = time.perf_counter()
    if fsdp > 1:
        params = sharded_params(shapes, dtype, target, fsdp)
    else:
        params = abstract_params(shapes, dtype, targets.device(target))
    compiled = plan.compile_update(tx, params) if step == "update" else compile_train(tx, params)
    seconds = time.perf_counter() - start
    local = [int(np.prod(p.sharding.shard_shape(p.shape))) for p in params.values()]
    n = sum(local)
    text = compiled.as_text()
    traffic = entry_traffic(text, local)
    mem = compiled.memory_analysis()
    return {
        "bytes_per_param": (traffic.bytes_read + traffic.bytes_written) / n,
        "kernels": traffic.kernels,
        "scalar_kernels": traffic.scalar_kernels,
        "temp_bytes": mem.temp_size_in_bytes,
        "peak_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes,
        "state_bytes": plan.shard_bytes(plan.abstract_state(tx, params)),
        "cpu_kernel_in_hlo": "optax_gwt_haar" in text,
        "compile_s": seconds,
    }  # fmt: skip


def run(
    target_names: list[str],
    dtypes: list[str],
    names: list[str],
    model: str = "60m",
    layers: int | None = None,
    step: str = "update",
    fsdp: int = 1,
    fast_path: str = "auto",
) -> dict:
    shapes = matrices(model, layers)
    out: dict[str, Any] = {
        "model": model,
        "layers": layers,
        "step": step,
        "fsdp": fsdp,
        "params": sum(int(np.prod(s)) for s in shapes.values()),
        "rows": [],
    }
    if fast_path != "auto":
        out["fast_path"] = fast_path
    for target in target_names:
        for dtype in dtypes:
            rows = {
                name: measure(target, jnp.dtype(dtype), name, shapes, step, fsdp, fast_path)
                for name in ["adamw", *names]
            }
            for name, r in rows.items():
                adamw = rows["adamw-stacked" if _on_stacked_layers(name) else "adamw"]
                saved = adamw["state_bytes"] - r["state_bytes"]
                r.update(target=target, dtype=dtype, optimizer=name, state_saved_bytes=saved)
                r["bytes_vs_adamw"] = r["bytes_per_param"] / adamw["bytes_per_param"]
                r["kernels_vs_adamw"] = r["kernels"] / adamw["kernels"]
                r["temp_vs_saved"] = r["temp_bytes"] / saved if saved else None
                r["peak_vs_adamw"] = r["peak_bytes"] / adamw["peak_bytes"]
                out["rows"].append(r)
                print(f"{target} {dtype} {name}: {r['bytes_per_param']:.2f} B/param, {r['kernels']} kernels, "
                      f"temp {r['temp_bytes'] / 2**20:.1f} MiB ({r['compile_s']:.1f} s)", flush=True)  # fmt: skip
    return out


def markdown(r: dict) -> str:
    lines = [
        "| target | dtype | optimizer | HBM B/param | vs AdamW | kernels | vs AdamW | scalar ops | temporaries, MiB "
        "| temporaries / state saved | peak, MiB | vs AdamW |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        share = "-" if x["temp_vs_saved"] is None else f"{100 * x['temp_vs_saved']:.1f}%"
        lines.append(
            f"| {x['target']} | {x['dtype']} | {x['optimizer']} | {x['bytes_per_param']:.2f} | "
            f"{x['bytes_vs_adamw']:.2f}x | {x['kernels']} | {x['kernels_vs_adamw']:.1f}x | {x['scalar_kernels']} | "
            f"{x['temp_bytes'] / 2**20:.1f} | {share} | {x['peak_bytes'] / 2**20:.1f} | {x['peak_vs_adamw']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=["h100", "v5e", "v6e"], choices=sorted(targets.TARGETS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=[
            "gwt1",
            "gwt2",
            "gwt3",
            "gwt2-nolimit",
            "gwt2-delayed",
            "adamw-stacked",
            "gwt2-stacked",
            "gwt2-vmapped",
        ],
        help="after adamw; a -stacked or -vmapped GWT is compared with adamw-stacked, which must come first",
    )
    p.add_argument("--model", default="60m", choices=sorted(CONFIGS), help="the LLaMA whose matrices are updated")
    p.add_argument("--layers", type=int, default=None, help="only the first N layers' matrices (default: all)")
    p.add_argument(
        "--step",
        default="update",
        choices=["update", "train"],
        help="the donated update step (grads an argument) or a train step (grads from its backward pass)",
    )
    p.add_argument(
        "--fsdp", type=int, default=1, help="split the matrices over this many chips as the planner does (per device)"
    )
    p.add_argument(
        "--fast-path",
        default="auto",
        choices=sorted(FAST_PATHS),
        help="GWT's fast_path: the table's rows (auto), all but the Pallas kernel (no-pallas), or none (xla)",
    )
    p.add_argument("--out", default="results/targets/update")
    args = p.parse_args(argv)
    r = run(args.targets, args.dtypes, args.optimizers, args.model, args.layers, args.step, args.fsdp, args.fast_path)
    r["jax"] = jax.__version__
    write_results(args.out, r, markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
