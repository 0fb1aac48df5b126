"""MaxText on real text: AdamW, GWT-2 and FOAM-2 each at its own tuned learning rate.

    python -m benchmarks.maxtext_text --out results/maxtext/text   # where MaxText is installed (Python >= 3.12)

The recipe of `benchmarks.maxtext_run` (GWT or FOAM on the scanned decoder layers' kernels,
MaxText's AdamW elsewhere), trained by MaxText's own trainer through its Hugging Face input
pipeline on the example's embedded corpus: windows of the Python standard library's source
(`examples.llama.data`, split into train and validation files by path), byte tokens (a
tokenizer written next to the data, ids 0-255 the bytes), nothing downloaded. Each optimizer's
learning rate is tuned on seed 0 by the final validation loss, then its best is rerun with
seeds 1 and 2 (MaxText's weight-initialisation and data-order seeds). GWT-2 runs with the
recipe's default bound on its details (`optax_gwt.SAFE_DETAIL_CLIP`); GWT-2 and FOAM-2 at
scale 0.25 on the kernels (MaxText's learning rate elsewhere). Writes ``<out>.json`` / ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

import optax_gwt
from benchmarks import maxtext_run, write_results
from examples.llama import data

#: optimizer: (MaxText's optimizer hook, GWT's settings, learning rates tried, the table's name).
OPTIMIZERS: dict[str, tuple[str, dict[str, str], list[float], str]] = {
    "adamw": ("adamw", {}, [3e-3, 1e-2, 3e-2], "MaxText adamw"),
    "gwt-2": ("gwt", {}, [1e-2, 3e-2, 1e-1], f"GWT-2, recipe default (detail clip {optax_gwt.SAFE_DETAIL_CLIP:g})"),
    "foam-2": ("gwt", {"GWT_RECIPE": "foam"}, [1e-2, 3e-2, 1e-1], "FOAM-2"),
}
SEQ_LEN, BATCH, EVAL_STEPS = 128, 16, 8


def _byte_alphabet() -> list[str]:
    """The printable character the byte-level pre-tokenizer writes for each byte 0-255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_byte_tokenizer(path: Path) -> None:
    """A Hugging Face tokenizer of UTF-8 bytes (id = byte), loadable by ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    sample = "def f(x):\n\treturn 'é' + x  # ✓"
    if fast(sample)["input_ids"] != list(sample.encode()):
        raise RuntimeError("the byte tokenizer does not give each UTF-8 byte its own value as its id")


def write_corpus(path: Path, windows: int, eval_windows: int) -> None:
    """``train.jsonl`` (`windows` windows of `SEQ_LEN` bytes at random places in the training
    files) and ``validation.jsonl`` (`eval_windows` evenly spaced over the validation files)."""
    root, files = data.list_files("stdlib")
    split = data.split_files(root, files, 0.05)
    tokenizer = data.ByteTokenizer()
    for name, count in (("train", windows), ("validation", eval_windows)):
        tokens = np.concatenate([tokenizer.encode(data.read_text(f)) for f in split[name]]).astype(np.uint8)
        if name == "train":
            starts = np.random.default_rng(0).integers(0, len(tokens) - SEQ_LEN, count)
        else:
            starts = np.linspace(0, len(tokens) - SEQ_LEN, count).astype(int)
        lines = [json.dumps({"text": tokens[s : s + SEQ_LEN].tobytes().decode("utf-8", "replace")}) for s in starts]
        (path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def text_keys(data_dir: Path, seed: int, eval_every: int) -> dict[str, Any]:
    """MaxText's config for the corpus: its HF pipeline on the local JSON files, byte tokens."""
    return {
        "dataset_type": "hf", "hf_path": "json", "hf_train_files": data_dir / "train.jsonl",
        "hf_eval_files": data_dir / "validation.jsonl", "hf_eval_split": "train",
        "tokenizer_type": "huggingface", "tokenizer_path": data_dir / "tokenizer",
        "add_bos": "false", "add_eos": "false", "vocab_size": 259, "max_target_length": SEQ_LEN,
        "per_device_batch_size": BATCH, "eval_per_device_batch_size": BATCH,
        "eval_interval": eval_every, "eval_steps": EVAL_STEPS,
        "init_weights_seed": seed, "data_shuffle_seed": seed,
    }  # fmt: skip


def final_eval(run: dict) -> float:
    evals = run["eval_losses"]
    return evals[max(evals)]


def study(workdir: Path, steps: int, seeds: list[int]) -> dict[str, Any]:
    """Every optimizer's learning rates on ``seeds[0]``, then its best on the other seeds; the
    runs are kept in ``workdir/runs.json``, so an interrupted study resumes."""
    data_dir = workdir / "data"
    if not (data_dir / "validation.jsonl").exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        write_byte_tokenizer(data_dir / "tokenizer")
        write_corpus(data_dir, windows=2 * steps * BATCH, eval_windows=EVAL_STEPS * BATCH)
    cache = workdir / "runs.json"
    runs: dict[str, Any] = json.loads(cache.read_text()) if cache.exists() else {}

    def one(name: str, lr: float, seed: int) -> float:
        key = f"{name} lr={lr:g} seed={seed}"
        if key not in runs:
            hook, env, _, _ = OPTIMIZERS[name]
            keys = text_keys(data_dir, seed, eval_every=max(1, steps // 10))
            # one step more, so that the last evaluation follows the last of `steps` updates
            runs[key] = maxtext_run.run(workdir / "out", hook, steps + 1, lr, env, **keys)
            cache.write_text(json.dumps(runs))
            print(f"{key}: {final_eval(_int_keys(runs[key])):.3f}", flush=True)
        return final_eval(_int_keys(runs[key]))

    result: dict[str, Any] = {}
    for name, (_, _, lrs, _) in OPTIMIZERS.items():
        tuned = {lr: one(name, lr, seeds[0]) for lr in lrs}
        best = min(tuned, key=tuned.__getitem__)
        finals = [one(name, best, s) for s in seeds]
        result[name] = {"lrs": tuned, "best_lr": best, "finals": finals,
                        "curve": _int_keys(runs[f"{name} lr={best:g} seed={seeds[0]}"])}  # fmt: skip
    return result


def _int_keys(run: dict) -> dict:
    return {k: ({int(s): v for s, v in x.items()} if isinstance(x, dict) else x) for k, x in run.items()}


def markdown(r: dict) -> str:
    seeds = len(r["adamw"]["finals"])
    lines = ["| optimizer | learning rates tried (seed 0's final validation loss) | best lr "
             f"| validation loss ({seeds} seeds) | layers' kernels' state |", "|---|---|---|---|---|"]  # fmt: skip
    adamw_bytes = r["adamw"]["curve"]["layer_kernels_bytes"]
    for name, (_, _, _, title) in OPTIMIZERS.items():
        o = r[name]
        tried = ", ".join(f"{lr:g}: {v:.3f}" for lr, v in o["lrs"].items())
        f = o["finals"]
        state = o["curve"]["layer_kernels_bytes"] / adamw_bytes
        lines.append(f"| {title} | {tried} | {o['best_lr']:g} | {statistics.mean(f):.3f} ± "
                     f"{statistics.stdev(f):.3f} | {state:.3f}x |")  # fmt: skip
    curves = [r[name]["curve"]["eval_losses"] for name in OPTIMIZERS]
    lines += ["", "Validation loss by step (seed 0, each at its best learning rate):", "",
              "| step | " + " | ".join(t for *_, t in OPTIMIZERS.values()) + " |",
              "|---|" + "---|" * len(OPTIMIZERS)]  # fmt: skip
    for s in sorted(curves[0]):
        lines.append(f"| {s} | " + " | ".join(f"{c.get(s, float('nan')):.3f}" for c in curves) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    versions = maxtext_run.require_maxtext("benchmarks.maxtext_text")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/maxtext/text")
    p.add_argument("--workdir", default="runs/maxtext-text")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    r: dict[str, Any] = {"steps": args.steps, "seq_len": SEQ_LEN, "batch": BATCH, "model": maxtext_run.MODEL}
    r.update(study(Path(args.workdir).resolve(), args.steps, args.seeds))
    r["versions"] = versions
    write_results(args.out, r, markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
