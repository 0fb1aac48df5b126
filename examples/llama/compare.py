"""Side-by-side optimizer comparison: same model, data, token budget and seed.

    python -m examples.llama.compare                    # the default: 8 optimizers x 100 steps
    python -m examples.llama.compare --runs adamw gwt-2 galore -- --config 60m --data c4 \\
        --seq-len 256 --batch-size 512 --grad-accum 4 --steps 10000 --eval-every 1000
    python -m examples.llama.compare --report results/llama --readme README.md   # no training

Arguments after ``--`` go to `examples.llama.train` (they override the small
defaults below). Writes into ``--out`` (default ``runs/compare-<UTC time>/``):
``results.md`` (the table), ``results.json`` (the command, commit and machine,
then each run's summary and metric history), ``val_loss.png`` (validation loss
vs tokens), ``README.md`` (all of it for people) and one run directory per
optimizer (``<out>/<run>/``, as `train` writes them).

``--report DIR`` trains nothing: it prints the table of a saved comparison.
``--readme FILE`` (after a comparison or with ``--report``) rewrites the block
of FILE between the markers ``<!-- results-table DIR:start ... -->`` and
``<!-- results-table DIR:end -->``: the table, where and at which commit it was
measured, and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from optax_gwt import _extras

with _extras.entry_point(__name__, "examples", "python -m examples.llama.compare"):
    from examples.llama import rundir, train

#: Each run: a name -> the `train` arguments that make it.
RUNS = {
    "adamw": ["--optimizer", "adamw"],
    "adamw-modular": ["--optimizer", "adamw-modular"],
    "gwt-1": ["--optimizer", "gwt", "--level", "1"],
    "gwt-2": ["--optimizer", "gwt", "--level", "2"],
    "gwt-3": ["--optimizer", "gwt", "--level", "3"],
    "gwt-2-nobc": ["--optimizer", "gwt-nobc", "--level", "2"],
    "galore": ["--optimizer", "galore", "--level", "2"],  # rank: state <= GWT-2's
    "adafactor": ["--optimizer", "adafactor"],
    "gwt-2-lion": ["--optimizer", "gwt-lion", "--level", "2"],
    "foam-2": ["--optimizer", "foam", "--level", "2"],
}
DEFAULT_RUNS = [name for name in RUNS if name not in ("gwt-2-lion", "foam-2")]

#: The default budget: the paper's 9M config on byte-level Python source,
#: 100 steps x 16 x 128 tokens = 205K tokens per optimizer.
DEFAULT_TRAIN_ARGS = [
    "--config", "9m", "--seq-len", "128", "--batch-size", "16", "--steps", "100",
    "--eval-every", "20", "--eval-batches", "4", "--galore-gap", "50",
]  # fmt: skip

RESULTS_JSON, RESULTS_MD, PLOT, README = "results.json", "results.md", "val_loss.png", "README.md"


def build_parser() -> argparse.ArgumentParser:
    """The comparison's own flags (those before ``--``)."""
    epilog = (
        f"Each run's train arguments: {' '.join(DEFAULT_TRAIN_ARGS)},\nthen the run's own "
        "(gwt-2: --optimizer gwt --level 2), those after --, --lr and --run-dir <out>/<run>."
    )
    p = argparse.ArgumentParser(prog="python -m examples.llama.compare", description=__doc__, epilog=epilog,
                                formatter_class=train.HelpFormatter)  # fmt: skip
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS), metavar="RUN",
                   help=f"which runs, in order, of: {', '.join(RUNS)}")  # fmt: skip
    p.add_argument("--lr", nargs="*", default=[], metavar="RUN=LR", help="peak lr per run, e.g. adamw=3e-3 gwt-2=2e-2")
    p.add_argument("--out", default=None, help="the comparison's directory; None: runs/compare-<UTC time>")
    p.add_argument("--report", default=None, metavar="DIR", help="train nothing: show the saved comparison in DIR")
    p.add_argument("--readme", default=None, metavar="FILE", help="rewrite FILE's results block for the comparison")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The comparison's own flags (before ``--``) and the train flags (after it, in ``train_argv``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = build_parser()
    args = p.parse_args(own)
    args.lrs = {k: float(v) for k, v in (item.split("=", 1) for item in args.lr)}
    unknown = set(args.lrs) - set(args.runs)
    if unknown:
        p.error(f"--lr for runs not in --runs: {sorted(unknown)}")
    if args.report and (train_argv or args.out):
        p.error("--report shows a saved comparison: it takes neither --out nor train arguments")
    args.out = args.out or rundir.default_run_dir("compare", time.time())
    args.train_argv, args.command = train_argv, rundir.command_line("examples.llama.compare", argv)
    return args


def run_all(args: argparse.Namespace) -> dict:
    """Trains each run in turn into ``<out>/<run>/``; returns the report (provenance and ``runs``)."""
    if os.path.exists(os.path.join(args.out, RESULTS_JSON)):
        raise SystemExit(f"{args.out} already holds a comparison; choose another --out")
    started = time.perf_counter()
    report = {"command": args.command, "commit": rundir.git_commit(), "started": rundir.timestamp(time.time()),
              "environment": rundir.environment(), "wall_s": None, "runs": []}  # fmt: skip
    for name in args.runs:
        argv = DEFAULT_TRAIN_ARGS + RUNS[name] + args.train_argv + ["--run-dir", os.path.join(args.out, name)]
        if name in args.lrs:
            argv += ["--lr", str(args.lrs[name])]
        print(f"=== {name}: {' '.join(argv)}", flush=True)
        out = train.run(train.parse_args(argv))
        print(rundir.format_summary(out["summary"]), flush=True)
        recorded = [rundir.repo_relative(a) for a in argv]  # no machine path in results.json
        report["runs"].append({"name": name, "argv": recorded, "summary": out["summary"], "history": out["history"]})
        report["wall_s"] = time.perf_counter() - started
        write_outputs(report, args.out)  # after each run: partial results survive an interruption
    return report


def table(runs: list[dict]) -> str:
    """The comparison as a Markdown table."""
    rows = [
        "| optimizer | peak lr | state MiB | state / AdamW | matrices' state / AdamW's "
        "| val loss | val ppl | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["summary"]
        rows.append(
            f"| {r['name']} | {s['lr']:g} | {s['state_bytes'] / 2**20:.2f} "
            f"| {s['state_bytes'] / s['adamw_state_bytes']:.3f} "
            f"| {s['matrix_state_bytes'] / s['adamw_matrix_state_bytes']:.3f} | {s['final_val_loss']:.4f} "
            f"| {s['final_val_ppl']:.3f} | {s['tokens_per_s'] or 0:.0f} |"
        )
    return "\n".join(rows) + "\n"


def plot(runs: list[dict], path: str) -> None:
    """Validation loss vs tokens, one line per run, to a PNG."""
    lines = []
    for r in runs:
        evals = [h for h in r["history"] if "val_loss" in h]
        lines.append(
            (r["name"], [h["tokens"] for h in evals], [h["val_loss"] for h in evals], {"marker": "o", "ms": 3})
        )
    rundir.save_line_plot(path, lines, xlabel="training tokens", ylabel="validation loss (nats/token)")


def provenance(report: dict) -> str:
    """Which command, commit and machine produced the numbers, in one paragraph."""
    env = report["environment"]
    machine = (
        f"{env['cpu_cores']} CPU cores ({env['platform']}; load average {env['load_average']} at the start), "
        f"JAX {env['jax']} on {env['backend']} ({env['devices']}), optax {env['optax']}, flax {env['flax']}, "
        f"Python {env['python']}"
    )
    wall = rundir.format_duration(report["wall_s"]) if report.get("wall_s") else "not recorded"
    return (
        f"Command: `{report['command']}`  \nCommit: {report['commit'] or 'unknown'}; started {report['started']} UTC; "
        f"wall time {wall}.  \nMachine: {machine}.\n"
    )


def write_outputs(report: dict, out: str) -> None:
    """results.json, results.md, val_loss.png and README.md in `out`."""
    rundir.write_json(os.path.join(out, RESULTS_JSON), report)
    with open(os.path.join(out, RESULTS_MD), "w") as fh:
        fh.write(table(report["runs"]))
    plot(report["runs"], os.path.join(out, PLOT))
    with open(os.path.join(out, README), "w") as fh:
        fh.write(
            f"# Optimizer comparison\n\n{provenance(report)}\n{table(report['runs'])}\n"
            f"![validation loss vs tokens]({PLOT})\n"
        )


def load_report(directory: str) -> dict:
    """A saved comparison's results.json."""
    with open(os.path.join(directory, RESULTS_JSON)) as fh:
        return json.load(fh)


def markers(directory: str) -> tuple[str, str]:
    """The README markers around the results block of `directory`."""
    key = os.path.normpath(directory)
    return (
        f"<!-- results-table {key}:start (python -m examples.llama.compare --report {key} --readme README.md) -->",
        f"<!-- results-table {key}:end -->",
    )


def update_readme(readme: str, directory: str, report: dict) -> None:
    """Rewrites the block between `markers(directory)` in `readme`: provenance, table, plot."""
    image = os.path.relpath(os.path.join(directory, PLOT), os.path.dirname(os.path.abspath(readme)))
    block = f"{provenance(report)}\n{table(report['runs'])}\n![validation loss vs tokens]({image})\n"
    rundir.replace_block(readme, *markers(directory), block)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    directory = args.report or args.out
    report = load_report(directory) if args.report else run_all(args)
    print(table(report["runs"]))
    if not args.report:
        print(f"wrote {directory}/: {RESULTS_MD}, {RESULTS_JSON}, {PLOT}, {README} and one run directory per run")
    if args.readme:
        update_readme(args.readme, directory, report)
        print(f"updated the results block of {args.readme}")


if __name__ == "__main__":
    main()
