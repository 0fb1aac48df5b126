"""Levanter's ``train_lm`` with ``type: gwt`` and ``type: foam`` registered first.

    python -m optax_gwt.levanter.train_lm --config_path my_run.yaml

Levanter parses its config (draccus) when ``train_lm`` starts, so the optimizer
configs must be registered before: this module imports `optax_gwt.levanter`,
then runs Levanter's own entry point unchanged.
"""

from __future__ import annotations

from optax_gwt import _extras

with _extras.entry_point(__name__, "levanter", "python -m optax_gwt.levanter.train_lm"):
    import levanter
    from levanter.main import train_lm

    import optax_gwt.levanter  # noqa: F401  (registers the configs)

if __name__ == "__main__":
    levanter.config.main(train_lm.main)()
