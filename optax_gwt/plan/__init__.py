"""Plan a training run before renting it: whole-step memory, largest batch, tokens/s.

Nothing is allocated. The train step ``params, state, batch -> params, state,
loss`` (gradient, ``optimizer.update``, ``optax.apply_updates``; params and
state donated) is jitted on `jax.ShapeDtypeStruct` instances that carry their
shardings, lowered and compiled ahead of time (on simulated CPU devices when
the mesh is bigger than the machine), and XLA's own analyses are read:

* ``compiled.memory_analysis()``: per device, the argument, output, aliased
  (donated) and temporary buffers. The step's peak is
  ``total = arguments + outputs - aliased + temporaries + code``; params,
  optimizer state and batch are the arguments' parts, the gradients (one per
  parameter, its shard and dtype) live among the temporaries.
* ``compiled.cost_analysis()``: FLOPs and bytes accessed per device. XLA counts
  a loop's body once, so a model that scans over its layers passes its own
  ``grad_cost`` (`optax_gwt.plan.llama` extrapolates from unrolled 1- and
  2-layer copies, `linear_extrapolation`), and the update's cost is added.
* The largest micro-batch per device that fits a budget: a search over the
  batch in which every probe is one compile (`largest_batch`).
* A roofline estimate on an `Accelerator`: ``t = max(F / peak, B / bandwidth)``
  per device, for the step and for the optimizer's update alone (its share).

The LLaMA planner and its CLI (``python -m optax_gwt.plan``) are in
`optax_gwt.plan.llama` and `optax_gwt.plan.__main__` (they need Flax); this
module needs only JAX and Optax.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from optax_gwt.sharding import state_shardings

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "abstract_state",
    "compiled_cost",
    "Cost",
    "StepMemory",
    "StepPlan",
    "Throughput",
    "compile_step",
    "compile_update",
    "largest_batch",
    "linear_extrapolation",
    "plan_step",
    "roofline",
    "roofline_seconds",
    "shard_bytes",
    "step_memory",
    "refused_memory",
    "train_step",
]

GIB = 2**30


class Accelerator(NamedTuple):
    """One device of an accelerator: dense bf16 peak FLOP/s, HBM bandwidth (B/s) and size (bytes)."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: int


#: Vendors' datasheet figures (dense bf16 without sparsity; SXM parts).
ACCELERATORS = {
    "h100": Accelerator("H100 SXM", 989e12, 3.35e12, 80 * GIB),
    "h200": Accelerator("H200 SXM", 989e12, 4.8e12, 141 * GIB),
    "a100": Accelerator("A100 80GB SXM", 312e12, 2.039e12, 80 * GIB),
    "v5e": Accelerator("TPU v5e", 197e12, 819e9, 16 * GIB),
    "v6e": Accelerator("TPU v6e", 918e12, 1.64e12, 32 * GIB),
    "v5p": Accelerator("TPU v5p", 459e12, 2.765e12, 95 * GIB),
}


class StepMemory(NamedTuple):
    """Bytes per device of one compiled train step.

    ``total = params + opt_state + batch + temporaries + other``: the
    gradients are counted inside ``temporaries`` (XLA allocates them there)
    and reported on their own as ``grads``; ``other`` is the outputs that do
    not alias a donated input (the loss) and the generated code. ``refused``:
    the chip's compiler refused the step for memory (`refused_memory`), and
    these are the sizes it needed.
    """

    params: int
    grads: int
    opt_state: int
    batch: int
    temporaries: int
    other: int
    total: int
    refused: bool = False


class Cost(NamedTuple):
    """FLOPs and bytes accessed per device of one step (`cost_analysis`)."""

    flops: float
    bytes: float


class StepPlan(NamedTuple):
    """The plan of one optimizer: largest micro-batch per device and the step there."""

    batch: int
    memory: StepMemory
    cost: Cost
    update_cost: Cost
    probes: dict
    seconds: float


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of `jax.ShapeDtypeStruct` instances (their ``sharding``'s shard shape)."""

    def one(x):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        return math.prod(shape) * np.dtype(x.dtype).itemsize

    return int(sum(one(x) for x in jax.tree.leaves(tree)))


def _with_shardings(tree: Any, shardings: Any) -> Any:
    if shardings is None:
        return tree
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: getattr(x, "sharding", None), tree)


def abstract_state(optimizer: optax.GradientTransformation, params: Any) -> Any:
    """``optimizer.init(params)`` as `jax.ShapeDtypeStruct` instances, sharded like their params (`state_shardings`)."""
    state = jax.eval_shape(optimizer.init, params)
    if all(s is None for s in jax.tree.leaves(_shardings(params), is_leaf=lambda s: s is None)):
        return state
    return _with_shardings(state, state_shardings(optimizer, params))


def train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """``(params, state, batch) -> (params, state, loss)``: one gradient step of `optimizer` on `loss_fn`."""

    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def compile_step(loss_fn: Callable, optimizer: optax.GradientTransformation, params: Any, batch: Any):
    """The train step compiled ahead of time for abstract, sharded inputs.

    Args:
      loss_fn: ``(params, batch) -> scalar``.
      optimizer: any Optax transformation.
      params, batch: pytrees of `jax.ShapeDtypeStruct` with a ``sharding``
        (`NamedSharding` on one mesh), or without (one device).

    Returns:
      ``(compiled, state)``: the `jax.stages.Compiled` step (params and state
      donated) and the abstract optimizer state it takes.
    """
    state = abstract_state(optimizer, params)
    out = (_shardings(params), _shardings(state), None)
    jitted = jax.jit(train_step(loss_fn, optimizer), out_shardings=out, donate_argnums=(0, 1))
    return jitted.lower(params, state, batch).compile(), state


def compile_update(optimizer: optax.GradientTransformation, params: Any):
    """``optimizer.update`` and ``apply_updates`` alone (gradients like the params), compiled."""
    state = abstract_state(optimizer, params)

    def update(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(update, out_shardings=(_shardings(params), _shardings(state)), donate_argnums=(0, 1))
    return jitted.lower(params, state, params).compile()


def step_memory(compiled: Any, state: Any, batch: Any, *, params: Any) -> StepMemory:
    """Per-device bytes of a compiled step from XLA's ``memory_analysis()`` (see `StepMemory`)."""
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes
    )
    p, s, b = shard_bytes(params), shard_bytes(state), shard_bytes(batch)
    other = total - p - s - b - m.temp_size_in_bytes
    return StepMemory(p, p, s, b, m.temp_size_in_bytes, other, total)


def compiled_cost(compiled: Any) -> Cost:
    """FLOPs and bytes accessed of a compiled computation (per device; a loop's body counted once).

    NaN where the compiler gives no cost analysis (XLA's GPU compiler, deviceless).
    """
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    if c is None:
        return Cost(float("nan"), float("nan"))
    return Cost(float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0)))


def _guess(probes: dict, budget: int, lo: int, hi: int) -> int:
    """The batch where memory meets `budget` on a line through two probes, inside ``(lo, hi)``.

    After a probe that fitted, the line runs through the two largest fitting
    probes (16 is tried after 1); else, or where those are flat, between the
    bracket's ends once both are probed. No line with a slope: the top of an
    open bracket, the middle of a closed one.
    """
    fitting = sorted(b for b in probes if b <= lo)
    if len(fitting) == 1 and hi not in probes:
        return min(16, hi - 1)
    lines = [tuple(fitting[-2:])] if next(reversed(probes)) == lo and len(fitting) > 1 else []
    lines += [(lo, hi)] if hi in probes and math.isfinite(probes[hi]) else []  # inf: refused, bytes unknown
    for b0, b1 in lines:
        slope = (probes[b1] - probes[b0]) / (b1 - b0)
        if slope > 0:
            return int(min(max(b0 + (budget - probes[b0]) // slope, lo + 1), hi - 1))
    return (lo + hi) // 2 if hi in probes else hi - 1


def largest_batch(total_bytes: Callable[[int], float], budget: int, max_batch: int = 4096) -> tuple[int, dict]:
    """The largest batch ``b <= max_batch`` with ``total_bytes(b) <= budget`` (0 if none).

    Each probe is one compile, so the bracket ``[lo, hi)`` (``lo`` fits,
    ``hi`` does not) is narrowed by where a line through two probes meets the
    budget (a step's memory is nearly affine in the batch: flat while the
    activations fit in the optimizer's scratch, then linear), with a bisection
    step after two guesses that did not halve the bracket (regula falsi made
    safe): 4-9 compiles up to 4096 on the recorded LLaMA plans. Memory is assumed nondecreasing in the batch.

    Returns:
      ``(batch, probes)``, `probes` mapping each compiled batch to its bytes.
    """
    probes: dict = {}

    def fits(b: int) -> bool:
        if b not in probes:
            probes[b] = total_bytes(b)
        return probes[b] <= budget

    if not fits(1):
        return 0, probes
    lo, hi, stalls = 1, max_batch + 1, 0
    while hi - lo > 1:
        b = (lo + hi) // 2 if stalls >= 2 else _guess(probes, budget, lo, hi)
        width, closed = hi - lo, hi in probes
        lo, hi = (b, hi) if fits(b) else (lo, b)
        stalls = stalls + 1 if closed and stalls < 2 and hi - lo > width // 2 else 0
    return lo, probes


def _refused_for_memory(error: Exception) -> bool:
    """A TPU's compiler refuses a program whose buffers exceed the chip's memory (where XLA for a
    CPU or a GPU gives its memory analysis): such a probe does not fit."""
    return "RESOURCE_EXHAUSTED" in str(error)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refused_memory(error: Exception, state: Any, batch: Any, *, params: Any) -> StepMemory:
    """The `StepMemory` of a step the chip's compiler refused for memory, ``refused`` set: params,
    state and batch from their shapes, the total from the compiler's message ("the total memory
    required for HLO temporaries (20.62G)", which counts the arguments too; their sum where it
    names none), the temporaries the rest.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> p = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
      >>> error = RuntimeError("RESOURCE_EXHAUSTED: ... memory required for HLO temporaries (1.50G) exceeds ...")
      >>> m = refused_memory(error, p, jax.ShapeDtypeStruct((8, 1024), jnp.float32), params=p)
      >>> m.refused, m.total / 2**30, round(m.temporaries / 2**30, 3)
      (True, 1.5, 1.492)
    """
    found = re.search(r"temporaries \(([\d.]+)\s*([KMGT]?)i?B?\)", str(error))
    p, s, b = shard_bytes(params), shard_bytes(state), shard_bytes(batch)
    total = max(int(float(found[1]) * _UNITS[found[2]]) if found else 0, p + s + b)
    return StepMemory(p, p, s, b, total - p - s - b, 0, total, refused=True)


def plan_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    params: Any,
    batch_at: Callable[[int], Any],
    budget: int,
    *,
    grad_cost: Callable[[int], Cost] | None = None,
    max_batch: int = 4096,
) -> StepPlan:
    """Plans one optimizer: the largest micro-batch per device that fits `budget`, its memory and cost.

    Args:
      loss_fn: ``(params, batch) -> scalar``, any model.
      optimizer: any Optax transformation.
      params: abstract params (`jax.ShapeDtypeStruct` instances, with shardings on a mesh).
      batch_at: a function of ``b`` that gives the abstract batch of micro-batch ``b`` per device.
      budget: bytes per device.
      grad_cost: ``b -> Cost`` of the loss's gradient at micro-batch `b`;
        the step's cost is then that plus the update's. Default: the compiled
        step's own `compiled_cost` (right when the model has no loop).
      max_batch: the largest micro-batch tried.

    Returns:
      A `StepPlan`; at batch 1 (memory, cost) when even that does not fit, with ``batch=0``.
      A micro-batch the chip's compiler refuses for memory (a TPU's does) is in its
      ``probes`` as ``math.inf`` bytes.

    Example:
      >>> import jax, jax.numpy as jnp, optax_gwt
      >>> params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
      >>> loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)
      >>> batch_at = lambda b: jax.ShapeDtypeStruct((8 * b, 256), jnp.float32)
      >>> result = plan_step(loss, optax_gwt.gwt_adamw(1e-3), params, batch_at, budget=2**20)
      >>> result.batch > 0, result.memory.total <= 2**20 < result.probes[result.batch + 1]
      (True, True)
    """
    start = time.perf_counter()
    compiled_at = functools.lru_cache(maxsize=None)(lambda b: compile_step(loss_fn, optimizer, params, batch_at(b)))

    def memory_at(b: int) -> StepMemory:
        compiled, state = compiled_at(b)
        return step_memory(compiled, state, batch_at(b), params=params)

    def total_at(b: int) -> float:
        try:
            return memory_at(b).total
        except jax.errors.JaxRuntimeError as e:
            if not _refused_for_memory(e):
                raise
            return math.inf

    batch, probes = largest_batch(total_at, budget, max_batch)
    b = max(batch, 1)
    try:
        memory, compiled = memory_at(b), compiled_at(b)[0]
    except jax.errors.JaxRuntimeError as e:  # micro-batch 1 refused: the sizes it needed
        if not _refused_for_memory(e):
            raise
        memory = refused_memory(e, abstract_state(optimizer, params), batch_at(b), params=params)
        compiled = None
    update_cost = _update_cost(optimizer, params)
    if grad_cost is not None:
        cost = Cost(*(g + u for g, u in zip(grad_cost(b), update_cost, strict=True)))
    else:
        cost = compiled_cost(compiled) if compiled is not None else Cost(float("nan"), float("nan"))
    return StepPlan(batch, memory, cost, update_cost, probes, time.perf_counter() - start)


def _update_cost(optimizer: optax.GradientTransformation, params: Any) -> Cost:
    """The cost of the update alone; NaN where the chip's compiler refuses even that for memory."""
    try:
        return compiled_cost(compile_update(optimizer, params))
    except jax.errors.JaxRuntimeError as e:
        if not _refused_for_memory(e):
            raise
        return Cost(float("nan"), float("nan"))


def linear_extrapolation(cost_of: Callable[[int], Cost], n: int) -> Cost:
    """``cost(n) = cost(1) + (n - 1) * (cost(2) - cost(1))``, for a cost affine in `n`.

    E.g. `n` layers of a stack of identical layers, compiled unrolled (so that
    XLA counts every layer, where a scan's body is counted once), or the
    micro-batch (FLOPs are linear in it).
    """
    one, two = cost_of(1), cost_of(2)
    return Cost(*(a + (n - 1) * (b - a) for a, b in zip(one, two, strict=True)))


class Throughput(NamedTuple):
    """Roofline estimate of one step: tokens/s, seconds per step and the update's share of them."""

    tokens_per_s: float
    step_seconds: float
    update_seconds: float
    update_share: float
    bound: str


def roofline_seconds(cost: Cost, accelerator: Accelerator) -> float:
    """``max(flops / peak, bytes / bandwidth)``: the time one device needs at best."""
    return max(cost.flops / accelerator.peak_flops, cost.bytes / accelerator.hbm_bandwidth)


def roofline(plan: StepPlan, accelerator: Accelerator, tokens_per_step: int) -> Throughput:
    """Tokens/s of `plan`'s step on `accelerator`: ``tokens_per_step / max(F / peak, B / bandwidth)``.

    `tokens_per_step` counts the whole mesh (micro-batch x batch-splitting
    devices x sequence length); the costs are per device, all devices
    running in parallel. Communication and kernel launch are not counted.
    """
    step, update = roofline_seconds(plan.cost, accelerator), roofline_seconds(plan.update_cost, accelerator)
    bound = (
        "compute"
        if plan.cost.flops / accelerator.peak_flops >= plan.cost.bytes / accelerator.hbm_bandwidth
        else "memory"
    )
    return Throughput(tokens_per_step / step, step, update, update / step, bound)
