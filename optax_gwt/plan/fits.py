"""``python -m optax_gwt.plan.fits``: the largest LLaMA each optimizer trains on each chip.

    python -m optax_gwt.plan.fits --out results/plan/fits

For every target chip (compiled for deviceless, `optax_gwt.targets`), every chip count
(FSDP over that many chips) and every optimizer, walks up the ladder of models (by
default LLaMA 1B, 3B, 7B, 13B) compiling the planner's whole train step at micro-batch 1
(`optax_gwt.plan.llama`: scanned layers, fp32 params and state, bf16 compute, remat), and
stops at the first model that does not fit the chip's memory. For the largest model that
fits it then finds the largest micro-batch per chip (`optax_gwt.plan.plan_step`). Each
answer is the chip's compiler's, for the whole step: params, gradients, state, activations
and the step's scratch.

Writes ``OUT.md`` (the table) and ``OUT.json`` (every probe). Needs Flax and JAX's
compile-only plugins (``pip install "optax-gwt[plan]" "jax[cuda12-local,tpu]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence

from optax_gwt import _extras
from optax_gwt.models.llama_config import CONFIGS

__all__ = ["Fit", "largest_fit", "markdown"]

TARGETS = ("h100", "v5e", "v6e")
CHIPS = (1, 8)
LADDER = ("1b", "3b", "7b", "13b")
OPTIMIZERS = ("adamw", "gwt-2", "gwt-3", "foam-2")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Fit:
    """One optimizer's answer on one slice of chips.

    Attributes:
      target, chips, optimizer: the question.
      config: the largest model of the ladder that fits at micro-batch 1 (None: not even the first).
      batch: its largest micro-batch per chip (0 where `config` is None).
      total_gib: GiB per chip at that micro-batch.
      next_config, next_gib: the first model that does not fit and the GiB per chip it needs at
        micro-batch 1 (None past the ladder's top).
      seconds: the compiles' wall time here.
      max_batch: the largest micro-batch tried (`batch` equal to it: at least that many).
    """

    target: str
    chips: int
    optimizer: str
    config: str | None
    batch: int
    total_gib: float
    next_config: str | None
    next_gib: float | None
    seconds: float
    max_batch: int


def largest_fit(
    target: str,
    chips: int,
    optimizer: str,
    ladder: Sequence[str] = LADDER,
    *,
    seq_len: int = 256,
    max_batch: int = 64,
    hbm_gib: float | None = None,
) -> Fit:
    """`optimizer`'s largest model of `ladder` on `chips` chips of `target` (each with `hbm_gib`
    GiB; default: the chip's), and its largest micro-batch up to `max_batch`."""
    from optax_gwt import plan as plan_lib, targets
    from optax_gwt.plan import llama

    start = time.perf_counter()
    mesh = llama.make_mesh({"fsdp": chips}, targets.devices(target, chips))
    budget = int(hbm_gib * GIB) if hbm_gib else plan_lib.ACCELERATORS[target].hbm_bytes
    precision = llama.Precision()

    def plan(name: str, most: int) -> plan_lib.StepPlan:
        cfg = CONFIGS[name]
        params = llama.sharded(llama.abstract_params(cfg, precision.params), mesh)
        loss, batch = llama.loss_fn(cfg, precision, mesh=mesh), llama.batch_at(mesh, seq_len)
        tx = llama.make_optimizer(optimizer, cfg, precision.state)
        return plan_lib.plan_step(loss, tx, params, batch, budget, max_batch=most)

    fitting, refused = None, None
    for name in ladder:
        at_one = plan(name, 1)
        if not at_one.batch:
            refused = (name, at_one.memory.total / GIB)
            break
        fitting = name
    best = plan(fitting, max_batch) if fitting else None
    return Fit(
        target, chips, optimizer, fitting, best.batch if best else 0, best.memory.total / GIB if best else 0.0,
        refused[0] if refused else None, refused[1] if refused else None, time.perf_counter() - start, max_batch,
    )  # fmt: skip


def _cell(fit: Fit) -> str:
    most = "+" if fit.batch == fit.max_batch else ""
    found = f"**{fit.config.upper()}** x{fit.batch}{most} ({fit.total_gib:.1f} GiB)" if fit.config else "none"
    if fit.next_config:
        found += f"; {fit.next_config.upper()} needs {fit.next_gib:.1f}"
    return found


def markdown(fits: Sequence[Fit], optimizers: Sequence[str]) -> str:
    """One row per slice of chips, one column per optimizer: the largest model, its micro-batch per
    chip and GiB per chip there, and what the next model would need."""
    from optax_gwt import plan as plan_lib

    by = {(f.target, f.chips, f.optimizer): f for f in fits}
    slices = list(dict.fromkeys((f.target, f.chips) for f in fits))
    cell = lambda key: _cell(by[key]) if key in by else "(not yet planned)"  # noqa: E731
    lines = ["| chips | " + " | ".join(optimizers) + " |", "|---|" + "---|" * len(optimizers)]
    for target, chips in slices:
        acc = plan_lib.ACCELERATORS[target]
        head = f"{chips} x {acc.name} ({acc.hbm_bytes / GIB:g} GiB)"
        lines.append(f"| {head} | " + " | ".join(cell((target, chips, o)) for o in optimizers) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m optax_gwt.plan.fits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=["h100", "a100", "v5e", "v6e", "v5p"])
    p.add_argument("--chips", nargs="+", type=int, default=list(CHIPS), help="FSDP over this many chips")
    p.add_argument("--ladder", nargs="+", default=list(LADDER), choices=CONFIGS, help="models, smallest first")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=64, help="the largest micro-batch per chip tried")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json after each answer (resumes from OUT.json)")
    args = p.parse_args(argv)
    with _extras.exit_on_missing():
        _extras.check("plan", "optax_gwt.plan.fits", "flax")
    from optax_gwt import targets
    from optax_gwt.plan.__main__ import start_backend

    for t in args.targets:
        if missing := targets.missing_compiler(t):
            raise SystemExit(missing)
    start_backend(1)
    fits = _done(args.out)
    for t in args.targets:
        for n in args.chips:
            for o in args.optimizers:
                if any((f.target, f.chips, f.optimizer) == (t, n, o) for f in fits):
                    continue
                fits.append(largest_fit(t, n, o, args.ladder, seq_len=args.seq_len, max_batch=args.max_batch))
                print(f"{t} x{n} {o}: {_cell(fits[-1])}  ({fits[-1].seconds:.0f} s)", flush=True)
                if args.out:
                    _write(args.out, fits, args)
    print("\n" + markdown(fits, args.optimizers))


def _done(out: str | None) -> list[Fit]:
    """The answers already in ``OUT.json`` (a run that stopped goes on where it was)."""
    if not out or not os.path.exists(out + ".json"):
        return []
    with open(out + ".json") as f:
        return [Fit(**x) for x in json.load(f)["fits"]]


def _write(out: str, fits: list[Fit], args: argparse.Namespace) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(markdown(fits, args.optimizers))
    with open(out + ".json", "w") as f:
        json.dump({"settings": vars(args), "fits": [dataclasses.asdict(x) for x in fits]}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
