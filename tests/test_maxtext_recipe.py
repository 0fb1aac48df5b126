"""The MaxText recipe's optimizer (`benchmarks.maxtext_run.layer_matrices`), without MaxText:
kernels laid out as MaxText scans them, ``(embed, layers, mlp)``; and the text comparison's
data and table (`benchmarks.maxtext_text`)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_gwt
from benchmarks.maxtext_run import layer_matrices

ADAM = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def _steps(tx, params, grads):
    state, out = tx.init(params), None
    for g in grads:
        out, state = jax.jit(tx.update)(g, state, params)
    return out, state


@pytest.mark.parametrize("env", [{}, {"GWT_DETAIL_CLIP": "none"}, {"GWT_RECIPE": "foam"}], ids=["gwt", "paper", "foam"])
def test_each_layer_is_a_matrix_of_its_own(env):
    """The layer axis (1) is a batch axis: each layer's kernel steps as it would alone, with
    its own limiter norm, along its longest own axis (mlp)."""
    rng = np.random.default_rng(0)
    params = {"kernel": jnp.asarray(rng.standard_normal((16, 3, 64)), jnp.float32)}
    grads = [{"kernel": jnp.asarray(rng.uniform(0.5, 4, (1, 3, 1)) * rng.standard_normal((16, 3, 64)), jnp.float32)}
             for _ in range(4)]  # fmt: skip
    tx = layer_matrices(1e-2, ADAM, scan_axis=1, env=env)
    got, state = _steps(tx, params, grads)
    assert any(x.shape == (16, 3, 16) for x in jax.tree.leaves(state))  # mlp 64 -> 16 at level 2
    if "GWT_RECIPE" not in env:
        assert any(x.shape == (3,) for x in jax.tree.leaves(state))  # one limiter norm per layer
    for layer in range(3):
        alone = layer_matrices(1e-2, ADAM, scan_axis=None, env=env)
        one = [{"kernel": g["kernel"][:, layer]} for g in grads]
        want, _ = _steps(alone, {"kernel": params["kernel"][:, layer]}, one)
        np.testing.assert_allclose(got["kernel"][:, layer], want["kernel"], rtol=2e-5, atol=1e-7)


def test_the_default_bounds_the_details_and_none_is_the_papers():
    default = layer_matrices(1.0, ADAM, scan_axis=1, env={})
    paper = layer_matrices(1.0, ADAM, scan_axis=1, env={"GWT_DETAIL_CLIP": "none"})
    g = {"kernel": jnp.asarray(np.random.default_rng(1).standard_normal((16, 3, 64)), jnp.float32)}
    bounded, _ = _steps(default, g, [g] * 5)
    unbounded, _ = _steps(paper, g, [g] * 5)
    scale = 0.25
    assert float(jnp.abs(bounded["kernel"]).max()) <= scale * (optax_gwt.SAFE_DETAIL_CLIP + 1)
    assert float(jnp.abs(unbounded["kernel"]).max()) > 10 * scale * optax_gwt.SAFE_DETAIL_CLIP


def test_the_text_comparison_writes_windows_of_the_corpus_split_by_file(tmp_path, monkeypatch):
    """`benchmarks.maxtext_text.write_corpus`: training windows from the training files only,
    validation windows from the validation files only, each `SEQ_LEN` bytes."""
    from benchmarks import maxtext_text
    from examples.llama import data

    for i in range(40):  # a small corpus of distinct files, so that both splits are found
        (tmp_path / f"m{i}.py").write_text("".join(f"value_{i}_{j} = {j * i}\n" for j in range(60)))
    monkeypatch.setattr(data, "list_files", lambda source: (str(tmp_path), sorted(map(str, tmp_path.glob("*.py")))))
    out = tmp_path / "out"
    out.mkdir()
    maxtext_text.write_corpus(out, windows=50, eval_windows=8)
    split = data.split_files(str(tmp_path), sorted(map(str, tmp_path.glob("*.py"))), 0.05)
    for name, count in (("train", 50), ("validation", 8)):
        text = "".join(data.read_text(f) for f in split[name])
        windows = [json.loads(line)["text"] for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert len(windows) == count
        assert all(len(w.encode()) == maxtext_text.SEQ_LEN and w in text for w in windows)


def test_the_text_comparison_table_names_each_optimizers_best_and_spread():
    from benchmarks import maxtext_text

    def run(curve):
        return {"eval_losses": curve, "layer_kernels_bytes": 100}

    one = {"lrs": {0.01: 2.0, 0.03: 1.5}, "best_lr": 0.03, "finals": [1.5, 1.6, 1.7], "curve": run({0: 5.0, 300: 1.5})}
    r = {name: one for name in maxtext_text.OPTIMIZERS}
    table = maxtext_text.markdown(r)
    assert "| 0.03 | 1.600 ± 0.100 | 1.000x |" in table
    assert "| 300 | 1.500 | 1.500 | 1.500 |" in table
