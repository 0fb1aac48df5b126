"""Modular learning rates, and the optimizers of the GWT paper's comparison, as Optax transformations.

The paper's modular learning rates (`optax.multi_transform` over two parameter
groups): the attention and MLP matrices (the "matrix" group, chosen by
parameter path, `param_labels`) are trained by GWT (or GaLore, or AdamW in the
``adamw-modular`` baseline) at an effective step ``lr * alpha``; embeddings,
norms and the output head (the "other" group) by AdamW at ``lr``; both under
one cosine schedule with linear warm-up (`make_schedule`). `make_optimizer`
builds any optimizer of the comparison by name (`OPTIMIZERS`) for a params
pytree of any model whose attention and MLP live under modules named ``attn``
and ``mlp`` (`MATRIX_MODULES`), such as `optax_gwt.models.llama`.

How ``lr * alpha`` is applied: the authors' WaveAdamW gives both parameter
groups the same ``lr`` and multiplies the matrices' update by ``scale = alpha``
inside the step. `optax_gwt.gwt_adamw` and `optax.contrib.galore` do the same
(their ``scale`` multiplies the update), so the matrix group gets
``learning_rate=schedule(lr), scale=alpha`` -- NOT a learning rate of
``lr * alpha`` on top of ``scale=alpha``, which would apply alpha twice. Only the
plain-AdamW modular baseline has no ``scale``; it gets ``schedule(lr * alpha)``.

Needs JAX and Optax only (no Flax).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax

from optax_gwt.adam_mini import adam_mini_blocks, path_names, scale_by_adam_mini
from optax_gwt.foam import foam_adamw
from optax_gwt.memory import optimizer_state_bytes
from optax_gwt.models.llama_config import CONFIGS
from optax_gwt.transform import gwt_adamw, scale_by_gwt

__all__ = [
    "DEFAULT_LR",
    "GWT_BASES",
    "LION_LR_RATIO",
    "MATRIX_MODULES",
    "OPTIMIZERS",
    "galore_rank_matching",
    "infer_num_heads",
    "make_optimizer",
    "make_schedule",
    "matrix_state_bytes",
    "param_labels",
]

#: Module names whose matrices form the "matrix" group (as in the authors' filter).
MATRIX_MODULES = ("attn", "mlp")

#: Peak learning rate per optimizer for the default (small) comparison: the best of
#: a sweep at the default budget (README, "LLaMA example"); the paper's setting at
#: scale is lr 1e-2 for GWT/GaLore (alpha 0.25) and about 1e-3 for AdamW.
DEFAULT_LR = {
    "adamw": 3e-2,  # swept 3e-3, 1e-2, 3e-2
    "adamw-modular": 1e-2,  # swept 1e-2, 3e-2
    "gwt": 2e-2,  # swept 1e-2, 2e-2, 4e-2 (level 2)
    "gwt-nobc": 2e-2,  # as gwt
    "gwt-delayed": 2e-2,  # as gwt
    "galore": 3e-2,  # swept 1e-2, 3e-2
    "adafactor": 1e-2,  # swept 1e-2, 3e-2
    "gwt-lion": 1e-2,  # not swept (optional run)
    # Not swept yet (examples/llama/sweep.py finds them): first guesses.
    "adam-mini": 3e-2,  # as adamw
    "gwt-adam-mini": 2e-2,  # as gwt
    "gwt-muon": 5e-2,  # Muon's steps have RMS ~ 2 / sqrt(128) on the 9m approximations: a larger lr
    "gwt-factored": 2e-2,  # as gwt
    "foam": 1e-2,  # the FOAM authors' scripts' lr (not swept here)
    "gwt-energy": 2e-2,  # as gwt
    "gwt-residual": 2e-2,  # as gwt
}
OPTIMIZERS = tuple(DEFAULT_LR)
#: The optimizers `make_optimizer` builds for stacked layers (``batch_axes``).
STACKABLE = ("adamw", "adamw-modular", "gwt", "gwt-nobc", "gwt-delayed", "gwt-energy", "gwt-residual", "foam")

#: Lion's steps are sign(.) (RMS 1) where Adam's are smaller: the usual advice
#: (Chen et al. 2023) is a 3-10x smaller learning rate. Applied to the matrices.
LION_LR_RATIO = 0.1


def param_labels(params: Any, batch_axes: int = 0) -> Any:
    """``"matrix"`` for matrices under an ``attn`` or ``mlp`` module, else ``"other"``.

    Works on any params pytree (``nnx.State``, nested dicts): the label is a
    function of the array's path, e.g. ``layers/0/attn/q_proj/kernel``. A matrix is an
    array of rank 2, or of rank ``2 + batch_axes`` where the layers are stacked along the
    first `batch_axes` axes.
    """

    def label(path, x):
        return "matrix" if x.ndim == 2 + batch_axes and path_names(path) & set(MATRIX_MODULES) else "other"

    return jax.tree_util.tree_map_with_path(label, params)


def make_schedule(lr: float, steps: int, warmup_frac: float = 0.1, min_lr_ratio: float = 0.1) -> optax.Schedule:
    """Linear warm-up from 0 over ``warmup_frac * steps``, cosine decay to ``min_lr_ratio * lr`` at `steps`."""
    warmup = max(1, int(warmup_frac * steps))
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * min_lr_ratio)


def infer_num_heads(params: Any) -> int | None:
    """Attention heads of a LLaMA of `optax_gwt.models.llama_config.CONFIGS`, from its hidden size; None if unknown.

    The optimizers see only the params, whose shapes do not tell the heads:
    a model whose ``num_heads`` was overridden gets the config's heads here.
    """
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if "q_proj" in path_names(path) and x.ndim == 2:
            heads = {c.num_heads for c in CONFIGS.values() if c.hidden_size == x.shape[-1]}
            return heads.pop() if len(heads) == 1 else None
    return None


def _adam_mini(params: Any, eps: float = 1e-6) -> optax.GradientTransformation:
    """Adam-mini with the paper's partition (per head for q/k, embeddings and head at full Adam)."""
    return scale_by_adam_mini(eps=eps, block_axes=adam_mini_blocks(num_heads=infer_num_heads(params)))


def _muon_base(params: Any) -> optax.GradientTransformation:
    """Muon on the approximations: each (in / 2^level, out) matrix reduced over its input axis."""
    del params
    numbers = lambda tree: jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(0, 1), tree)  # noqa: E731
    return optax.contrib.scale_by_muon(weight_dimension_numbers=numbers)


def _factored_base(params: Any) -> optax.GradientTransformation:
    """The authors' Adafactor-style base: factored second moment (every matrix), RMS clip 1, momentum 0.9."""
    del params
    return optax.chain(
        optax.scale_by_factored_rms(min_dim_size_to_factor=1),
        optax.clip_by_block_rms(1.0),
        optax.ema(0.9, debias=False),
    )


#: The bases of the ``gwt-<base>`` optimizers (GWT's own Adam is ``gwt``), each
#: a function of the params; the learning rate's factor for the base.
GWT_BASES = {
    "gwt-lion": (lambda params: optax.scale_by_lion(), LION_LR_RATIO),
    "gwt-muon": (_muon_base, 1.0),
    "gwt-factored": (_factored_base, 1.0),
    "gwt-adam-mini": (_adam_mini, 1.0),
}


def _gwt_on(
    base: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    level: int,
    wavelet: str,
    alpha: float,
    weight_decay: float,
    detail_rule: str,
) -> optax.GradientTransformation:
    """`scale_by_gwt` on `base`, decoupled weight decay, the learning rate ("auto" details: the norm ratio)."""
    rule = "norm_ratio" if detail_rule == "auto" else detail_rule
    return optax.chain(
        scale_by_gwt(base, level=level, wavelet=wavelet, scale=alpha, detail_rule=rule),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def make_optimizer(
    name: str,
    params: Any,
    *,
    lr: float | None = None,
    steps: int,
    alpha: float = 0.25,
    level: int = 2,
    wavelet: str = "haar",
    detail_rule: str = "auto",
    warmup_frac: float = 0.1,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    b2: float = 0.999,
    galore_rank: int | None = None,
    galore_gap: int = 200,
    norm_growth_limit: float | None = 1.01,
    detail_clip: float | None = None,
    gwt_axis: int = 0,
    batch_axes: int = 0,
) -> optax.GradientTransformation:
    """The named optimizer for `params` (only their shapes and paths are used).

    Args:
      name: one of `OPTIMIZERS`:
        ``adamw``: one learning rate for everything (the paper's baseline);
        ``adamw-modular``: AdamW with the modular learning rates;
        ``gwt``: GWT-AdamW (`level`, `wavelet`) on the matrices, modular lrs;
        ``gwt-nobc``: the same with ``bias_correct_details=False``;
        ``gwt-delayed``: the same with ``norm_growth_delayed=True``;
        ``galore``: `optax.contrib.galore` on the matrices, modular lrs;
        ``adafactor``: `optax.adafactor` for everything;
        ``adam-mini``: `optax_gwt.scale_by_adam_mini` for everything, one lr
        (per-head q/k blocks, heads from `infer_num_heads`);
        ``foam``: `optax_gwt.foam_adamw` (`level`, no limiter) on the matrices, modular lrs;
        ``gwt-energy``, ``gwt-residual``: ``gwt`` with one of FOAM's two ideas
        (``second_moment="energy"``; ``detail_rule="residual"``);
        ``gwt-lion``, ``gwt-muon``, ``gwt-factored``, ``gwt-adam-mini``:
        `scale_by_gwt` with that base (`GWT_BASES`: Lion, Muon, the authors'
        Adafactor-style factored RMS, Adam-mini) on the matrices, the details
        scaled by the norm ratio, modular lrs.
      params: the model parameters (arrays or `jax.ShapeDtypeStruct` instances).
      lr: peak learning rate (None: `DEFAULT_LR[name]`).
      steps: optimizer steps of the run (for the schedule).
      alpha: the matrices' learning-rate factor (GWT/GaLore ``scale``).
      detail_rule: GWT's `optax_gwt.wavelet_inverse` detail rule; ``auto`` is
        the reference (``adam``) for ``gwt``/``gwt-nobc`` and ``norm_ratio``
        for the other bases.
      b2: the second moment's decay of every Adam (AdamW, GWT, FOAM; the others keep their own).
      galore_rank: GaLore's rank; None picks the largest rank whose state is no
        bigger than GWT's at `level` (`galore_rank_matching`).
      galore_gap: steps between GaLore's SVD projector updates.
      norm_growth_limit: GWT's limiter gamma (`optax_gwt.limit_norm_growth`: the
        step's norm grows at most this factor per step); None: no limiter. The
        reference is 1.01.
      detail_clip: GWT's bound on the details' part of the update (`optax_gwt.wavelet_inverse`);
        None: the reference (unbounded).
      gwt_axis: the axis of each matrix GWT transforms: 0 (the reference: the
        ``(in, out)`` kernel's input axis) or 1 (its output axis).
      batch_axes: leading axes along which the layers' matrices are stacked (scanned
        layers); GWT and FOAM run on the stacks (`gwt_adamw`'s ``batch_axes``), the
        other optimizers see the stacks as arrays (elementwise ones are unchanged by it).
    """
    if name not in DEFAULT_LR:
        raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")
    if batch_axes and name not in STACKABLE:
        raise ValueError(f"{name!r} does not run on stacked layers (batch_axes); those that do: {STACKABLE}")
    lr = DEFAULT_LR[name] if lr is None else lr
    sched = lambda peak: make_schedule(peak, steps, warmup_frac, min_lr_ratio)  # noqa: E731
    adamw = lambda peak: optax.adamw(sched(peak), b1=0.9, b2=b2, eps=1e-6, weight_decay=weight_decay)  # noqa: E731

    if name == "adamw":
        return adamw(lr)
    if name == "adafactor":
        # The authors' Adafactor: no parameter scaling, first moment 0.9, update clipping 1.
        return optax.adafactor(sched(lr), multiply_by_parameter_scale=False, momentum=0.9, clipping_threshold=1.0)
    if name == "adam-mini":
        return optax.chain(
            _adam_mini(params), optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(sched(lr))
        )
    matrix: optax.GradientTransformation
    if name == "adamw-modular":
        matrix = adamw(lr * alpha)
    elif name in ("gwt", "gwt-nobc", "gwt-delayed", "gwt-energy", "gwt-residual"):
        matrix = gwt_adamw(
            sched(lr),
            b2=b2,
            weight_decay=weight_decay,
            level=level,
            wavelet=wavelet,
            scale=alpha,
            detail_rule="residual" if name == "gwt-residual" else detail_rule,
            second_moment="energy" if name == "gwt-energy" else "approx",
            bias_correct_details=name != "gwt-nobc",
            norm_growth_limit=norm_growth_limit,
            norm_growth_delayed=name == "gwt-delayed",
            detail_clip=detail_clip,
            axis=gwt_axis,
            batch_axes=batch_axes,
        )
    elif name == "foam":
        matrix = foam_adamw(
            sched(lr), b2=b2, weight_decay=weight_decay, level=level, scale=alpha, axis=gwt_axis,
            batch_axes=batch_axes,
        )  # fmt: skip
    elif name == "galore":
        rank = galore_rank or galore_rank_matching(params, level)
        matrix = optax.contrib.galore(
            sched(lr), rank=rank, update_proj_gap=galore_gap, scale=alpha, weight_decay=weight_decay
        )
    else:  # gwt-<base>: the base on the approximation; its details scaled by the norm ratio
        make_base, ratio = GWT_BASES[name]
        matrix = _gwt_on(make_base(params), sched(lr * ratio), level=level, wavelet=wavelet, alpha=alpha,
                         weight_decay=weight_decay, detail_rule=detail_rule)  # fmt: skip
    labels = functools.partial(param_labels, batch_axes=batch_axes)
    return optax.multi_transform({"matrix": matrix, "other": adamw(lr)}, labels)


def matrix_state_bytes(optimizer: optax.GradientTransformation, params: Any) -> int:
    """Bytes of `optimizer`'s state that belong to the "matrix" group's parameters."""
    per = optimizer_state_bytes(optimizer, params).per_param
    labels = jax.tree.leaves(param_labels(params))
    return int(sum(b for b, label in zip(jax.tree.leaves(per), labels, strict=True) if label == "matrix"))


def _modular(matrix: optax.GradientTransformation) -> optax.GradientTransformation:
    return optax.multi_transform({"matrix": matrix, "other": optax.adamw(1.0)}, param_labels)


def galore_rank_matching(params: Any, level: int = 2) -> int:
    """The largest GaLore rank whose state on the matrix group is at most GWT's at `level`."""
    budget = matrix_state_bytes(_modular(gwt_adamw(1.0, level=level)), params)
    labels = jax.tree.leaves(param_labels(params))
    lo, hi = 1, max(min(x.shape) for x, label in zip(jax.tree.leaves(params), labels, strict=True) if label == "matrix")
    while lo < hi:  # the state grows with the rank: find the last rank within budget
        mid = (lo + hi + 1) // 2
        if matrix_state_bytes(_modular(optax.contrib.galore(1.0, rank=mid)), params) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
