"""The run directory: everything one training run leaves, in one folder.

`examples.llama.train` writes, by default under ``runs/<run name>-<UTC time>/``::

    config.json     the resolved configuration: every flag, the learning rate
                    used, the model config, the command, commit and versions
    metrics.jsonl   one JSON line per step (loss, grad_norm, lr_factor,
                    tokens_per_s; val_loss/val_ppl at evaluations); with
                    ``--diagnostics`` also, per parameter group G (qk: attention
                    q/k kernels, vo: v/o kernels, mlp: gate/up/down kernels,
                    other: embedding, norms, head; `examples.llama.diagnostics`):
                    update_norm/G (norm of the applied update), highfreq_share/G
                    (share of the update's energy off its means over blocks
                    of 2^level entries along --diagnostics-axis: for Haar GWT
                    the details' share) and, for GWT's limiter only,
                    limiter_scale_mean/G and limiter_scale_max/G (the factor
                    lam >= 1 the step's approximation was divided by)
    checkpoints/    Orbax checkpoints (`examples.llama.checkpoint`)
    loss.png        training and validation loss vs step

``train --resume <run directory>`` reads ``config.json`` back, so one flag
continues a run. This module holds the folder's layout, its files' readers and
writers, the loss plot and the human-readable summary; it knows nothing about
training.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from matplotlib.figure import Figure

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "command_line",
    "METRICS",
    "PLOT",
    "default_run_dir",
    "environment",
    "format_duration",
    "format_summary",
    "git_commit",
    "open_metrics",
    "plot_losses",
    "read_config",
    "read_metrics",
    "replace_block",
    "repo_relative",
    "save_line_plot",
    "timestamp",
    "write_json",
]

CONFIG, METRICS, CHECKPOINTS, PLOT = "config.json", "metrics.jsonl", "checkpoints", "loss.png"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timestamp(seconds: float) -> str:
    """``20261203-081512``: UTC time, sortable, safe in a file name."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")


def default_run_dir(name: str, seconds: float, root: str = "runs") -> str:
    """``<root>/<name>-<UTC time>``, e.g. ``runs/gwt-2-20261203-081512``."""
    return os.path.join(root, f"{name}-{timestamp(seconds)}")


#: The code a run executes: a change there (not in results or docs) makes the commit ``+dirty``.
CODE_PATHS = ("optax_gwt", "examples", "pyproject.toml")


def git_commit() -> str | None:
    """The short commit of this checkout, ``+dirty`` when tracked `CODE_PATHS` changed; None outside git."""
    try:

        def run(*cmd):
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10)

        head = run("rev-parse", "--short", "HEAD")
        if head.returncode:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Where a run ran: software versions and the machine (JSON-able)."""
    import flax
    import jax
    import optax

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "flax": flax.__version__,
        "backend": jax.default_backend(),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "cpu_cores": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 1) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
    }


def write_json(path: str, value: Any) -> None:
    """Writes `value` as indented JSON, creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(value, fh, indent=1)
        fh.write("\n")


def read_config(run_dir: str) -> dict:
    """The ``config.json`` of a run directory; SystemExit with advice when there is none."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.exists(path):
        raise SystemExit(
            f"--resume {run_dir}: no {CONFIG} there, so it is not a run directory of examples.llama.train. "
            "To continue from a bare checkpoint folder, give the run's flags with --ckpt-dir DIR --resume."
        )
    with open(path) as fh:
        return json.load(fh)


def open_metrics(path: str, keep_until: int | None) -> TextIO:
    """The metrics file, open for writing; on resume (`keep_until` a step) it keeps the records up to that step."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = [] if keep_until is None else [json.dumps(r) + "\n" for r in read_metrics(path) if r["step"] <= keep_until]
    fh = open(path, "w")
    fh.writelines(kept)
    return fh


def read_metrics(path: str) -> list[dict]:
    """The complete records of a metrics file (a line cut short by a crash is skipped); [] if absent."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n") and line.strip()]


Line = tuple[str, Sequence[float], Sequence[float], dict]


def save_line_plot(path: str, lines: Iterable[Line], xlabel: str, ylabel: str, title: str | None = None) -> None:
    """A PNG of ``(label, xs, ys, matplotlib kwargs)`` lines (no pyplot: no global state, no display)."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for label, xs, ys, style in lines:
        ax.plot(xs, ys, label=label, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(ax.lines) > 6:  # many curves: the legend beside the axes, not over them
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_losses(records: Sequence[dict], path: str, title: str) -> None:
    """Training loss per step and validation loss at the evaluations, from metrics records."""
    evals = [r for r in records if "val_loss" in r]
    save_line_plot(
        path,
        [
            ("train", [r["step"] for r in records], [r["loss"] for r in records], {"lw": 1, "alpha": 0.8}),
            ("validation", [r["step"] for r in evals], [r["val_loss"] for r in evals], {"marker": "o", "ms": 4}),
        ],
        xlabel="step",
        ylabel="loss (nats/token)",
        title=title,
    )


def format_duration(seconds: float) -> str:
    """``1 h 02 min``, ``1 min 48 s`` or ``7.3 s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def format_summary(summary: dict) -> str:
    """The end-of-run report for people: loss, throughput, optimizer memory, time, where the files are."""
    val = summary["final_val_loss"]
    loss = "no evaluation" if val is None else f"val loss {val:.4f} (ppl {summary['final_val_ppl']:.2f})"
    speed = f"{summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else "tokens/s not measured"
    state = summary["state_bytes"]
    return "\n".join([
        f"{summary['name']}: {loss} after {summary['step']} steps ({summary['tokens']:,} tokens)",
        f"  speed           {speed} (compilation excluded); wall time {format_duration(summary['wall_s'])}",
        f"  optimizer state {state / 2**20:.2f} MiB = {state / summary['adamw_state_bytes']:.3f} x AdamW's "
        f"(attention/MLP matrices {summary['matrix_state_bytes'] / summary['adamw_matrix_state_bytes']:.3f} x)",
        f"  run directory   {summary['run_dir']}  ({CONFIG}, {METRICS}, {CHECKPOINTS}/, {PLOT})",
    ])  # fmt: skip


def repo_relative(arg: str) -> str:
    """`arg` with an absolute path inside the repository written relative to its root; any other `arg` as it is.

    So that what a run records (its command, its paths) names no machine's folders: the tools
    run from the root. A flag's value counts too (``--out=/.../results/x`` -> ``--out=results/x``).
    """
    flag, eq, value = arg.partition("=") if arg.startswith("-") and "=" in arg else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    rel = os.path.relpath(os.path.abspath(value), REPO)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return arg  # outside the repository
    return flag + eq + rel


def command_line(module: str, argv: Sequence[str]) -> str:
    """The shell command that runs `module` with `argv` (absolute paths inside the repository made relative)."""
    return shlex.join(["python", "-m", module, *(repo_relative(a) for a in argv)])


def replace_block(path: str, start: str, end: str, block: str) -> None:
    """Rewrites the text of file `path` between the lines `start` and `end` (kept) with `block`."""
    with open(path) as fh:
        doc = fh.read()
    if start not in doc or end not in doc:
        raise SystemExit(f"{path} has no block for this; add the two lines\n{start}\n{end}")
    head, rest = doc.split(start, 1)
    with open(path, "w") as fh:
        fh.write(head + start + "\n" + block.rstrip("\n") + "\n" + end + rest.split(end, 1)[1])
