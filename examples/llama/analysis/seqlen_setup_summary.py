"""Issue 23: the tables of the setup checks, from their committed results, into setup.md.

    python -m examples.llama.analysis.seqlen_setup_summary   # reads results/seqlen/setup_*.json,
                                                             # control.jsonl, seqlen2.jsonl -> setup.md

docs/study_records.md carries setup.md between its ``seqlen-setup`` markers (tests/test_seqlen_setup.py checks it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from examples.llama.analysis import REPO

HERE = os.path.join(REPO, "results", "seqlen")


def _load(name: str) -> Any:
    """A results file of results/seqlen: a JSON file's value, or a JSONL file's list of records."""
    path = os.path.join(HERE, name)
    if name.endswith(".jsonl"):
        with open(path) as fh:
            return [json.loads(line) for line in fh if line.strip()]
    with open(path) as fh:
        return json.load(fh)


def data_table() -> list[str]:
    rows = _load("setup_data.json")["rows"]
    by = {(r["seq_len"], r["val_span"]): r for r in rows}
    lengths = sorted({r["seq_len"] for r in rows})
    lines = [
        "| validation windows | " + " | ".join(f"{L} tokens" for L in lengths) + " |",
        "|---|" + "---|" * len(lengths),
        "| old (`--val-span 0`): windows spread over the text | "
        + " | ".join(f"{by[L, 0]['bigram_nats']:.4f}" for L in lengths)
        + " |",
        "| new (`--val-span 1024`): the same 16 x 1024 tokens | "
        + " | ".join(f"{by[L, 1024]['bigram_nats']:.4f}" for L in lengths)
        + " |",
    ]
    return lines


def positions_table() -> list[str]:
    rows = _load("setup_positions.json")["rows"]
    lines = [
        "| trained at (best lr, seed 0) | evaluated on windows of | loss | positions 0-15 | 16-127 "
        "| 128-511 (or to the end) | 512-1023 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.get(k) for k in ("pos 0-15", "pos 16-127")]
        cells += [r.get(k) for k in (f"pos 128-{min(511, r['eval_seq_len'] - 1)}", "pos 512-1023")]
        lines.append(
            f"| {r['trained_seq_len']} x {2048 // r['trained_seq_len']} (lr {r['lr']:g}) | {r['eval_seq_len']} | "
            f"{r['mean']:.4f} | " + " | ".join("" if c is None else f"{c:.4f}" for c in cells) + " |"
        )
    return lines


def noise_table() -> list[str]:
    d = _load("setup_noise.json")
    lines = [
        "| batch (2048 tokens) | cosine of one batch's gradient to the others' mean | noise / signal |",
        "|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['batch_size']} x {r['seq_len']} | {r['cosine_to_others_mean']:.3f} | {r['noise_to_signal']:.2f} |"
        )
    return lines


def detail_noise_table() -> list[str]:
    d = _load("setup_detail_noise.json")
    lines = [
        "| batch (2048 tokens) | noise / signal, approximation | noise / signal, details "
        "| details' share of one batch's gradient | of the mean gradient |",
        "|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['batch_size']} x {r['seq_len']} | {r['noise_to_signal_approximation']:.2f} | "
            f"{r['noise_to_signal_details']:.2f} | {r['detail_share_one_batch']:.3f} | "
            f"{r['detail_share_mean_gradient']:.3f} |"
        )
    return lines


def control_table() -> list[str]:
    """AdamW-modular, seed 0: 16 x 128 from 16 places, 16 x 128 cut from the 2 x 1024 (4 x 512) text, and those."""
    main = [r for r in _load("seqlen2.jsonl") if r["name"] == "adamw-modular" and r["flags"]["seed"] == 0]
    control = _load("control.jsonl")
    lrs = sorted({r["flags"]["lr"] for r in control})

    def cell(records: list[dict], **want: float) -> str:
        hit = [r for r in records if all(r["flags"].get(k, 1) == v for k, v in want.items())]
        return f"{hit[-1]['final_val_loss']:.4f}" if hit else ""

    lines = [
        "| batch of 2048 tokens | places of the text a step samples | context | "
        + " | ".join(f"lr {lr:g}" for lr in lrs)
        + " |",
        "|---|---|---|" + "---|" * len(lrs),
        "| 16 x 128 | 16 | 128 | " + " | ".join(cell(main, lr=lr, seq_len=128) for lr in lrs) + " |",
    ]
    for k, long in ((4, 512), (8, 1024)):
        lines.append(
            f"| 16 x 128, drawn {k} consecutive (`--contiguous-windows {k}`) | {16 // k} | 128 | "
            + " | ".join(cell(control, lr=lr, contiguous_windows=k) for lr in lrs)
            + " |"
        )
        lines.append(
            f"| {2048 // long} x {long} | {2048 // long} | {long} | "
            + " | ".join(cell(main, lr=lr, seq_len=long) for lr in lrs)
            + " |"
        )
    return lines


def render() -> str:
    """setup.md's text from the results files."""
    parts = [
        "A bigram model counted on the training split (it sees one token of context, so only the text "
        "changes its loss), nats per predicted token:",
        "",
        *data_table(),
        "",
        "AdamW-modular's seqlen2 checkpoints (each length's best lr, seed 0), mean loss by position in the "
        "window, on the same validation text:",
        "",
        *positions_table(),
        "",
        "Gradients at 2048 tokens a step, at AdamW-modular's 1024-token checkpoint, 24 training batches of each shape:",
        "",
        *noise_table(),
        "",
        "The same gradients of the attention and MLP kernels, split as GWT-2 splits them (Haar level 2 "
        "along the input axis: the approximation's block means and the details):",
        "",
        *detail_noise_table(),
        "",
        "The control, AdamW-modular, seed 0, final validation loss (same validation text):",
        "",
        *control_table(),
    ]
    return "\n".join(parts) + "\n"


def main() -> str:
    text = render()
    with open(os.path.join(HERE, "setup.md"), "w") as fh:
        fh.write(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
