"""LLaMA pre-training with GWT in Flax NNX, and the side-by-side optimizer comparison.

Modules: `model` (the decoder and the paper's configs), `data` (three sources, one
loader), `optimizers` (parameter labels and the optimizer factory), `checkpoint`
(Orbax save/restore), `train` (the training CLI), `compare` (the comparison CLI).
"""
