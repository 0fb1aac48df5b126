"""Checks the planner's memory estimate against the measured peak memory of the real step.

For each model (60m, 130m) and optimizer (AdamW, GWT-2), one fresh process
on one CPU device compiles the planner's train step (`optax_gwt.plan.llama`:
the library's LLaMA, scanned, with the comparison's optimizers) and reads the
estimate from XLA's ``memory_analysis()`` (`optax_gwt.plan.step_memory`);
then it allocates the params, optimizer state and batch for real and runs the
step twice. Measured: the peak resident memory during the steps (``VmHWM``,
reset through ``/proc/self/clear_refs`` after allocation) minus the resident
memory before allocating (after compiling), i.e. what the step's buffers
added to the process. The state bytes are also checked against
`optax_gwt.optimizer_state_bytes`.

    python benchmarks/plan_check.py                  # writes results/plan/check.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

CASES = [(c, o) for c in ("60m", "130m") for o in ("adamw", "gwt-2")]
MIB = 2**20


def _status(key: str) -> int:
    """A ``/proc/self/status`` memory field (kB) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def measure(config: str, optimizer: str, batch: int, seq_len: int) -> dict:
    """The estimate and the measured peak of one step (run in a fresh process)."""
    import jax
    import jax.numpy as jnp

    import optax_gwt
    from optax_gwt import plan
    from optax_gwt.models.llama_config import CONFIGS
    from optax_gwt.plan import llama

    cfg, mesh = CONFIGS[config], llama.make_mesh({})
    params = llama.sharded(llama.abstract_params(cfg), mesh)
    tx, tokens = llama.make_optimizer(optimizer, cfg), llama.batch_at(mesh, seq_len)(batch)
    compiled, state = plan.compile_step(llama.loss_fn(cfg, mesh=mesh), tx, params, tokens)
    estimate = plan.step_memory(compiled, state, tokens, params=params)
    before = _status("VmRSS")
    real = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), tree)  # noqa: E731
    args = [real(params), jax.jit(tx.init)(real(params)), real(tokens)]
    jax.block_until_ready(args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak so far (compile, init) no longer counts
    for _ in range(2):
        args[0], args[1], loss = compiled(*args)
        jax.block_until_ready(loss)
    measured = _status("VmHWM") - before
    expected_state = optax_gwt.optimizer_state_bytes(tx, params).total
    return {
        "config": config,
        "optimizer": optimizer,
        "batch": batch,
        "seq_len": seq_len,
        "estimate": estimate._asdict(),
        "measured_peak": measured,
        "optimizer_state_bytes": expected_state,
        "ratio": estimate.total / measured,
    }


def run_case(config: str, optimizer: str, batch: int, seq_len: int) -> dict:
    """`measure` in a fresh subprocess (XLA path of GWT, one CPU device)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.plan_check",
        "--one",
        config,
        optimizer,
        "--batch",
        str(batch),
        "--seq-len",
        str(seq_len),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(results: Sequence[dict]) -> str:
    lines = [
        "| model | optimizer | batch x seq | estimate MiB (params / state / temps) | measured peak MiB "
        "| estimate / measured | state = optimizer_state_bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        e = r["estimate"]
        parts = " / ".join(f"{e[k] / MIB:.0f}" for k in ("params", "opt_state", "temporaries"))
        lines.append(
            f"| {r['config']} | {r['optimizer']} | {r['batch']} x {r['seq_len']} | {e['total'] / MIB:.0f} ({parts}) "
            f"| {r['measured_peak'] / MIB:.0f} | {r['ratio']:.3f} | {e['opt_state'] == r['optimizer_state_bytes']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", nargs=2, metavar=("CONFIG", "OPTIMIZER"), help="measure one case in this process")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default="results/plan/check")
    args = p.parse_args(argv)
    from optax_gwt import _extras

    _extras.check("plan", "python -m benchmarks.plan_check", "flax")  # before any case's subprocess
    if args.one:
        print(json.dumps(measure(*args.one, args.batch, args.seq_len)))
        return
    results = [run_case(c, o, args.batch, args.seq_len) for c, o in CASES]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    from optax_gwt import _extras

    with _extras.exit_on_missing():
        main()
