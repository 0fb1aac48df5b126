"""What XLA on the CPU can fuse of GWT-2's step: the experiment behind issue 22.

Run from the repository root::

    python -m benchmarks.fusion_limits --out results/benchmarks/fusion_limits
    XLA_FLAGS=--xla_backend_extra_options=xla_cpu_use_multi_output_fusion \
        python -m benchmarks.fusion_limits --rows adamw,gwt2-xla --rounds 3 \
        --out results/benchmarks/fusion_limits_mof

The bytes limit of GWT-2's donated train step is one read of ``G`` for the
moments (4 B/param in float32), the quarter-size moments read and written
(2 + 2), the limiter's norm reading them (2) and the final pass reading ``P,
G``, the moments and writing ``P`` (14): 24 B/param, where `optax_gwt`'s XLA
path moves 29. The library keeps ``m`` and ``v`` in two arrays, and XLA on the
CPU (no sibling multi-output fusion by default) computes them in two fusions
that each read ``G``. The rows ``interleaved-*`` are prototypes (not library
code) that keep both moments in one array, ``(..., 2, n)`` with the moments'
rows interleaved, updated by one elementwise fusion that reads ``G`` once; they
differ in how the limiter's norm pairs each ``m`` with its ``v``:

* ``interleaved-sum``: ``sum((m / (sqrt(v) + eps))^2)`` on slices of the array
  (XLA hands the sum to YNNPACK, which takes no slices: both are copied out);
* ``interleaved-prod``: ``m / (sqrt(v) + eps)`` as a product over the slot axis
  (an XLA reduction that fuses with the array), then the sum (YNNPACK): one
  quarter-size temporary written and read;
* ``interleaved-variadic``: a two-output reduction, which XLA does not hand to
  YNNPACK and fuses with the slices (no temporary), but runs on one thread.

Every row transforms the attention and MLP matrices of 60m (``--model``), Haar
level 2 along axis 0, with the limiter, bias correction, alpha and decoupled
weight decay (the prototypes follow `optax_gwt.gwt_adamw`'s math, not its
exact rounding, and are written for float32: in bfloat16 they write per-block
temporaries that the library's path avoids). For each: the fusions and bytes per parameter of the compiled
donated train step (`optax_gwt.hlo_traffic`), XLA's temporaries, and its
step-time ratio to `optax.adamw` in alternating rounds
(`benchmarks.optimizer_step.measure`). Results go to ``--out`` as JSON and
Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import optax_gwt
from benchmarks.llama_shapes import CONFIGS, llama_params
from benchmarks.optimizer_step import LEARNING_RATE, WEIGHT_DECAY, command_line, machine, measure
from optax_gwt import haar

B1, B2, EPS, GAMMA, ALPHA, BLOCK = 0.9, 0.999, 1e-6, 1.01, 0.25, 4
NORMS = ("sum", "prod", "variadic")


class InterleavedState(NamedTuple):
    count: jax.Array
    moments: dict  # per matrix (n / B, 2, k): row i of m, then row i of v
    norm_prev: dict


def _norm_sq(moments: jax.Array, how: str) -> jax.Array:
    """``sum((m / (sqrt(v) + eps))^2)`` of one interleaved array, computed as `how` says."""
    x = moments.astype(jnp.float32)
    if how == "prod":
        slot = jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1)
        s = jnp.prod(jnp.where(slot == 0, x, 1 / (jnp.sqrt(x) + EPS)), axis=1)
        return jnp.sum(s * s)
    s = x[:, 0, :] / (jnp.sqrt(x[:, 1, :]) + EPS)
    if how == "sum":
        return jnp.sum(s * s)
    total, aside = jax.lax.reduce((s * s, s), (jnp.float32(0), jnp.float32(0)), _add_pairs, (0, 1))
    return total + 0 * aside  # the second output is used, so XLA keeps the reduction variadic


def _add_pairs(x, y):
    return x[0] + y[0], x[1] + y[1]


def interleaved_gwt2(norm: str) -> optax.GradientTransformation:
    """Prototype: GWT-2 (Haar, axis 0, reference Adam, limiter) with interleaved moments."""

    def init_fn(params):
        def zeros(p):
            return jnp.zeros((p.shape[0] // BLOCK, 2, *p.shape[1:]), p.dtype)

        norm_prev = jax.tree.map(lambda p: jnp.zeros([], jnp.float32), params)
        return InterleavedState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params), norm_prev)

    def update_fn(grads, state, params):
        count = state.count + 1
        t = count.astype(jnp.float32)
        step = jnp.sqrt(1 - B2**t) / (1 - B1**t)
        slot = jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1)
        decay = jnp.where(slot == 0, B1, B2).astype(jnp.float32)

        def one(g, moments, prev, p):
            a = haar.block_sums(g.astype(jnp.float32), 0, BLOCK) * BLOCK**-0.5
            ab = a[:, None, :]
            new = decay * moments.astype(jnp.float32) + (1 - decay) * jnp.where(slot == 0, ab, ab * ab)
            moments = new.astype(moments.dtype)
            r = jnp.sqrt(_norm_sq(moments, norm))
            lam = jnp.where(count == 1, 1.0, jnp.maximum(r / (prev + 1e-8), GAMMA) / GAMMA)
            u = haar.adam_update(
                g, a * BLOCK**0.5, moments[:, 0, :], moments[:, 1, :], axis=0, block=BLOCK, eps=EPS,
                approx_factor=step / lam, detail_factor=step / lam,
            )  # fmt: skip
            lr = jnp.asarray(LEARNING_RATE, u.dtype)
            # (p - lr * alpha * u) * (1 - lr * wd) - p, with u used once (else XLA writes it out)
            update = -lr * ALPHA * (1 - lr * WEIGHT_DECAY) * u - lr * WEIGHT_DECAY * p.astype(u.dtype)
            return update.astype(p.dtype), moments, r / lam

        out = jax.tree.map(one, grads, state.moments, state.norm_prev, params)
        pick = functools.partial(jax.tree.map, is_leaf=lambda x: isinstance(x, tuple))
        updates, moments, norm_prev = (pick(lambda o, i=i: o[i], out) for i in range(3))
        return updates, InterleavedState(count, moments, norm_prev)

    return optax.GradientTransformation(init_fn, update_fn)


def rows(names: list[str], dtype) -> dict[str, optax.GradientTransformation]:
    """The compared optimizers, by row name."""

    def gwt2(kernel: bool):
        return optax_gwt.gwt_adamw(
            LEARNING_RATE, weight_decay=WEIGHT_DECAY, level=2, scale=ALPHA, mu_dtype=dtype, nu_dtype=dtype,
            fast_path=optax_gwt.FastPath(cpu_kernel=kernel),
        )  # fmt: skip

    table = {
        "adamw": lambda: optax.adamw(LEARNING_RATE, eps=EPS, weight_decay=WEIGHT_DECAY, mu_dtype=dtype),
        "gwt2": lambda: gwt2(True),
        "gwt2-xla": lambda: gwt2(False),
        **{f"interleaved-{n}": functools.partial(interleaved_gwt2, n) for n in NORMS},
    }
    return {name: table[name]() for name in names}


def markdown(report: dict) -> str:
    lines = [
        f"`{report['command']}` ({report['date']}, {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, load {report['machine']['load_average'][0]:.2f} at start; "
        f"XLA_FLAGS={report['xla_flags'] or '(none)'})",
        "",
        "| dtype | row | fusions | B/param (HLO) | temporaries MiB | step / AdamW's |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, res in report["dtypes"].items():
        for name, r in res["optimizers"].items():
            h = r["hlo"]
            moved = h["bytes_read_per_param"] + h["bytes_written_per_param"]
            temp = r["step_memory"]["temp_bytes"] / 2**20
            lines.append(f"| {dtype} | {name} | {h['fusions']} | {moved:.2f} | {temp:.2f} | {r['step_ratio']:.3f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_rows = "adamw,gwt2,gwt2-xla," + ",".join(f"interleaved-{n}" for n in NORMS)
    parser.add_argument("--rows", default=default_rows)
    parser.add_argument("--model", default="60m", choices=list(CONFIGS))
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=2)
    parser.add_argument("--out", default="results/benchmarks/fusion_limits")
    args = parser.parse_args(argv)
    report = {
        "command": command_line("benchmarks.fusion_limits", argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "machine": machine(),
        "dtypes": {},
    }
    for dtype in args.dtypes.split(","):
        params = llama_params(CONFIGS[args.model], only_attention_mlp=True, dtype=jnp.dtype(dtype))
        print(f"{args.model} matrices, {dtype} ...", flush=True)
        report["dtypes"][dtype] = measure(rows(args.rows.split(","), jnp.dtype(dtype)), params, args.rounds, args.inner)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
