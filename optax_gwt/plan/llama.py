"""The LLaMA planner: the LLaMA model scanned over its layers, sharded, with the comparison's optimizers.

The model is `optax_gwt.models.llama`'s (its `Block`, embedding, final norm
and head, its `CONFIGS`; the model the LLaMA example trains), only run
differently: the layers' params are stacked along a leading axis of length
``num_layers`` and the forward pass is one ``jax.lax.scan`` over them
(``jax.checkpoint`` on the body with remat), so the compiled program, and the
time to compile it, do not grow with depth.

Params: ``{"model": embed / final_norm / lm_head, "layers": every Block's
arrays stacked, (L, ...)}``. Mesh axes ``data`` x ``fsdp`` x ``tensor``: the
batch is split over ``data`` and ``fsdp``; column-parallel kernels (q, k, v,
gate, up, the head) split their output axis over ``fsdp`` and ``tensor``,
row-parallel ones (o, down) their input axis over ``tensor`` and output axis
over ``fsdp``, the embedding its vocabulary over ``tensor`` and hidden axis
over ``fsdp``; an axis that a mesh axis does not divide moves to the other
axis of the matrix, else stays whole. GWT transforms axis 0 of each kernel
(the input axis), which only ``tensor`` splits.

Optimizers: `optax_gwt.modular.make_optimizer`'s (the paper's
modular grouping: GWT / GaLore on the attention and MLP matrices, AdamW on the
rest). GWT and FOAM run on the stacks themselves (``batch_axes=1``, as a trainer
of scanned layers runs them: one limiter norm per layer's matrix); the others are
applied to each layer by ``jax.vmap`` over the stacked axis (`over_layers`). Either
way every matrix keeps its own state, norms and projectors exactly as in the
unstacked model.

Needs Flax (``pip install "optax-gwt[plan]"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from optax_gwt import modular, plan as plan_lib
from optax_gwt._extras import requires

with requires("plan", "optax_gwt.plan.llama"):
    from flax import nnx

    from optax_gwt.models.llama import Block, Llama, LlamaConfig

__all__ = [
    "AXES",
    "OPTIMIZERS",
    "PLANNABLE",
    "Precision",
    "abstract_params",
    "batch_at",
    "grad_cost",
    "loss_fn",
    "make_mesh",
    "make_optimizer",
    "over_layers",
    "param_shardings",
    "plan_llama",
    "state_in",
]

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
#: The optimizers the planner compares by default (GaLore's rank matches GWT-2's state).
OPTIMIZERS = ("adamw", "gwt-1", "gwt-2", "gwt-3", "galore", "adafactor")
#: Every optimizer it can plan: the defaults and FOAM at fold levels 1-4 (``--optimizers foam-2``).
PLANNABLE = (*OPTIMIZERS, "foam-1", "foam-2", "foam-3", "foam-4")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
_ROW = ("o_proj", "down_proj")


class Precision(NamedTuple):
    """dtypes of the params (and gradients), of the optimizer state and of the computation; remat."""

    params: str = "float32"
    state: str = "float32"
    compute: str = "bfloat16"
    remat: bool = True


def _split(module: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    graphdef, state = nnx.split(module)
    return graphdef, nnx.to_pure_dict(state)


def _modules(cfg: LlamaConfig) -> tuple:
    """Abstract (graphdef, pure-dict state) of the model without layers, and of one `Block`."""
    top = nnx.eval_shape(lambda: Llama(dataclasses.replace(cfg, num_layers=0), nnx.Rngs(0)))
    block = nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0)))
    return _split(top), _split(block)


def abstract_params(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    """The params as `jax.ShapeDtypeStruct` instances: ``{"model": ..., "layers": (L, ...) stacked}``."""
    (_, top), (_, block) = _modules(cfg)
    as_dtype = lambda x, lead=(): jax.ShapeDtypeStruct(lead + x.shape, jnp.dtype(dtype))  # noqa: E731
    layers = jax.tree.map(lambda x: as_dtype(x, (cfg.num_layers,)), block)
    return {"model": jax.tree.map(as_dtype, top), "layers": layers}


def loss_fn(
    cfg: LlamaConfig, precision: Precision = Precision(), unroll: bool = False, mesh: Mesh | None = None
) -> Callable:
    """A function ``(params, tokens) -> loss``: mean next-token cross-entropy, the layers scanned.

    ``tokens`` has shape ``(B, T + 1)``.

    `unroll` unrolls the scan (for `grad_cost`: XLA's cost analysis counts a
    loop's body once). On a `mesh`, the activations between layers are
    constrained to the batch's split (``data`` x ``fsdp``), as FSDP runs them.
    """
    cfg = dataclasses.replace(cfg, dtype=precision.compute)
    (top_def, _), (block_def, _) = _modules(cfg)
    split = NamedSharding(mesh, P(BATCH_AXES)) if mesh is not None else None
    constrain = (lambda x: jax.lax.with_sharding_constraint(x, split)) if split else (lambda x: x)

    def layer(x, params):
        return constrain(nnx.merge(block_def, params)(x)), None

    body = jax.checkpoint(layer) if precision.remat else layer

    def loss(params, tokens):
        model = nnx.merge(top_def, params["model"])
        x, _ = jax.lax.scan(body, constrain(model.embed(tokens[:, :-1])), params["layers"], unroll=unroll)
        logits = constrain(model.lm_head(model.final_norm(x)).astype(jnp.float32))
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def make_mesh(sizes: dict, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh ``data x fsdp x tensor`` (missing axes of size 1) over the first `devices` (default:
    the process's; compile-only devices of `optax_gwt.targets` plan for a chip)."""
    shape = tuple(int(sizes.get(a, 1)) for a in AXES)
    n = math.prod(shape)
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        mesh = dict(zip(AXES, shape, strict=True))
        raise ValueError(f"mesh {mesh} needs {n} devices, {len(devices)} given")
    return Mesh(np.array(devices[:n]).reshape(shape), AXES)


def _wants(path: tuple, ndim: int) -> list:
    """The mesh axes each array axis would like (before divisibility), from the array's path."""
    names = {getattr(k, "key", None) for k in path}
    wants: list[tuple[str, ...]] = [()] * ndim
    if names & set(_COLUMN):
        wants[-1] = ("fsdp", "tensor")
    elif names & set(_ROW):
        wants[-2:] = [("tensor",), ("fsdp",)]
    elif "embedding" in names:
        wants = [("tensor",), ("fsdp",)]
    return wants


def _spec(shape: tuple, wants: list, mesh: Mesh) -> P:
    """`wants` kept where the mesh axes' size divides the length, else moved to a free matrix axis, else dropped."""
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    entries = [tuple(a for a in w if mesh.shape[a] > 1) for w in wants]
    for i, axes in enumerate(entries):
        if axes and shape[i] % size(axes):
            entries[i] = ()
            free = [
                j for j in range(len(shape) - 2, len(shape)) if j != i and not entries[j] and shape[j] % size(axes) == 0
            ]
            if len(shape) >= 2 and free:
                entries[free[0]] = axes
    return P(*(e or None for e in entries))


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """The `NamedSharding` of every parameter (the module docstring's layout)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, _spec(x.shape, _wants(path, len(x.shape)), mesh)), params
    )


def sharded(params: Any, mesh: Mesh) -> Any:
    """`params` as `jax.ShapeDtypeStruct` instances that carry their `param_shardings`."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, param_shardings(params, mesh)
    )


def batch_at(mesh: Mesh, seq_len: int) -> Callable[[int], jax.ShapeDtypeStruct]:
    """A function of ``b``: the int32 token batch ``(b * data * fsdp, seq_len + 1)``.

    The batch is split over the mesh axes ``data`` and ``fsdp``.
    """
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    per_step = mesh.shape["data"] * mesh.shape["fsdp"]
    return lambda b: jax.ShapeDtypeStruct((b * per_step, seq_len + 1), jnp.int32, sharding=sharding)


def over_layers(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` on every slice along the leading (layer) axis: ``init`` and ``update`` under ``jax.vmap``.

    A stacked ``(L, m, n)`` kernel gets L states of one ``(m, n)`` matrix,
    stacked: the same bytes, norms and projectors as L separate matrices.
    """
    return optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))


def state_in(dtype: str, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with every floating array of its state stored in `dtype` (cast back after each update)."""

    def to(x, d):
        return x.astype(d) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def update(updates, state, params=None):
        updates, new_state = tx.update(updates, state, params)
        return updates, jax.tree.map(lambda new, old: to(new, old.dtype), new_state, state)

    return optax.GradientTransformation(lambda params: jax.tree.map(lambda x: to(x, dtype), tx.init(params)), update)


def make_optimizer(name: str, cfg: LlamaConfig, state_dtype: str = "float32") -> optax.GradientTransformation:
    """One of `PLANNABLE` for `abstract_params(cfg)`: `modular.make_optimizer`'s, per layer on the stack.

    ``gwt-L`` is GWT-AdamW at level L on the attention and MLP matrices, ``foam-L``
    FOAM-AdamW at fold level L; ``galore`` has the largest rank whose state is at most GWT-2's.
    """
    kind, _, level = name.partition("-")
    if name not in PLANNABLE:
        raise ValueError(f"unknown optimizer {name!r}; choose from {PLANNABLE}")
    block = _modules(cfg)[1][1]
    steps, at_level = 10_000, int(level or 2)
    rank = modular.galore_rank_matching(block, at_level) if kind == "galore" else None
    if kind in ("gwt", "foam"):  # on the stacks themselves, as a scanned model's trainer runs them
        layers = modular.make_optimizer(kind, block, steps=steps, level=at_level, batch_axes=1)
    else:
        layers = over_layers(modular.make_optimizer(kind, block, steps=steps, level=at_level, galore_rank=rank))
    # embedding, head, final norm: the "other" group, AdamW (Adafactor when everything is)
    model = modular.make_optimizer(kind if kind == "adafactor" else "adamw", block, steps=steps)
    tx = optax.multi_transform({"layers": layers, "model": model}, {"layers": "layers", "model": "model"})
    return state_in(state_dtype, tx)


def grad_cost(cfg: LlamaConfig, precision: Precision, mesh: Mesh, seq_len: int) -> Callable[[int], plan_lib.Cost]:
    """A function of ``b``: the `plan.Cost` of the loss's gradient with all layers at micro-batch ``b``.

    From four small compiles: unrolled 1- and 2-layer copies at micro-batch 1
    and 2, extrapolated linearly in depth and in batch (`plan.linear_extrapolation`;
    exact for FLOPs, every layer and every example being the same computation).
    """

    @functools.cache
    def at(b: int, n: int) -> plan_lib.Cost:
        c = dataclasses.replace(cfg, num_layers=n)
        params = sharded(abstract_params(c, precision.params), mesh)
        grad = jax.jit(jax.value_and_grad(loss_fn(c, precision, unroll=True, mesh=mesh)))
        return plan_lib.compiled_cost(grad.lower(params, batch_at(mesh, seq_len)(b)).compile())

    per_batch = lambda b: plan_lib.linear_extrapolation(lambda n: at(b, n), cfg.num_layers)  # noqa: E731
    return lambda b: plan_lib.linear_extrapolation(per_batch, b)


def plan_llama(
    cfg: LlamaConfig,
    mesh: Mesh,
    budget: int,
    *,
    precision: Precision = Precision(),
    optimizers: Sequence[str] = OPTIMIZERS,
    seq_len: int = 256,
    max_batch: int = 4096,
    with_cost: bool = True,
) -> dict:
    """``{optimizer: plan.StepPlan}``: the largest micro-batch per device within `budget` bytes, and the step there."""
    params = sharded(abstract_params(cfg, precision.params), mesh)
    loss, batch = loss_fn(cfg, precision, mesh=mesh), batch_at(mesh, seq_len)
    costs = grad_cost(cfg, precision, mesh, seq_len) if with_cost else None
    out = {}
    for name in optimizers:
        tx = make_optimizer(name, cfg, precision.state)
        out[name] = plan_lib.plan_step(loss, tx, params, batch, budget, grad_cost=costs, max_batch=max_batch)
    return out
