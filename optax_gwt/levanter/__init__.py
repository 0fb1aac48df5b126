"""GWT and FOAM by name inside Levanter (``pip install "optax-gwt[levanter]"``).

Importing this module registers two optimizer configs with Levanter's
``OptimizerConfig`` choice registry, so that a Levanter config says::

    optimizer:
      type: gwt        # or foam
      learning_rate: 1e-2
      level: 2

`GWTConfig` and `FOAMConfig` apply the optimizer to the hidden linear weights
(attention and MLP: the paper's grouping) and AdamW to embeddings, head and
norms; each weight's transform axis is chosen by its haliax axis names
(`choose_axes`). Launch Levanter's trainer with the registration imported
first: ``python -m optax_gwt.levanter.train_lm --config_path ...``.
"""

from __future__ import annotations

from optax_gwt import _extras

with _extras.requires("levanter", "optax_gwt.levanter"):
    from optax_gwt.levanter.config import FOAMConfig, GWTConfig, choose_axes, gwt_labels, hidden_state_bytes

__all__ = ["GWTConfig", "FOAMConfig", "choose_axes", "gwt_labels", "hidden_state_bytes"]
