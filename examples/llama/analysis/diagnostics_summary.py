"""Summarises the diagnosis runs of results/diagnostics/run.sh into results/diagnostics/summary.md: per run
and parameter group, the means over steps 31-300 of the update norm, the high-frequency share and the limiter's scale.

    python -m examples.llama.analysis.diagnostics_summary   # results/diagnostics/<run>/metrics.jsonl -> summary.md
"""

from __future__ import annotations

import json
import os

import numpy as np

from examples.llama.analysis import REPO

HERE = os.path.join(REPO, "results", "diagnostics")
RUNS = ["gwt-2-seq128", "gwt-2-seq512", "galore-seq128", "galore-seq512"]
GROUPS = ["qk", "vo", "mlp", "other"]


def records(run: str) -> list[dict]:
    """The metrics records of a run directory of results/diagnostics."""
    with open(os.path.join(HERE, run, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def mean_of(recs: list[dict], key: str) -> str:
    """The mean of `key` over the records that have it, to 3 digits ('-' where none has it)."""
    values = [r[key] for r in recs if key in r]
    return f"{np.mean(values):.3g}" if values else "-"


def main() -> None:
    lines = ["| run | final val loss | group | update norm | high-freq share | limiter scale (mean, max of max) |",
             "|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for run in RUNS:
        recs = records(run)
        later = [r for r in recs if r["step"] > 30]
        val = [r["val_loss"] for r in recs if "val_loss" in r][-1]
        for g in GROUPS:
            scale_max = [r[f"limiter_scale_max/{g}"] for r in later if f"limiter_scale_max/{g}" in r]
            scale = f"{mean_of(later, f'limiter_scale_mean/{g}')}, {max(scale_max):.3g}" if scale_max else "-"
            lines.append(
                f"| {run} | {val:.4f} | {g} | {mean_of(later, f'update_norm/{g}')} | "
                f"{mean_of(later, f'highfreq_share/{g}')} | {scale} |"
            )
    text = "Means over steps 31-300 (`python -m examples.llama.analysis.diagnostics_summary`, runs of `run.sh`).\n\n"
    with open(os.path.join(HERE, "summary.md"), "w") as fh:
        fh.write(text + "\n".join(lines) + "\n")
    print(text + "\n".join(lines))


if __name__ == "__main__":
    main()
