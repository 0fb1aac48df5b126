"""The LLaMA example end to end on tiny data: model, labels, data sources, train/resume, compare."""

from __future__ import annotations

import json
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_gwt
from examples.llama import compare, data, rundir, train
from optax_gwt import modular as optimizers
from optax_gwt.models import llama as model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--model", "num_layers=1", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2", "--no-progress"]


def _words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = ["def", "return", "self", "import", "value", "class", "for", "in", "if", "else", "x", "y", "(", ")", ":"]
    return " ".join(rng.choice(vocab, size=n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of 24 small text files."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(24):
        (root / f"doc{i:02d}.txt").write_text(_words(400, i) + f"\nend of document {i}\n")
    return str(root)


def _params(cfg):
    return nnx.split(model.Llama(cfg, nnx.Rngs(0)), nnx.Param)


@pytest.fixture(scope="module")
def one_layer():
    """``(graphdef, params, grads)`` of the 9m config with one layer, shared by the optimizer tests."""
    graphdef, params = _params(model.get_config("9m", vocab_size=258, num_layers=1))
    batch = jnp.arange(2 * 17).reshape(2, 17) % 258
    return graphdef, params, jax.jit(jax.grad(lambda p: train.loss_fn(graphdef, p, batch)))(params)


_forward = nnx.jit(lambda m, tokens: m(tokens))


# ---------------------------------------------------------------------------
# Model.
# ---------------------------------------------------------------------------


def test_configs_match_the_paper():
    expected = {
        "9m": (128, 352, 4, 4),
        "20m": (256, 688, 4, 4),
        "35m": (384, 1024, 8, 6),
        "60m": (512, 1376, 8, 8),
        "130m": (768, 2048, 12, 12),
        "350m": (1024, 2736, 16, 24),
        "1b": (2048, 5461, 32, 24),
    }
    for name, dims in expected.items():
        c = model.CONFIGS[name]
        assert (c.hidden_size, c.intermediate_size, c.num_heads, c.num_layers) == dims
        assert (c.vocab_size, c.max_seq_len) == (32000, 1024)
    assert model.get_config("9m", vocab_size=258).vocab_size == 258


@pytest.mark.slow
def test_model_shapes_and_parameter_count():
    cfg = model.get_config("9m", vocab_size=258, num_layers=2)
    m = model.Llama(cfg, nnx.Rngs(0))
    logits = _forward(m, jnp.zeros((3, 17), jnp.int32))
    assert logits.shape == (3, 17, 258) and logits.dtype == jnp.float32
    d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    # untied embedding and head, per layer 4 d x d attention + 3 d x f SwiGLU + 2 norms, a final norm
    expected = 2 * v * d + L * (4 * d * d + 3 * d * f + 2 * d) + d
    assert sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param))) == expected
    assert m.lm_head.kernel.shape == (d, v) and m.layers[0].mlp.down_proj.kernel.shape == (f, d)


@pytest.mark.slow
def test_attention_is_causal():
    cfg = model.get_config("9m", vocab_size=258, num_layers=2)
    m = model.Llama(cfg, nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    k = 11
    changed = tokens.at[:, k].set((tokens[:, k] + 7) % 256)
    a, b = _forward(m, tokens), _forward(m, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :k]), np.asarray(b[:, :k]))
    assert np.all(np.abs(np.asarray(a[:, k:] - b[:, k:])).max(axis=-1) > 1e-6)


# ---------------------------------------------------------------------------
# Labels and optimizers.
# ---------------------------------------------------------------------------


def test_labels_put_attention_and_mlp_kernels_in_the_matrix_group():
    cfg = model.get_config("9m", vocab_size=258, num_layers=2)
    m = model.Llama(cfg, nnx.Rngs(0))
    # the reference: kernels of Linear modules inside Attention/MLP instances, found by type, not by name
    inside = {
        id(lin.kernel)
        for blk in m.layers
        for sub in (blk.attn, blk.mlp)
        for _, lin in nnx.iter_graph(sub)
        if isinstance(lin, nnx.Linear)
    }
    state = nnx.state(m, nnx.Param)
    labels = optimizers.param_labels(state)
    variables = dict(nnx.to_flat_state(state))
    for path, label in nnx.to_flat_state(labels):
        want = "matrix" if id(_variable(m, path)) in inside else "other"
        assert label.get_value() == want, (path, label)
    assert sum(label.get_value() == "matrix" for _, label in nnx.to_flat_state(labels)) == 7 * cfg.num_layers
    for name in (("embed", "embedding"), ("lm_head", "kernel"), ("final_norm", "scale")):
        assert dict(nnx.to_flat_state(labels))[name].get_value() == "other"
    assert len(variables) == len(list(nnx.to_flat_state(labels)))


def _variable(module, path):
    obj = module
    for key in path:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    return obj


def test_modular_adamw_scales_matrix_updates_by_alpha(one_layer):
    _, params, grads = one_layer
    alpha, lr = 0.25, 1e-2
    one = optimizers.make_optimizer("adamw", params, lr=lr, steps=10, warmup_frac=0.0)
    mod = optimizers.make_optimizer("adamw-modular", params, lr=lr, alpha=alpha, steps=10, warmup_frac=0.0)
    u1, _ = jax.jit(one.update)(grads, one.init(params), params)
    u2, _ = jax.jit(mod.update)(grads, mod.init(params), params)
    labels = jax.tree.leaves(optimizers.param_labels(params))
    for a, b, label in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), labels, strict=True):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a) * (alpha if label == "matrix" else 1.0), rtol=1e-6, atol=1e-12
        )


@pytest.mark.parametrize("detail_rule", ["auto", "zero", "norm_ratio"])
def test_gwt_matches_gwt_adamw_on_matrices_with_scale_alpha_applied_once(one_layer, detail_rule):
    _, params, grads = one_layer
    tx = optimizers.make_optimizer(
        "gwt", params, lr=1e-2, alpha=0.25, steps=10, warmup_frac=0.0, detail_rule=detail_rule
    )
    upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    labels = jax.tree.leaves(optimizers.param_labels(params))
    sched = optimizers.make_schedule(1e-2, 10, 0.0)
    refs = {
        "matrix": optax_gwt.gwt_adamw(sched, scale=0.25, level=2, detail_rule=detail_rule),
        "other": optax.adamw(sched, eps=1e-6, weight_decay=0.0),
    }
    # One jitted first update per group, compiled once per shape.
    first_update = {label: jax.jit(lambda g, ref=ref: ref.update(g, ref.init(g), g)[0]) for label, ref in refs.items()}
    for g, u, label in zip(jax.tree.leaves(grads), jax.tree.leaves(upd), labels, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(first_update[label](g)), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name", ["adamw-modular", "foam"])
def test_b2_reaches_both_groups(one_layer, name):
    """``b2`` is every Adam's: the matrices' (AdamW or FOAM) and the other group's, seen at step two."""
    _, params, grads = one_layer
    sched = optimizers.make_schedule(1e-2, 10, 0.0)
    refs = {
        "matrix": optax.adamw(sched, b2=0.95, eps=1e-6) if name == "adamw-modular"
        else optax_gwt.foam_adamw(sched, b2=0.95, scale=1.0, level=2),
        "other": optax.adamw(sched, b2=0.95, eps=1e-6),
    }  # fmt: skip
    second = jax.tree.map(lambda g: -0.5 * g[::-1] if g.ndim else g, grads)

    def two_steps(tx, g1, g2):
        state = tx.update(g1, tx.init(g1), g1)[1]
        return tx.update(g2, state, g1)[0]

    tx = optimizers.make_optimizer(name, params, lr=1e-2, alpha=1.0, steps=10, warmup_frac=0.0, b2=0.95)
    upd = jax.jit(lambda g1, g2: two_steps(tx, g1, g2))(grads, second)
    labels = jax.tree.leaves(optimizers.param_labels(params))
    by_label = {label: jax.jit(lambda g1, g2, r=ref: two_steps(r, g1, g2)) for label, ref in refs.items()}
    leaves = (jax.tree.leaves(t) for t in (grads, second, upd))
    for g1, g2, u, label in zip(*leaves, labels, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(by_label[label](g1, g2)), rtol=1e-4, atol=1e-7)
    default = optimizers.make_optimizer(name, params, lr=1e-2, alpha=1.0, steps=10, warmup_frac=0.0)
    other = jax.jit(lambda g1, g2: two_steps(default, g1, g2))(grads, second)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(other), strict=True))


def test_state_memory_of_the_groups():
    cfg = model.get_config("9m", vocab_size=258, num_layers=2)
    _, params = _params(cfg)
    adam = optimizers.matrix_state_bytes(optimizers.make_optimizer("adamw", params, steps=10), params)
    n_matrices = 7 * cfg.num_layers
    for level in (1, 2, 3):
        gwt = optimizers.matrix_state_bytes(optimizers.make_optimizer("gwt", params, steps=10, level=level), params)
        assert gwt == adam / 2**level + 2 * 4 * n_matrices  # m, v on 1/2^level of the rows, the limiter's norm and lam
    lion = optimizers.matrix_state_bytes(optimizers.make_optimizer("gwt-lion", params, steps=10, level=2), params)
    assert lion == adam / 2 / 4 + 2 * 4 * n_matrices  # Lion keeps one moment
    rank = optimizers.galore_rank_matching(params, level=2)
    gwt2 = optimizers.matrix_state_bytes(optimizers.make_optimizer("gwt", params, steps=10, level=2), params)

    def galore(r):
        return optimizers.matrix_state_bytes(
            optimizers.make_optimizer("galore", params, steps=10, galore_rank=r), params
        )

    assert galore(rank) <= gwt2 < galore(rank + 1)


# ---------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------


def test_stdlib_source_lists_the_standard_library_and_splits_by_file():
    root, files = data.list_files("stdlib")
    assert root == sysconfig.get_paths()["stdlib"]
    assert len(files) > 100 and all(
        f.endswith(".py") and f.startswith(root) and "site-packages" not in f for f in files
    )
    assert os.path.join(root, "os.py") in files
    split = data.split_files(root, files, 0.05)
    assert sorted(split["train"] + split["validation"]) == files and not set(split["train"]) & set(split["validation"])
    assert 0.02 < len(split["validation"]) / len(files) < 0.08
    assert data.split_files(root, files[::-1], 0.05)["validation"] == sorted(split["validation"])[::-1]


def test_local_files_loader_windows_come_from_the_right_split(corpus):
    spec = data.DataSpec(
        source=os.path.join(corpus, "*.txt"), batch_size=4, seq_len=32, val_fraction=0.25, eval_batches=2
    )
    tok, train_loader, val = data.make_data(spec)
    split = data.split_files(*data.list_files(spec.source), 0.25)

    def text(files):
        return b"".join(open(f, "rb").read() + b"\x00" for f in files)

    train_text, val_text = text(split["train"]), text(split["validation"])
    assert val.shape == (2, 4, 33)
    for row in val.reshape(-1, 33):
        assert bytes(row[row < 256].astype(np.uint8)) in val_text.replace(b"\x00", b"") or tok.eos_id in row
    batch = next(train_loader)
    assert batch.shape == (4, 33) and batch.dtype == np.int32
    for row in batch:
        piece = bytes(row[: np.argmax(row == tok.eos_id) if tok.eos_id in row else None].astype(np.uint8))
        assert piece in train_text and piece not in val_text


def test_window_loader_resumes_exactly_and_reshuffles_each_epoch():
    tokens = np.arange(1000)  # a window is identified by its first token
    a = data.WindowLoader(tokens, batch_size=4, seq_len=10, seed=3)
    batches = [next(a) for _ in range(60)]  # 99 windows -> 24 batches per epoch: crosses two epochs
    b = data.WindowLoader(tokens, batch_size=4, seq_len=10, seed=3)
    b.load_state_dict(json.loads(json.dumps({"position": 30})))
    for want in batches[30:]:
        np.testing.assert_array_equal(next(b), want)
    first_epoch = np.concatenate(batches[:24])[:, 0]
    assert len(set(first_epoch.tolist())) == 96  # no window twice within an epoch
    assert not np.array_equal(batches[0], batches[24])


def _write_c4_like(path, n, seed):
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(
                json.dumps(
                    {
                        "text": _words(60, seed + i) + f" doc{seed + i}",
                        "timestamp": "2019-04-25T12:57:54Z",
                        "url": f"https://example.com/{seed + i}",
                    }
                )
                + "\n"
            )


def test_c4_source_streams_through_datasets_and_resumes(tmp_path):
    _write_c4_like(tmp_path / "train.json", 80, 0)
    _write_c4_like(tmp_path / "validation.json", 20, 1000)
    files = {"train": str(tmp_path / "train.json"), "validation": str(tmp_path / "validation.json")}
    spec = data.DataSpec(
        source="c4", hf_path="json", hf_name=None, hf_data_files=files, batch_size=2, seq_len=64, eval_batches=1
    )
    tok, loader, val = data.make_data(spec)
    assert isinstance(loader, data.StreamLoader) and val.shape == (1, 2, 65)
    val_docs = "".join(json.loads(line)["text"] for line in open(files["validation"]))
    assert tok.decode(val[0, 0, :20]) in val_docs
    batches = [next(loader) for _ in range(6)]
    train_docs = "".join(json.loads(line)["text"] for line in open(files["train"]))
    piece = batches[0][0]
    piece = piece[: np.argmax(piece == tok.eos_id) if tok.eos_id in piece else None]
    assert tok.decode(piece) in train_docs
    state = json.loads(json.dumps(_state_after(data.make_data(spec)[1], 3)))
    resumed = data.make_data(spec)[1]
    resumed.load_state_dict(state)
    for want in batches[3:]:
        np.testing.assert_array_equal(next(resumed), want)


def _state_after(loader, n):
    for _ in range(n):
        next(loader)
    return loader.state_dict()


def test_hf_tokenizer_is_optional():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="transformers"):
            data.get_tokenizer("t5-base")
    else:
        pytest.skip("transformers is installed; loading a tokenizer would need a download")


# ---------------------------------------------------------------------------
# Training, checkpoints, comparison.
# ---------------------------------------------------------------------------


def _png(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_help_shows_every_default():
    for parser in (train.build_parser(), compare.build_parser()):
        text = " ".join(parser.format_help().split())  # undo the line wrapping
        options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert text.count("(default: ") == len(options), parser.prog


def test_default_run_directory_names():
    assert rundir.default_run_dir("gwt-2", 0.0) == os.path.join("runs", "gwt-2-19700101-000000")
    assert train.run_name(train.parse_args(["--optimizer", "gwt", "--level", "3"])) == "gwt-3"
    assert train.run_name(train.parse_args(["--optimizer", "adamw"])) == "adamw"


@pytest.mark.slow
def test_train_checkpoint_resume_is_bit_for_bit(corpus, tmp_path):
    """An interrupted run continued with one flag, ``--resume RUN_DIR``, equals an uninterrupted one."""
    common = TINY + ["--data", corpus, "--optimizer", "gwt", "--steps", "6", "--eval-every", "3"]
    full = train.run(train.parse_args(common + ["--run-dir", str(tmp_path / "a")]))
    run_dir = str(tmp_path / "b")
    first = train.run(train.parse_args(common + ["--run-dir", run_dir, "--save-every", "3", "--stop-at", "3"]))
    second = train.run(train.parse_args(["--resume", run_dir]))

    def losses(h):
        return [r["loss"] for r in h]

    assert losses(first["history"]) + losses(second["history"]) == losses(full["history"])
    assert [r["step"] for r in second["history"]] == [4, 5, 6]
    assert second["summary"]["final_val_loss"] == full["summary"]["final_val_loss"]
    for a, b in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(second["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert full["history"][-1]["loss"] < full["history"][0]["loss"]


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(one_layer):
    graphdef, params, _ = one_layer
    tx = optax.sgd(1.0)
    batch = (np.arange(4 * 33).reshape(4, 33) * 7 % 258).astype(np.int32)

    def copy(t):
        return jax.tree.map(jnp.array, t)

    p1, _, m1 = train.make_train_step(graphdef, tx, 1)(copy(params), tx.init(params), batch)
    p2, _, m2 = train.make_train_step(graphdef, tx, 2)(copy(params), tx.init(params), batch)
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compare_writes_table_and_plot(corpus, tmp_path):
    out = str(tmp_path / "cmp")
    compare.main(
        ["--runs", "adamw", "gwt-2", "--out", out, "--", "--data", corpus, "--steps", "2", "--eval-every", "1"] + TINY
    )
    table = open(os.path.join(out, "results.md")).read().splitlines()
    assert len(table) == 4 and table[2].startswith("| adamw |") and table[3].startswith("| gwt-2 |")
    gwt_matrix_ratio = float(table[3].split("|")[5])
    assert abs(gwt_matrix_ratio - 0.25) < 0.01
    assert _png(os.path.join(out, "val_loss.png"))
    report = json.load(open(os.path.join(out, "results.json")))
    assert [r["name"] for r in report["runs"]] == ["adamw", "gwt-2"] and report["command"].startswith("python -m")
    readme = open(os.path.join(out, "README.md")).read()
    assert report["command"] in readme and "\n".join(table) in readme
    for name in ("adamw", "gwt-2"):
        assert {"config.json", "metrics.jsonl", "checkpoints", "loss.png"} <= set(os.listdir(os.path.join(out, name)))


def test_readme_tables_are_the_saved_results_and_regenerate(tmp_path, monkeypatch, capsys):
    """The study page's results tables are those of results/llama and results/llama-long.

    ``--report --readme`` rewrites one block."""
    monkeypatch.chdir(REPO)
    readme = open("docs/study_records.md").read()  # the tables' page since the README became a front page
    for directory in ("results/llama", "results/llama-long"):
        report = compare.load_report(directory)
        assert compare.table(report["runs"]) in readme and compare.provenance(report) in readme
    start, end = compare.markers("results/llama")
    copy = tmp_path / "README.md"
    copy.write_text(f"before\n{start}\nstale\n{end}\nafter\n")
    compare.main(["--report", "results/llama", "--readme", str(copy)])
    text = copy.read_text()
    assert text.startswith(f"before\n{start}\n") and text.endswith(f"{end}\nafter\n") and "stale" not in text
    assert compare.table(compare.load_report("results/llama")["runs"]) in text
    assert "| gwt-2 |" in capsys.readouterr().out
