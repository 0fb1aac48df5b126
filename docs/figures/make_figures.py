"""Draws the documentation's figure of GWT: the coefficient layout and the chain of stages.

    python docs/figures/make_figures.py      # writes docs/figures/gwt_stages.png

Nothing here is measured: the figure is a diagram of `optax_gwt`'s defaults (Haar,
level 2, the transform along axis 0), drawn with matplotlib. The sizes printed in it
are computed with `optax_gwt.wavelets.coeff_lengths` and the optimizers' own `init`
(`jax.eval_shape`), so they are the library's.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import optax
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

import optax_gwt
from optax_gwt import wavelets

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gwt_stages.png")
N, M, LEVEL = 64, 32, 2  # the quickstart's matrix: w is 64 x 32, level 2

COLORS = {"A": "#2b7bba", "D": "#f2a541", "state": "#c0392b", "stage": "#eef3f8", "edge": "#34495e"}


def layout(ax) -> None:
    """Left: G, and its coefficients [A, D_2, D_1] along axis 0, with where Adam's state lives."""
    lengths = wavelets.coeff_lengths(N, "haar", LEVEL, "zero")  # [A, D_2, D_1]
    names = ["A"] + [f"D{LEVEL - i}" for i in range(LEVEL)]
    ax.add_patch(Rectangle((0, 0), M, N, facecolor="#d5d8dc", edgecolor=COLORS["edge"]))
    ax.text(M / 2, N / 2, f"G\n{N} x {M}", ha="center", va="center", fontsize=14)
    ax.annotate("", xy=(-4, 0), xytext=(-4, N), arrowprops=dict(arrowstyle="->", color=COLORS["edge"]))
    ax.text(-6, N / 2, "axis 0 (transformed)", rotation=90, ha="right", va="center", fontsize=12)
    x0, top = M + 18, N
    for name, length in zip(names, lengths, strict=True):
        color = COLORS["A"] if name == "A" else COLORS["D"]
        ax.add_patch(Rectangle((x0, top - length), M, length, facecolor=color, edgecolor=COLORS["edge"], alpha=0.85))
        ax.text(x0 + M / 2, top - length / 2, f"{name}: {length} x {M}", ha="center", va="center", fontsize=12)
        top -= length
    ax.add_patch(FancyArrowPatch((M + 2, N / 2), (x0 - 2, N / 2), arrowstyle="->", mutation_scale=14))
    ax.text(M + 9, N / 2 + 3, "wavedec", ha="center", fontsize=12)
    # Adam's moments: A's shape only.
    xs = x0 + M + 10
    for i, moment in enumerate(("m", "v")):
        ax.add_patch(
            Rectangle((xs + i * (M / 2 + 4), N - lengths[0]), M / 2, lengths[0], facecolor=COLORS["state"], alpha=0.8)
        )
        ax.text(xs + i * (M / 2 + 4) + M / 4, N - lengths[0] / 2, moment, ha="center", va="center", color="white", fontsize=13)
    params = {"w": jax.ShapeDtypeStruct((N, M), jnp.float32)}
    state = jax.eval_shape(optax_gwt.gwt_adamw(1e-3, level=LEVEL).init, params)
    moments = optax.tree_utils.tree_get(state, "mu")["w"].shape  # the base's first moment, on A
    adam = jax.eval_shape(optax.adam(1e-3).init, params)[0].mu["w"].shape
    ax.text(
        xs + M / 2,
        N - lengths[0] - 4,
        f"Adam state on A only:\nm, v of {moments[0]} x {moments[1]}\n(Adam's: {adam[0]} x {adam[1]})",
        ha="center",
        va="top",
        fontsize=11.5,
    )
    ax.set_xlim(-14, xs + M + 8)
    ax.set_ylim(-2, N + 8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"Haar, level {LEVEL}: coefficients of one matrix", fontsize=14)


def chain(ax) -> None:
    """Right: the stages in the order the data flows, each with what it does."""
    stages = [
        ("wavelet_project(projection)", "G -> [A, D_2, D_1]  (temporary, one step)"),
        ("on_approximation(base, projection)", "N = base(A);  state m, v of A's shape"),
        ("limit_norm_growth(1.01)", "N <- N / lam  (||N|| grows <= 1.01x a step)"),
        ("wavelet_inverse(scale=0.25)", "D / (sqrt(v) + eps);  U = scale * waverec([N, D])"),
        ("learning rate, weight decay", "p <- p - lr U;  p <- p - lr wd p"),
    ]
    height, gap = 1.0, 0.55
    for i, (name, what) in enumerate(stages):
        y = -i * (height + gap)
        ax.add_patch(
            FancyBboxPatch(
                (0, y - height),
                10,
                height,
                boxstyle="round,pad=0.05",
                facecolor=COLORS["stage"],
                edgecolor=COLORS["edge"],
            )
        )
        ax.text(0.3, y - 0.33, f"{i + 1}. {name}", fontsize=13, family="monospace", va="center")
        ax.text(0.3, y - 0.72, what, fontsize=12, va="center", color="#333")
        if i:
            ax.add_patch(FancyArrowPatch((5, y + gap), (5, y + 0.02), arrowstyle="->", mutation_scale=12))
    ax.text(5, 0.45, "gradient G", ha="center", fontsize=12)
    ax.add_patch(FancyArrowPatch((5, 0.35), (5, 0.07), arrowstyle="->", mutation_scale=12))
    bottom = -len(stages) * (height + gap) + gap
    ax.add_patch(FancyArrowPatch((5, bottom - 0.02), (5, bottom - 0.35), arrowstyle="->", mutation_scale=12))
    ax.text(5, bottom - 0.6, "the params' full-size update", ha="center", fontsize=12)
    ax.set_xlim(-0.3, 10.3)
    ax.set_ylim(bottom - 0.9, 0.8)
    ax.axis("off")
    ax.set_title("optax.chain of the stages (gwt_adamw)", fontsize=14)


def main() -> None:
    # One panel above the other, so that the page shows each at about its drawn width and the
    # text stays legible (side by side, a docs column scaled it to about 7 px).
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 10.5), gridspec_kw={"height_ratios": [1, 1.05]})
    layout(top)
    chain(bottom)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
