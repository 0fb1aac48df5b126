"""optax-gwt: the Gradient Wavelet Transform (GWT) for Optax.

Wen et al., "Breaking Memory Limits: Gradient Wavelet Transform Enhances LLMs
Training", arXiv 2501.07237.

Submodules not imported here: `optax_gwt.models.llama` (the Flax NNX LLaMA, needs
Flax), `optax_gwt.models.llama_config` (its configs) and `optax_gwt.plan.llama`
(the LLaMA planner, needs Flax; ``pip install "optax-gwt[plan]"``).
"""

__version__ = "0.1.0"  # the one source of the version: pyproject.toml reads it

from optax_gwt import (
    haar,
    kernels,  # the fast paths: chip-specific formulations, chosen by one table
    modular,  # modular learning rates and the comparison's optimizers (JAX and Optax only)
    plan,  # the memory planner (JAX and Optax only; its LLaMA part, optax_gwt.plan.llama, needs Flax)
    sharding,
    wavelets,
)
from optax_gwt.adam import SECOND_MOMENTS, GWTBase, Preconditioner, adam_preconditioner, scale_by_reference_adam
from optax_gwt.adam_mini import (
    Blocks,
    ScaleByAdamMiniState,
    adam_mini_blocks,
    head_blocks,
    output_blocks,
    scale_by_adam_mini,
)
from optax_gwt.foam import FOAM_STATIC_ARGS, foam_adamw, scale_by_foam
from optax_gwt.kernels import FastPath
from optax_gwt.memory import StateBytes, optimizer_state_bytes
from optax_gwt.projection import LeafSpec, WaveletCoefficients, WaveletProjection
from optax_gwt.stages import (
    DETAIL_RULES,
    SAFE_DETAIL_CLIP,
    LimitNormGrowthState,
    OnApproximationState,
    limit_norm_growth,
    on_approximation,
    wavelet_inverse,
    wavelet_project,
)
from optax_gwt.transform import STATIC_ARGS, DecayAfterStepState, decay_weights_after_step, gwt_adamw, scale_by_gwt
from optax_gwt.wavelets import wavedec, waverec

__all__ = [
    "DETAIL_RULES",
    "FOAM_STATIC_ARGS",
    "SAFE_DETAIL_CLIP",
    "SECOND_MOMENTS",
    "STATIC_ARGS",
    "DecayAfterStepState",
    "GWTBase",
    "LeafSpec",
    "LimitNormGrowthState",
    "OnApproximationState",
    "Preconditioner",
    "StateBytes",
    "WaveletCoefficients",
    "WaveletProjection",
    "adam_preconditioner",
    "adam_mini_blocks",
    "Blocks",
    "head_blocks",
    "output_blocks",
    "scale_by_adam_mini",
    "ScaleByAdamMiniState",
    "FastPath",
    "kernels",
    "decay_weights_after_step",
    "foam_adamw",
    "gwt_adamw",
    "haar",
    "limit_norm_growth",
    "modular",
    "plan",
    "on_approximation",
    "optimizer_state_bytes",
    "scale_by_foam",
    "scale_by_gwt",
    "scale_by_reference_adam",
    "sharding",
    "wavelet_inverse",
    "wavelet_project",
    "wavedec",
    "waverec",
    "wavelets",
]
