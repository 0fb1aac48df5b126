"""Pre-train a LLaMA with GWT (or a baseline optimizer): the training CLI.

    python -m examples.llama.train                                  # 9m, GWT-2, 300 steps on the stdlib
    python -m examples.llama.train --optimizer adamw --steps 100 --quiet
    python -m examples.llama.train --resume runs/gwt-2-20261203-081512   # continue a run, bit-for-bit

Every run writes a run directory (default ``runs/<optimizer>-<UTC time>/``,
see `examples.llama.rundir`): ``config.json``, ``metrics.jsonl``, the Orbax
checkpoint(s) in ``checkpoints/`` and ``loss.png``; at the end it prints a
summary (validation loss, tokens/s, optimizer-state bytes, wall time) naming
the directory. ``--quiet``: only that summary; ``--json``: only the summary as
one JSON line. ``--resume DIR`` reads DIR's config.json, so the flags need not
be repeated (flags given again override it; changing what defines the run is
refused).

The core is two pure functions, `make_train_step` and `make_eval_step`, jitted
with params and optimizer state donated; `run` is the loop around them and
returns the metrics, so that `examples.llama.compare` can call it per optimizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gwt
from optax_gwt import _extras, modular
from optax_gwt.sharding import state_shardings

with _extras.entry_point(__name__, "examples", "python -m examples.llama.train"):
    from flax import nnx
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    from examples.llama import data as data_lib, diagnostics as diagnostics_lib, mesh as mesh_lib, rundir
    from examples.llama.checkpoint import Checkpointer, run_metadata
    from optax_gwt.models import llama as model_lib

__all__ = [
    "HelpFormatter",
    "build_parser",
    "loss_fn",
    "main",
    "make_eval_step",
    "make_train_step",
    "parse_args",
    "peak_lr",
    "run",
    "run_name",
]


# ---------------------------------------------------------------------------
# The core: pure step functions.
# ---------------------------------------------------------------------------


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of a (batch, seq_len + 1) token array."""
    logits = nnx.merge(graphdef, params)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    grad_accum: int = 1,
    diagnostics: Callable[[Any, Any], dict] | None = None,
) -> Callable:
    """``(params, opt_state, batch) -> (params, opt_state, metrics)``, jitted, params and state donated.

    The batch (batch, seq_len + 1) is split into `grad_accum` micro-batches
    whose gradients are averaged in a `jax.lax.scan` (memory of one micro-batch).
    `diagnostics`, given: ``(updates, new opt_state) -> {key: scalar}`` (such as
    `examples.llama.diagnostics.collect`), merged into the metrics.
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
        metrics = {"loss": losses.mean(), "grad_norm": optax.tree.norm(grads)}
        if diagnostics is not None:
            metrics.update(diagnostics(updates, opt_state))
        return params, opt_state, metrics

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


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` keeps the description's layout and shows every option's default."""


#: Flags that a resumed run does not take from the run directory's config.json.
NOT_RESUMED = ("resume", "run_dir", "stop_at", "quiet", "json", "no_progress")


def _add_model_and_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--config", default="9m", choices=sorted(model_lib.CONFIGS), help="the paper's model config")
    g.add_argument(
        "--model", nargs="*", default=[], metavar="FIELD=VALUE", help="override LlamaConfig fields, e.g. num_layers=2"
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", default="stdlib", help="'stdlib' (no download), 'c4', or a file/dir/glob of text files")
    g.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer name (needs transformers)")
    g.add_argument("--hf-path", default="allenai/c4", help="datasets path for --data c4 (e.g. a local copy of C4)")
    g.add_argument("--hf-name", default="en", help="datasets config name for --data c4")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step (all micro-batches)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (must divide --batch-size)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out for validation")
    g.add_argument("--eval-batches", type=int, default=8, help="validation batches of --batch-size sequences")
    g.add_argument(
        "--contiguous-windows",
        type=int,
        default=1,
        help="draw training windows K consecutive at a time (K must divide --batch-size): a batch is then the "
        "text of --batch-size/K windows of K x --seq-len tokens, with the shorter context (a control)",
    )
    g.add_argument(
        "--val-span",
        type=int,
        default=0,
        help="0: validation windows spread evenly over the validation text (the text changes with --seq-len); "
        "N: windows cut from evenly spaced spans of N tokens, the same predicted tokens of the same text at "
        "every --seq-len dividing N, at a fixed --batch-size x --seq-len (examples.llama.data.span_windows)",
    )


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="gwt", choices=modular.OPTIMIZERS, help="see optax_gwt/modular.py")
    g.add_argument(
        "--lr", type=float, default=None, help="peak learning rate; None: the optimizer's modular.DEFAULT_LR"
    )
    g.add_argument("--alpha", type=float, default=0.25, help="the matrices' lr factor (GWT/GaLore scale)")
    g.add_argument("--level", type=int, default=2, help="GWT levels")
    g.add_argument("--wavelet", default="haar", help="GWT's wavelet (a PyWavelets name)")
    g.add_argument(
        "--detail-rule",
        default="auto",
        choices=optax_gwt.DETAIL_RULES,
        help="GWT's detail rule (optax_gwt.wavelet_inverse; auto: adam for Adam, else norm_ratio)",
    )
    g.add_argument("--warmup-frac", type=float, default=0.1, help="linear warm-up, as a share of --steps")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this fraction of the peak")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay of the matrices")
    g.add_argument("--b2", type=float, default=0.999, help="the second moment's decay (AdamW, GWT and FOAM)")
    g.add_argument(
        "--galore-rank", type=int, default=None, help="None: the largest rank whose state <= GWT's at --level"
    )
    g.add_argument("--galore-gap", type=int, default=200, help="GaLore projector update interval")
    g.add_argument(
        "--norm-growth-limit",
        type=float,
        default=1.01,
        help="GWT-AdamW's limiter gamma: the step's norm grows at most this factor a step (0: no limiter)",
    )
    g.add_argument(
        "--detail-clip",
        type=float,
        default=None,
        help="GWT's bound on the details' part of the update, in Adam steps (None: the paper's, unbounded)",
    )
    g.add_argument(
        "--gwt-axis", type=int, default=0, choices=(0, 1), help="GWT-AdamW's transform axis of each (in, out) kernel"
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps (the schedule's length)")
    g.add_argument("--stop-at", type=int, default=None, help="stop after this step (the schedule still spans --steps)")
    g.add_argument("--seed", type=int, default=0, help="model init and data order")
    g.add_argument("--eval-every", type=int, default=50, help="validation interval in steps (and at the last step)")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint interval in steps (0: only at the end)")
    g = p.add_argument_group("output")
    g.add_argument("--run-dir", default=None, help="where the run's files go; None: runs/<optimizer>-<UTC time>")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR from its latest checkpoint, with its config.json's flags; "
                        "without RUN_DIR: the checkpoints of --run-dir or --ckpt-dir")  # fmt: skip
    g.add_argument("--ckpt-dir", default=None, help="checkpoint folder; None: <run dir>/checkpoints")
    g.add_argument("--metrics", default=None, help="JSON-lines metrics file; None: <run dir>/metrics.jsonl")
    g.add_argument("--quiet", action="store_true", help="no start line and no progress bar: only the final summary")
    g.add_argument("--json", action="store_true", help="print nothing but the summary, as one JSON line (for scripts)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--diagnostics",
        action="store_true",
        help="also record per step, per parameter group (qk, vo, mlp, other), in metrics.jsonl: the update's "
        "norm (update_norm/G), its high-frequency share (highfreq_share/G) and GWT's limiter factor "
        "(limiter_scale_mean/G, limiter_scale_max/G); see examples.llama.diagnostics",
    )
    g.add_argument("--diagnostics-axis", type=int, default=0, help="the axis of highfreq_share's block means")
    g.add_argument(
        "--diagnostics-level", type=int, default=None, help="highfreq_share's blocks are 2^level; None: --level"
    )


def _add_device_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices")
    g.add_argument(
        "--mesh", default=None, help="shard over a device mesh, e.g. data=2,fsdp=4 (see examples.llama.mesh)"
    )
    g.add_argument(
        "--coordinator", default=None, help="host:port of process 0 for a multi-process run (jax.distributed)"
    )
    g.add_argument("--num-processes", type=int, default=1, help="processes of a multi-process run")
    g.add_argument("--process-id", type=int, default=None, help="this process's index (None: from the environment)")


def build_parser() -> argparse.ArgumentParser:
    """The training CLI's parser (`compare` documents its train flags with it too)."""
    p = argparse.ArgumentParser(
        prog="python -m examples.llama.train", description=__doc__, formatter_class=HelpFormatter
    )
    for add in (_add_model_and_data_args, _add_optimizer_args, _add_run_args, _add_device_args):
        add(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses `argv`; with ``--resume RUN_DIR``, RUN_DIR's config.json supplies the flags not given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume:
        if args.run_dir and os.path.abspath(args.run_dir) != os.path.abspath(args.resume):
            parser.error("--resume RUN_DIR continues RUN_DIR; leave out --run-dir")
        saved = rundir.read_config(args.resume)["args"]
        parser.set_defaults(**{k: v for k, v in saved.items() if k in vars(args) and k not in NOT_RESUMED})
        args = parser.parse_args(argv)
        args.run_dir = args.resume
    if args.resume == "" and not (args.run_dir or args.ckpt_dir):
        parser.error("--resume without a run directory needs --run-dir or --ckpt-dir")
    if args.batch_size % args.grad_accum:
        parser.error(f"--grad-accum {args.grad_accum} must divide --batch-size {args.batch_size}")
    args.argv = argv
    return args


def run_name(args: argparse.Namespace) -> str:
    """``gwt-2`` for GWT and FOAM optimizers (with their level), else the optimizer's name."""
    return f"{args.optimizer}-{args.level}" if "gwt" in args.optimizer or args.optimizer == "foam" else args.optimizer


def peak_lr(args: argparse.Namespace) -> float:
    """``--lr``, or the optimizer's default peak learning rate."""
    return modular.DEFAULT_LR[args.optimizer] if args.lr is None else args.lr


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
    return modular.make_optimizer(
        args.optimizer,
        params,
        lr=args.lr,
        steps=args.steps,
        alpha=args.alpha,
        level=args.level,
        wavelet=args.wavelet,
        detail_rule=args.detail_rule,
        warmup_frac=args.warmup_frac,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        b2=getattr(args, "b2", 0.999),
        galore_rank=args.galore_rank,
        galore_gap=args.galore_gap,
        norm_growth_limit=getattr(args, "norm_growth_limit", 1.01) or None,
        detail_clip=getattr(args, "detail_clip", None),
        gwt_axis=getattr(args, "gwt_axis", 0),
    )


# ---------------------------------------------------------------------------
# A run: setup, loop, outputs.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """What one run trains: the model, its state, the data and the compiled steps."""

    cfg: model_lib.LlamaConfig
    params: Any
    opt_state: Any
    tx: optax.GradientTransformation
    train_data: Any
    val_batches: np.ndarray
    train_step: Callable
    eval_step: Callable
    place_batch: Callable


def _data_spec(args: argparse.Namespace) -> data_lib.DataSpec:
    return data_lib.DataSpec(
        source=args.data,
        tokenizer=args.tokenizer,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        val_fraction=args.val_fraction,
        eval_batches=args.eval_batches,
        val_span=getattr(args, "val_span", 0),
        contiguous=getattr(args, "contiguous_windows", 1),
        hf_path=args.hf_path,
        hf_name=args.hf_name,
    )


def _diagnostics(args: argparse.Namespace) -> Callable | None:
    """`examples.llama.diagnostics.collect` at the ``--diagnostics-*`` axis and level, if ``--diagnostics``."""
    if not args.diagnostics:
        return None
    level = args.level if args.diagnostics_level is None else args.diagnostics_level
    return functools.partial(diagnostics_lib.collect, axis=args.diagnostics_axis, level=level)


def make_job(args: argparse.Namespace) -> Job:
    """Data, model, optimizer and the jitted steps; sharded over ``--mesh`` when given."""
    tokenizer, train_data, val_batches = data_lib.make_data(_data_spec(args))
    cfg = model_lib.get_config(args.config, tokenizer.vocab_size, **_model_overrides(args.model))
    graphdef, params = nnx.split(model_lib.Llama(cfg, nnx.Rngs(args.seed)), nnx.Param)
    tx = make_optimizer(args, params)
    train_step = make_train_step(graphdef, tx, args.grad_accum, _diagnostics(args))
    eval_step = make_eval_step(graphdef)
    place_batch = lambda batch: batch  # noqa: E731
    if args.mesh:
        mesh = mesh_lib.make_mesh(args.mesh)
        shardings = mesh_lib.param_shardings(params, mesh)
        params = jax.device_put(params, shardings)
        place_batch = functools.partial(mesh_lib.place, sharding=mesh_lib.batch_sharding(mesh))
        layouts = (shardings, state_shardings(tx, params))
        train_step = jax.jit(train_step, out_shardings=(*layouts, None), donate_argnums=(0, 1))
        eval_step = functools.partial(lambda step, p, b: step(p, place_batch(b)), eval_step)
    opt_state = jax.jit(tx.init, out_shardings=state_shardings(tx, params) if args.mesh else None)(params)
    return Job(cfg, params, opt_state, tx, train_data, val_batches, train_step, eval_step, place_batch)


def state_memory(tx: optax.GradientTransformation, params: Any, steps: int) -> dict:
    """Optimizer-state bytes of `tx` and of AdamW, in total and for the attention/MLP matrices."""
    adam = modular.make_optimizer("adamw", params, steps=steps)
    return {
        "state_bytes": optax_gwt.optimizer_state_bytes(tx, params).total,
        "matrix_state_bytes": modular.matrix_state_bytes(tx, params),
        "adamw_state_bytes": optax_gwt.optimizer_state_bytes(adam, params).total,
        "adamw_matrix_state_bytes": modular.matrix_state_bytes(adam, params),
    }


def _describe(args: argparse.Namespace, job: Job, memory: dict) -> str:
    """The start line: model size and the optimizer state against AdamW's."""
    cfg, n_params = job.cfg, sum(x.size for x in jax.tree.leaves(job.params))
    return (
        f"model {args.config} {cfg.hidden_size}x{cfg.num_layers} vocab {cfg.vocab_size}: "
        f"{n_params / 1e6:.2f}M params | "
        f"optimizer {run_name(args)}: state {memory['state_bytes'] / 2**20:.2f} MiB = "
        f"{memory['state_bytes'] / memory['adamw_state_bytes']:.3f} x AdamW's (attention/MLP matrices "
        f"{memory['matrix_state_bytes'] / 2**20:.2f} MiB = "
        f"{memory['matrix_state_bytes'] / memory['adamw_matrix_state_bytes']:.3f} x)"
    )


def _claim_run_dir(args: argparse.Namespace) -> str:
    """The run directory: ``--run-dir``, or a new ``runs/<name>-<UTC time>`` (the same on every process)."""
    if args.run_dir:
        os.makedirs(args.run_dir, exist_ok=True)
        return args.run_dir
    now = time.time()
    if jax.process_count() > 1:  # one name for all processes: process 0's clock
        from jax.experimental import multihost_utils

        return rundir.default_run_dir(run_name(args), int(multihost_utils.broadcast_one_to_all(np.int32(now))))
    for suffix in ("", *(f"-{i}" for i in range(2, 100))):  # two runs started in the same second
        path = rundir.default_run_dir(run_name(args), now) + suffix
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise SystemExit(f"could not create a new run directory {path}")


def _start_step(args: argparse.Namespace, job: Job, ckpt: Checkpointer, log: Callable[[str], None]) -> int:
    """Restores the latest checkpoint on ``--resume`` (0 if there is none); refuses to overwrite one otherwise."""
    latest = ckpt.latest_step()
    where = ckpt.manager.directory
    if args.resume is None:
        if latest is not None:
            raise SystemExit(f"{where} already holds a checkpoint (step {latest}): continue it with "
                             f"--resume {args.run_dir}, or start afresh with another --run-dir")  # fmt: skip
        return 0
    if latest is None:
        log(f"no checkpoint in {where} yet: starting from step 0")
        return 0
    job.params, job.opt_state, step = ckpt.restore(job.params, job.opt_state, job.train_data)
    log(f"resumed from step {step} of {where}")
    return step


def _write_config(args: argparse.Namespace, job: Job, path: str) -> None:
    """config.json: the flags (what --resume reads back), the resolved lr and model, the command and provenance."""
    flags = {k: v for k, v in vars(args).items() if k != "argv"}
    rundir.write_json(path, {
        "command": rundir.command_line("examples.llama.train", args.argv),
        "args": flags,
        "lr": peak_lr(args),
        "model_config": dataclasses.asdict(job.cfg),
        "commit": rundir.git_commit(),
        "started": rundir.timestamp(time.time()),
        "environment": rundir.environment(),
    })  # fmt: skip


@dataclasses.dataclass
class Throughput:
    """Tokens and seconds of the timed steps (a process's first step includes compilation)."""

    tokens: int = 0
    seconds: float = 0.0

    def per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


def _train_loop(
    args: argparse.Namespace, job: Job, step: int, ckpt: Checkpointer, metrics_file
) -> tuple[list, Throughput]:
    """Steps from `step` to the last one, logging, evaluating and checkpointing; returns the records."""
    lr_fn = modular.make_schedule(1.0, args.steps, args.warmup_frac, args.min_lr_ratio)
    tokens_per_step, last = args.batch_size * args.seq_len, min(args.steps, args.stop_at or args.steps)
    history, speed, first = [], Throughput(), step
    quiet = args.no_progress or args.quiet or args.json or jax.process_index() > 0
    bar = tqdm(total=last, initial=step, disable=quiet, desc=run_name(args), dynamic_ncols=True)
    while step < last:
        batch = job.place_batch(next(job.train_data))
        t0 = time.perf_counter()
        job.params, job.opt_state, m = job.train_step(job.params, job.opt_state, batch)
        loss = float(m["loss"])  # waits for the step
        if step > first:
            speed.seconds += time.perf_counter() - t0
            speed.tokens += tokens_per_step
        step += 1
        record = {"step": step, "tokens": step * tokens_per_step, "loss": loss, "grad_norm": float(m["grad_norm"]),
                  "lr_factor": float(jnp.asarray(lr_fn(step - 1))), "tokens_per_s": speed.per_second()}  # fmt: skip
        record.update({k: float(v) for k, v in m.items() if "/" in k})  # the --diagnostics keys
        if step % args.eval_every == 0 or step == last:
            record["val_loss"] = evaluate(job.eval_step, job.params, job.val_batches)
            record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
        history.append(record)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed.per_second() or 0:.0f}",
                        **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}))  # fmt: skip
        if (args.save_every and step % args.save_every == 0) or step == last:
            ckpt.save(step, job.params, job.opt_state, job.train_data)
    bar.close()
    return history, speed


def run(args: argparse.Namespace) -> dict:
    """Trains as `args` say, into the run directory.

    Returns ``{"history": [metrics per step of this process], "summary": {...}, "params": ...}``.
    """
    started = time.perf_counter()
    mesh_lib.initialize(args.coordinator, args.num_processes, args.process_id)
    args.run_dir = _claim_run_dir(args)
    writer = jax.process_index() == 0
    log = functools.partial(print, flush=True) if writer and not (args.quiet or args.json) else lambda _: None
    job = make_job(args)
    memory = state_memory(job.tx, job.params, args.steps)
    log(_describe(args, job, memory))
    ckpt = Checkpointer(
        args.ckpt_dir or os.path.join(args.run_dir, rundir.CHECKPOINTS), run=run_metadata(args, job.cfg)
    )
    step = _start_step(args, job, ckpt, log)
    config_path, metrics_path = (
        os.path.join(args.run_dir, rundir.CONFIG),
        args.metrics or os.path.join(args.run_dir, rundir.METRICS),
    )
    if writer and not (args.resume is not None and os.path.exists(config_path)):
        _write_config(args, job, config_path)
    metrics_file = (
        rundir.open_metrics(metrics_path, keep_until=step if args.resume is not None else None) if writer else None
    )
    try:
        history, speed = _train_loop(args, job, step, ckpt, metrics_file)
    finally:
        ckpt.close()
        if metrics_file:
            metrics_file.close()
    records = rundir.read_metrics(metrics_path) if writer else history  # on resume: all segments' records
    if writer:
        rundir.plot_losses(records, os.path.join(args.run_dir, rundir.PLOT), run_name(args))
    summary = _summary(args, job, records, memory, speed, time.perf_counter() - started)
    return {"history": history, "summary": summary, "params": job.params}


def _summary(args: argparse.Namespace, job: Job, records: list, memory: dict, speed: Throughput, wall_s: float) -> dict:
    """The run's result: final validation loss, this segment's throughput, state bytes, where it is (JSON-able)."""
    evals = [r for r in records if "val_loss" in r]
    return {
        "name": run_name(args),
        "optimizer": args.optimizer,
        "params": sum(x.size for x in jax.tree.leaves(job.params)),
        **memory,
        "lr": peak_lr(args),
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "final_val_ppl": evals[-1]["val_ppl"] if evals else None,
        "tokens_per_s": speed.per_second(),
        "step": records[-1]["step"] if records else 0,
        "tokens": records[-1]["tokens"] if records else 0,
        "wall_s": wall_s,
        "run_dir": args.run_dir,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    summary = run(args)["summary"]
    if jax.process_index() == 0:
        print(json.dumps(summary) if args.json else rundir.format_summary(summary), flush=True)


if __name__ == "__main__":
    main()
