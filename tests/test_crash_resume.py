"""Crash-safe training in the LLaMA example: SIGKILL between checkpoints, partial and foreign checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")
from examples.llama import train
from examples.llama.checkpoint import CheckpointError, Checkpointer

# Orbax's reads of a damaged checkpoint leave failed coroutines behind; the error itself is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_EVERY = 30, 5


def _words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = ["def", "return", "self", "import", "value", "class", "for", "in", "if", "else", "x", "(", ")", ":"]
    return " ".join(rng.choice(vocab, size=n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(16):
        (root / f"doc{i:02d}.txt").write_text(_words(300, i) + "\n")
    return str(root)


def _args(corpus, ckpt_dir, *extra):
    return [
        "--model", "num_layers=1", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2", "--no-progress",
        "--data", corpus, "--optimizer", "gwt", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--eval-every", "1000", "--ckpt-dir", ckpt_dir, *extra,
    ]  # fmt: skip


def _logged_steps(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line)["step"] for line in fh if line.endswith("\n")]


@pytest.fixture(scope="module")
def killed_run(corpus, tmp_path_factory):
    """A training process killed with SIGKILL after its first complete checkpoint, between two saves.

    Returns ``(checkpoint dir, last step the process had logged)``.
    """
    root = tmp_path_factory.mktemp("killed")
    ckpt, metrics = str(root / "ckpt"), str(root / "metrics.jsonl")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.llama.train", *_args(corpus, ckpt, "--metrics", metrics)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            steps = _logged_steps(metrics)
            # A complete checkpoint exists, and the run is past it but not at the next save.
            if os.path.isdir(os.path.join(ckpt, str(SAVE_EVERY))) and steps and steps[-1] % SAVE_EVERY not in (0, SAVE_EVERY - 1):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, ("the run was not killed mid-way", proc.returncode, proc.stderr.read()[-2000:])
    return ckpt, _logged_steps(metrics)[-1]


def _copy(ckpt, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, dst)
    return dst


def test_sigkill_between_checkpoints_resumes_to_the_same_losses(corpus, killed_run, tmp_path):
    ckpt, reached = killed_run
    ckpt = _copy(ckpt, tmp_path)
    last_complete = Checkpointer(ckpt).latest_step()
    assert last_complete is not None and last_complete % SAVE_EVERY == 0 and last_complete < reached
    resumed = train.run(train.parse_args(_args(corpus, ckpt, "--resume")))
    full = train.run(train.parse_args(_args(corpus, str(tmp_path / "uninterrupted"))))
    assert [r["step"] for r in resumed["history"]] == list(range(last_complete + 1, STEPS + 1))
    losses = {r["step"]: r["loss"] for r in full["history"]}
    assert [r["loss"] for r in resumed["history"]] == [losses[s] for s in range(last_complete + 1, STEPS + 1)]
    assert resumed["summary"]["final_val_loss"] == full["summary"]["final_val_loss"]


def test_a_partially_written_step_is_never_picked(killed_run, tmp_path):
    ckpt, _ = killed_run
    ckpt = _copy(ckpt, tmp_path)
    complete = Checkpointer(ckpt).latest_step()
    # What a save cut short leaves: Orbax's temporary folder for a later step, even with all files in it.
    shutil.copytree(os.path.join(ckpt, str(complete)), os.path.join(ckpt, f"{complete + SAVE_EVERY}.orbax-checkpoint-tmp-123"))
    assert Checkpointer(ckpt).latest_step() == complete


@pytest.mark.parametrize(
    "change, named",
    [(["--level", "3"], "level"), (["--optimizer", "adamw"], "optimizer"), (["--model", "num_layers=2"], "num_layers")],
)
def test_a_checkpoint_of_another_run_is_refused(corpus, killed_run, tmp_path, change, named):
    ckpt, _ = killed_run
    ckpt = _copy(ckpt, tmp_path)
    argv = _args(corpus, ckpt, "--resume", *change)  # the later option wins
    with pytest.raises(CheckpointError, match=rf"not from this run(.|\n)*{named}"):
        train.run(train.parse_args(argv))


@pytest.mark.parametrize("damage", ["truncate array data", "delete array data", "truncate metadata"])
def test_a_damaged_checkpoint_is_refused_whole(corpus, killed_run, tmp_path, damage):
    ckpt, _ = killed_run
    ckpt = _copy(ckpt, tmp_path)
    step_dir = os.path.join(ckpt, str(Checkpointer(ckpt).latest_step()))
    if damage == "truncate metadata":
        path = os.path.join(step_dir, "meta", "metadata")
        size = os.path.getsize(path)
    else:
        data = os.path.join(step_dir, "opt_state", "ocdbt.process_0", "d")
        path = max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)
        size = os.path.getsize(path)
    if damage.startswith("delete"):
        os.remove(path)
    else:
        with open(path, "r+b") as fh:
            fh.truncate(size // 2)
    with pytest.raises(CheckpointError, match="cannot be read"):
        train.run(train.parse_args(_args(corpus, ckpt, "--resume")))
