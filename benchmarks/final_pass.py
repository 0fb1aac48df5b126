"""Where the time of GWT-2's final full-size pass goes, on LLaMA-60M's matrices.

Run from the repository root::

    python -m benchmarks.final_pass

Times, in one process and in alternating rounds, the donated jitted loop
``p <- (p - lr * u)(1 - lr * wd)`` over the 56 attention and MLP kernels of
LLaMA-60M for the ``u`` of `optax_gwt.haar.adam_update` (what GWT-2's
train step runs after the moments) and for variants that each drop one part of
it: the block means recomputed from ``G``, the square root and division, and
everything but ``G`` itself (an axpy, the floor of a pass that reads ``P, G``
and writes ``P``). The variants compute wrong updates: they only price the
parts. Also prints XLA's temporary bytes of each.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.llama_shapes import CONFIGS, llama_params
from optax_gwt import haar

LR, WD, BLOCK = 1e-3, 0.01, 4


def _variants() -> dict:
    def rep(x, n):
        return haar.repeat_blocks(x, 0, BLOCK, n)

    def mean(g):
        return haar.block_sums(g, 0, BLOCK) / BLOCK

    def gwt(g, m, v, lam):
        approx = haar.block_sums(g, 0, BLOCK) * BLOCK**-0.5
        return haar.adam_update(
            g, approx, m, v, axis=0, block=BLOCK, eps=1e-6, approx_factor=0.9 / lam, detail_factor=0.8 / lam
        )

    def no_block_means(g, m, v, lam):
        n = g.shape[0]
        return (g * (0.8 / lam) + rep(m, n) * (0.45 / lam)) / (jnp.sqrt(rep(v, n) + 0 * g) + 1e-6)

    def no_sqrt_division(g, m, v, lam):
        n = g.shape[0]
        return ((g - rep(mean(g), n)) * (0.8 / lam) + rep(m, n) * (0.45 / lam)) * (rep(v, n) + 0 * g)

    return {
        "GWT-2 final pass": gwt,
        "without the block means": no_block_means,
        "without sqrt and division": no_sqrt_division,
        "axpy (P, G only)": lambda g, m, v, lam: g,
    }


def main() -> None:
    params = llama_params(CONFIGS["60m"], only_attention_mlp=True)
    leaves = jax.tree_util.tree_leaves(params)
    rng = np.random.default_rng(0)
    grads = [jnp.asarray(rng.standard_normal(p.shape, dtype=np.float32) * 1e-3) for p in leaves]

    def quarter(p):
        return (-(-p.shape[0] // BLOCK),) + p.shape[1:]

    mus = [jnp.asarray(rng.standard_normal(quarter(p), dtype=np.float32) * 1e-3) for p in leaves]
    nus = [jnp.square(m) + 1e-8 for m in mus]
    lams = jnp.full([len(leaves)], 1.01, jnp.float32)

    def step_for(update):
        def step(ps, gs, ms, vs, ls):
            return [
                (p - LR * 0.25 * update(g, m, v, ls[i])) * (1 - LR * WD)
                for i, (p, g, m, v) in enumerate(zip(ps, gs, ms, vs, strict=True))
            ]

        return jax.jit(step, donate_argnums=(0,))

    runs, temps, state = {}, {}, {}
    for name, update in _variants().items():
        step = step_for(update)
        state[name] = [jnp.copy(p) for p in leaves]
        compiled = step.lower(state[name], grads, mus, nus, lams).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
        runs[name] = (compiled, [])
        state[name] = compiled(state[name], grads, mus, nus, lams)
    names = list(runs)
    for r in range(9):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            compiled, times = runs[name]
            ps = state[name]
            t0 = time.perf_counter()
            for _ in range(5):
                ps = compiled(ps, grads, mus, nus, lams)
            jax.block_until_ready(ps)
            times.append((time.perf_counter() - t0) / 5)
            state[name] = ps
    base = statistics.median(runs[names[0]][1])
    print(
        f"LLaMA-60M attention+MLP kernels, {sum(p.size for p in leaves) / 1e6:.1f}M params, "
        "median of 9 alternating rounds"
    )
    for name in names:
        t = statistics.median(runs[name][1])
        print(f"  {name:28s} {t * 1e3:6.2f} ms  {t / base:5.2f} of the full pass   temp {temps[name] / 2**10:6.1f} KiB")


if __name__ == "__main__":
    main()
