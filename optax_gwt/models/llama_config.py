"""The LLaMA model configs of the GWT / GaLore papers: `LlamaConfig`, `CONFIGS`, `get_config`.

Plain Python (no Flax), so that what names a model's size (the planner's
``--config``, `optax_gwt.modular.infer_num_heads`) works without the model.
The model itself is `optax_gwt.models.llama` (Flax NNX).
"""

from __future__ import annotations  # keeps the fields' types as strings ("int", "float", "str")

import dataclasses

__all__ = ["CONFIGS", "LlamaConfig", "get_config"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyperparameters (names as in the authors' ``configs/llama_*.json``)."""

    vocab_size: int = 32000
    hidden_size: int = 128
    intermediate_size: int = 352
    num_heads: int = 4
    num_layers: int = 4
    max_seq_len: int = 1024
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    rope_theta: float = 10000.0
    dtype: str = "float32"  # computation dtype; parameters stay float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


#: The paper's configs (hidden, intermediate, heads, layers), vocab 32000 for
#: the authors' T5 tokenizer and max_seq 1024; `get_config` replaces the vocab
#: by the tokenizer's.
CONFIGS: dict[str, LlamaConfig] = {
    name: LlamaConfig(hidden_size=h, intermediate_size=i, num_heads=nh, num_layers=nl)
    for name, (h, i, nh, nl) in {
        "9m": (128, 352, 4, 4),
        "20m": (256, 688, 4, 4),
        "35m": (384, 1024, 8, 6),
        "60m": (512, 1376, 8, 8),
        "130m": (768, 2048, 12, 12),
        "350m": (1024, 2736, 16, 24),
        "1b": (2048, 5461, 32, 24),
        # larger, for the memory planner (optax_gwt.plan): GaLore's 3B and 7B; 13B and a
        # 70B-shaped model with LLaMA-2's widths (full multi-head attention, no GQA)
        "3b": (2560, 6848, 32, 32),
        "7b": (4096, 11008, 32, 32),
        "13b": (5120, 13824, 40, 40),
        "70b": (8192, 28672, 64, 80),
    }.items()
}


def get_config(name: str, vocab_size: int | None = None, **overrides) -> LlamaConfig:
    """The named config, with the tokenizer's vocab size and any field overridden."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose from {sorted(CONFIGS)}")
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return dataclasses.replace(CONFIGS[name], **overrides)
