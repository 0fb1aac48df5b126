"""``train --diagnostics``: the per-group diagnostics against direct NumPy computations, and on a tiny run."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import pywt
from flax import nnx

import optax_gwt
from examples.llama import diagnostics as diag, rundir, train
from examples.llama.checkpoint import Checkpointer
from optax_gwt import modular
from optax_gwt.models import llama as model

TINY = ["--model", "num_layers=1", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2", "--no-progress"]


def _tree(rng: np.random.Generator, rows: int = 8, layers: int = 2) -> dict:
    """A params-like tree with the model's paths: `layers` blocks (attention, MLP, a norm), embedding, head."""

    def m(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    layer = lambda: {  # noqa: E731
        "attn": {k: {"kernel": m(rows, 6)} for k in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "mlp": {"gate_proj": {"kernel": m(rows, 10)}, "up_proj": {"kernel": m(rows, 10)},
                "down_proj": {"kernel": m(10, 6)}},
        "input_norm": {"scale": m(6)},
    }  # fmt: skip
    blocks = [layer() for _ in range(layers)]
    return {"embed": {"embedding": m(11, 6)}, "layers": blocks, "lm_head": {"kernel": m(6, 11)}}


def _np_groups(tree: dict) -> dict[str, list[np.ndarray]]:
    """The groups written out by hand for `_tree`."""
    layers = tree["layers"]
    return {
        "qk": [np.asarray(lay["attn"][k]["kernel"]) for lay in layers for k in ("q_proj", "k_proj")],
        "vo": [np.asarray(lay["attn"][k]["kernel"]) for lay in layers for k in ("v_proj", "o_proj")],
        "mlp": [np.asarray(lay["mlp"][k]["kernel"]) for lay in layers for k in ("gate_proj", "up_proj", "down_proj")],
        "other": [np.asarray(tree["embed"]["embedding"]), np.asarray(tree["lm_head"]["kernel"])]
        + [np.asarray(lay["input_norm"]["scale"]) for lay in layers],
    }


def _np_lowpass(u: np.ndarray, axis: int, level: int) -> np.ndarray:
    """Block means by a loop over the blocks (a short last block: its sum / B)."""
    b, x = 2**level, np.moveaxis(u, axis, 0)
    out = np.empty_like(x)
    for start in range(0, x.shape[0], b):
        out[start : start + b] = x[start : start + b].sum(axis=0) / b
    return np.moveaxis(out, 0, axis)


def _np_share(mats: list[np.ndarray], axis: int, level: int) -> float:
    mats = [m for m in mats if m.ndim >= 2]
    high = sum(np.sum((m - _np_lowpass(m, axis, level)) ** 2) for m in mats)
    total = sum(np.sum(m**2) for m in mats)
    return float(high / total) if total else 0.0


# ---------------------------------------------------------------------------
# The functions.
# ---------------------------------------------------------------------------


def test_groups_of_the_llama_parameters():
    cfg = model.get_config("9m", vocab_size=258, num_layers=2)
    params = nnx.state(model.Llama(cfg, nnx.Rngs(0)), nnx.Param)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    groups = [diag.param_group(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    names = {g: [n for n, h in zip(paths, groups, strict=True) if h == g] for g in diag.GROUPS}
    assert [len(names[g]) for g in diag.GROUPS] == [4, 4, 6, 3 + 2 * 2]  # embed, final norm, head; 2 norms a layer
    assert all(("q_proj" in n or "k_proj" in n) and "kernel" in n for n in names["qk"])
    assert all(("v_proj" in n or "o_proj" in n) and "kernel" in n for n in names["vo"])
    assert all("mlp" in n for n in names["mlp"]) and not any("['attn']" in n or "['mlp']" in n for n in names["other"])
    assert {len(v) for v in diag.group_leaves(params).values()} == {4, 6, 7}


def test_update_norms_are_the_groups_norms():
    tree = _tree(np.random.default_rng(0))
    got = jax.jit(diag.update_norms)(tree)
    assert set(got) == set(diag.GROUPS)
    for g, mats in _np_groups(tree).items():
        np.testing.assert_allclose(float(got[g]), np.sqrt(sum(np.sum(m.astype(np.float64) ** 2) for m in mats)),
                                   rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("shape", [(7, 5), (8, 3), (5, 9), (1, 4)])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_lowpass_is_the_block_means(shape, axis, level):
    u = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    got = np.asarray(jax.jit(diag.lowpass, static_argnums=(1, 2))(jnp.asarray(u), axis, level))
    np.testing.assert_allclose(got, _np_lowpass(u, axis, level), rtol=1e-5, atol=1e-6)


def test_lowpass_of_an_odd_length_by_hand():
    u = jnp.arange(1.0, 6.0)[:, None]  # 1..5, blocks of 4: [1, 2, 3, 4], [5, 0, 0, 0]
    np.testing.assert_allclose(np.asarray(diag.lowpass(u, 0, 2))[:, 0], [2.5, 2.5, 2.5, 2.5, 1.25])


@pytest.mark.parametrize("axis", [0, 1, {"qk": 1, "vo": 0, "mlp": 1, "other": 0}])
@pytest.mark.parametrize("level", [2, 1])
def test_highfreq_shares_against_numpy(axis, level):
    tree = _tree(np.random.default_rng(2), rows=7)  # an odd length along axis 0
    got = jax.jit(lambda t: diag.highfreq_shares(t, axis, level))(tree)
    assert set(got) == set(diag.GROUPS)
    for g, mats in _np_groups(tree).items():
        ax = axis[g] if isinstance(axis, dict) else axis
        np.testing.assert_allclose(float(got[g]), _np_share(mats, ax, level), rtol=1e-5)
        assert 0.0 < float(got[g]) < 1.0


def test_highfreq_share_is_zero_for_a_zero_or_a_constant_update():
    zero = jax.tree.map(jnp.zeros_like, _tree(np.random.default_rng(3)))
    shares = jax.jit(diag.highfreq_shares)
    assert all(float(v) == 0.0 for v in shares(zero).values())
    shares = shares(jax.tree.map(jnp.ones_like, zero))  # 8 rows: whole blocks of 4
    assert float(shares["qk"]) < 1e-12 and float(shares["vo"]) < 1e-12
    assert "other" in shares and diag.highfreq_shares({"final_norm": {"scale": jnp.ones(4)}}) == {}


def test_highfreq_share_is_the_haar_detail_share():
    """Whole blocks: the energy of the Haar details over the total (PyWavelets, orthonormal Haar)."""
    u = np.random.default_rng(4).normal(size=(16, 6))
    for level in (1, 2, 3):
        coeffs = pywt.wavedec(u, "haar", mode="zero", level=level, axis=0)
        detail = sum(np.sum(d**2) for d in coeffs[1:])
        got = diag.highfreq_shares({"mlp": {"up_proj": {"kernel": jnp.asarray(u, jnp.float32)}}}, 0, level)["mlp"]
        np.testing.assert_allclose(float(got), detail / np.sum(u**2), rtol=1e-5)


def _steps(name: str, params, n: int = 3):
    tx = modular.make_optimizer(name, params, steps=10, warmup_frac=0.0)
    rng = np.random.default_rng(5)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(n):  # one gradient again and again: Adam's uncorrected step grows, the limiter acts
        _, state = update(grads, state, params)
    return state


def test_limiter_scales_per_group():
    params = _tree(np.random.default_rng(7), rows=16, layers=1)  # paths as the model's: the modular groups
    assert set(diag.limiter_scales(jax.jit(modular.make_optimizer("gwt", params, steps=10).init)(params))) == {
        f"limiter_scale_{s}/{g}" for s in ("mean", "max") for g in ("qk", "vo", "mlp")
    }  # before a step: all 1
    state = _steps("gwt", params)
    (limiter,) = diag.limiter_states(state)
    lam = {}  # by hand: the scale leaves that are not MaskedNode, named by their param path
    for path, x in jax.tree_util.tree_leaves_with_path(limiter.scale):
        lam.setdefault(diag.param_group(path), []).append(float(x))
    assert {g: len(v) for g, v in lam.items()} == {"qk": 2, "vo": 2, "mlp": 3}  # the matrices, nothing else
    got = diag.limiter_scales(state)
    for g, values in lam.items():
        np.testing.assert_allclose(float(got[f"limiter_scale_mean/{g}"]), np.mean(values), rtol=1e-6)
        assert float(got[f"limiter_scale_max/{g}"]) == max(values) >= 1.0
    assert max(max(v) for v in lam.values()) > 1.0
    for name in ("adamw-modular", "galore"):
        assert diag.limiter_scales(_steps(name, params, 1)) == {}


def test_collect_has_flat_keys():
    tree = _tree(np.random.default_rng(6))
    keys = set(jax.jit(diag.collect)(tree, optax_gwt.limit_norm_growth().init(tree)))
    assert keys == {f"{k}/{g}" for k in ("update_norm", "highfreq_share") for g in diag.GROUPS} | {
        f"limiter_scale_{s}/{g}" for s in ("mean", "max") for g in diag.GROUPS
    }


# ---------------------------------------------------------------------------
# The CLI: a tiny run's metrics.jsonl against its checkpoints.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "value", "class", "for", "in", "if", "x", "(", ")", ":"]
    for i in range(24):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, size=400)) + f"\nend {i}\n")
    return str(root)


def test_diagnostics_flag_defaults_off_and_resume_keeps_it(tmp_path):
    args = train.parse_args([])
    assert (args.diagnostics, args.diagnostics_axis, args.diagnostics_level) == (False, 0, None)
    assert train._diagnostics(args) is None
    assert "update_norm/G" in " ".join(train.build_parser().format_help().split())
    saved = {k: v for k, v in vars(args).items() if k != "argv"}
    old = {k: v for k, v in saved.items() if not k.startswith("diagnostics")}  # a run dir from before the flag
    for name, flags, want in (("old", old, False), ("new", {**saved, "diagnostics": True}, True)):
        rundir.write_json(str(tmp_path / name / "config.json"), {"args": flags})
        assert train.parse_args(["--resume", str(tmp_path / name)]).diagnostics is want
    on = train.parse_args(["--diagnostics", "--level", "3", "--diagnostics-axis", "1"])
    assert (on.diagnostics, train._diagnostics(on).keywords) == (True, {"axis": 1, "level": 3})


def _checkpoints(args, run_dir: str, steps: int) -> list:
    """``(params, opt_state)`` at steps 0 (a fresh job: the seeded init) to `steps` (the run's checkpoints)."""
    job = train.make_job(args)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    out = [(job.params, job.opt_state)]
    out += [ckpt.restore(job.params, job.opt_state, job.train_data, s)[:2] for s in range(1, steps + 1)]
    ckpt.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["gwt", "adamw-modular"])
def test_tiny_run_records_the_diagnostics(corpus, tmp_path, optimizer):
    run_dir = str(tmp_path / optimizer)
    argv = TINY + ["--data", corpus, "--optimizer", optimizer, "--steps", "2", "--save-every", "1",
                   "--run-dir", run_dir, "--diagnostics", "--lr", "3e-2"]  # fmt: skip
    train.run(train.parse_args(argv))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert json.load(open(os.path.join(run_dir, "config.json")))["args"]["diagnostics"] is True
    states = _checkpoints(train.parse_args(argv), run_dir, len(records))
    limiter = {f"limiter_scale_{s}/{g}" for s in ("mean", "max") for g in ("qk", "vo", "mlp")}
    for r in records:
        (before, _), (after, opt_state) = states[r["step"] - 1], states[r["step"]]
        update = jax.tree.map(lambda a, b: np.asarray(b, np.float64) - np.asarray(a, np.float64), before, after)
        for g, mats in diag.group_leaves(update).items():
            np.testing.assert_allclose(r[f"update_norm/{g}"], np.sqrt(sum(np.sum(m**2) for m in mats)), rtol=1e-3)
            np.testing.assert_allclose(r[f"highfreq_share/{g}"], _np_share(mats, 0, 2), rtol=1e-3, atol=1e-6)
        assert limiter <= set(r) if optimizer == "gwt" else not any(k.startswith("limiter") for k in r)
        for k, v in diag.limiter_scales(opt_state).items():  # the saved state's factors, as recorded
            assert r[k] == pytest.approx(float(v), rel=1e-6) and r[k] >= 1.0
    assert records[0]["update_norm/qk"] == 0.0 < records[1]["update_norm/qk"]  # warm-up: the first lr is 0
    assert {k for k in records[0] if "/" in k} >= {f"{k}/{g}" for k in ("update_norm", "highfreq_share")
                                                    for g in diag.GROUPS}  # fmt: skip
