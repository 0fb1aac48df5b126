"""Parameter sets shaped like the LLaMA models of the GWT / GaLore papers.

Flax layout: kernels are ``(in, out)``, the embedding is ``(vocab, hidden)``,
the output head ``(hidden, vocab)`` (untied), RMSNorm scales ``(hidden,)``.
"""

from __future__ import annotations

import jax
import numpy as np

from optax_gwt.models import llama_config
from optax_gwt.models.llama_config import LlamaConfig

__all__ = ["LlamaConfig", "CONFIGS", "llama_params", "is_attention_or_mlp", "param_labels"]


#: The papers' configurations, as the library's LLaMA (and its example) defines them.
CONFIGS = {name: llama_config.CONFIGS[name] for name in ("60m", "130m", "350m", "1b")}

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def llama_shapes(cfg: LlamaConfig) -> dict:
    """The nested dict of parameter shapes of one model."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    layer = {
        "attention": {name: {"kernel": (h, h)} for name in _ATTENTION},
        "mlp": {"gate_proj": {"kernel": (h, f)}, "up_proj": {"kernel": (h, f)}, "down_proj": {"kernel": (f, h)}},
        "input_norm": {"scale": (h,)},
        "post_attention_norm": {"scale": (h,)},
    }
    return {
        "embed": {"embedding": (cfg.vocab_size, h)},
        "layers": {f"layer_{i}": layer for i in range(cfg.num_layers)},
        "final_norm": {"scale": (h,)},
        "lm_head": {"kernel": (h, cfg.vocab_size)},
    }


def llama_params(cfg: LlamaConfig, seed: int = 0, only_attention_mlp: bool = False, dtype=np.float32) -> dict:
    """Random parameters (normal, std 0.02) of a model; or only its attention and MLP kernels."""
    rng = np.random.default_rng(seed)
    shapes = llama_shapes(cfg)

    def is_shape(x) -> bool:
        return isinstance(x, tuple) and all(isinstance(d, int) for d in x)

    def make(path, shape):
        if only_attention_mlp and not is_attention_or_mlp(path):
            return None
        return jax.numpy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype) * 0.02)

    tree = jax.tree_util.tree_map_with_path(make, shapes, is_leaf=is_shape)
    return _drop_none(tree)


def _drop_none(tree):
    if isinstance(tree, dict):
        out = {k: _drop_none(v) for k, v in tree.items() if v is not None}
        return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}
    return tree


def is_attention_or_mlp(path) -> bool:
    """True for the attention and MLP kernels: the arrays the paper transforms."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return any(k in _ATTENTION or k in _MLP for k in keys)


def param_labels(params) -> dict:
    """``"matrix"`` for attention / MLP kernels, ``"other"`` for the rest (optax.multi_transform labels)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: "matrix" if is_attention_or_mlp(p) else "other", params)
