"""Levanter's own ``train_lm`` with ``type: gwt`` (and ``adam`` beside it), offline, on 8 simulated CPU devices.

    python -m benchmarks.levanter_run --out results/levanter    # in an environment with optax-gwt[levanter]

A local word-level tokenizer and a small jsonl corpus are made first (no hub, no
download); each run is ``python -m optax_gwt.levanter.train_lm --config_path <yaml>``
in a subprocess with ``--xla_force_host_platform_device_count=8``, logging its metrics
through Levanter's ``json_logger`` tracker. Writes ``<out>.json`` and ``<out>.md``: the
training losses of GWT-2 and of Levanter's ``adam`` (same model, data, steps and seed),
a run resumed from the GWT run's step-4 checkpoint (its losses from there on must be
the same), and the state bytes of the hidden matrices.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

MODEL = {"hidden_dim": 64, "intermediate_dim": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
SEQ_LEN, BATCH = 64, 16


def make_data(root: Path) -> Path:
    """A word-level tokenizer saved as Hugging Face files, and a jsonl corpus of 200 documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = [f"w{i}" for i in range(200)]
    docs = [" ".join(rng.choice(words[: 20 + (j % 5) * 30]) for _ in range(200)) for j in range(200)]
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    specials = dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(root / "tokenizer")
    return root


def config(root: Path, run_id: str, steps: int, optimizer: dict) -> str:
    """The YAML of one run (JSON is YAML)."""
    tokenizer = str(root / "tokenizer")
    return json.dumps(
        {
            "data": {
                "tokenizer": tokenizer,
                "cache_dir": str(root / "cache"),
                "components": {"local": {"source": {"type": "url", "train_urls": [str(root / "train.jsonl")]}}},
            },
            "model": {"type": "llama", "max_seq_len": SEQ_LEN, "tokenizer": tokenizer, **MODEL},
            "trainer": {
                "tracker": {"type": "json_logger"},
                "mp": "p=f32,c=f32",
                "train_batch_size": BATCH,
                "num_train_steps": steps,
                "steps_per_eval": 10_000,
                "id": run_id,
                "seed": 0,
                "require_accelerator": False,
                "checkpointer": {"base_path": str(root / "checkpoints"), "keep": [{"every": 4}]},
            },
            "optimizer": optimizer,
        },
        indent=1,
    )


def train(root: Path, run_id: str, steps: int, optimizer: dict) -> dict[int, float]:
    """One ``train_lm`` run (resuming from its own latest checkpoint if any): {step: training loss}."""
    path = root / f"{run_id}-{steps}.yaml"
    path.write_text(config(root, run_id, steps, optimizer))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "optax_gwt.levanter.train_lm", "--config_path", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    losses = {}
    for line in (done.stdout + done.stderr).splitlines():
        if "levanter.json_logger" in line and '"event": "log"' in line:
            record = json.loads(line[line.index("{") :])
            if "train/loss" in record.get("metrics", {}):
                losses[int(record["step"])] = float(record["metrics"]["train/loss"])
    return losses


GWT = {"type": "gwt", "learning_rate": 1e-2, "level": 2, "weight_decay": 0.1, "warmup": 0.1}
ADAM = {"type": "adam", "learning_rate": 1e-2, "weight_decay": 0.1, "warmup": 0.1}


def state_bytes() -> dict[str, int]:
    """Bytes of the optimizer state of the hidden matrices, GWT-2 and Levanter's adam, for this model."""
    import equinox as eqx
    import haliax as hax
    import jax
    from levanter.models.llama import LlamaConfig
    from levanter.optim import AdamConfig

    import optax_gwt.levanter as gl

    model = LlamaConfig(max_seq_len=SEQ_LEN, **MODEL).build(hax.Axis("vocab", 144), key=jax.random.PRNGKey(0))
    params = eqx.filter(model, eqx.is_array)
    return {
        "gwt_bytes": gl.hidden_state_bytes(gl.GWTConfig(level=2).build(10), params),
        "adam_bytes": gl.hidden_state_bytes(AdamConfig().build(10), params),
    }


def run_all(root: Path, steps: int = 8) -> dict:
    make_data(root)
    gwt = train(root, "gwt", steps, GWT)
    adam = train(root, "adam", steps, ADAM)
    # The GWT run's checkpoint of step steps/2 as another run's only one: that run resumes from it.
    half = f"step-{steps // 2}"
    shutil.rmtree(root / "checkpoints" / "resumed", ignore_errors=True)
    shutil.copytree(root / "checkpoints" / "gwt" / half, root / "checkpoints" / "resumed" / half)
    resumed = train(root, "resumed", steps, GWT)
    return {"steps": steps, "gwt": gwt, "adam": adam, "resume": {"from": half, "then": resumed}, **state_bytes()}


def markdown(r: dict) -> str:
    def by_step(losses):
        return {int(k): v for k, v in losses.items()}

    gwt, adam, resumed = by_step(r["gwt"]), by_step(r["adam"]), by_step(r["resume"]["then"])
    lines = ["| step | GWT-2 loss | adam loss | GWT-2 resumed |", "|---|---|---|---|"]
    for s in sorted(set(gwt) | set(adam)):
        row = [gwt.get(s), adam.get(s), resumed.get(s)]
        lines.append(f"| {s} | " + " | ".join("" if v is None else f"{v:.4f}" for v in row) + " |")
    lines.append("")
    lines.append(f"Hidden matrices' optimizer state: GWT-2 {r['gwt_bytes']:,} B, adam {r['adam_bytes']:,} B "
                 f"({r['gwt_bytes'] / r['adam_bytes']:.3f}x).")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/levanter/run")
    p.add_argument("--workdir", default="runs/levanter")
    args = p.parse_args(argv)
    r = run_all(Path(args.workdir).resolve())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(r, indent=1))
    Path(args.out + ".md").write_text(markdown(r) + "\n")
    print(markdown(r))


if __name__ == "__main__":
    main()
