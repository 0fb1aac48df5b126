"""Optimizer step cost: GWT vs AdamW, GaLore and Adafactor on LLaMA-shaped params.

Run from the repository root::

    python -m benchmarks.optimizer_step                      # 60m and 130m, CPU defaults
    python -m benchmarks.optimizer_step --models 60m --rounds 5 --no-shapes

For each model and optimizer, in one process, after warm-up, in alternating
rounds (the order rotates every round; the machine may be shared, so only
medians of alternating runs and ratios within one run mean anything):

(a) the update alone, ``updates, state = opt.update(grads, state, params)``,
    jitted with the state donated;
(b) a donated train step ``params, state = step(params, state, grads)`` that
    applies the update (params and state donated);
(c) the optimizer state's bytes, and XLA's compiled memory analysis of (b)
    (temporary, argument bytes) and of (a);

and the memory traffic of (b) read from its compiled HLO: fusions, bytes read
and written per parameter, full-size reads per parameter
(`optax_gwt.hlo_traffic`). GWT, GaLore and Adafactor run on the attention and
MLP kernels, as in the GWT paper; the embedding, the output head and the norms
get `optax.adamw` through `optax.multi_transform`. ``gwt2-xla`` is GWT-2 without the compiled CPU kernel
(`optax_gwt.kernels.cpu_ffi`, opted in with ``FastPath(cpu_kernel=True)``), XLA alone. The AdamW baseline is
`optax.adamw` on everything (the same math on those other arrays). With
``--scope matrices`` the params are only the attention and MLP kernels, which
isolates the optimizers' own cost. Results go to ``results/benchmarks/`` as JSON
and Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gwt
from benchmarks.llama_shapes import CONFIGS, llama_params, param_labels
from optax_gwt.hlo_traffic import entry_traffic
from optax_gwt.kernels import cpu_ffi

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
TARGET_RATIO = 0.8


def optimizers(
    hidden: int, labels: Any, names: list[str], dtype: Any = None
) -> dict[str, optax.GradientTransformation]:
    """The compared optimizers; all but AdamW run on the "matrix" label only, AdamW on "other".

    `dtype`: the moments' dtype (None: the params'); ``gwtN-xla`` is ``gwtN`` without the CPU kernel.
    """

    def adamw():
        return optax.adamw(LEARNING_RATE, eps=1e-6, weight_decay=WEIGHT_DECAY, mu_dtype=dtype)

    def gwt(level, kernel=True):
        return optax_gwt.gwt_adamw(
            LEARNING_RATE,
            weight_decay=WEIGHT_DECAY,
            level=level,
            fast_path=optax_gwt.FastPath(cpu_kernel=kernel),
            mu_dtype=dtype,
            nu_dtype=dtype,
        )

    on_matrices = {
        **{f"gwt{level}": functools.partial(gwt, level) for level in (1, 2, 3)},
        # The same without the compiled CPU kernel: XLA alone, as on GPUs and TPUs.
        **{f"gwt{level}-xla": functools.partial(gwt, level, False) for level in (1, 2, 3)},
        # GaLore's rank hidden/4 (128 for 60m, as in the papers) keeps about
        # the state of GWT-2 (reported in the state bytes column).
        "galore": lambda: optax.contrib.galore(LEARNING_RATE, rank=hidden // 4, weight_decay=WEIGHT_DECAY),
        "adafactor": lambda: optax.adafactor(LEARNING_RATE, weight_decay_rate=WEIGHT_DECAY),
    }
    out = {}
    for name in names:
        if name == "adamw":
            out[name] = adamw()
        else:
            out[name] = optax.multi_transform({"matrix": on_matrices[name](), "other": adamw()}, labels)
    return out


def _train_step(opt: optax.GradientTransformation) -> Callable:
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def _update_only(opt: optax.GradientTransformation) -> Callable:
    return jax.jit(lambda grads, state, params: opt.update(grads, state, params), donate_argnums=(1,))


def _bytes_accessed(compiled) -> float:
    """XLA's own estimate of the bytes a compiled program reads and writes (`cost_analysis`)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("bytes accessed", float("nan")))


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    return {
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
    }


class _Runner:
    """One optimizer's params, state and compiled programs."""

    def __init__(self, opt, params, grads):
        self.params = jax.tree_util.tree_map(jnp.copy, params)
        self.state = jax.jit(opt.init)(self.params)
        self.grads = grads
        self.step = _train_step(opt)
        self.update = _update_only(opt)
        self.step_compiled = self.step.lower(self.params, self.state, grads).compile()
        self.update_compiled = self.update.lower(grads, self.state, self.params).compile()

    def run_step(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.params, self.state = self.step_compiled(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))
        return (time.perf_counter() - t0) / n

    def run_update(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            updates, self.state = self.update_compiled(self.grads, self.state, self.params)
        jax.block_until_ready((updates, self.state))
        return (time.perf_counter() - t0) / n


def measure(opts: dict, params: Any, rounds: int, inner: int, seed: int = 1) -> dict:
    """Times (a) and (b) for every optimizer in alternating rounds; sizes state, temp memory, traffic.

    The gradients have the params' dtype."""
    rng = np.random.default_rng(seed)
    grads = jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.standard_normal(p.shape, dtype=np.float32) * 1e-3).astype(p.dtype), params
    )
    sizes = [int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params)]
    n_params = sum(sizes)
    runners, results = {}, {}
    for name, opt in opts.items():
        r = _Runner(opt, params, grads)
        runners[name] = r
        traffic = entry_traffic(r.step_compiled.as_text(), sizes)
        results[name] = {
            "state_bytes": optax_gwt.optimizer_state_bytes(opt, params).total,
            "step_memory": _memory(r.step_compiled),
            "update_memory": _memory(r.update_compiled),
            "hlo": {
                "fusions": traffic.fusions,
                "ops": traffic.ops,
                "bytes_read_per_param": traffic.bytes_read / n_params,
                "bytes_written_per_param": traffic.bytes_written / n_params,
                "full_size_reads_per_param": traffic.full_size_read_elements / n_params,
                # XLA's cost analysis (the planner's roofline reads the same) of (a) and (b).
                "update_cost_bytes_per_param": _bytes_accessed(r.update_compiled) / n_params,
                "step_cost_bytes_per_param": _bytes_accessed(r.step_compiled) / n_params,
            },
            "step_s": [],
            "update_s": [],
        }
        r.run_step(2)
        r.run_update(2)
    names = list(opts)
    for i in range(rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            results[name]["step_s"].append(runners[name].run_step(inner))
        for name in order:
            results[name]["update_s"].append(runners[name].run_update(inner))
    base = "adamw" if "adamw" in results else names[0]
    for res in results.values():
        res["step_median_s"] = statistics.median(res["step_s"])
        res["update_median_s"] = statistics.median(res["update_s"])
        # Ratios per round (both runs of a round saw about the same load), then their median.
        res["step_ratio"] = statistics.median(
            a / b for a, b in zip(res["step_s"], results[base]["step_s"], strict=True)
        )
        res["update_ratio"] = statistics.median(
            a / b for a, b in zip(res["update_s"], results[base]["update_s"], strict=True)
        )
    return {"n_params": n_params, "n_arrays": len(sizes), "optimizers": results}


def shape_study(rounds: int, inner: int) -> list[dict]:
    """GWT-2 vs AdamW on single matrices: power-of-two, odd lengths, Haar vs db2, both axes."""
    cases = [
        ("2048x2048 haar axis 0", (2048, 2048), dict(level=2)),
        ("2047x2048 haar axis 0 (odd, zero-padded)", (2047, 2048), dict(level=2)),
        ("2048x2047 haar axis 0 (odd rows)", (2048, 2047), dict(level=2)),
        ("2048x2048 haar axis 1", (2048, 2048), dict(level=2, axis=1)),
        ("2048x2048 db2 axis 0", (2048, 2048), dict(level=2, wavelet="db2")),
        ("2048x2048 haar periodization axis 0", (2048, 2048), dict(level=2, mode="periodization")),
    ]
    out = []
    for label, shape, kw in cases:
        params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32) * 0.02)}
        opts = {
            "adamw": optax.adamw(LEARNING_RATE, eps=1e-6, weight_decay=WEIGHT_DECAY),
            "gwt": optax_gwt.gwt_adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY, **kw),
        }
        res = measure(opts, params, rounds, inner)
        g = res["optimizers"]["gwt"]
        out.append(
            {
                "case": label,
                "step_ratio": g["step_ratio"],
                "update_ratio": g["update_ratio"],
                "fusions": g["hlo"]["fusions"],
                "bytes_per_param": g["hlo"]["bytes_read_per_param"] + g["hlo"]["bytes_written_per_param"],
                "adamw_bytes_per_param": res["optimizers"]["adamw"]["hlo"]["bytes_read_per_param"]
                + res["optimizers"]["adamw"]["hlo"]["bytes_written_per_param"],
                "temp_bytes": g["step_memory"]["temp_bytes"],
            }
        )
        print(
            f"  {label:42s} step {g['step_ratio']:.2f}x adamw  ({out[-1]['bytes_per_param']:.1f} B/param)", flush=True
        )
    return out


#: The repository root, where the benchmarks run from.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _repo_relative(arg: str) -> str:
    """`arg` with an absolute path inside the repository written relative to its root; any other `arg` as it is."""
    flag, eq, value = arg.partition("=") if arg.startswith("-") and "=" in arg else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    rel = os.path.relpath(os.path.abspath(value), REPO)
    return arg if rel == os.pardir or rel.startswith(os.pardir + os.sep) else flag + eq + rel


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that ran `module` with `argv` (default: this process's arguments), as a report records it.

    It names no machine's folders: an absolute path inside the repository (``--out /.../results/benchmarks/x``)
    is written relative to the root (``--out results/benchmarks/x``).
    """
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *(_repo_relative(a) for a in args)])


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        # Whether GWT's compiled CPU kernel runs (else every GWT row is XLA alone).
        "gwt_cpu_kernel": jax.default_backend() == "cpu" and cpu_ffi.available(),
    }


def verdict(model_results: dict) -> list[str]:
    """Whether GWT-2 meets the target (<= 0.8x AdamW, not slower than GaLore, temp <= AdamW's)."""
    lines = []
    for model, res in model_results.items():
        opts = res["optimizers"]
        if "gwt2" not in opts or "adamw" not in opts:
            continue
        g, a = opts["gwt2"], opts["adamw"]
        ok_speed = g["step_ratio"] <= TARGET_RATIO
        ok_galore = "galore" not in opts or g["step_ratio"] <= opts["galore"]["step_ratio"]
        ok_temp = g["step_memory"]["temp_bytes"] <= a["step_memory"]["temp_bytes"]
        ok_update_temp = g["update_memory"]["temp_bytes"] <= a["update_memory"]["temp_bytes"]
        line = (
            f"{model} [{res['scope']}]: GWT-2 train step {g['step_ratio']:.2f}x AdamW "
            f"({'meets' if ok_speed else 'MISSES'} <= {TARGET_RATIO}x); "
            + (f"XLA alone {opts['gwt2-xla']['step_ratio']:.2f}x; " if "gwt2-xla" in opts else "")
            + (
                f"GaLore {opts['galore']['step_ratio']:.2f}x ({'not slower' if ok_galore else 'GWT-2 SLOWER'}); "
                if "galore" in opts
                else ""
            )
            + f"update temp {g['update_memory']['temp_bytes'] / 2**20:.2f} MiB vs AdamW "
            f"{a['update_memory']['temp_bytes'] / 2**20:.2f} MiB ({'ok' if ok_update_temp else 'MORE'}); "
            f"train step temp {g['step_memory']['temp_bytes'] / 2**10:.1f} KiB vs AdamW "
            f"{a['step_memory']['temp_bytes'] / 2**10:.1f} KiB ({'ok' if ok_temp else 'more'}); "
            f"{g['hlo']['fusions']} fusions, "
            f"{g['hlo']['bytes_read_per_param'] + g['hlo']['bytes_written_per_param']:.1f} B/param moved vs AdamW "
            f"{a['hlo']['bytes_read_per_param'] + a['hlo']['bytes_written_per_param']:.1f}"
        )
        if res["scope"] == "model" and res.get("matrix_fraction", 1.0) < 1.0:
            f = res["matrix_fraction"]
            line += (
                f"; only {f:.0%} of the params are attention/MLP matrices (the rest run AdamW in both), so the "
                f"whole-model ratio could not go below about {1 - f:.2f}x even if GWT took no time"
            )
        lines.append(line)
    return lines


KERNEL_NOTE = (
    "How GWT-2 runs on the CPU: XLA alone compiles the approximation's Adam into three passes over G (m and "
    "v are two fusions that each read G, as XLA CPU has no sibling multi-output fusion; the limiter's norm is a "
    "separate reduction that YNNPACK runs at about half the streaming bandwidth) before the final pass that "
    "reads G, P and the quarter-size m, v and writes P. The compiled kernel (optax_gwt.kernels.cpu_ffi, an XLA FFI "
    "custom call, opted in with FastPath(cpu_kernel=True) in the gwt-N rows) makes the first three one pass "
    "that reads G once, updates "
    "m and v in place and returns the norm; the final pass stays in XLA, fused with the learning rate, weight "
    "decay and apply_updates. What is left is that final pass's arithmetic: it recomputes each block's mean "
    "from G (B loads per element) and the square root and division per element, since materialising "
    "per-block values would cost a quarter-size temporary per matrix, all alive at once; "
    "`python -m benchmarks.final_pass` prices these parts."
)


def markdown(report: dict) -> str:
    m = report["machine"]
    out = [
        f"Machine: {m['cpu']}, {m['cores']} cores, JAX {m['jax']} ({m['jax_backend']}), optax {m['optax']}; "
        f"params, gradients and moments in {report.get('dtype', 'float32')}; "
        f"load average at start {m['load_average'][0]:.1f} (shared machine: medians of {report['rounds']} alternating "
        f"rounds of {report['inner']} steps; ratio = median over rounds of the per-round ratio to AdamW). "
        "GWT's compiled CPU kernel: "
        f"{'used (gwt-N rows; gwt2-xla is XLA alone)' if m.get('gwt_cpu_kernel') else 'not used'}.",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    for model, res in report["models"].items():
        out += [
            f"### {model} ({res['scope']}: {res['n_params'] / 1e6:.1f}M params in {res['n_arrays']} arrays)",
            "",
            "| optimizer | train step (b) ms | vs AdamW | update (a) ms | vs AdamW | state MiB | step temp MiB "
            "| step args MiB | update temp MiB | fusions | B/param read+written | full-size reads/param "
            "| update (a) cost-analysis B/param |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in res["optimizers"].items():
            h = r["hlo"]
            out.append(
                f"| {name} | {r['step_median_s'] * 1e3:.1f} | {r['step_ratio']:.2f} | "
                f"{r['update_median_s'] * 1e3:.1f} | {r['update_ratio']:.2f} | {r['state_bytes'] / 2**20:.1f} | "
                f"{r['step_memory']['temp_bytes'] / 2**20:.1f} | "
                f"{r['step_memory']['argument_bytes'] / 2**20:.1f} | {r['update_memory']['temp_bytes'] / 2**20:.1f} | "
                f"{h['fusions']} | {h['bytes_read_per_param'] + h['bytes_written_per_param']:.1f} | "
                f"{h['full_size_reads_per_param']:.2f} | "
                f"{h.get('update_cost_bytes_per_param', float('nan')):.1f} |"
            )
        out.append("")
    if report.get("shapes"):
        out += [
            "### GWT-2 across shapes (single matrix, train step vs AdamW)",
            "",
            "| case | train step vs AdamW | update vs AdamW | fusions | B/param (AdamW) | temp MiB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for s in report["shapes"]:
            out.append(
                f"| {s['case']} | {s['step_ratio']:.2f} | {s['update_ratio']:.2f} | {s['fusions']} | "
                f"{s['bytes_per_param']:.1f} ({s['adamw_bytes_per_param']:.1f}) | {s['temp_bytes'] / 2**20:.1f} |"
            )
        out.append("")
    out += ["### Verdict", ""] + [f"- {line}" for line in report["verdict"]]
    if report.get("kernel_note"):
        out += ["", report["kernel_note"]]
    return "\n".join(out) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_models = "60m,130m" if jax.default_backend() == "cpu" else "60m,130m,350m,1b"
    parser.add_argument("--models", default=default_models, help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--optimizers", default="adamw,gwt1,gwt1-xla,gwt2,gwt2-xla,gwt3,gwt3-xla,galore,adafactor")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="params, gradients and optimizer moments in this dtype",
    )
    parser.add_argument(
        "--scope",
        default="model",
        choices=["model", "matrices", "both"],
        help="model: whole LLaMA params (others AdamW); matrices: attention+MLP kernels only",
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inner", type=int, default=2, help="steps per timed run")
    parser.add_argument("--no-shapes", action="store_true", help="skip the single-matrix shape study")
    parser.add_argument("--out", default="results/benchmarks/optimizer_step")
    parser.add_argument(
        "--readme", default=None, help="also put the Markdown between the performance-table markers of this file"
    )
    parser.add_argument(
        "--render", default=None, metavar="JSON", help="only re-render a saved JSON report (to --readme)"
    )
    return parser


def _render(path: str, readme: str | None) -> None:
    """Re-renders a saved report (and puts it into `readme`)."""
    report = json.loads(Path(path).read_text())
    if report.get("kernel_note"):
        report["kernel_note"] = KERNEL_NOTE  # interpretation, not a measurement: the current text
    print(markdown(report))
    if readme:
        replace_between_markers(Path(readme), markdown(report))


def _measure_model(model: str, scope: str, names: list[str], args: argparse.Namespace) -> dict:
    """One model's (and scope's) measurements, printed as they come."""
    cfg = CONFIGS[model]
    params = llama_params(cfg, only_attention_mlp=scope == "matrices", dtype=jnp.dtype(args.dtype))
    opts = optimizers(cfg.hidden_size, param_labels(params), names, dtype=jnp.dtype(args.dtype))
    print(f"{model} [{scope}] ...", flush=True)
    res = measure(opts, params, args.rounds, args.inner)
    res["scope"] = scope
    labels = jax.tree_util.tree_leaves(param_labels(params))
    sizes = [int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params)]
    matrix_size = sum(n for n, lab in zip(sizes, labels, strict=True) if lab == "matrix")
    res["matrix_fraction"] = matrix_size / sum(sizes)
    for name, r in res["optimizers"].items():
        print(
            f"  {name:10s} step {r['step_median_s'] * 1e3:8.1f} ms {r['step_ratio']:5.2f}x   update "
            f"{r['update_median_s'] * 1e3:8.1f} ms {r['update_ratio']:5.2f}x   "
            f"state {r['state_bytes'] / 2**20:7.1f} MiB   "
            f"temp {r['step_memory']['temp_bytes'] / 2**20:6.1f} MiB   fusions {r['hlo']['fusions']:4d}   "
            f"{r['hlo']['bytes_read_per_param'] + r['hlo']['bytes_written_per_param']:5.1f} B/param",
            flush=True,
        )
    return res


def _write(report: dict, out_path: str, readme: str | None) -> None:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    if readme:
        replace_between_markers(Path(readme), markdown(report))
        print(f"updated {readme}")


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.render:
        return _render(args.render, args.readme)
    names = args.optimizers.split(",")
    scopes = ["model", "matrices"] if args.scope == "both" else [args.scope]
    report = {
        "command": command_line("benchmarks.optimizer_step", argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "rounds": args.rounds,
        "inner": args.inner,
        "dtype": args.dtype,
        "learning_rate": LEARNING_RATE,
        "weight_decay": WEIGHT_DECAY,
        "models": {},
    }
    for model in args.models.split(","):
        for scope in scopes:
            key = model if len(scopes) == 1 else f"{model}-{scope}"
            report["models"][key] = _measure_model(model, scope, names, args)
    if not args.no_shapes and "gwt2" in names:
        print("GWT-2 across shapes ...", flush=True)
        report["shapes"] = shape_study(args.rounds, args.inner)
    report["verdict"] = verdict(report["models"])
    report["kernel_note"] = KERNEL_NOTE
    report["machine"]["load_average_end"] = os.getloadavg()
    print("\n".join(report["verdict"]))
    print(report["kernel_note"])
    _write(report, args.out, args.readme)


START_MARKER = "<!-- performance-table:start (written by python -m benchmarks.optimizer_step --readme) -->"
END_MARKER = "<!-- performance-table:end -->"


def replace_between_markers(path: Path, text: str) -> None:
    """Replaces what lies between `START_MARKER` and `END_MARKER` in `path` with `text`."""
    doc = path.read_text()
    start, end = doc.index(START_MARKER) + len(START_MARKER), doc.index(END_MARKER)
    path.write_text(doc[:start] + "\n" + text + doc[end:])


if __name__ == "__main__":
    main()
