"""Issue 23's remedies: GWT-2 with one change each against its reference, at 128 and 1024 tokens.

    python -m examples.llama.analysis.seqlen_remedies   # results/seqlen/remedies.jsonl -> remedies.md, remedies.json

From the runs of examples/llama/studies/seqlen2-remedies.toml (the seqlen2 setup, lr 2e-2, three
seeds). Per variant and length: the mean final validation loss over the seeds with its sample std,
and the mean over seeds of the paired ratio to the reference (seed s against the reference's seed
s: the same initialisation and data order); a variant wins where that ratio is below 1 at 1024
tokens without being above 1 at 128. From the diagnostics of each run (metrics.jsonl): the
limiter's mean factor lam over steps 31-150, per parameter group (the run directories are not
committed; their summary is, in remedies.json).
"""

from __future__ import annotations

import json
import os

import numpy as np

from examples.llama import rundir, sweep
from examples.llama.analysis import REPO

HERE = os.path.join(REPO, "results", "seqlen")

REFERENCE = "gwt-2"


def _runs(path: str) -> dict:
    """``{(name, seq_len): {seed: record}}``, the last record of each run."""
    out: dict = {}
    for r in sweep.load_records(path):
        if "error" not in r and r.get("final_val_loss") is not None:
            out.setdefault((r["name"], r["flags"]["seq_len"]), {})[r["flags"]["seed"]] = r
    return out


def _limiter(record: dict) -> dict:
    """Mean limiter factor per group over steps 31 on, from the run's metrics.jsonl (if it is there)."""
    sums: dict = {}
    for m in rundir.read_metrics(os.path.join(REPO, record.get("run_dir", ""), "metrics.jsonl")):
        if m.get("step", 0) <= 30:
            continue
        for key, value in m.items():
            if key.startswith("limiter_scale_mean/"):
                sums.setdefault(key.split("/")[-1], []).append(value)
    return {g: float(np.mean(v)) for g, v in sums.items()}


def summarize(runs: dict) -> list[dict]:
    """One row per variant and length: the loss over seeds, the paired ratio to the reference, the limiter."""
    rows = []
    for (name, seq_len), seeds in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ref = runs.get((REFERENCE, seq_len), {})
        common = sorted(set(seeds) & set(ref))
        losses = [seeds[s]["final_val_loss"] for s in sorted(seeds)]
        ratios = [seeds[s]["final_val_loss"] / ref[s]["final_val_loss"] for s in common]
        limiter = [_limiter(seeds[s]) for s in sorted(seeds)]
        groups = sorted({g for d in limiter for g in d})
        rows.append(
            {
                "name": name,
                "seq_len": seq_len,
                "seeds": sorted(seeds),
                "mean": float(np.mean(losses)),
                "std": float(np.std(losses, ddof=1)) if len(losses) > 1 else 0.0,
                "ratio_to_reference": float(np.mean(ratios)) if ratios else None,
                "limiter_mean": {g: float(np.mean([d[g] for d in limiter if g in d])) for g in groups},
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """remedies.md's table."""
    lines = [
        "| seq len | variant | seeds | val loss | / reference (paired) | limiter mean lam |",
        "|---:|---|---|---|---:|---|",
    ]
    for r in rows:
        ratio = "-" if r["ratio_to_reference"] is None else f"{r['ratio_to_reference']:.4f}"
        lam = ", ".join(f"{g} {v:.3f}" for g, v in r["limiter_mean"].items()) or "-"
        seeds = ",".join(map(str, r["seeds"]))
        lines.append(f"| {r['seq_len']} | {r['name']} | {seeds} | {r['mean']:.4f} ± {r['std']:.4f} | {ratio} | {lam} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    rows = summarize(_runs(os.path.join(HERE, "remedies.jsonl")))
    with open(os.path.join(HERE, "remedies.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(HERE, "remedies.md"), "w") as f:
        f.write(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
