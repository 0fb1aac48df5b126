"""Accuracy per dtype, state bytes per dtype, and the detail_clip headroom: the README's numerics tables.

    python -m benchmarks.numerics_report --out results/numerics/report

1. Accuracy: 8 steps of `gwt_adamw` (level 2, Haar, lr 1e-2, weight decay
   0.1) on fixed random gradients (arrays (37, 6), (64, 48), (16, 16), (7,)),
   in each dtype setup, against the same run in float64. Error:
   ``||p - p64|| / ||p64 - p0||`` (relative to the distance moved), worst of 3
   seeds; inputs are rounded to the setup's dtype for both runs. Column
   "rounded ref": against a float64 run whose params are rounded to the
   params' dtype after every step, i.e. the optimizer's own arithmetic, not
   the storage of the params.
2. A bfloat16 second moment over a long run: ``nu`` after N steps of unit
   Gaussian gradients (b2 = 0.999), relative to float32's (whose value is ~1).
3. State bytes of a LLaMA-60M-shaped model (8 layers, 512 hidden, 1376 MLP)
   for AdamW and GWT level 2 per moment dtype.
4. detail_clip headroom: the share of elements whose details' part of the
   update (units of a bias-corrected Adam step) exceeds c, over 50 steps of
   Gaussian gradients.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gwt
from benchmarks import write_results

SHAPES = {"w": (37, 6), "m": (64, 48), "sq": (16, 16), "b": (7,)}
STEPS, SEEDS = 8, 3
SETUPS = [  # name, params dtype, mu dtype, nu dtype
    ("float32", jnp.float32, None, None),
    ("float32 params, bfloat16 mu", jnp.float32, jnp.bfloat16, None),
    ("float32 params, bfloat16 mu + nu", jnp.float32, jnp.bfloat16, jnp.bfloat16),
    ("bfloat16 params (bfloat16 moments)", jnp.bfloat16, None, None),
    ("bfloat16 params, float32 moments", jnp.bfloat16, jnp.float32, jnp.float32),
    ("float16 params, float32 moments", jnp.float16, jnp.float32, jnp.float32),
]


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [{k: rng.uniform(0.2, 3.0) * rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def _trajectory(params, grads, dtype, mu_dtype=None, nu_dtype=None, round_to=None):
    opt = optax_gwt.gwt_adamw(1e-2, level=2, weight_decay=0.1, mu_dtype=mu_dtype, nu_dtype=nu_dtype)

    def cast(t, d):
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x, d), t)

    p = cast(params, dtype)
    state = opt.init(p)
    update = jax.jit(opt.update)
    for g in grads:
        u, state = update(cast(g, dtype), state, p)
        p = optax.apply_updates(p, u)
        if round_to is not None:
            p = cast(cast(p, round_to), dtype)
    return {k: np.asarray(v, np.float64) for k, v in p.items()}


def _rel(got, want, start) -> float:
    num = sum(np.sum((got[k] - want[k]) ** 2) for k in got)
    den = sum(np.sum((want[k] - start[k]) ** 2) for k in got)
    return float(np.sqrt(num / den))


def accuracy_table() -> list[str]:
    rows = ["| setup | rel. error vs float64 | vs rounded ref |", "|---|---|---|"]
    for name, dtype, mu, nu in SETUPS:
        errs, errs_rounded = [], []
        for seed in range(SEEDS):
            params, grads = _inputs(seed)
            # Both runs see the same, rounded, inputs.
            params = {k: np.asarray(jnp.asarray(v, dtype), np.float64) for k, v in params.items()}
            grads = [{k: np.asarray(jnp.asarray(v, dtype), np.float64) for k, v in g.items()} for g in grads]
            got = _trajectory(params, grads, dtype, mu, nu)
            with jax.enable_x64(True):
                exact = _trajectory(params, grads, jnp.float64)
                rounded = _trajectory(params, grads, jnp.float64, round_to=dtype)
            errs.append(_rel(got, exact, params))
            errs_rounded.append(_rel(got, rounded, params))
        rows.append(f"| {name} | {max(errs):.1e} | {max(errs_rounded):.1e} |")
    return rows


def bf16_nu_drift(steps=(100, 1000, 5000)) -> list[str]:
    adam = {d: optax_gwt.scale_by_reference_adam(nu_dtype=d) for d in (jnp.float32, jnp.bfloat16)}
    key = jax.random.PRNGKey(0)
    rows = ["| steps | bfloat16 nu / float32 nu (median) |", "|---|---|"]
    for n in steps:
        nus = {}
        for d, opt in adam.items():

            def body(state, k, opt=opt):
                _, state = opt.update(jax.random.normal(k, (4096,)), state)
                return state, None

            state, _ = jax.lax.scan(body, opt.init(jnp.zeros(4096)), jax.random.split(key, n))
            nus[d] = np.asarray(state.nu, np.float64)
        rows.append(f"| {n} | {np.median(nus[jnp.bfloat16] / nus[jnp.float32]):.3f} |")
    return rows


def state_bytes_table() -> list[str]:
    hidden, inter, layers = 512, 1376, 8
    shapes = {
        "q": (hidden, hidden),
        "k": (hidden, hidden),
        "v": (hidden, hidden),
        "o": (hidden, hidden),
        "gate": (hidden, inter),
        "up": (hidden, inter),
        "down": (inter, hidden),
    }

    def params(dtype):
        return {f"layer{i}": {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()} for i in range(layers)}

    adam = optax_gwt.optimizer_state_bytes(optax.adamw(1e-3), params(jnp.float32)).total
    rows = ["| optimizer (params dtype) | state MiB | x AdamW float32 |", "|---|---|---|"]
    setups = [
        ("AdamW (float32)", optax.adamw(1e-3), jnp.float32),
        ("AdamW, mu bfloat16 (float32)", optax.adamw(1e-3, mu_dtype=jnp.bfloat16), jnp.float32),
        ("GWT level 2 (float32)", optax_gwt.gwt_adamw(1e-3, level=2), jnp.float32),
        ("GWT level 2, mu bfloat16 (float32)", optax_gwt.gwt_adamw(1e-3, level=2, mu_dtype=jnp.bfloat16), jnp.float32),
        (
            "GWT level 2, mu + nu bfloat16 (float32)",
            optax_gwt.gwt_adamw(1e-3, level=2, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
            jnp.float32,
        ),
        ("GWT level 2 (bfloat16)", optax_gwt.gwt_adamw(1e-3, level=2), jnp.bfloat16),
        (
            "GWT level 3, mu + nu bfloat16 (float32)",
            optax_gwt.gwt_adamw(1e-3, level=3, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
            jnp.float32,
        ),
    ]
    for name, opt, dtype in setups:
        b = optax_gwt.optimizer_state_bytes(opt, params(dtype)).total
        rows.append(f"| {name} | {b / 2**20:.2f} | {b / adam:.4f} |")
    return rows


def clip_headroom(clips=(1.0, 2.0, 5.0, 10.0, 100.0), steps=50) -> list[str]:
    shape = (256, 64)
    full = optax_gwt.scale_by_gwt(level=2, scale=1.0)
    low = optax_gwt.scale_by_gwt(level=2, scale=1.0, detail_rule="zero")

    @jax.jit
    def run(key):
        def body(states, k):
            g = {"w": jax.random.normal(k, shape)}
            u, s1 = full.update(g, states[0])
            low_u, s2 = low.update(g, states[1])
            return (s1, s2), jnp.abs(u["w"] - low_u["w"])

        p = {"w": jnp.zeros(shape)}
        _, high = jax.lax.scan(body, (full.init(p), low.init(p)), jax.random.split(key, steps))
        return high

    high = np.asarray(run(jax.random.PRNGKey(0)))
    rows = ["| detail_clip | share of elements clipped (steps 1-5) | (steps 6-50) |", "|---|---|---|"]
    for c in clips:
        rows.append(f"| {c:g} | {np.mean(high[:5] > c):.2e} | {np.mean(high[5:] > c):.2e} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/numerics/report")
    args = parser.parse_args()
    sections = [
        ("Accuracy (8 steps, worst of 3 seeds)", accuracy_table()),
        ("bfloat16 second moment over long runs (unit Gaussian gradients, b2 = 0.999)", bf16_nu_drift()),
        ("Optimizer state, LLaMA-60M matrices (8 x 512 hidden, 1376 MLP)", state_bytes_table()),
        ("detail_clip headroom on Gaussian gradients (256 x 64, level 2, Haar)", clip_headroom()),
    ]
    md = f"jax {jax.__version__}, backend {jax.default_backend()}\n\n" + "\n\n".join(
        f"{title}:\n\n" + "\n".join(rows) for title, rows in sections
    )
    print(md)
    write_results(args.out, {"sections": {title: rows for title, rows in sections}}, md)


if __name__ == "__main__":
    main()
