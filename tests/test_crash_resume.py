"""The LLaMA example's run directory and crash-safe training.

SIGKILL between checkpoints, partial and foreign checkpoints.

One training process is killed (slow: a subprocess); the checks of the run
directory and of partial, foreign and damaged checkpoints share one short
in-process run.
"""

from __future__ import annotations

import contextlib
import io
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
from examples.llama import rundir, train
from examples.llama.checkpoint import Checkpointer, CheckpointError

# Orbax's reads of a damaged checkpoint leave failed coroutines behind; the error itself is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_EVERY = 20, 5


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


def _args(corpus, run_dir, *extra):
    return [
        "--model", "num_layers=1", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2", "--quiet",
        "--data", corpus, "--optimizer", "gwt", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--eval-every", "1000", "--run-dir", run_dir, *extra,
    ]  # fmt: skip


def _checkpoints(run_dir):
    return os.path.join(run_dir, rundir.CHECKPOINTS)


@pytest.fixture(scope="module")
def killed_run(corpus, tmp_path_factory):
    """A training process killed with SIGKILL after its first complete checkpoint, between two saves.

    Returns ``(run directory, the metrics records the process had written)``.
    """
    run_dir = str(tmp_path_factory.mktemp("killed") / "run")
    metrics = os.path.join(run_dir, rundir.METRICS)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.llama.train", *_args(corpus, run_dir)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [r["step"] for r in rundir.read_metrics(metrics)]
            # A complete checkpoint exists, and the run is past it but not at the next save.
            if (
                os.path.isdir(os.path.join(_checkpoints(run_dir), str(SAVE_EVERY)))
                and steps
                and steps[-1] % SAVE_EVERY not in (0, SAVE_EVERY - 1)
            ):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, (
        "the run was not killed mid-way",
        proc.returncode,
        proc.stderr.read()[-2000:],
    )
    return run_dir, rundir.read_metrics(metrics)


@pytest.fixture(scope="module")
def saved_json_run(corpus, tmp_path_factory):
    """A short in-process run of the CLI with ``--json``, checkpoints at steps 1 and 2: ``(run dir, stdout)``."""
    run_dir = str(tmp_path_factory.mktemp("saved") / "run")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(_args(corpus, run_dir, "--stop-at", "2", "--save-every", "1", "--json"))
    return run_dir, out.getvalue()


@pytest.fixture
def saved_run(saved_json_run):
    return saved_json_run[0]


@pytest.mark.slow
def test_a_run_writes_its_directory_and_a_summary(saved_json_run):
    run_dir, printed = saved_json_run
    assert len(printed.splitlines()) == 1  # --json: nothing but the summary
    summary = json.loads(printed)
    assert summary["run_dir"] == run_dir and summary["step"] == 2 and summary["name"] == "gwt-2"
    config = json.load(open(os.path.join(run_dir, rundir.CONFIG)))
    assert config["args"]["steps"] == STEPS and config["args"]["stop_at"] == 2 and config["lr"] == 2e-2
    assert config["command"].startswith("python -m examples.llama.train --model num_layers=1")
    assert [r["step"] for r in rundir.read_metrics(os.path.join(run_dir, rundir.METRICS))] == [1, 2]
    assert sorted(os.listdir(_checkpoints(run_dir))) == ["1", "2"]
    with open(os.path.join(run_dir, rundir.PLOT), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    text = rundir.format_summary(summary)
    assert f"val loss {summary['final_val_loss']:.4f}" in text and run_dir in text and "tokens/s" in text


def _copy(run_dir, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(run_dir, dst)
    return dst


@pytest.mark.slow
def test_sigkill_between_checkpoints_resumes_to_the_same_losses(killed_run, tmp_path):
    """``--resume RUN_DIR`` after a SIGKILL repeats the killed process's losses after its last checkpoint exactly,
    and the metrics file ends up with every step once. (That a resumed run equals an uninterrupted one to the
    last step is tests/test_llama_example.py::test_train_checkpoint_resume_is_bit_for_bit.)"""
    original, logged = killed_run
    run_dir = _copy(original, tmp_path)
    last_complete = Checkpointer(_checkpoints(run_dir)).latest_step()
    reached = logged[-1]["step"]
    assert last_complete is not None and last_complete % SAVE_EVERY == 0 and last_complete < reached
    resumed = train.run(train.parse_args(["--resume", run_dir]))
    assert [r["step"] for r in resumed["history"]] == list(range(last_complete + 1, STEPS + 1))
    redone = {r["step"]: r["loss"] for r in resumed["history"]}
    assert [redone[r["step"]] for r in logged if r["step"] > last_complete] == [
        r["loss"] for r in logged if r["step"] > last_complete
    ]
    assert [r["step"] for r in rundir.read_metrics(os.path.join(run_dir, rundir.METRICS))] == list(range(1, STEPS + 1))
    assert resumed["summary"]["final_val_loss"] is not None


@pytest.mark.slow
def test_a_partially_written_step_is_never_picked(saved_run, tmp_path):
    ckpt = _checkpoints(_copy(saved_run, tmp_path))
    complete = Checkpointer(ckpt).latest_step()
    assert complete == 2
    # What a save cut short leaves: Orbax's temporary folder for a later step, even with all files in it.
    shutil.copytree(
        os.path.join(ckpt, str(complete)), os.path.join(ckpt, f"{complete + SAVE_EVERY}.orbax-checkpoint-tmp-123")
    )
    assert Checkpointer(ckpt).latest_step() == complete


@pytest.mark.slow
def test_a_fresh_run_does_not_overwrite_a_run_directory(corpus, saved_run, tmp_path):
    with pytest.raises(SystemExit, match="already holds a checkpoint(.|\n)*--resume"):
        train.run(train.parse_args(_args(corpus, _copy(saved_run, tmp_path))))


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, named",
    [(["--level", "3"], "level"), (["--optimizer", "adamw"], "optimizer"), (["--model", "num_layers=2"], "num_layers")],
)
def test_a_checkpoint_of_another_run_is_refused(saved_run, tmp_path, change, named):
    run_dir = _copy(saved_run, tmp_path)
    with pytest.raises(CheckpointError, match=rf"not from this run(.|\n)*{named}"):
        train.run(train.parse_args(["--resume", run_dir, *change]))  # flags given again override config.json


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate array data", "delete array data", "truncate metadata"])
def test_a_damaged_checkpoint_is_refused_whole(saved_run, tmp_path, damage):
    run_dir = _copy(saved_run, tmp_path)
    step_dir = os.path.join(_checkpoints(run_dir), str(Checkpointer(_checkpoints(run_dir)).latest_step()))
    if damage == "truncate metadata":
        path = os.path.join(step_dir, "meta", "metadata")
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
        train.run(train.parse_args(["--resume", run_dir]))


def test_resume_needs_a_run_directory(tmp_path):
    with pytest.raises(SystemExit, match="not a run directory"):
        train.parse_args(["--resume", str(tmp_path)])
    with pytest.raises(SystemExit):
        train.parse_args(["--resume"])  # neither a run directory nor --run-dir/--ckpt-dir
