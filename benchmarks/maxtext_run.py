"""GWT inside MaxText through its one hook, ``maxtext.optimizers.optimizers.get_optimizer``.

    python -m benchmarks.maxtext_run --out results/maxtext/run   # where MaxText is installed (Python >= 3.12)

MaxText's ``opt_type`` is a closed list (adamw, adam_pax, sgd, muon) checked when its
config is parsed, so a new optimizer cannot be named in its YAML: this recipe leaves
``opt_type: adamw`` and replaces ``get_optimizer`` before MaxText's trainer starts (the
trainer looks it up on its module at each call). The replacement (`gwt_get_optimizer`)
applies `optax_gwt.gwt_adamw` to the scanned decoder layers' kernels and MaxText's own
AdamW (its betas, eps, weight decay and decay mask) to everything else, under MaxText's
learning-rate schedule.

The script runs MaxText's own ``maxtext.trainers.pre_train.train`` on synthetic data, on
the CPU, a tiny Llama-style decoder (`RUNS`: MaxText's adamw; GWT-2 as the paper states it;
GWT-2 with the recipe's default bound on its details, at scale 0.25 and 1; FOAM-2: same
config, data, learning rate and seed) in subprocesses, and writes ``<out>.json`` /
``<out>.md``: the losses and the optimizer-state bytes of the decoder kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import optax

import optax_gwt
from benchmarks import write_results

MODEL = [
    "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=256",
    "base_num_decoder_layers=2", "head_dim=16", "vocab_size=256", "max_target_length=64",
]  # fmt: skip


def _is_layer_kernel(path: tuple, x: Any) -> bool:
    # Dict keys only: at init MaxText's params may still be boxed (a trailing ``.value``).
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    return "layers" in keys and keys[-1] == "kernel" and x.ndim >= 3


def transform_axis(shape: tuple[int, ...], scan_axis: int | None) -> int:
    """The longest axis that is not the scanned layer axis (the last of equals)."""
    axes = [i for i in range(len(shape)) if i != scan_axis]
    return max(axes, key=lambda i: (shape[i], i))


def layer_matrices(
    learning_rate: optax.ScalarOrSchedule, adam: dict[str, Any], scan_axis: int | None, env: Mapping[str, str]
) -> optax.GradientTransformation:
    """GWT (or FOAM) for the scanned layers' kernels, set by `env` (``GWT_*``): each kernel
    transformed along its longest axis other than the layer axis, which is a batch axis."""
    shared = dict(
        level=int(env.get("GWT_LEVEL", "2")),
        scale=float(env.get("GWT_SCALE", "0.25")),
        axis=lambda path, x: transform_axis(x.shape, scan_axis),
        batch_axes=lambda path, x: (scan_axis,) if scan_axis is not None and x.ndim >= 3 else 0,
    )
    if env.get("GWT_RECIPE", "gwt") == "foam":
        return optax_gwt.foam_adamw(learning_rate, **adam, **shared)
    return optax_gwt.gwt_adamw(learning_rate, **adam, **shared, detail_clip=_detail_clip(env.get("GWT_DETAIL_CLIP")))


def gwt_get_optimizer(config, learning_rate_schedule, model=None, mesh=None) -> optax.GradientTransformation:
    """MaxText's ``get_optimizer``, GWT on the decoder layers' kernels, MaxText's AdamW elsewhere.

    GWT's settings come from the environment (``GWT_LEVEL``, ``GWT_SCALE``, ``GWT_DETAIL_CLIP``;
    ``GWT_RECIPE=foam`` for `optax_gwt.foam_adamw`), since MaxText's config rejects keys it
    does not know. The layer axis is MaxText's ``param_scan_axis``, which sits between a
    kernel's own axes (``(embed, layer, mlp)``): ``batch_axes`` names it, so that the limiter
    keeps one norm per layer's matrix, as for separate matrices.
    """
    from maxtext.optimizers import optimizers

    scan_axis = config.param_scan_axis if config.scan_layers else None
    adam = dict(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps, weight_decay=config.adam_weight_decay)
    matrices = layer_matrices(learning_rate_schedule, adam, scan_axis, os.environ)
    rest = optax.adamw(learning_rate_schedule, **adam, mask=optimizers.get_adamw_mask(config))

    def labels(params):
        return jax.tree_util.tree_map_with_path(lambda p, x: "gwt" if _is_layer_kernel(p, x) else "adamw", params)

    return _reporting(optax.multi_transform({"gwt": matrices, "adamw": rest}, labels))


def _detail_clip(text: str | None) -> float | None:
    """``GWT_DETAIL_CLIP``: unset for `optax_gwt.SAFE_DETAIL_CLIP`, ``none`` for the paper's (unbounded)."""
    if text is None:
        return optax_gwt.SAFE_DETAIL_CLIP
    return None if text.lower() == "none" else float(text)


def _reporting(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx`, printing at init the state bytes of the layers' kernels as one JSON line."""

    def init(params):
        per = jax.tree.leaves(optax_gwt.optimizer_state_bytes(tx, params).per_param)
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        kernels = sum(b for b, (p, x) in zip(per, flat, strict=True) if _is_layer_kernel(p, x))
        print("OPTAX_GWT_STATE " + json.dumps({"layer_kernels_bytes": int(kernels)}), flush=True)
        return tx.init(params)

    return optax.GradientTransformation(init, tx.update)


def _adamw_reporting(config, learning_rate_schedule, model=None, mesh=None):
    return _reporting(_ORIGINAL(config, learning_rate_schedule, model, mesh=mesh))


_ORIGINAL: Any = None


def train(argv: list[str], optimizer: str) -> None:
    """MaxText's pre-training entry point, with `optimizer` ("adamw" or "gwt") in place."""
    global _ORIGINAL
    from absl import app
    from maxtext.optimizers import optimizers
    from maxtext.trainers.pre_train import train as maxtext_train

    _ORIGINAL = optimizers.get_optimizer
    optimizers.get_optimizer = gwt_get_optimizer if optimizer == "gwt" else _adamw_reporting
    app.run(maxtext_train.main, argv=argv)  # as MaxText's own entry point (absl's flags and logging)


def run(workdir: Path, optimizer: str, steps: int, learning_rate: float, env: dict[str, str], **overrides: Any) -> dict:
    """One MaxText run in a subprocess (`env`: GWT's settings; `overrides`: MaxText config keys
    over this module's synthetic-data defaults): its training losses by step, its eval losses
    (``eval_losses``, when it evaluates), each step's seconds and the kernels' state bytes."""
    import maxtext

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    tag = [f"{zlib.crc32(repr(overrides).encode()):08x}"] if overrides else []
    name = "-".join([optimizer, *env.values(), f"lr{learning_rate:g}", *tag])
    keys = {"run_name": name, "base_output_directory": workdir, "dataset_type": "synthetic", "steps": steps,
            "hardware": "cpu", "per_device_batch_size": 4, "enable_checkpointing": "false",
            "skip_jax_distributed_system": "true", "learning_rate": learning_rate,
            **dict(kv.split("=", 1) for kv in MODEL), **overrides}  # fmt: skip
    args = [base, *(f"{k}={v}" for k, v in keys.items())]
    code = f"import sys; from benchmarks import maxtext_run; maxtext_run.train(sys.argv[1:], {optimizer!r})"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("GWT_")}  # each run's own settings only
    full_env = {**inherited, "JAX_PLATFORMS": "cpu", **env}
    done = subprocess.run([sys.executable, "-c", code, "_", *args], capture_output=True, text=True, env=full_env)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"MaxText ({name}) failed:\n{out[-4000:]}")
    losses = {int(s): float(v) for s, v in re.findall(r"completed step: (\d+),.*? loss: ([0-9.]+)", out)}
    evals = {int(s): float(v) for s, v in re.findall(r"Completed eval after train step (\d+).*?loss=([0-9.]+)", out)}
    seconds = [float(v) for v in re.findall(r"completed step: \d+, seconds: ([0-9.]+)", out)]
    state = json.loads(out[out.index("OPTAX_GWT_STATE ") + 16 :].splitlines()[0])
    return {"losses": losses, **({"eval_losses": evals} if evals else {}), "step_seconds": seconds, **state}


#: name: (MaxText's optimizer hook, GWT's settings, the table's column).
RUNS = {
    "adamw": ("adamw", {}, "MaxText adamw"),
    "gwt-paper": ("gwt", {"GWT_DETAIL_CLIP": "none"}, "GWT-2, the paper's"),
    "gwt": ("gwt", {}, "GWT-2, recipe default"),
    "gwt-scale-1": ("gwt", {"GWT_SCALE": "1"}, "GWT-2, recipe default, scale 1"),
    "foam": ("gwt", {"GWT_RECIPE": "foam"}, "FOAM-2"),
}


def markdown(r: dict) -> str:
    losses = [{int(k): v for k, v in r[name]["losses"].items()} for name in RUNS]
    titles = [title for _, _, title in RUNS.values()]
    lines = ["| step | " + " | ".join(titles) + " |", "|---|" + "---|" * len(titles)]
    steps = sorted(losses[0])
    every = max(1, len(steps) // 10)
    for s in [s for s in steps if s % every == 0 or s == steps[-1]]:
        lines.append(f"| {s} | " + " | ".join(f"{run.get(s, float('nan')):.4f}" for run in losses) + " |")
    a, g = r["adamw"]["layer_kernels_bytes"], r["gwt"]["layer_kernels_bytes"]
    lines += ["", f"Decoder layers' kernels, optimizer state: GWT-2 {g:,} B, adamw {a:,} B ({g / a:.3f}x)."]
    return "\n".join(lines)


def require_maxtext(command: str) -> dict[str, str]:
    """The versions of MaxText, JAX and Optax, or exit naming what `command` needs."""
    try:
        import maxtext
    except ImportError:
        sys.exit(f"{command} needs MaxText: pip install 'maxtext[tpu]' (Python >= 3.12)")
    return {"maxtext": maxtext.__version__, "jax": jax.__version__, "optax": optax.__version__}


def main(argv=None) -> None:
    versions = require_maxtext("benchmarks.maxtext_run")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/maxtext/run")
    p.add_argument("--workdir", default="runs/maxtext")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    args = p.parse_args(argv)
    workdir = Path(args.workdir).resolve()
    r: dict[str, Any] = {"steps": args.steps, "learning_rate": args.learning_rate, "model": MODEL}
    for name, (optimizer, env, _) in RUNS.items():
        r[name] = run(workdir, optimizer, args.steps, args.learning_rate, env)
    r["versions"] = versions
    write_results(args.out, r, markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
