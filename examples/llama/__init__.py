"""LLaMA pre-training with GWT in Flax NNX, and the side-by-side optimizer comparison.

Modules: `data` (three sources, one loader), `mesh` (the device mesh and the
params' shardings), `checkpoint` (Orbax save/restore), `rundir` (run
directories), `train` (the training CLI), `compare` (the comparison CLI),
`sweep` (the studies), `analysis` (scripts that summarise the studies'
committed results under results/). The model and the optimizers are the
library's: `optax_gwt.models.llama` (the decoder and the paper's configs) and
`optax_gwt.modular` (parameter labels and the optimizer factory).
"""
