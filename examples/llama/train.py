"""Pre-train a LLaMA with GWT (or a baseline optimizer): the training CLI.

    python -m examples.llama.train --config 9m --optimizer gwt --level 2 --steps 300

The core is two pure functions, `make_train_step` and `make_eval_step`, jitted
with params and optimizer state donated; `run` is the loop around them
(data, progress bar, evaluation, JSON-lines metrics, checkpoints via
`examples.llama.checkpoint`). `run` returns the metrics so that
`examples.llama.compare` can call it per optimizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import optax_gwt
from optax_gwt.sharding import state_shardings
from examples.llama import data as data_lib
from examples.llama import model as model_lib
from examples.llama import mesh as mesh_lib
from examples.llama import optimizers
from examples.llama.checkpoint import Checkpointer, run_metadata

__all__ = ["build_parser", "loss_fn", "make_eval_step", "make_train_step", "parse_args", "run"]


# ---------------------------------------------------------------------------
# The core: pure step functions.
# ---------------------------------------------------------------------------


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of a (batch, seq_len + 1) token array."""
    logits = nnx.merge(graphdef, params)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, grad_accum: int = 1) -> Callable:
    """``(params, opt_state, batch) -> (params, opt_state, metrics)``, jitted, params and state donated.

    The batch (batch, seq_len + 1) is split into `grad_accum` micro-batches
    whose gradients are averaged in a `jax.lax.scan` (memory of one micro-batch).
    """

    def train_step(params, opt_state, batch):
        micro = batch.reshape(grad_accum, -1, batch.shape[-1])
        grad_fn = jax.value_and_grad(lambda p, mb: loss_fn(graphdef, p, mb))

        def accumulate(grad_sum, mb):
            loss, grads = grad_fn(params, mb)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        grads, losses = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), micro)
        grads = jax.tree.map(lambda g: g / grad_accum, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": losses.mean(), "grad_norm": optax.tree.norm(grads)}

    return jax.jit(train_step, donate_argnums=(0, 1))


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    """``(params, batch) -> mean loss``, jitted."""
    return jax.jit(lambda params, batch: loss_fn(graphdef, params, batch))


def evaluate(eval_step: Callable, params: nnx.State, val_batches: np.ndarray) -> float:
    """Mean loss over the fixed validation batches (eval_batches, batch, seq_len + 1)."""
    return float(np.mean([float(eval_step(params, b)) for b in val_batches]))


# ---------------------------------------------------------------------------
# The CLI.
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--config", default="9m", choices=sorted(model_lib.CONFIGS), help="the paper's model config")
    g.add_argument("--model", nargs="*", default=[], metavar="FIELD=VALUE", help="override LlamaConfig fields, e.g. num_layers=2")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="stdlib", help="'stdlib' (default, no download), 'c4', or a file/dir/glob of text files")
    g.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer name (needs transformers)")
    g.add_argument("--hf-path", default="allenai/c4", help="datasets path for --data c4 (e.g. a local copy of C4)")
    g.add_argument("--hf-name", default="en", help="datasets config name for --data c4")
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step (all micro-batches)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (must divide --batch-size)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out for validation")
    g.add_argument("--eval-batches", type=int, default=8, help="validation batches of --batch-size sequences")
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="gwt", choices=optimizers.OPTIMIZERS)
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per optimizer, see optimizers.DEFAULT_LR)")
    g.add_argument("--alpha", type=float, default=0.25, help="the matrices' lr factor (GWT/GaLore scale)")
    g.add_argument("--level", type=int, default=2, help="GWT levels")
    g.add_argument("--wavelet", default="haar")
    g.add_argument("--warmup-frac", type=float, default=0.1)
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this fraction of the peak")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--galore-rank", type=int, default=None, help="default: GaLore state <= GWT's at --level")
    g.add_argument("--galore-gap", type=int, default=200, help="GaLore projector update interval")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps (the schedule's length)")
    g.add_argument("--stop-at", type=int, default=None, help="stop after this step (the schedule still spans --steps)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eval-every", type=int, default=50)
    g.add_argument("--save-every", type=int, default=0, help="checkpoint interval in steps (0: only at the end, if --ckpt-dir)")
    g.add_argument("--ckpt-dir", default=None)
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    g.add_argument("--metrics", default=None, help="JSON-lines file for the metrics")
    g.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("devices")
    g.add_argument("--mesh", default=None, help="shard over a device mesh, e.g. data=2,fsdp=4 (see examples.llama.mesh)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0 for a multi-process run (jax.distributed)")
    g.add_argument("--num-processes", type=int, default=1)
    g.add_argument("--process-id", type=int, default=None)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.batch_size % args.grad_accum:
        raise SystemExit(f"--grad-accum {args.grad_accum} must divide --batch-size {args.batch_size}")
    if args.resume and not args.ckpt_dir:
        raise SystemExit("--resume needs --ckpt-dir")
    return args


def _model_overrides(items: Sequence[str]) -> dict:
    """``["num_layers=2", ...]`` -> ``{"num_layers": 2, ...}``, typed as the `LlamaConfig` fields."""
    types = {"int": int, "float": float, "str": str}
    fields = {f.name: types[str(f.type)] for f in dataclasses.fields(model_lib.LlamaConfig)}
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--model {item!r}: unknown field; choose from {sorted(fields)}")
        out[key] = fields[key](value)
    return out


def make_optimizer(args: argparse.Namespace, params: Any) -> optax.GradientTransformation:
    return optimizers.make_optimizer(
        args.optimizer,
        params,
        lr=args.lr,
        steps=args.steps,
        alpha=args.alpha,
        level=args.level,
        wavelet=args.wavelet,
        warmup_frac=args.warmup_frac,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        galore_rank=args.galore_rank,
        galore_gap=args.galore_gap,
    )


def run(args: argparse.Namespace) -> dict:
    """Trains as `args` say; returns ``{"history": [metrics per logged step], "summary": {...}}``."""
    mesh_lib.initialize(args.coordinator, args.num_processes, args.process_id)
    spec = data_lib.DataSpec(
        source=args.data,
        tokenizer=args.tokenizer,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        val_fraction=args.val_fraction,
        eval_batches=args.eval_batches,
        hf_path=args.hf_path,
        hf_name=args.hf_name,
    )
    tokenizer, train_data, val_batches = data_lib.make_data(spec)
    cfg = model_lib.get_config(args.config, tokenizer.vocab_size, **_model_overrides(args.model))
    graphdef, params = nnx.split(model_lib.Llama(cfg, nnx.Rngs(args.seed)), nnx.Param)
    tx = make_optimizer(args, params)
    place_batch = lambda batch: batch  # noqa: E731
    if args.mesh:
        mesh = mesh_lib.make_mesh(args.mesh)
        shardings = mesh_lib.param_shardings(params, mesh)
        params = jax.device_put(params, shardings)
        place_batch = functools.partial(mesh_lib.place, sharding=mesh_lib.batch_sharding(mesh))
    opt_state = jax.jit(tx.init, out_shardings=state_shardings(tx, params) if args.mesh else None)(params)

    n_params = sum(x.size for x in jax.tree.leaves(params))
    memory = state_memory(tx, params, args.steps)
    print(
        f"model {args.config} {cfg.hidden_size}x{cfg.num_layers} vocab {cfg.vocab_size}: {n_params / 1e6:.2f}M params | "
        f"optimizer {args.optimizer}: state {memory['state_bytes'] / 2**20:.2f} MiB = "
        f"{memory['state_bytes'] / memory['adamw_state_bytes']:.3f} x AdamW's (attention/MLP matrices "
        f"{memory['matrix_state_bytes'] / 2**20:.2f} MiB = {memory['matrix_state_bytes'] / memory['adamw_matrix_state_bytes']:.3f} x)",
        flush=True,
    )

    step = 0
    ckpt = Checkpointer(args.ckpt_dir, run=run_metadata(args, cfg)) if args.ckpt_dir else None
    if args.resume and ckpt.latest_step() is not None:
        params, opt_state, step = ckpt.restore(params, opt_state, train_data)
        print(f"resumed from step {step}", flush=True)
    metrics_file = _open_metrics(args.metrics, keep_until=step if args.resume else None) if jax.process_index() == 0 else None

    train_step = make_train_step(graphdef, tx, args.grad_accum)
    eval_step = make_eval_step(graphdef)
    if args.mesh:
        layouts = (shardings, state_shardings(tx, params))
        train_step = jax.jit(train_step, out_shardings=(*layouts, None), donate_argnums=(0, 1))
        eval_step = functools.partial(lambda step, p, b: step(p, place_batch(b)), eval_step)
    lr_fn = optimizers.make_schedule(1.0, args.steps, args.warmup_frac, args.min_lr_ratio)
    tokens_per_step = args.batch_size * args.seq_len
    last = min(args.steps, args.stop_at or args.steps)
    history, timed_tokens, timed_seconds = [], 0, 0.0
    bar = tqdm(total=last, initial=step, disable=args.no_progress or jax.process_index() > 0, desc=args.optimizer, dynamic_ncols=True)
    while step < last:
        batch = next(train_data)
        t0 = time.perf_counter()
        params, opt_state, m = train_step(params, opt_state, place_batch(batch))
        loss = float(m["loss"])  # waits for the step
        if step > 0 or args.resume:  # the first step of a process includes compilation
            timed_seconds += time.perf_counter() - t0
            timed_tokens += tokens_per_step
        step += 1
        record = {
            "step": step,
            "tokens": step * tokens_per_step,
            "loss": loss,
            "grad_norm": float(m["grad_norm"]),
            "lr_factor": float(lr_fn(step - 1)),
            "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None,
        }
        if step % args.eval_every == 0 or step == last:
            record["val_loss"] = evaluate(eval_step, params, val_batches)
            record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
        history.append(record)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s'] or 0:.0f}",
                        **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}))
        if ckpt and ((args.save_every and step % args.save_every == 0) or step == last):
            ckpt.save(step, params, opt_state, train_data)
    bar.close()
    if ckpt:
        ckpt.close()
    if metrics_file:
        metrics_file.close()

    evals = [r for r in history if "val_loss" in r]
    summary = {
        "optimizer": args.optimizer,
        "params": n_params,
        **memory,
        "lr": optimizers.DEFAULT_LR[args.optimizer] if args.lr is None else args.lr,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "final_val_ppl": evals[-1]["val_ppl"] if evals else None,
        "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None,
        "tokens": step * tokens_per_step,
    }
    return {"history": history, "summary": summary, "params": params}


def state_memory(tx: optax.GradientTransformation, params: Any, steps: int) -> dict:
    """Optimizer-state bytes of `tx` and of AdamW, in total and for the attention/MLP matrices."""
    adam = optimizers.make_optimizer("adamw", params, steps=steps)
    return {
        "state_bytes": optax_gwt.optimizer_state_bytes(tx, params).total,
        "matrix_state_bytes": optimizers.matrix_state_bytes(tx, params),
        "adamw_state_bytes": optax_gwt.optimizer_state_bytes(adam, params).total,
        "adamw_matrix_state_bytes": optimizers.matrix_state_bytes(adam, params),
    }


def _open_metrics(path: Optional[str], keep_until: Optional[int]):
    """The metrics file for appending; on resume, drops records past the restored step."""
    if not path:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if keep_until is None:
        return open(path, "w")
    kept = []
    if os.path.exists(path):
        with open(path) as fh:
            kept = [line for line in fh if line.strip() and json.loads(line)["step"] <= keep_until]
    fh = open(path, "w")
    fh.writelines(kept)
    return fh


def main(argv: Optional[Sequence[str]] = None) -> None:
    result = run(parse_args(argv))
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
