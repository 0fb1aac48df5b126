"""Orbax checkpoints of a training run: params, optimizer state and the run's metadata.

Everything needed to continue bit-for-bit is in one checkpoint: the params and
the optimizer state (arrays, restored exactly), and a JSON ``meta`` dict with the
step and the data loader's position (`examples.llama.data` loaders'
``state_dict()``, which includes where the seeded data order stands; training
itself draws no random numbers). Any later change to what a checkpoint holds
belongs here.

Crash safety. Orbax writes each step into a temporary directory
(``<step>.orbax-checkpoint-tmp-<n>``) and renames it when complete, so a run
killed mid-save leaves at most a temporary directory that `latest_step` never
picks; the previous complete step is resumed. Each checkpoint also records the
run's identity (`run_metadata`: model config, optimizer and its settings,
schedule, data) and the paths, shapes and dtypes of its arrays. `restore`
reads that first and refuses, with a message naming every difference, a
checkpoint of another run (other config, optimizer, level, ...); a checkpoint
whose files cannot be read is refused as a whole. Nothing is half-loaded: the
caller's arrays and the data loader change only after everything was read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp  # type: ignore[import-untyped]

__all__ = ["CheckpointError", "Checkpointer", "RUN_ARGS", "run_metadata"]

#: CLI arguments that define a run: resuming with any of them changed is refused.
#: (Not here: how far to go, logging, checkpoint cadence, gradient accumulation
#: and the device mesh, which may change between a run's segments.)
RUN_ARGS = (
    "config", "model", "data", "tokenizer", "hf_path", "hf_name", "seq_len", "batch_size", "val_fraction",
    "optimizer", "lr", "alpha", "level", "wavelet", "warmup_frac", "min_lr_ratio", "weight_decay",
    "galore_rank", "galore_gap", "steps", "seed",
)  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: another run's, or unreadable."""


def run_metadata(args: Any, model_config: Any = None) -> dict:
    """The identity of a run: the `RUN_ARGS` of the parsed CLI `args` and the resolved model config."""
    values = vars(args) if hasattr(args, "__dict__") else dict(args)
    meta = {k: values.get(k) for k in RUN_ARGS}
    if model_config is not None:
        meta["model_config"] = dataclasses.asdict(model_config)
    return meta


def _signature(tree: Any) -> list[list]:
    """``[path, shape, dtype]`` of each array of `tree` (JSON-able)."""
    return [
        [jax.tree_util.keystr(path), list(x.shape), str(x.dtype)]
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """Readable differences between two JSON-like values."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            out += _differences(saved.get(key), current.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == current else [f"{prefix.rstrip('.')}: checkpoint {saved!r}, this run {current!r}"]


class Checkpointer:
    """Saves and restores ``(params, opt_state, meta)`` under `directory`, one folder per step.

    Args:
      directory: where the step folders go.
      max_to_keep: complete checkpoints kept (older ones are deleted).
      run: the run's identity (`run_metadata`), stored with every checkpoint
        and compared on `restore`; None skips that check.
    """

    def __init__(self, directory: str, max_to_keep: int = 2, run: dict | None = None):
        self.run = None if run is None else json.loads(json.dumps(run))  # as it reads back (tuples -> lists)
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )

    def save(self, step: int, params: Any, opt_state: Any, data_loader) -> None:
        """Writes a checkpoint for `step` (asynchronously; `close` or the next save waits for it)."""
        meta = {
            "step": step,
            "data": data_loader.state_dict(),
            "run": self.run,
            "arrays": {"params": _signature(params), "opt_state": _signature(opt_state)},
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete step (a save cut short is not one), or None."""
        return self.manager.latest_step()

    def restore(self, params: Any, opt_state: Any, data_loader, step: int | None = None) -> tuple[Any, Any, int]:
        """Restores the checkpoint at `step` (default: the latest).

        Returns ``(params, opt_state, step)`` shaped like the given `params` and
        `opt_state`, and puts `data_loader` back at its saved position.

        Raises:
          FileNotFoundError: no checkpoint.
          CheckpointError: the checkpoint belongs to another run (its metadata
            or its arrays' paths, shapes or dtypes differ from this run's), or
            cannot be read. Nothing is restored then.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        where = f"checkpoint step {step} in {self.manager.directory}"
        meta = self._read(step, where, meta=ocp.args.JsonRestore()).meta
        self._validate(meta, params, opt_state, where)

        def abstract(tree):
            return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)

        restored = self._read(
            step,
            where,
            params=ocp.args.StandardRestore(abstract(params)),
            opt_state=ocp.args.StandardRestore(abstract(opt_state)),
        )
        data_loader.load_state_dict(meta["data"])
        return restored.params, restored.opt_state, int(meta["step"])

    def _read(self, step: int, where: str, **items) -> Any:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # Orbax / TensorStore / JSON errors of a damaged checkpoint
            raise CheckpointError(
                f"{where} cannot be read ({type(e).__name__}: {str(e)[:300]}); nothing was restored. "
                "Delete that step's folder to resume from an earlier one, or start afresh."
            ) from e

    def _validate(self, meta: dict, params: Any, opt_state: Any, where: str) -> None:
        problems = []
        if self.run is not None:
            if "run" not in meta:
                problems.append("it has no run metadata (written by an older version)")
            else:
                problems += _differences(meta["run"], self.run)
        saved = meta.get("arrays")
        if saved is not None:
            for name, tree in (("params", params), ("opt_state", opt_state)):
                have, want = saved[name], _signature(tree)
                if have != want:
                    diff = [
                        f"{name}{w[0]}: checkpoint {h[1:]}, this run {w[1:]}"
                        for h, w in zip(have, want, strict=False)  # the lengths may differ: see below
                        if h != w
                    ]
                    problems += diff[:5] or [f"{name}: {len(have)} arrays in the checkpoint, {len(want)} in this run"]
        if problems:
            raise CheckpointError(
                f"{where} is not from this run; refusing to resume from it:\n  "
                + "\n  ".join(problems)
                + "\nResume with the original settings, or start a new run (another --run-dir)."
            )

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
