"""The planner's output: rows of numbers, a terminal table, Markdown, JSON and a plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from optax_gwt import plan as plan_lib

__all__ = ["COLUMNS", "row", "with_state_saved", "table", "markdown", "to_json", "plot", "replot"]

GIB = 2**30

#: (key, header, format) of the table's columns; memory in GiB per device.
COLUMNS = (
    ("config", "model", "{}"),
    ("optimizer", "optimizer", "{}"),
    ("batch_text", "micro-batch/dev", "{}"),
    ("params_gib", "params", "{:.2f}"),
    ("grads_gib", "grads", "{:.2f}"),
    ("state_gib", "opt state", "{:.2f}"),
    ("state_saved_gib", "state saved", "{:.2f}"),
    ("temps_gib", "temps", "{:.2f}"),
    ("total_gib", "total", "{:.2f}"),
    ("total_b1_gib", "total @1", "{:.2f}"),
    ("tflops", "TFLOP/step/dev", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("update_share", "update share", "{:.2%}"),
)


def row(
    name: str,
    optimizer: str,
    n_params: int,
    plan: plan_lib.StepPlan,
    accelerator: plan_lib.Accelerator,
    tokens_per_example: int,
    batch_devices: int,
) -> dict:
    """`optimizer`'s numbers on config `name`: GiB per device at its largest micro-batch, cost, roofline tokens/s.

    `tokens_per_example`: the sequence length; `batch_devices`: the devices
    the batch is split over (``data x fsdp``).
    """
    m = plan.memory
    tokens = plan.batch * batch_devices * tokens_per_example
    speed = plan_lib.roofline(plan, accelerator, max(tokens, 1))
    return {
        "config": name,
        "optimizer": optimizer,
        "n_params": n_params,
        "batch": plan.batch,
        # 0: even micro-batch 1 exceeds the budget (or the chip's compiler refused it)
        "batch_text": str(plan.batch) if plan.batch else "does not fit",
        "global_batch": plan.batch * batch_devices,
        **{f"{k}_gib": getattr(m, k) / GIB for k in ("params", "grads", "total")},
        "state_gib": m.opt_state / GIB,
        "temps_gib": m.temporaries / GIB,
        # micro-batch 1 refused by the chip's compiler: the size it needed (`plan.refused_memory`)
        "total_b1_gib": (m.total if math.isinf(plan.probes[1]) else plan.probes[1]) / GIB,
        "tflops": plan.cost.flops / 1e12,
        "gbytes": plan.cost.bytes / 1e9,
        "update_tflops": plan.update_cost.flops / 1e12,
        "update_gbytes": plan.update_cost.bytes / 1e9,
        "tokens_per_s": speed.tokens_per_s if plan.batch else 0.0,
        # the FLOP-bound alone (XLA CPU's byte counts include what a GPU's fusions would keep on chip)
        "tokens_per_s_flops": tokens * accelerator.peak_flops / plan.cost.flops if plan.batch else 0.0,
        "update_share": speed.update_share,
        "bound": speed.bound,
        # None: the chip's compiler refused that micro-batch for memory
        "compile_probes": {int(b): None if math.isinf(v) else int(v) for b, v in plan.probes.items()},
        "seconds": plan.seconds,
    }


def with_state_saved(rows: Sequence[dict]) -> list[dict]:
    """`rows` with ``state_saved_gib``: AdamW's optimizer state minus each row's, per config
    (NaN where AdamW was not planned)."""
    adamw = {r["config"]: r["state_gib"] for r in rows if r["optimizer"] == "adamw"}
    return [{**r, "state_saved_gib": adamw.get(r["config"], math.nan) - r["state_gib"]} for r in rows]


def _cells(r: dict) -> list[str]:
    """`r`'s cells; "-" where the compiler gave no figure (NaN: a GPU's costs, compiled deviceless)."""
    saved_before = {"batch_text": r.get("batch"), "state_saved_gib": float("nan")}  # rows of older reports

    def cell(value, fmt: str) -> str:
        return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)

    return [cell(r[key] if key in r else saved_before[key], fmt) for key, _, fmt in COLUMNS]


def table(rows: Sequence[dict]) -> str:
    """A plain-text table, columns aligned (memory in GiB per device)."""
    lines = [[h for _, h, _ in COLUMNS]] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out[:1] + ["  ".join("-" * w for w in widths)] + out[1:])


def markdown(rows: Sequence[dict]) -> str:
    """The table in Markdown (memory in GiB per device)."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(_cells(r)) + " |" for r in rows])


def to_json(rows: Sequence[dict], settings: dict) -> str:
    """``{"settings": ..., "rows": ...}`` as indented JSON."""
    return json.dumps({"settings": settings, "rows": list(rows)}, indent=1)


def plot(rows: Sequence[dict], path: str, hbm_gib: float) -> None:
    """Memory per device at micro-batch 1, and the largest micro-batch, against model size, per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["optimizer"] for r in rows):
        mine = sorted((r for r in rows if r["optimizer"] == name), key=lambda r: r["n_params"])
        sizes = [r["n_params"] / 1e9 for r in mine]
        left.plot(sizes, [r["total_b1_gib"] for r in mine], marker="o", label=name)
        right.plot(sizes, [r["batch"] for r in mine], marker="o", label=name)
    left.axhline(hbm_gib, color="k", ls="--", lw=1, label=f"budget {hbm_gib:g} GiB")
    left.set(yscale="log", ylabel="GiB per device at micro-batch 1")
    right.set(ylabel="largest micro-batch per device")
    ticks = {r["config"]: r["n_params"] / 1e9 for r in rows}
    for ax in (left, right):  # one tick per model, named
        ax.set(xscale="log", xlabel="parameters (B)")
        ax.set_xticks(list(ticks.values()), [f"{k}\n{v:.2g}" for k, v in ticks.items()], minor=False)
        ax.set_xticks([], minor=True)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(prefix: str) -> None:
    """``PREFIX.png`` again from ``PREFIX.json`` (no compiling)."""
    with open(prefix + ".json") as f:
        saved = json.load(f)
    plot(saved["rows"], prefix + ".png", saved["settings"]["accelerator"]["hbm_bytes"] / GIB)
