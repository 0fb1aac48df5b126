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

from typing import Any

from optax_gwt import _extras

try:
    with _extras.requires("levanter", "optax_gwt.levanter"):
        from optax_gwt.levanter._config import FOAMConfig, GWTConfig, choose_axes, gwt_labels, hidden_state_bytes
except _extras.MissingExtraError as missing:
    # Importable without the extra (so that ``python -m optax_gwt.levanter.train_lm`` can say
    # in one line what is missing); any of its names is the one-line error.
    _MISSING = missing
    __all__: list[str] = []

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _MISSING
else:
    __all__ = ["GWTConfig", "FOAMConfig", "choose_axes", "gwt_labels", "hidden_state_bytes"]
