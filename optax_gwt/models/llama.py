"""A LLaMA decoder in Flax NNX, with the model configs of the GWT/GaLore papers.

The architecture follows Hugging Face's ``LlamaForCausalLM`` as the authors use
it: pre-norm blocks of RMSNorm -> causal multi-head attention with rotary
embeddings -> RMSNorm -> SwiGLU MLP, a final RMSNorm and an untied output head,
no biases, every matrix initialised N(0, 0.02). ``nnx.Linear`` kernels are
``(in, out)``. Attention and MLP live in submodules named ``attn`` and ``mlp``:
`optax_gwt.modular` labels parameters by these path names.

Needs Flax (``pip install "optax-gwt[plan]"``). The configs (`LlamaConfig`,
`CONFIGS`, `get_config`) are defined in `optax_gwt.models.llama_config`,
which does not, and are re-exported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optax_gwt._extras import requires
from optax_gwt.models.llama_config import CONFIGS, LlamaConfig, get_config

with requires("plan", "optax_gwt.models.llama"):
    from flax import nnx

__all__ = ["CONFIGS", "MLP", "Attention", "Block", "Llama", "LlamaConfig", "get_config", "rotary_embedding"]


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotates ``x`` of shape (batch, seq, heads, head_dim) by its positions (HF's rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (seq, half)
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _linear(cfg: LlamaConfig, n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        dtype=jnp.dtype(cfg.dtype),
        kernel_init=nnx.initializers.normal(cfg.init_std),
        rngs=rngs,
    )


def _norm(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, dtype=jnp.dtype(cfg.dtype), rngs=rngs)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary position embeddings."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.q_proj = _linear(cfg, d, d, rngs)
        self.k_proj = _linear(cfg, d, d, rngs)
        self.v_proj = _linear(cfg, d, d, rngs)
        self.o_proj = _linear(cfg, d, d, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """(batch, seq, hidden) -> (batch, seq, hidden)."""
        b, t, _ = x.shape

        def heads(y: jax.Array) -> jax.Array:
            return y.reshape(b, t, self.cfg.num_heads, self.cfg.head_dim)

        positions = jnp.arange(t)
        q = rotary_embedding(heads(self.q_proj(x)), positions, self.cfg.rope_theta)
        k = rotary_embedding(heads(self.k_proj(x)), positions, self.cfg.rope_theta)
        out = jax.nn.dot_product_attention(q, k, heads(self.v_proj(x)), is_causal=True)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.up_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.input_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nnx.Module):
    """The decoder: token ids (batch, seq) -> logits (batch, seq, vocab), float32."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=jnp.dtype(cfg.dtype),
            embedding_init=nnx.initializers.normal(cfg.init_std),
            rngs=rngs,
        )
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _norm(cfg, rngs)
        self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.shape[-1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)
