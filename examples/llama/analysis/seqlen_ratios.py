"""Issue 23: each optimizer's validation loss relative to AdamW-modular's, per sequence length.

    python -m examples.llama.analysis.seqlen_ratios   # results/seqlen/seqlen2.jsonl (and remedies.jsonl)
                                                      # -> results/seqlen/ratios.md, ratios.json, ratios.png

Two questions, from the runs of examples/llama/studies/seqlen2.toml and seqlen2-fixed.toml:

* fixed: every optimizer at the setting that is best at 128 tokens (by its three-seed mean there),
  used unchanged at every length (the paper's claim: "the same training settings");
* retuned: every optimizer at its best setting of each length (lr tuned on seed 0, the best rerun
  on seeds 1 and 2; among the settings run on three seeds the lowest mean wins, as
  examples.llama.sweep ranks). GWT-2's lr 2e-2 also has three seeds at 128, 512 and 1024, from
  seqlen2-remedies.toml (its reference runs: the same training, with --diagnostics).

A ratio is mean loss (three seeds) / AdamW-modular's mean loss of the same question and length;
"± " is the sample std over seeds of the per-seed ratio (seed s against AdamW-modular's seed s:
same initialisation and data order). "Stable" means the ratio does not grow with the length.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from examples.llama import sweep
from examples.llama.analysis import REPO

HERE = os.path.join(REPO, "results", "seqlen")
SEEDS = (0, 1, 2)
REFERENCE = "adamw-modular"


#: Flags that do not change training (``--diagnostics`` only records): not part of a setting.
NOT_TRAINING = ("seed", "seq_len", "batch_size", "diagnostics")

#: Runs of other studies that are seqlen2 runs: seqlen2-remedies.toml's reference GWT-2 (lr 2e-2,
#: three seeds at 128, 512 and 1024) is seqlen2's GWT-2 setting, recorded with --diagnostics.
ALSO = (("remedies.jsonl", "gwt-2"),)


def _setting(flags: dict) -> str:
    """A run's setting across lengths: its flags but the seed, the batch shape and --diagnostics."""
    return json.dumps({k: v for k, v in flags.items() if k not in NOT_TRAINING}, sort_keys=True)


def collect(records: list[dict]) -> dict:
    """``{name: {setting: {seq_len: {seed: loss}}}}`` (the last record of each run)."""
    out: dict = {}
    for r in {r["key"]: r for r in records if "error" not in r}.values():
        f = r["flags"]
        loss = r["final_val_loss"] if r["final_val_loss"] is not None else math.inf
        out.setdefault(r["name"], {}).setdefault(_setting(f), {}).setdefault(f["seq_len"], {})[f["seed"]] = loss
    return out


def _complete(per_len: dict, L: int) -> bool:
    return all(s in per_len.get(L, {}) for s in SEEDS)


def choose(runs: dict, lengths: list[int]) -> dict:
    """``{question: {name: {seq_len: setting}}}``: fixed (best at the shortest length) and retuned.

    A length where no setting of an optimizer has all three seeds yet falls back to seed 0's best
    (its cells say "1 seed"): the study ran out of machine time there.
    """
    out: dict = {"fixed": {}, "retuned": {}}
    for name, settings in runs.items():
        for L in lengths:
            done = {s: np.mean([v[L][x] for x in SEEDS]) for s, v in settings.items() if _complete(v, L)}
            if not done:
                done = {s: v[L][0] for s, v in settings.items() if 0 in v.get(L, {})}
            if done:
                out["retuned"].setdefault(name, {})[L] = min(done, key=lambda s: (done[s], s))
        base = out["retuned"].get(name, {}).get(lengths[0])
        if base is not None:
            out["fixed"][name] = {L: base for L in lengths if 0 in settings[base].get(L, {})}
    return out


def table(runs: dict, chosen: dict, lengths: list[int]) -> dict:
    """``{question: {name: {seq_len: {"mean", "std", "n", "ratio", "ratio_std", "setting"}}}}``.

    Over the seeds (of 0, 1, 2) the setting has at that length; the ratio pairs them with
    AdamW-modular's same seeds.
    """
    out: dict = {}
    for question, names in chosen.items():
        ref = names.get(REFERENCE, {})
        for name, per_len in names.items():
            for L, setting in per_len.items():
                have = runs[name][setting][L]
                seeds = [s for s in SEEDS if s in have]
                losses = np.array([have[s] for s in seeds])
                cell = {"mean": float(losses.mean()), "std": float(losses.std(ddof=1)) if len(seeds) > 1 else 0.0,
                        "n": len(seeds), "setting": json.loads(setting)}  # fmt: skip
                if L in ref:
                    ref_have = runs[REFERENCE][ref[L]][L]
                    common = [s for s in seeds if s in ref_have]
                    if common:
                        per_seed = np.array([have[s] / ref_have[s] for s in common])
                        ref_mean = np.mean([ref_have[s] for s in common])
                        cell["ratio"] = float(np.mean([have[s] for s in common]) / ref_mean)
                        cell["ratio_std"] = float(per_seed.std(ddof=1)) if len(common) > 1 else 0.0
                        cell["ratio_n"] = len(common)
                out.setdefault(question, {}).setdefault(name, {})[L] = cell
    return out


def _short(setting: dict) -> str:
    parts = [f"lr {setting['lr']:g}"]
    if "galore_gap" in setting:
        parts.append(f"gap {setting['galore_gap']}")
    return ", ".join(parts)


def _ratio_cell(c: dict | None) -> str:
    if c is None or "ratio" not in c:
        return ""
    return f"**{c['ratio']:.3f}** ± {c['ratio_std']:.3f}" + ("" if c["ratio_n"] == 3 else f" ({c['ratio_n']} seed)")


def _loss_cell(c: dict | None) -> str:
    if c is None:
        return ""
    seeds = "" if c["n"] == 3 else f", {c['n']} seed"
    return f"{c['mean']:.4f} ± {c['std']:.4f} ({_short(c['setting'])}{seeds})"


def markdown(tab: dict, lengths: list[int]) -> str:
    lines = []
    titles = (("fixed", "Fixed settings (each optimizer's best at 128, unchanged at every length)"),
              ("retuned", "Retuned at every length"))  # fmt: skip
    head = "| optimizer | " + " | ".join(f"{L} tokens" for L in lengths) + " |"
    rule = "|---|" + "---|" * len(lengths)
    for question, title in titles:
        names = sorted(tab.get(question, {}), key=lambda n: (n != REFERENCE, n))
        if not names:
            continue
        ratio_rows, loss_rows = [], []
        for name in names:
            cells = [tab[question][name].get(L) for L in lengths]
            ratio_rows.append(f"| {name} | " + " | ".join(
                _ratio_cell(c) for c in cells
            ) + " |")  # fmt: skip
            loss_rows.append(f"| {name} | " + " | ".join(
                _loss_cell(c) for c in cells
            ) + " |")  # fmt: skip
        lines += [f"**{title}**: validation loss / AdamW-modular's (three seeds; ± over the per-seed ratios)", "",
                  head, rule, *ratio_rows, "", "Validation loss, mean ± std of three seeds (setting):", "",
                  head, rule, *loss_rows, ""]  # fmt: skip
    return "\n".join(lines)


def plot(tab: dict, lengths: list[int], path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, question in zip(axes, ("fixed", "retuned"), strict=True):
        for name, per_len in sorted(tab.get(question, {}).items()):
            Ls = [L for L in lengths if L in per_len and "ratio" in per_len[L]]
            if Ls:
                ax.errorbar(Ls, [per_len[L]["ratio"] for L in Ls], yerr=[per_len[L]["ratio_std"] for L in Ls],
                            marker="o", capsize=3, label=name)  # fmt: skip
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(L) for L in lengths])
        ax.set_xlabel("tokens a sequence (2048 tokens a step)")
        ax.set_title(f"{question} settings")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("val loss / AdamW-modular's (3 seeds)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(jsonl: str = os.path.join(HERE, "seqlen2.jsonl")) -> tuple[dict, list[int], str]:
    """(the ratio table, the lengths, ratios.md's text) from the study's JSONL."""
    records = sweep.load_records(jsonl)
    for name, optimizer in ALSO:
        records += [r for r in sweep.load_records(os.path.join(os.path.dirname(jsonl), name)) if r["name"] == optimizer]
    runs = collect(records)
    lengths = sorted({r["flags"]["seq_len"] for r in records})
    tab = table(runs, choose(runs, lengths), lengths)
    return tab, lengths, markdown(tab, lengths)


def main(jsonl: str = os.path.join(HERE, "seqlen2.jsonl"), out_dir: str = HERE) -> dict:
    tab, lengths, text = render(jsonl)
    with open(os.path.join(out_dir, "ratios.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out_dir, "ratios.json"), "w") as fh:
        json.dump({q: {n: {str(L): c for L, c in v.items()} for n, v in names.items()} for q, names in tab.items()},
                  fh, indent=1)  # fmt: skip
    plot(tab, lengths, os.path.join(out_dir, "ratios.png"))
    print(text)
    return tab


if __name__ == "__main__":
    main(*sys.argv[1:])
