"""Issue 23, why the loss rose with the sequence length: measurements of the setup.

    python -m examples.llama.analysis.seqlen_setup_check data          # no training
    python -m examples.llama.analysis.seqlen_setup_check positions     # needs seqlen2's runs
    python -m examples.llama.analysis.seqlen_setup_check noise         # needs seqlen2's runs
    python -m examples.llama.analysis.seqlen_setup_check detail_noise  # the same

Each writes results/seqlen/setup_<what>.json (setup_data.json, ...).

data: the validation windows of the old studies (``--val-span 0``: ``eval_batches x batch_size``
windows spread evenly over the validation text, so other text at every length) against
``--val-span 1024`` (the same 16 x 1024 predicted tokens at every length), scored by a model
that cannot use context: a bigram model (add-one smoothing) counted on the training split.
Its loss changes with the length only if the text does.

positions: AdamW-modular's runs of results/seqlen/seqlen2.jsonl (seed 0, each length's best lr),
restored from their checkpoints and evaluated on the same validation text cut at 128 and at the
length each was trained on: the loss by position in the window, so that a model trained on long
sequences can be compared with one trained on short ones on identical inputs.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import numpy as np
import optax

from examples.llama import data as data_lib, sweep
from examples.llama.analysis import REPO

HERE = os.path.join(REPO, "results", "seqlen")
LENGTHS = (64, 128, 256, 512, 1024)
TOKENS_PER_STEP, EVAL_BATCHES, SPAN = 2048, 8, 1024


def _spec(seq_len: int, val_span: int) -> data_lib.DataSpec:
    return data_lib.DataSpec(
        seq_len=seq_len, batch_size=TOKENS_PER_STEP // seq_len, eval_batches=EVAL_BATCHES, val_span=val_span
    )


def check_data() -> dict:
    """The bigram model's loss on the old and the new validation windows at each length."""
    tokenizer = data_lib.get_tokenizer("byte")
    root, files = data_lib.list_files("stdlib")
    split = data_lib.split_files(root, files, 0.05)
    train = data_lib._concat(tokenizer, split["train"]).astype(np.int64)
    counts = np.ones((tokenizer.vocab_size, tokenizer.vocab_size))
    np.add.at(counts, (train[:-1], train[1:]), 1)
    logp = np.log(counts / counts.sum(1, keepdims=True))
    out: dict[str, Any] = {"train_tokens": int(len(train)), "rows": []}
    for L in LENGTHS:
        for span in (0, SPAN):
            v = data_lib.make_data(_spec(L, span))[2].reshape(-1, L + 1).astype(np.int64)
            out["rows"].append({
                "seq_len": L, "val_span": span, "windows": int(v.shape[0]), "predicted_tokens": int(v[:, 1:].size),
                "bigram_nats": float(-logp[v[:, :-1], v[:, 1:]].mean()),
            })  # fmt: skip
    return out


def _restore(run_dir: str) -> tuple[Any, Any]:
    """(graphdef, params) of a finished run, from its checkpoint."""
    from flax import nnx

    from examples.llama import train
    from examples.llama.checkpoint import Checkpointer, run_metadata
    from optax_gwt.models import llama as model_lib

    args = train.parse_args(["--resume", run_dir])
    job = train.make_job(args)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), run=run_metadata(args, job.cfg))
    params, _, _ = ckpt.restore(job.params, job.opt_state, job.train_data)
    ckpt.close()
    graphdef, _ = nnx.split(model_lib.Llama(job.cfg, nnx.Rngs(0)), nnx.Param)
    return graphdef, params


def _per_position(graphdef: Any, params: Any, windows: np.ndarray) -> np.ndarray:
    """Mean cross-entropy at each position of (count, L + 1) windows: (L,)."""
    from flax import nnx

    @jax.jit
    def nll(p: Any, batch: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, p)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])

    per = [np.asarray(nll(params, windows[i : i + 8])) for i in range(0, len(windows), 8)]
    return np.concatenate(per).mean(axis=0)


def check_positions() -> dict:
    """AdamW-modular's seed-0 checkpoints (best lr of each length): the loss by position in the window."""
    best = _best_adamw_modular()
    val = {L: data_lib.make_data(_spec(L, SPAN))[2].reshape(-1, L + 1) for L in (128, *sorted(best))}
    buckets = [(0, 16), (16, 128), (128, 512), (512, 1024)]
    out: dict[str, list[dict]] = {"rows": []}
    for L, r in sorted(best.items()):
        graphdef, params = _restore(os.path.join(REPO, r["run_dir"]))
        for eval_len in sorted({128, L}):
            per = _per_position(graphdef, params, val[eval_len])
            row = {"trained_seq_len": L, "lr": r["flags"]["lr"], "eval_seq_len": eval_len,
                   "final_val_loss": r["final_val_loss"], "mean": float(per.mean())}  # fmt: skip
            for a, b in buckets:
                if a < eval_len:
                    row[f"pos {a}-{min(b, eval_len) - 1}"] = float(per[a : min(b, eval_len)].mean())
            out["rows"].append(row)
            print(row, flush=True)
    return out


def _best_adamw_modular(seed: int = 0) -> dict:
    """{seq_len: record} of AdamW-modular's best-lr run of `seed` at each length in seqlen2.jsonl."""
    records = sweep.load_records(os.path.join(HERE, "seqlen2.jsonl"))
    best: dict[int, dict] = {}
    for r in records:
        f = r["flags"]
        if r["name"] == "adamw-modular" and f["seed"] == seed and r["final_val_loss"] is not None:
            if f["seq_len"] not in best or r["final_val_loss"] < best[f["seq_len"]]["final_val_loss"]:
                best[f["seq_len"]] = r
    return best


def check_noise(batches: int = 24) -> dict:
    """How well one step's gradient points, at 2048 tokens a step cut at each length.

    At AdamW-modular's 1024-token checkpoint (best lr, seed 0), `batches` training batches of
    each shape (128 x 16 ... 1024 x 2, the training loader's own windows): the cosine between
    one batch's gradient and the mean gradient of the other batches of that shape (leave one
    out), and the noise-to-signal ratio mean |g_i - g|^2 / |g|^2. Fewer, longer sequences
    carry fewer independent samples of the text: a lower cosine is a noisier step.
    """
    from examples.llama import train

    r = _best_adamw_modular()[1024]
    graphdef, params = _restore(os.path.join(REPO, r["run_dir"]))
    grad_fn = jax.jit(jax.grad(lambda p, b: train.loss_fn(graphdef, p, b)))
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])  # noqa: E731
    out: dict[str, Any] = {"checkpoint": r["run_dir"], "batches": batches, "rows": []}
    for L in (128, 256, 512, 1024):
        loader = data_lib.make_data(_spec(L, SPAN))[1]
        g = np.stack([flat(grad_fn(params, next(loader))) for _ in range(batches)]).astype(np.float64)
        total = g.sum(0)
        loo = [(total - gi) / (batches - 1) for gi in g]
        cos = [float(gi @ m / np.linalg.norm(gi) / np.linalg.norm(m)) for gi, m in zip(g, loo, strict=True)]
        mean = total / batches
        noise = float(np.mean(((g - mean) ** 2).sum(1)) / (mean @ mean))
        row = {"seq_len": L, "batch_size": TOKENS_PER_STEP // L, "cosine_to_others_mean": float(np.mean(cos)),
               "noise_to_signal": noise}  # fmt: skip
        out["rows"].append(row)
        print(row, flush=True)
    return out


def check_detail_noise(batches: int = 24) -> dict:
    """Where the step's noise sits in GWT-2's split of a matrix gradient: approximation or details.

    The same checkpoint and batches as `check_noise`. For the attention and MLP kernels, each
    gradient is split along axis 0 (GWT's) into its Haar level-2 approximation part (block
    means of 4 rows, `examples.llama.diagnostics.lowpass`) and its detail part (the rest).
    Per part: noise / signal over the batches (as in `check_noise`), and the detail share of
    the energy in one batch's gradient and in the mean gradient. GWT-2 runs Adam (momentum
    0.9) on the approximation only; the details of each step go into its update as they are.
    """
    from examples.llama import diagnostics, train

    r = _best_adamw_modular()[1024]
    graphdef, params = _restore(os.path.join(REPO, r["run_dir"]))
    grad_fn = jax.jit(jax.grad(lambda p, b: train.loss_fn(graphdef, p, b)))

    @jax.jit
    def split(grads: Any) -> tuple[jax.Array, jax.Array]:
        leaves = [(path, g) for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                  if diagnostics.param_group(path) != "other" and g.ndim == 2]  # fmt: skip
        low = [diagnostics.lowpass(g, 0, 2) for _, g in leaves]
        flat = lambda xs: jax.numpy.concatenate([x.ravel() for x in xs])  # noqa: E731
        return flat(low), flat([g for _, g in leaves]) - flat(low)

    def noise(g: np.ndarray) -> tuple[float, float, float]:
        mean = g.mean(0)
        return float(np.mean(((g - mean) ** 2).sum(1)) / (mean @ mean)), float((g**2).sum(1).mean()), float(mean @ mean)

    out: dict[str, Any] = {"checkpoint": r["run_dir"], "batches": batches, "rows": []}
    for L in (128, 512, 1024):
        loader = data_lib.make_data(_spec(L, SPAN))[1]
        parts = [split(grad_fn(params, next(loader))) for _ in range(batches)]
        low = np.stack([np.asarray(a, np.float64) for a, _ in parts])
        det = np.stack([np.asarray(b, np.float64) for _, b in parts])
        (n_low, e_low, m_low), (n_det, e_det, m_det) = noise(low), noise(det)
        row = {"seq_len": L, "batch_size": TOKENS_PER_STEP // L, "noise_to_signal_approximation": n_low,
               "noise_to_signal_details": n_det, "detail_share_one_batch": e_det / (e_det + e_low),
               "detail_share_mean_gradient": m_det / (m_det + m_low)}  # fmt: skip
        out["rows"].append(row)
        print(row, flush=True)
    return out


CHECKS = {"data": check_data, "positions": check_positions, "noise": check_noise, "detail_noise": check_detail_noise}


def main(what: str = "data") -> dict:
    """Runs the check `what` (a key of `CHECKS`) and writes its results/seqlen/setup_<what>.json."""
    result = CHECKS[what]()
    path = os.path.join(HERE, f"setup_{what}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
