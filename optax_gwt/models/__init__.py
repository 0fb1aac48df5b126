"""Reference models for training and planning with GWT.

`optax_gwt.models.llama`: the LLaMA decoder of the GWT / GaLore papers in Flax
NNX (needs Flax: ``pip install "optax-gwt[plan]"``); its configs are in
`optax_gwt.models.llama_config` (no Flax). Importing this package imports
neither.
"""
