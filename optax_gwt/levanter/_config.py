"""Levanter optimizer configs ``type: gwt`` and ``type: foam``, registered on import.

Levanter (``marin-levanter``) builds its optimizer from a config class registered
with ``levanter.optim.OptimizerConfig``: ``build(num_train_steps)`` returns an
Optax transformation. Ours is ``clip_by_global_norm -> multi_transform`` with
`optax_gwt.gwt_adamw` (or `optax_gwt.foam_adamw`) on the hidden linear weights
and AdamW on the rest, with Levanter's learning-rate schedule, warm-up and weight
decay mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

import optax_gwt
from optax_gwt import _extras

with _extras.requires("levanter", "optax_gwt.levanter"):
    import haliax as hax
    from levanter.optim import OptimizerConfig
    from levanter.optim.util import label_linear_like_module

__all__ = ["GWTConfig", "FOAMConfig", "choose_axes", "gwt_labels", "hidden_state_bytes"]

#: Names of the axis that stacks (scans) layers in Levanter's models: a batch of matrices.
LAYER_AXES = ("layer", "layers")


def choose_axes(
    weight: Any, layer_axes: Sequence[str] = LAYER_AXES, avoid: Sequence[str] = ("embed",)
) -> tuple[int | None, int]:
    """``(transform axis, batch axes)`` of a haliax weight, from its axis names.

    The leading axes named in `layer_axes` are a batch of matrices (never
    transformed; the limiter keeps one norm per layer). The transform axis is the
    longest of the weight's own axes not named in `avoid` (by default ``embed``,
    the axis Levanter's FSDP shards, so that the compressed length never has to
    divide the mesh), the last one on ties; all own axes if every one is avoided.
    None (not transformed) for a weight with fewer than two own axes.

    Example:
      >>> import haliax as hax, jax.numpy as jnp
      >>> w = hax.zeros((hax.Axis("layer", 2), hax.Axis("mlp", 32), hax.Axis("embed", 16)))
      >>> choose_axes(w)
      (1, 1)
    """
    shape = getattr(weight.array, "shape", None)
    if shape is None:  # a weight optax.multi_transform masked out
        return None, 0
    names = list(weight.axis_names)
    batch = 0
    while batch < len(names) and names[batch] in layer_axes:
        batch += 1
    own = list(range(batch, len(names)))
    if len(own) < 2:
        return None, batch
    candidates = [i for i in own if names[i] not in avoid] or own
    return max(candidates, key=lambda i: (shape[i], i)), batch


def _is_linear(x: Any) -> bool:
    return isinstance(x, hax.nn.Linear)


def gwt_labels(params: Any) -> Any:
    """``"gwt"`` for the weights of the hidden linear layers (attention, MLP), ``"adamw"`` for
    the rest (embeddings, the head ``lm_head``, norms, biases): the paper's grouping."""

    def label(path, module):
        name = jax.tree_util.keystr(path).lower()
        if _is_linear(module) and "lm_head" not in name and "embed" not in name:
            return label_linear_like_module(module, weight_label="gwt", bias_label="adamw")
        return jax.tree.map(lambda _: "adamw", module)

    return jax.tree_util.tree_map_with_path(label, params, is_leaf=lambda x: _is_linear(x) or hax.is_named_array(x))


def _named(
    make: Callable[[Any, Any], optax.GradientTransformation], layer_axes: Sequence[str], avoid: Sequence[str]
) -> optax.GradientTransformation:
    """The transformation ``make(axes, batch_axes)``, its per-weight axes read from the
    haliax axis names of the tree it gets (static: the same at init and at every update)."""

    def plan(tree):
        chosen = jax.tree.map(
            lambda x: choose_axes(x, layer_axes, avoid) if hax.is_named_array(x) else (None, 0),
            tree,
            is_leaf=hax.is_named_array,
        )
        pick = lambda i: jax.tree.map(lambda c: c[i], chosen, is_leaf=lambda c: isinstance(c, tuple))  # noqa: E731
        return make(pick(0), pick(1))

    def init_fn(params):
        return plan(params).init(params)

    def update_fn(updates, state, params=None):
        return plan(updates).update(updates, state, params)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class _GroupedConfig(OptimizerConfig):
    """What GWT and FOAM share: the grouping, the AdamW group, clipping and the schedules."""

    level: int = 2
    scale: float = 0.25
    beta1: float = 0.9
    beta2: float = 0.999
    max_grad_norm: float | None = 1.0
    adam_lr: float | None = None
    """The AdamW group's peak learning rate (None: ``learning_rate``)."""
    layer_axes: tuple[str, ...] = LAYER_AXES
    avoid_axes: tuple[str, ...] = ("embed",)

    def _matrices(self, learning_rate, axes, batch_axes) -> optax.GradientTransformation:
        raise NotImplementedError

    def _shared(self, axes, batch_axes) -> dict[str, Any]:
        """The matrices' builder arguments both configs set the same way."""
        return dict(
            b1=self.beta1,
            b2=self.beta2,
            eps=self.epsilon,
            weight_decay=self.weight_decay,
            level=self.level,
            scale=self.scale,
            axis=axes,
            batch_axes=batch_axes,
            min_dim_size=2**self.level,
        )

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        lr = self.lr_scheduler(num_train_steps)
        adam_lr = lr if self.adam_lr is None else self.lr_scheduler(num_train_steps, override_lr=self.adam_lr)

        def optimizer(learning_rate, adam_learning_rate):
            adamw = optax.chain(
                optax.scale_by_adam(self.beta1, self.beta2, self.epsilon),
                optax.add_decayed_weights(self.weight_decay, self.build_weight_decay_mask()),
                optax.scale(-adam_learning_rate),
            )
            matrices = _named(
                lambda axes, batch: self._matrices(learning_rate, axes, batch), self.layer_axes, self.avoid_axes
            )
            grouped = optax.multi_transform({"gwt": matrices, "adamw": adamw}, gwt_labels)
            return (
                optax.chain(optax.clip_by_global_norm(self.max_grad_norm), grouped) if self.max_grad_norm else grouped
            )

        return optax.inject_hyperparams(optimizer)(learning_rate=lr, adam_learning_rate=adam_lr)


@OptimizerConfig.register_subclass("gwt")
@dataclasses.dataclass(frozen=True)
class GWTConfig(_GroupedConfig):
    """``type: gwt``: `optax_gwt.gwt_adamw` on the hidden linear weights, AdamW on the rest.

    The matrices' step is ``learning_rate * scale`` (the paper's modular learning
    rates), with the authors' decoupled weight decay; the AdamW group's is
    ``adam_lr`` (default ``learning_rate``) with Levanter's weight-decay mask.

    ``detail_clip`` defaults to `optax_gwt.SAFE_DETAIL_CLIP` (Adam steps), not to the paper's unbounded
    details: on gradients that hardly change from step to step the paper's
    update reaches thousands of Adam steps per entry (the numerics guide's
    "Degenerate gradients"); ``detail_clip: null`` is the paper's algorithm.
    """

    wavelet: str = "haar"
    norm_growth_limit: float | None = 1.01
    norm_growth_delayed: bool = False  # not the paper's: for FSDP on TPUs (`optax_gwt.limit_norm_growth`)
    detail_clip: float | None = optax_gwt.SAFE_DETAIL_CLIP
    epsilon: float = 1e-6

    def _matrices(self, learning_rate, axes, batch_axes) -> optax.GradientTransformation:
        own: dict[str, Any] = dict(
            wavelet=self.wavelet,
            norm_growth_limit=self.norm_growth_limit,
            norm_growth_delayed=self.norm_growth_delayed,
            detail_clip=self.detail_clip,
        )
        return optax_gwt.gwt_adamw(learning_rate, **self._shared(axes, batch_axes), **own)


@OptimizerConfig.register_subclass("foam")
@dataclasses.dataclass(frozen=True)
class FOAMConfig(_GroupedConfig):
    """``type: foam``: `optax_gwt.foam_adamw` on the hidden linear weights, AdamW on the rest."""

    residual_scale: float = 1.0
    epsilon: float = 1e-8

    def _matrices(self, learning_rate, axes, batch_axes) -> optax.GradientTransformation:
        own: dict[str, Any] = dict(residual_scale=self.residual_scale)
        return optax_gwt.foam_adamw(learning_rate, **self._shared(axes, batch_axes), **own)


def hidden_state_bytes(optimizer: optax.GradientTransformation, model: Any) -> int:
    """Bytes of `optimizer`'s state that belong to the hidden linear weights of `model`."""
    per = optax_gwt.optimizer_state_bytes(optimizer, model).per_param
    labels = jax.tree.leaves(gwt_labels(model))
    return int(sum(b for b, label in zip(jax.tree.leaves(per), labels, strict=True) if label == "gwt"))
