"""optax-gwt: the Gradient Wavelet Transform (GWT) for Optax.

Wen et al., "Breaking Memory Limits: Gradient Wavelet Transform Enhances LLMs
Training", arXiv 2501.07237.
"""

from optax_gwt import cpu_kernel, sharding, wavelets
from optax_gwt.memory import StateBytes, optimizer_state_bytes
from optax_gwt.transform import (
    DETAIL_RULES,
    STATIC_ARGS,
    DecayAfterStepState,
    GWTState,
    Projected,
    WaveletProjection,
    decay_weights_after_step,
    gwt_adamw,
    scale_by_gwt,
    scale_by_reference_adam,
    wavelet_inverse,
    wavelet_project,
)
from optax_gwt.wavelets import waverec, wavedec

__version__ = "0.1.0"

__all__ = [
    "DETAIL_RULES",
    "STATIC_ARGS",
    "DecayAfterStepState",
    "GWTState",
    "Projected",
    "StateBytes",
    "WaveletProjection",
    "cpu_kernel",
    "decay_weights_after_step",
    "gwt_adamw",
    "optimizer_state_bytes",
    "scale_by_gwt",
    "scale_by_reference_adam",
    "sharding",
    "wavelet_inverse",
    "wavelet_project",
    "wavedec",
    "waverec",
    "wavelets",
]
