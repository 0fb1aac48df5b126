"""A study: a grid of training runs from one config file, resumable, and its report.

    python -m examples.llama.sweep --config examples/llama/studies/smoke.toml      # runs the grid, then reports
    python -m examples.llama.sweep --config examples/llama/studies/default.toml --dry-run   # lists the runs
    python -m examples.llama.sweep --config examples/llama/studies/default.toml --report    # only the report

The config (TOML, JSON or YAML) has four parts::

    [study]                  name, output (the JSONL), run_root (run directories),
                             keep_checkpoints (false: delete each run's checkpoints),
                             confirm_seeds (tune on the grid's seed, then rerun
                             each optimizer's best setting with these seeds)
    [grid]                   axes shared by every optimizer, each a list:
                             seed, seq_len, steps, alpha, lr, ... (any train flag);
                             tokens_per_step = N sets batch_size = N // seq_len
    [train]                  fixed train flags for every run (config, model, batch_size, ...)
    [optimizers.<name>]      one table per optimizer: optimizer (default: <name>),
                             its own flags and axes (lr = [...], galore_gap = [...]),
                             which override [grid] and [train]

A list value is an axis (a list of lists for a flag that takes a list, such as
``model``); the runs are the product of the axes, per optimizer, seeds
outermost (every optimizer's first seed runs before any second seed). Flags
are `examples.llama.train`'s (``batch_size`` or ``batch-size``); each run calls
its `run` in this process with the namespace its `parse_args` builds. Each
finished run appends one JSON line to the output: its flags, the validation
loss curve, tokens/s, optimizer-state bytes and wall time. Runs already in the
output are skipped, so an interrupted study continues where it stopped.

Tuning on one seed and confirming on more: with ``seed = [0]`` in [grid] and
``confirm_seeds = [1, 2]`` in [study], once an optimizer's grid (of a task)
is finished, its best setting by seed 0's final validation loss runs again
with seeds 1 and 2; the report then ranks the settings run on three seeds.

``--report`` (also written after a grid) groups the runs by task (sequence
length, steps, batch) and setting (every flag but the seed): per optimizer its
best setting by mean final validation loss over seeds (with the spread, and a
flag where the best value of a swept axis sits on the edge of its grid),
whether the optimizers' ranking at half the steps agrees with the final one,
plots of loss against steps and against training time and of loss against
optimizer memory, and a Markdown table (``report.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from optax_gwt import _extras

with _extras.entry_point(__name__, "examples", "python -m examples.llama.sweep"):
    from examples.llama import rundir

__all__ = [
    "best_settings",
    "confirmation_runs",
    "expand",
    "load_config",
    "load_records",
    "main",
    "run_grid",
    "write_report",
]

#: Axes that define a run's task (runs of one task are compared with each other).
TASK_AXES = ("config", "model", "seq_len", "batch_size", "steps")

#: Axes named first in tables (in this order); any other swept flag follows.
SHOWN_AXES = ("lr", "alpha", "level", "galore_rank", "galore_gap")


# ---------------------------------------------------------------------------
# The config and its grid.
# ---------------------------------------------------------------------------


def load_config(path: str) -> dict:
    """The study config from a ``.toml``, ``.json`` or ``.yaml``/``.yml`` file."""
    ext = os.path.splitext(path)[1].lower()
    with open(path, "rb") as fh:
        if ext == ".toml":
            import tomllib  # type: ignore[import-not-found]  # Python 3.11+ (mypy checks for 3.10)

            return tomllib.load(fh)
        if ext == ".json":
            return json.load(fh)
        if ext in (".yaml", ".yml"):
            import yaml  # type: ignore[import-untyped]  # PyYAML, only for YAML configs

            return yaml.safe_load(fh)
    raise SystemExit(f"{path}: a study config is .toml, .json or .yaml")


def _train_actions() -> dict[str, argparse.Action]:
    """The training parser's options by destination (``batch_size``)."""
    from examples.llama import train

    return {a.dest: a for a in train.build_parser()._actions if a.option_strings}


def _flag_name(key: str) -> str:
    return key.replace("-", "_")


def _is_axis(dest: str, value: Any, actions: dict) -> bool:
    """A list is an axis, except for a flag taking a list, whose axis is a list of lists."""
    if not isinstance(value, list):
        return False
    takes_list = actions[dest].nargs in ("*", "+")
    return not takes_list or (bool(value) and all(isinstance(v, list) for v in value))


def _optimizer_table(name: str, table: dict, config: dict, actions: dict) -> dict:
    """The flags of one optimizer: [train], then [grid], then its own table (names checked)."""
    merged = {}
    for part in (config.get("train", {}), config.get("grid", {}), table):
        merged.update({_flag_name(k): v for k, v in part.items()})
    merged.setdefault("optimizer", name)
    unknown = sorted(k for k in merged if k not in actions and k != "tokens_per_step")
    if unknown:
        raise SystemExit(
            f"optimizer {name!r}: unknown train flags {unknown} (see python -m examples.llama.train --help)"
        )
    return merged


def expand(config: dict) -> list[dict]:
    """Every run of the study: ``{"name", "flags"}``, seeds outermost, then the optimizers in file order."""
    actions, runs = _train_actions(), []
    for name, table in config.get("optimizers", {}).items():
        merged = _optimizer_table(name, table, config, actions)
        axes = [k for k, v in merged.items() if k != "tokens_per_step" and _is_axis(k, v, actions)]
        fixed = {k: v for k, v in merged.items() if k not in axes}
        for values in itertools.product(*(merged[k] for k in axes)):
            flags = {**fixed, **dict(zip(axes, values, strict=True))}
            per_step = flags.pop("tokens_per_step", None)
            if per_step:
                flags["batch_size"] = per_step // flags.get("seq_len", actions["seq_len"].default)
            runs.append({"name": name, "flags": flags})
    order = {name: i for i, name in enumerate(config.get("optimizers", {}))}
    return sorted(runs, key=lambda r: (r["flags"].get("seed", 0), order[r["name"]]))  # stable within an optimizer


def run_key(run: dict) -> str:
    """The run's identity in the JSONL: its name and flags, canonical."""
    return json.dumps({"name": run["name"], "flags": run["flags"]}, sort_keys=True)


def train_argv(flags: dict, actions: dict) -> list[str]:
    """``--flag value`` arguments of the training CLI for `flags`."""
    argv = []
    for dest, value in flags.items():
        option = max(actions[dest].option_strings, key=len)
        if isinstance(actions[dest], argparse._StoreTrueAction):
            argv += [option] if value else []
        elif isinstance(value, list):
            argv += [option, *map(str, value)]
        elif value is not None:
            argv += [option, str(value)]
    return argv


# ---------------------------------------------------------------------------
# Running the grid.
# ---------------------------------------------------------------------------


def load_records(path: str) -> list[dict]:
    """The JSONL's complete lines (a line cut short by a crash is skipped); [] if absent."""
    return rundir.read_metrics(path)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _record(study: str, run: dict, argv: list, result: dict, wall_s: float) -> dict:
    """One JSONL line from `train.run`'s result."""
    summary = result["summary"]
    evals = [r for r in result["history"] if "val_loss" in r]
    keep = (
        "params",
        "state_bytes",
        "matrix_state_bytes",
        "adamw_state_bytes",
        "adamw_matrix_state_bytes",
        "tokens_per_s",
    )
    return {
        "study": study,
        "key": run_key(run),
        "name": run["name"],
        "flags": {**run["flags"], "lr": summary["lr"]},
        "final_val_loss": _finite(summary["final_val_loss"]),
        "val_curve": [{"step": r["step"], "tokens": r["tokens"], "val_loss": _finite(r["val_loss"])} for r in evals],
        **{k: summary[k] for k in keep},
        "wall_s": wall_s,
        "command": rundir.command_line("examples.llama.train", argv),
        "commit": rundir.git_commit(),
        "finished": rundir.timestamp(time.time()),
    }


def run_one(study: dict, run: dict, actions: dict) -> dict:
    """Trains `run` in this process, into a fresh run directory; returns its JSONL record."""
    import jax

    from examples.llama import train

    digest = hashlib.sha1(run_key(run).encode()).hexdigest()[:10]
    run_dir = os.path.join(study["run_root"], f"{run['name']}-{digest}")
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted attempt's files
    argv = train_argv(run["flags"], actions) + ["--run-dir", run_dir, "--json"]
    started = time.perf_counter()
    result = train.run(train.parse_args(argv))
    record = _record(study["name"], run, argv, result, time.perf_counter() - started)
    record["run_dir"] = rundir.repo_relative(run_dir)  # the study's JSONL names no machine path
    if not study.get("keep_checkpoints", False):
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    jax.clear_caches()  # each run's steps are new closures: their compilations would pile up over a study
    return record


def _study_settings(config: dict, output: str | None, run_root: str | None) -> dict:
    study = dict(config.get("study", {}))
    study.setdefault("name", "study")
    study["output"] = output or study.get("output", f"results/study/{study['name']}.jsonl")
    study["run_root"] = run_root or study.get("run_root", f"runs/study/{study['name']}")
    return study


def confirmation_runs(config: dict, records: Iterable[dict]) -> list[dict]:
    """The runs that repeat each optimizer's best tuned setting with ``[study] confirm_seeds``.

    Per optimizer and task, once every grid run of it is in `records`, its best
    run by final validation loss (a diverged run counts as infinite) is run
    again with each confirmation seed. [] without ``confirm_seeds``.
    """
    seeds = config.get("study", {}).get("confirm_seeds", [])
    done = {r["key"]: r for r in records if "error" not in r}
    groups: dict = {}
    for run in expand(config) if seeds else []:
        groups.setdefault((run["name"], _task(run["flags"])), []).append(run)
    out = []
    for runs in groups.values():
        if all(run_key(r) in done for r in runs):
            best = min(runs, key=lambda r: (_loss(done[run_key(r)]["final_val_loss"]), run_key(r)))
            out += [{"name": best["name"], "flags": {**best["flags"], "seed": seed}} for seed in seeds]
    return out


def _todo(runs: list[dict], records: list[dict], only: Sequence[str] | None) -> list[dict]:
    done = {r["key"] for r in records}
    return [r for r in runs if run_key(r) not in done and (not only or r["name"] in only)]


def run_grid(config: dict, output: str | None = None, run_root: str | None = None,
             max_runs: int | None = None, only: Sequence[str] | None = None, log=print) -> list[dict]:  # fmt: skip
    """Runs the study's runs not yet in its JSONL (at most `max_runs`, of optimizers `only`); returns the new records.

    The grid's runs go first, then the confirmation runs (`confirmation_runs`) of
    the optimizers whose grid is finished.
    """
    study, actions = _study_settings(config, output, run_root), _train_actions()
    records = load_records(study["output"])
    todo = _todo(expand(config), records, only) or _todo(confirmation_runs(config, records), records, only)
    log(f"{study['name']}: {len(records)} runs done, {len(todo)} to run now -> {study['output']}")
    os.makedirs(os.path.dirname(os.path.abspath(study["output"])), exist_ok=True)
    new: list[dict] = []
    while todo and (max_runs is None or len(new) < max_runs):
        run = todo.pop(0)
        record = run_one(study, run, actions)
        with open(study["output"], "a") as fh:
            fh.write(json.dumps(record) + "\n")
        new.append(record)
        log(f"[{len(new)}] {run['name']} {_describe_flags(run['flags'])}: val {record['final_val_loss']} "
            f"in {record['wall_s']:.0f} s ({len(todo)} left)")  # fmt: skip
        if not todo:  # the grid is done (or this share of it): its best settings' other seeds
            records = load_records(study["output"])
            todo = _todo(confirmation_runs(config, records), records, only)
    return new


def _describe_flags(flags: dict) -> str:
    shown = ("lr", "alpha", "b2", "weight_decay", "seed", "seq_len", "steps")
    return " ".join(f"{k}={flags[k]}" for k in shown if k in flags)


# ---------------------------------------------------------------------------
# The report: best settings, ranking stability, plots, table.
# ---------------------------------------------------------------------------


def _task(flags: dict) -> str:
    """The task a run belongs to, e.g. ``9m seq 256 x 16, 300 steps``."""
    model = f" ({' '.join(flags['model'])})" if flags.get("model") else ""
    shape = f"seq {flags.get('seq_len')} x {flags.get('batch_size')}, {flags.get('steps')} steps"
    return f"{flags.get('config', '9m')}{model} {shape}"


def _setting(flags: dict) -> str:
    return json.dumps({k: v for k, v in flags.items() if k != "seed"}, sort_keys=True)


def _loss(value: float | None) -> float:
    return math.inf if value is None else value


def group_settings(records: Iterable[dict]) -> dict:
    """``{task: {name: {setting: [records over seeds]}}}``, the last record of each run."""
    by_key = {r["key"]: r for r in records if "error" not in r}
    groups: dict = {}
    for r in by_key.values():
        groups.setdefault(_task(r["flags"]), {}).setdefault(r["name"], {}).setdefault(_setting(r["flags"]), []).append(
            r
        )
    return groups


def _stats(runs: list[dict]) -> dict:
    """Mean and spread (sample std, 0 for one seed) of the final validation loss over seeds."""
    losses = np.array([_loss(r["final_val_loss"]) for r in runs])
    finite = np.isfinite(losses).all()
    return {
        "mean": float(losses.mean()) if finite else math.inf,
        "std": float(losses.std(ddof=1)) if finite and len(losses) > 1 else 0.0,
        "n": len(losses),
        "diverged": int((~np.isfinite(losses)).sum()),
    }


def _edges(best: dict, settings: dict) -> list[str]:
    """The swept axes whose best value is the smallest or largest of the optimizer's grid."""
    grids: dict = {}
    for runs in settings.values():
        for k, v in runs[0]["flags"].items():
            if k != "seed" and isinstance(v, (int, float)) and not isinstance(v, bool):
                grids.setdefault(k, set()).add(v)
    flags = []
    for k, values in sorted(grids.items()):
        if len(values) > 1 and best[k] in (min(values), max(values)):
            flags.append(f"{k} at the {'low' if best[k] == min(values) else 'high'} edge")
    return flags


def best_settings(records: Iterable[dict]) -> dict:
    """Per task and optimizer: its best setting by mean final validation loss over seeds.

    Only the settings run on the most seeds (of that optimizer and task) are
    candidates: a lucky single seed of a setting dropped from the grid does not win.
    Returns ``{task: {name: {"flags", "mean", "std", "n", "diverged", "edges", "runs",
    "settings"}}}``; ``edges`` names the swept axes (lr, alpha, ...) whose best
    value sits on the edge of the values tried: widen the grid there.
    """
    out: dict = {}
    for task, names in group_settings(records).items():
        out[task] = {}
        for name, settings in names.items():
            scored = {s: _stats(runs) for s, runs in settings.items()}
            most = max(st["n"] for st in scored.values())  # a setting run on fewer seeds is not a candidate
            best = min((s for s in scored if scored[s]["n"] == most), key=lambda s: (scored[s]["mean"], s))
            flags = settings[best][0]["flags"]
            out[task][name] = {"flags": {k: v for k, v in flags.items() if k != "seed"}, **scored[best],
                               "edges": _edges(flags, settings), "runs": settings[best],
                               "settings": len(settings)}  # fmt: skip
    return out


def _curve(runs: list[dict]) -> tuple[list, list, list]:
    """Mean validation curve over seeds: steps, tokens, losses (steps every seed evaluated)."""
    per = [{p["step"]: p for p in r["val_curve"]} for r in runs]
    steps = sorted(set.intersection(*(set(p) for p in per)))
    losses = [float(np.mean([_loss(p[s]["val_loss"]) for p in per])) for s in steps]
    return steps, [per[0][s]["tokens"] for s in steps], losses


def _rank(d: dict) -> list:
    """The keys of `d` by value (ties by key)."""
    return sorted(d, key=lambda k: (d[k], k))


def ranking_agreement(best: dict) -> dict:
    """Per task: the optimizers ranked by best mean loss at the evaluation nearest half the steps and at the end.

    Returns ``{task: {"half", "final", "agree", "spearman"}}``: the two rankings, whether
    they are the same, and Spearman's rank correlation between them (1: same order).
    """
    out = {}
    for task, names in best.items():
        final, half = {}, {}
        for name, b in names.items():
            steps, _, losses = _curve(b["runs"])
            if not steps:
                continue
            final[name] = losses[-1]
            half[name] = losses[int(np.argmin([abs(s - steps[-1] / 2) for s in steps]))]
        h, f = _rank(half), _rank(final)
        spearman = float(np.corrcoef([h.index(n) for n in f], range(len(f)))[0, 1]) if len(f) > 1 else 1.0
        out[task] = {"half": h, "final": f, "agree": h == f, "spearman": spearman}
    return out


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _row(name: str, b: dict) -> str:
    """One table row: the setting, the loss over seeds, memory, speed, flags."""
    f, r0 = b["flags"], b["runs"][0]
    others = ", ".join(f"{k}={v}" for k, v in f.items() if k in SHOWN_AXES[2:])
    loss = "diverged" if not math.isfinite(b["mean"]) else f"{b['mean']:.4f} ± {b['std']:.4f} ({b['n']})"
    speed = np.mean([r["tokens_per_s"] or 0 for r in b["runs"]])
    notes = "; ".join(b["edges"] + ([f"{b['diverged']} diverged"] if b["diverged"] else []))
    return (f"| {name} | {f.get('lr'):g} | {f.get('alpha', '')} | {others} | {loss} | {b['settings']} | "
            f"{_mib(r0['state_bytes'])} | {_mib(r0['matrix_state_bytes'])} | "
            f"{r0['matrix_state_bytes'] / r0['adamw_matrix_state_bytes']:.3f} | {speed:,.0f} | {notes} |")  # fmt: skip


def report_markdown(best: dict, agreement: dict, plots: dict) -> str:
    """The report: per task a table of each optimizer's best setting, the ranking check, the plots."""
    lines = ["# Study report", ""]
    head = ("| optimizer | lr | alpha | other | val loss mean ± std (seeds) | settings tried | state MiB | "
            "matrix state MiB | matrix state / AdamW's | tokens/s | notes |")  # fmt: skip
    for task, names in best.items():
        lines += [f"## {task}", "", head, "|" + "---|" * 11]
        lines += [_row(n, b) for n, b in sorted(names.items(), key=lambda nb: (nb[1]["mean"], nb[0]))]
        a = agreement.get(task)
        if a:
            verdict = "agrees" if a["agree"] else "does NOT agree"
            lines += ["", f"Ranking at half the steps {verdict} with the final one (Spearman's rank correlation "
                      f"{a['spearman']:.2f}): {' < '.join(a['half'])} (half) "
                      f"vs {' < '.join(a['final'])} (final)."]  # fmt: skip
        lines += [""] + [f"![{kind}]({os.path.basename(p)})" for kind, p in plots.get(task, {}).items()] + [""]
    return "\n".join(lines + across_tasks(best))


def across_tasks(best: dict) -> list[str]:
    """A table of each optimizer's best mean loss (± std, seeds) per task: [] for a single task."""
    if len(best) < 2:
        return []
    names = sorted({n for names in best.values() for n in names})

    def size(t) -> tuple:
        flags = next(iter(best[t].values()))["runs"][0]["flags"]
        return tuple(flags.get(k) or 0 for k in ("seq_len", "steps", "batch_size"))

    def cell(b) -> str:
        if b is None:
            return ""
        return "diverged" if not math.isfinite(b["mean"]) else f"{b['mean']:.4f} ± {b['std']:.4f} ({b['n']})"

    tasks = sorted(best, key=size)
    lines = ["## Across tasks", "", "| optimizer | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    lines += [f"| {n} | " + " | ".join(cell(best[t].get(n)) for t in tasks) + " |" for n in names]
    return lines + [""]


def _slug(task: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in task).strip("-").replace("--", "-")


def plot_task(task: str, names: dict, out_dir: str) -> dict:
    """Loss vs steps, loss vs training time (tokens / measured tokens/s) and loss vs memory; returns the paths."""
    curves = {n: _curve(b["runs"]) for n, b in names.items()}
    speed = {n: np.mean([r["tokens_per_s"] or np.nan for r in b["runs"]]) for n, b in names.items()}
    paths = {k: os.path.join(out_dir, f"{_slug(task)}-{k}.png") for k in ("steps", "time", "memory")}
    style = plot_styles(names)
    rundir.save_line_plot(paths["steps"], [(n, c[0], c[2], style[n]) for n, c in curves.items()],
                          "step", "validation loss (mean over seeds)", task)  # fmt: skip
    rundir.save_line_plot(paths["time"], [(n, np.array(c[1]) / speed[n], c[2], style[n]) for n, c in curves.items()],
                          "training time (s, compilation and evaluation excluded)", "validation loss",
                          task)  # fmt: skip
    _memory_plot(paths["memory"], names, task, style)
    return paths


def plot_styles(names: Iterable[str]) -> dict[str, dict]:
    """A colour, marker and line style per optimizer, no two alike (ten colours; past ten, the
    next marker with dashed lines, then dotted)."""
    from matplotlib import colormaps

    tab10 = colormaps["tab10"]
    colours, markers, lines = [tab10(i) for i in range(10)], "os^Dv", ["-", "--", ":", "-.", "-"]
    styles = {}
    for i, name in enumerate(sorted(names)):
        cycle = i // len(colours) % len(markers)
        styles[name] = {"color": colours[i % len(colours)], "marker": markers[cycle], "ls": lines[cycle], "ms": 4}
    return styles


def _memory_plot(path: str, names: dict, title: str, style: dict[str, dict]) -> None:
    """Best mean final loss (with its spread) against the matrices' optimizer-state MiB; a legend,
    not labels beside the points, since optimizers of equal state share an x."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for name, b in names.items():
        x = b["runs"][0]["matrix_state_bytes"] / 2**20
        if math.isfinite(b["mean"]):
            s = style[name]
            ax.errorbar([x], [b["mean"]], yerr=[b["std"]], fmt=s["marker"], color=s["color"], capsize=3, label=name)
    ax.set_xlabel("optimizer state of the attention/MLP matrices (MiB)")
    ax.set_ylabel("best validation loss (mean ± std over seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def readme_markers(report_dir: str) -> tuple[str, str]:
    """The README lines around the block of the report in `report_dir`."""
    key = os.path.normpath(report_dir)
    return f"<!-- study-report {key}:start -->", f"<!-- study-report {key}:end -->"


def readme_block(text: str, report_dir: str, readme: str, command: str) -> str:
    """The report's Markdown for `readme`: the command first, headings two levels down, image paths from `readme`."""
    where = os.path.relpath(report_dir, os.path.dirname(os.path.abspath(readme)))
    lines = [f"Written by `{command}` from the committed JSONL(s)."]
    for line in text.splitlines()[1:]:  # the report's title goes
        if line.startswith("#"):
            line = "##" + line
        elif line.startswith("![") and "](" in line:
            label, name = line[:-1].split("](", 1)
            line = f"{label}]({where}/{name})"
        lines.append(line)
    return "\n".join(lines)


def default_report_dir(records_path: str) -> str:
    """Where a study's report goes unless told: ``<jsonl without .jsonl>-report/``."""
    return os.path.splitext(records_path)[0] + "-report"


def write_report(records_path: str, out_dir: str | None = None, plots: bool = True,
                 include: Sequence[str] = (), only: Sequence[str] | None = None) -> str:  # fmt: skip
    """Writes ``report.md`` (and the plots) for a study's JSONL; returns the Markdown.

    `include`: other studies' JSONLs whose runs join the report (runs of the same
    task are compared with each other); `only`: report just these optimizers.
    """
    out_dir = out_dir or default_report_dir(records_path)
    os.makedirs(out_dir, exist_ok=True)
    records = [r for path in (records_path, *include) for r in load_records(path)]
    best = best_settings(r for r in records if not only or r["name"] in only)
    paths = {task: plot_task(task, names, out_dir) for task, names in best.items()} if plots else {}
    text = report_markdown(best, ranking_agreement(best), paths)
    with open(os.path.join(out_dir, "report.md"), "w") as fh:
        fh.write(text)
    return text


# ---------------------------------------------------------------------------
# The CLI.
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.llama.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", required=True, help="the study config (.toml, .json, .yaml)")
    p.add_argument("--output", default=None, help="the JSONL (default: the config's study.output)")
    p.add_argument("--run-root", default=None, help="where run directories go (default: study.run_root)")
    p.add_argument("--report", action="store_true", help="only write the report of the JSONL's runs")
    p.add_argument("--report-dir", default=None, help="default: <output without .jsonl>-report/")
    p.add_argument(
        "--readme",
        default=None,
        metavar="FILE",
        help="also write the report into FILE between its study-report markers (see readme_markers)",
    )
    p.add_argument(
        "--include",
        nargs="+",
        default=(),
        metavar="JSONL",
        help="other studies' JSONLs whose runs join the report (e.g. the default study's)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the runs (done or not) and exit")
    p.add_argument("--max-runs", type=int, default=None, help="run at most this many of the runs left")
    p.add_argument(
        "--only", nargs="+", default=None, metavar="NAME", help="run (and report) only these optimizers' runs"
    )
    return p


def _report_command(args: argparse.Namespace) -> str:
    """The command that rewrites this report and its README block."""
    argv = ["--config", args.config, "--report"]
    for flag, value in (("--output", args.output), ("--report-dir", args.report_dir), ("--readme", args.readme)):
        argv += [flag, value] if value else []
    for flag, values in (("--include", args.include), ("--only", args.only)):
        argv += [flag, *values] if values else []
    return rundir.command_line("examples.llama.sweep", argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = load_config(args.config)
    study = _study_settings(config, args.output, args.run_root)
    if args.dry_run:
        records = load_records(study["output"])
        done = {r["key"] for r in records}
        runs = expand(config)
        runs += [r for r in confirmation_runs(config, records) if r not in runs]
        for run in runs:
            print(("done " if run_key(run) in done else "todo ") + f"{run['name']} {_describe_flags(run['flags'])}")
        print(
            f"{len(runs)} runs, {sum(run_key(r) in done for r in runs)} done"
            + (
                " (confirmation runs appear once their optimizer's grid is done)"
                if config.get("study", {}).get("confirm_seeds")
                else ""
            )
        )
        return
    if not args.report:
        run_grid(
            config, study["output"], study["run_root"], args.max_runs, args.only, log=lambda s: print(s, flush=True)
        )
    report_dir = args.report_dir or default_report_dir(study["output"])
    text = write_report(study["output"], report_dir, include=args.include, only=args.only)
    print(text)
    if args.readme:
        rundir.replace_block(
            args.readme, *readme_markers(report_dir), readme_block(text, report_dir, args.readme, _report_command(args))
        )
        print(f"updated the study-report block of {args.readme}")


if __name__ == "__main__":
    with _extras.exit_on_missing(), _extras.requires("examples", "python -m examples.llama.sweep"):
        main()
