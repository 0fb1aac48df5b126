"""Issue 23's sequence-length setup: the validation set is the same text at every length, and RoPE is relative."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.llama import data, train
from optax_gwt.models import llama as model


def _bigram_nll(windows: np.ndarray, table: np.ndarray) -> float:
    """Mean -log p(target | previous token) of (count, seq_len + 1) windows: a model with one token of context."""
    return float(-np.log(table[windows[:, :-1], windows[:, 1:]]).mean())


def test_span_windows_are_direct_slices_of_evenly_spaced_spans():
    tokens = np.arange(10_000) % 251
    count, seq_len, span = 12, 16, 64  # 12 x 16 = 192 predicted tokens = 3 spans of 64
    got = data.span_windows(tokens, seq_len, count, span)
    starts = np.linspace(0, len(tokens) - span - 1, num=3).astype(np.int64)  # evenly_spaced_windows' starts
    want = [tokens[s + j * seq_len : s + (j + 1) * seq_len + 1] for s in starts for j in range(span // seq_len)]
    np.testing.assert_array_equal(got, np.stack(want))
    assert got.shape == (count, seq_len + 1)


@pytest.mark.parametrize("seq_len", [8, 16, 32, 64])
def test_span_windows_predict_the_same_tokens_at_every_length(seq_len):
    """(position in the text, token) of every prediction: one set for all lengths at a fixed token count."""
    tokens = np.random.default_rng(0).integers(0, 256, size=5_000)
    positions = np.arange(len(tokens))
    n_predicted, span = 256, 64

    def targets(length):
        pos = data.span_windows(positions, length, n_predicted // length, span)
        tok = data.span_windows(tokens, length, n_predicted // length, span)
        np.testing.assert_array_equal(tok, tokens[pos])  # the windows are the text at those positions
        return sorted(pos[:, 1:].ravel().tolist())

    assert targets(seq_len) == targets(span)
    assert len(set(targets(seq_len))) == n_predicted  # no token predicted twice


def test_span_windows_refuse_lengths_that_do_not_divide_the_span():
    with pytest.raises(ValueError, match="multiple of seq_len"):
        data.span_windows(np.arange(1000), 24, 8, 64)
    with pytest.raises(ValueError, match="divide"):
        data.span_windows(np.arange(1000), 16, 6, 64)  # 96 tokens: not whole spans of 64


def test_make_data_val_span_gives_one_validation_text_and_the_old_default_does_not():
    """On the stdlib corpus at 2048 tokens a batch: a bigram model's loss on the validation set is
    the same at 128 and 1024 tokens with --val-span 1024 (the same targets and previous tokens,
    except the first token of each window), while the default windows are other text per length."""
    specs = {(L, s): data.DataSpec(seq_len=L, batch_size=2048 // L, eval_batches=8, val_span=s)
             for L in (128, 1024) for s in (0, 1024)}  # fmt: skip
    vals = {k: data.make_data(spec)[2] for k, spec in specs.items()}
    for (L, _), v in vals.items():
        assert v.shape == (8, 2048 // L, L + 1)
    flat = {k: v.reshape(-1, k[0] + 1) for k, v in vals.items()}
    # the same predicted tokens, in the same text order
    np.testing.assert_array_equal(flat[128, 1024][:, 1:].ravel(), flat[1024, 1024][:, 1:].ravel())
    rng = np.random.default_rng(0)
    table = rng.dirichlet(np.ones(258), size=258)  # a fixed bigram model
    same = [_bigram_nll(flat[L, 1024], table) for L in (128, 1024)]
    assert same[0] == pytest.approx(same[1], abs=1e-12)
    old = [_bigram_nll(flat[L, 0], table) for L in (128, 1024)]
    assert abs(old[0] - old[1]) > 1e-3  # the default's windows are other text at each length


def test_train_cli_passes_val_span_to_the_data():
    args = train.parse_args(["--seq-len", "64", "--batch-size", "4", "--val-span", "256"])
    assert train._data_spec(args).val_span == 256
    assert train._data_spec(train.parse_args([])).val_span == 0


def test_rotary_attention_scores_depend_only_on_the_position_difference():
    """q(i) . k(j) after RoPE equals q(i + s) . k(j + s): positions are relative, at every offset used up to 1024."""
    cfg = model.get_config("9m", vocab_size=258)
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, cfg.head_dim))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, cfg.head_dim))

    def score(i, j):
        rq = model.rotary_embedding(q, jnp.array([i]), cfg.rope_theta)
        rk = model.rotary_embedding(k, jnp.array([j]), cfg.rope_theta)
        return float(jnp.sum(rq * rk))

    for i, j in [(5, 2), (100, 37), (700, 1)]:
        for shift in (0, 64, 300, 1023 - i):
            assert score(i + shift, j + shift) == pytest.approx(score(i, j), rel=2e-4, abs=2e-4)
    assert cfg.max_seq_len >= 1024


@pytest.mark.parametrize(("gamma", "axis"), [(None, 0), (1.1, 0), (1.01, 1)])
def test_make_optimizer_passes_the_limiter_gamma_and_the_axis_to_gwt_adamw(gamma, axis):
    """The remedies' options: make_optimizer("gwt", ...) equals gwt_adamw built with them, step for step."""
    import optax

    import optax_gwt
    from optax_gwt import modular

    params = {"attn": {"kernel": jnp.ones((16, 8))}, "mlp": {"kernel": jnp.ones((8, 24))}, "norm": jnp.ones(8)}
    tx = modular.make_optimizer("gwt", params, lr=1e-2, steps=10, alpha=0.125, norm_growth_limit=gamma, gwt_axis=axis)
    sched = modular.make_schedule(1e-2, 10)
    ref = optax.multi_transform(
        {"matrix": optax_gwt.gwt_adamw(sched, level=2, scale=0.125, norm_growth_limit=gamma, axis=axis),
         "other": optax.adamw(sched, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0)},
        modular.param_labels,
    )  # fmt: skip
    s1, s2 = tx.init(params), ref.init(params)
    for i in range(4):
        grads = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.key(i), x.shape) * (1 + 3 * i), params)
        u1, s1 = tx.update(grads, s1, params)
        u2, s2 = ref.update(grads, s2, params)
        for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mu = s1.inner_states["matrix"].inner_state[0][1].inner_state.mu
    assert mu["attn"]["kernel"].shape == ((4, 8) if axis == 0 else (16, 2))


def test_train_cli_limiter_zero_means_none_and_axis_is_passed(monkeypatch):
    seen = {}
    monkeypatch.setattr(train.modular, "make_optimizer", lambda name, params, **kw: seen.update(kw))
    train.make_optimizer(train.parse_args(["--norm-growth-limit", "0", "--gwt-axis", "1"]), {})
    assert seen["norm_growth_limit"] is None and seen["gwt_axis"] == 1
    train.make_optimizer(train.parse_args([]), {})
    assert seen["norm_growth_limit"] == 1.01 and seen["gwt_axis"] == 0


def test_contiguous_windows_are_the_long_windows_text_cut_short():
    """contiguous=k at (batch, L) yields exactly the tokens of the (batch / k, k L) loader, cut into k windows."""
    tokens = np.arange(50_000) % 65_521
    long = data.WindowLoader(tokens, batch_size=2, seq_len=64, seed=5)
    short = data.WindowLoader(tokens, batch_size=16, seq_len=8, seed=5, contiguous=8)
    for _ in range(200):  # crosses an epoch (48 batches)
        a, b = next(long), next(short)
        assert b.shape == (16, 9)
        for r in range(2):
            for j in range(8):
                np.testing.assert_array_equal(b[r * 8 + j], a[r, j * 8 : j * 8 + 9])
    with pytest.raises(ValueError, match="divide"):
        data.WindowLoader(tokens, batch_size=6, seq_len=8, contiguous=4)
    plain = data.WindowLoader(tokens, batch_size=4, seq_len=8, seed=1)
    same = data.WindowLoader(tokens, batch_size=4, seq_len=8, seed=1, contiguous=1)
    np.testing.assert_array_equal(next(plain), next(same))


def test_train_cli_passes_contiguous_windows_to_the_data():
    args = train.parse_args(["--seq-len", "64", "--batch-size", "16", "--contiguous-windows", "8"])
    assert train._data_spec(args).contiguous == 8


# ---------------------------------------------------------------------------
# The study page's sequence-length blocks are their results files.
# ---------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _results_module(name: str):
    """The analysis module that writes results/seqlen/<name>.md (examples/llama/analysis/seqlen_<name>.py)."""
    import importlib

    return importlib.import_module(f"examples.llama.analysis.seqlen_{name}")


def _block(marker: str) -> str:
    with open(os.path.join(REPO, "docs", "study_records.md")) as fh:
        text = fh.read()
    start = text.index(f"<!-- {marker}:start")
    body = text[text.index("\n", start) + 1 : text.index(f"<!-- {marker}:end -->")]
    return body


def test_setup_tables_are_the_committed_results():
    """results/seqlen/setup.md regenerates from its JSON/JSONL files, and docs/study_records.md carries it."""
    text = _results_module("setup_summary").render()
    with open(os.path.join(REPO, "results", "seqlen", "setup.md")) as fh:
        assert fh.read() == text
    assert _block("seqlen-setup") == text


def test_ratio_table_is_the_committed_results():
    """results/seqlen/ratios.md regenerates from seqlen2.jsonl, and docs/study_records.md carries it."""
    _, lengths, text = _results_module("ratios").render()
    assert lengths == [128, 256, 512, 1024]
    with open(os.path.join(REPO, "results", "seqlen", "ratios.md")) as fh:
        assert fh.read() == text
    assert _block("seqlen-ratios") == text
