"""Orbax checkpoints of a training run: params, optimizer state and the run's metadata.

Everything needed to continue bit-for-bit is in one checkpoint: the params and
the optimizer state (arrays, restored exactly), and a JSON ``meta`` dict with the
step and the data loader's position (`examples.llama.data` loaders'
``state_dict()``, which includes where the seeded data order stands; training
itself draws no random numbers). Any later change to what a checkpoint holds
belongs here.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves and restores ``(params, opt_state, meta)`` under `directory`, one folder per step."""

    def __init__(self, directory: str, max_to_keep: int = 2):
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )

    def save(self, step: int, params: Any, opt_state: Any, data_loader) -> None:
        """Writes a checkpoint for `step` (asynchronously; `close` or the next save waits for it)."""
        meta = {"step": step, "data": data_loader.state_dict()}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def restore(self, params: Any, opt_state: Any, data_loader, step: Optional[int] = None) -> tuple[Any, Any, int]:
        """Restores the checkpoint at `step` (default: the latest).

        Returns ``(params, opt_state, step)`` shaped like the given `params` and
        `opt_state`, and puts `data_loader` back at its saved position.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract(params)),
                opt_state=ocp.args.StandardRestore(abstract(opt_state)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        data_loader.load_state_dict(restored.meta["data"])
        return restored.params, restored.opt_state, int(restored.meta["step"])

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
