"""Side-by-side optimizer comparison: same model, data, token budget and seed.

    python -m examples.llama.compare                       # the default, ~10 min on 2 CPU cores
    python -m examples.llama.compare --runs adamw gwt-2 galore -- --config 60m --data c4 \\
        --seq-len 256 --batch-size 512 --grad-accum 4 --steps 10000 --eval-every 1000

Arguments after ``--`` go to `examples.llama.train` (they override the small
defaults below). Writes ``results.md`` (the table), ``results.json`` (summaries
and metric histories) and ``val_loss.png`` (validation loss vs tokens) to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from examples.llama import train

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
}
DEFAULT_RUNS = [name for name in RUNS if name != "gwt-2-lion"]

#: The default budget: the paper's 9M config on byte-level Python source,
#: 100 steps x 16 x 128 tokens = 205K tokens per optimizer.
DEFAULT_TRAIN_ARGS = [
    "--config", "9m", "--seq-len", "128", "--batch-size", "16", "--steps", "100",
    "--eval-every", "20", "--eval-batches", "4", "--galore-gap", "50",
]


def parse_args(argv: Optional[Sequence[str]] = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=sorted(RUNS))
    p.add_argument("--lr", nargs="*", default=[], metavar="RUN=LR", help="peak lr per run, e.g. adamw=3e-3 gwt-2=2e-2")
    p.add_argument("--out", default="runs/compare", help="directory for results.md, results.json, val_loss.png")
    args = p.parse_args(own)
    args.lrs = {k: float(v) for k, v in (item.split("=", 1) for item in args.lr)}
    unknown = set(args.lrs) - set(args.runs)
    if unknown:
        p.error(f"--lr for runs not in --runs: {sorted(unknown)}")
    args.train_argv = train_argv
    return args


def run_all(args) -> list[dict]:
    """Trains each run in turn; returns per run ``{"name", "summary", "history"}``."""
    results = []
    for name in args.runs:
        argv = DEFAULT_TRAIN_ARGS + RUNS[name] + args.train_argv
        if name in args.lrs:
            argv += ["--lr", str(args.lrs[name])]
        argv += ["--metrics", os.path.join(args.out, f"{name}.jsonl")]
        print(f"=== {name}: {' '.join(argv)}", flush=True)
        out = train.run(train.parse_args(argv))
        results.append({"name": name, "argv": argv, "summary": out["summary"], "history": out["history"]})
        write_outputs(results, args.out)  # after each run: partial results survive an interruption
    return results


def table(results: list[dict]) -> str:
    """The comparison as a Markdown table."""
    rows = [
        "| optimizer | peak lr | state MiB | state / AdamW | matrices' state / AdamW's | val loss | val ppl | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"]
        rows.append(
            f"| {r['name']} | {s['lr']:g} | {s['state_bytes'] / 2**20:.2f} | {s['state_bytes'] / s['adamw_state_bytes']:.3f} "
            f"| {s['matrix_state_bytes'] / s['adamw_matrix_state_bytes']:.3f} | {s['final_val_loss']:.4f} "
            f"| {s['final_val_ppl']:.3f} | {s['tokens_per_s'] or 0:.0f} |"
        )
    return "\n".join(rows) + "\n"


def plot(results: list[dict], path: str) -> None:
    """Validation loss vs tokens, one line per run, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        evals = [h for h in r["history"] if "val_loss" in h]
        ax.plot([h["tokens"] for h in evals], [h["val_loss"] for h in evals], marker="o", ms=3, label=r["name"])
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: list[dict], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(table(results))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    plot(results, os.path.join(out, "val_loss.png"))


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    results = run_all(args)
    print(table(results))
    print(f"wrote {args.out}/results.md, results.json, val_loss.png")


if __name__ == "__main__":
    main()
