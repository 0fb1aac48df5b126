"""The hazard of near-constant gradients, and what bounds it: the numerics guide's table.

    python -m benchmarks.constant_gradient --out results/numerics/constant_gradient

One (256, 64) float32 matrix, a Gaussian gradient drawn once and then repeated
every step (``constant``), or the same plus fresh noise of 1% of its scale each
step (``near-constant``); no warm-up, no weight decay, learning rate 1 and
``scale=1``, so that an update is in units of an Adam step. For each optimizer,
the largest entry of the update at steps 1, 10 and 200 and the largest over
steps 11-200. Adam's largest entry is about 1 by construction; the paper's GWT
divides each detail by its block's approximation denominator, which is small
where the block's approximation nearly cancels, and on a gradient that hardly
changes that ratio stays large.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gwt
from benchmarks import write_results

SHAPE, STEPS, REPORTED = (256, 64), 200, (1, 10, 200)

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1.0),
    "gwt-2 (the paper's)": lambda: optax_gwt.gwt_adamw(1.0, level=2, scale=1.0),
    "gwt-2, bias_correct_details=False": lambda: optax_gwt.gwt_adamw(
        1.0, level=2, scale=1.0, bias_correct_details=False
    ),
    "gwt-2, detail_clip=10": lambda: optax_gwt.gwt_adamw(1.0, level=2, scale=1.0, detail_clip=10.0),
    "gwt-2, detail_clip=3": lambda: optax_gwt.gwt_adamw(1.0, level=2, scale=1.0, detail_clip=3.0),
    "foam-2": lambda: optax_gwt.foam_adamw(1.0, level=2, scale=1.0),
}


def largest_entries(tx: optax.GradientTransformation, noise: float, seed: int = 0) -> np.ndarray:
    """``max |U_t|`` for t = 1..STEPS on the repeated gradient plus `noise` times fresh noise."""
    key = jax.random.PRNGKey(seed)
    g = jax.random.normal(key, SHAPE)
    params = {"w": jnp.zeros(SHAPE)}

    def step(state, k):
        grad = g + noise * jax.random.normal(k, SHAPE)
        u, state = tx.update({"w": grad}, state, params)
        return state, jnp.abs(u["w"]).max()

    keys = jax.random.split(jax.random.fold_in(key, 1), STEPS)
    _, largest = jax.jit(lambda s: jax.lax.scan(step, s, keys))(tx.init(params))
    return np.asarray(largest)


def measure() -> dict:
    rows = {}
    for name, build in OPTIMIZERS.items():
        for kind, noise in (("constant", 0.0), ("near-constant", 0.01)):
            largest = largest_entries(build(), noise)
            rows[f"{name} | {kind}"] = {
                **{f"step {t}": float(largest[t - 1]) for t in REPORTED},
                "steps 11-200": float(largest[10:].max()),
            }
    return rows


def table(rows: dict) -> str:
    columns = [f"step {t}" for t in REPORTED] + ["steps 11-200"]
    lines = [
        "| optimizer | gradient | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for key, row in rows.items():
        name, kind = key.split(" | ")
        lines.append(f"| {name} | {kind} | " + " | ".join(f"{row[c]:,.3g}" for c in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/numerics/constant_gradient")
    args = parser.parse_args()
    rows = measure()
    md = table(rows)
    print(md)
    write_results(args.out, {"shape": SHAPE, "steps": STEPS, "rows": rows}, md)


if __name__ == "__main__":
    main()
