"""``python -m optax_gwt.plan``: plan a LLaMA run per optimizer, without allocating the model.

    python -m optax_gwt.plan --config 7b --devices 64 --mesh fsdp=64 --hbm 80
    python -m optax_gwt.plan --config 60m 130m 350m 1b --accelerator h100 --out results/plan/sizes
    python -m optax_gwt.plan --config 7b --mesh fsdp=64 --target v5e

The process simulates ``--devices`` CPU devices (``jax_num_cpu_devices``,
set before JAX starts its backend) and compiles, for every optimizer, the
whole train step on the mesh; nothing of the model's size is allocated. With
``--target`` it compiles for that chip instead, deviceless (`optax_gwt.targets`;
needs JAX's compile-only plugin for it), so that memory, largest batch and
roofline come from the chip's own compiler and figures.
Prints the table (GiB per device, at each optimizer's largest micro-batch)
and, with ``--out PREFIX``, writes ``PREFIX.md``, ``PREFIX.json`` and
``PREFIX.png`` (memory per device and largest batch against model size).

Needs Flax and, for the plot, Matplotlib: ``pip install "optax-gwt[plan]"``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence

from optax_gwt import _extras
from optax_gwt.models.llama_config import CONFIGS

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m optax_gwt.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", nargs="+", default=["1b"], choices=CONFIGS, metavar="NAME", help=f"models: {', '.join(CONFIGS)}"
    )
    p.add_argument("--devices", type=int, default=None, help="simulated devices (default: the mesh's)")
    p.add_argument("--mesh", default="fsdp=1", help="e.g. data=2,fsdp=4,tensor=2 (axes data, fsdp, tensor)")
    p.add_argument("--hbm", type=float, default=None, help="GiB per device (default: the accelerator's)")
    p.add_argument("--accelerator", default="h100", help="h100, h200, a100, v5e, v6e or v5p (figures only)")
    p.add_argument(
        "--target",
        default=None,
        choices=["h100", "a100", "v5e", "v6e", "v5p"],
        help="compile for this chip, deviceless (sets --accelerator)",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="override the accelerator's peak")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="override its HBM bandwidth (GB/s)")
    p.add_argument("--params", choices=DTYPES, default="fp32", help="params and gradients")
    p.add_argument("--state", choices=DTYPES, default="fp32", help="optimizer state")
    p.add_argument("--compute", choices=DTYPES, default="bf16", help="matmuls and activations")
    p.add_argument(
        "--remat", action=argparse.BooleanOptionalAction, default=True, help="recompute each layer in the backward"
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=None,
        help="default: optax_gwt.plan.llama.OPTIMIZERS; also foam-1 to foam-4 (PLANNABLE)",
    )
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--out", default=None, help="write OUT.md, OUT.json, OUT.png")
    return p.parse_args(argv)


def mesh_sizes(text: str) -> dict:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}``."""
    sizes = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if name.strip() not in ("data", "fsdp", "tensor") or not size.strip().isdigit():
            raise SystemExit(f"--mesh {text!r}: expected e.g. data=2,fsdp=4,tensor=2")
        sizes[name.strip()] = int(size)
    return sizes


def start_backend(devices: int) -> None:
    """`devices` simulated CPU devices."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    # LLVM's optimisations change the generated code, not XLA's buffers: skip them (half the compile time)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"


def accelerator(args: argparse.Namespace):
    from optax_gwt import plan as plan_lib

    acc = plan_lib.ACCELERATORS[args.target or args.accelerator]
    return acc._replace(
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else acc.peak_flops,
        hbm_bandwidth=args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else acc.hbm_bandwidth,
        hbm_bytes=int(args.hbm * 2**30) if args.hbm else acc.hbm_bytes,
    )


def plan_rows(args: argparse.Namespace, sizes: dict) -> list[dict]:
    """Plans every ``--config`` and returns the report's rows."""
    import jax

    from optax_gwt.plan import llama, report

    devices = None
    if args.target:
        from optax_gwt import targets

        devices = targets.devices(args.target, math.prod(sizes.values()))
    acc, mesh = accelerator(args), llama.make_mesh(sizes, devices)
    precision = llama.Precision(DTYPES[args.params], DTYPES[args.state], DTYPES[args.compute], args.remat)
    rows = []
    for name in args.config:
        cfg = CONFIGS[name]
        n_params = sum(x.size for x in jax.tree.leaves(llama.abstract_params(cfg)))
        plans = llama.plan_llama(
            cfg,
            mesh,
            acc.hbm_bytes,
            precision=precision,
            seq_len=args.seq_len,
            optimizers=args.optimizers or llama.OPTIMIZERS,
            max_batch=args.max_batch,
        )
        mine = []
        for opt, plan in plans.items():
            mine.append(
                report.row(name, opt, n_params, plan, acc, args.seq_len, sizes.get("data", 1) * sizes.get("fsdp", 1))
            )
            print(report.table(mine[-1:]).splitlines()[-1], f"  ({plan.seconds:.0f} s)", flush=True)
        rows += report.with_state_saved(mine)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with _extras.exit_on_missing():  # one line naming the extra, before anything starts
        _extras.check("plan", "optax_gwt.plan", "flax", *(["matplotlib"] if args.out else []))
    if args.target:
        from optax_gwt import targets

        missing = targets.missing_compiler(args.target)
        if missing:
            raise SystemExit(missing)
    sizes = mesh_sizes(args.mesh)
    start_backend(1 if args.target else args.devices or math.prod(sizes.values()))
    from optax_gwt.plan import report

    start = time.perf_counter()
    rows = plan_rows(args, sizes)
    settings = {
        **vars(args),
        "mesh": sizes,
        "accelerator": accelerator(args)._asdict(),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"\n{settings['accelerator']['name']}, {settings['accelerator']['hbm_bytes'] / 2**30:g} GiB per device, "
        f"mesh {sizes}, params {args.params}, state {args.state}, compute {args.compute}, remat {args.remat}, "
        f"seq {args.seq_len}; GiB per device at each optimizer's largest micro-batch\n"
    )
    print(report.table(rows))
    print(f"\nplanned in {settings['seconds']:.0f} s")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(report.markdown(rows) + "\n")
        with open(args.out + ".json", "w") as f:
            f.write(report.to_json(rows, settings) + "\n")
        report.plot(rows, args.out + ".png", settings["accelerator"]["hbm_bytes"] / 2**30)


if __name__ == "__main__":
    main()
