"""scale_by_adam_mini: an independent NumPy reference, Optax's combinators, GWT's base, state bytes."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt
from optax_gwt import adam_mini

HEADS = 2
B1, B2, EPS = 0.9, 0.95, 1e-8


def _params(dtype=jnp.float32, seed=0):
    """A small transformer-like tree: embeddings, per-head q/k, matrices, a norm, a 3-D kernel, the head."""
    rng = np.random.default_rng(seed)
    shapes = {
        "embed": {"embedding": (10, 8)},
        "layers": {
            "attn": {"q_proj": {"kernel": (8, 8)}, "k_proj": {"kernel": (8, 8)}, "v_proj": {"kernel": (8, 8)}},
            "mlp": {"up": {"kernel": (8, 12)}, "down": {"kernel": (12, 8)}},
            "norm": {"scale": (8,)},
        },
        "conv": {"kernel": (3, 4, 5)},
        "lm_head": {"kernel": (8, 10)},
    }
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s), dtype), shapes, is_leaf=lambda s: isinstance(s, tuple)
    )


def _small(dtype=jnp.float32):
    """Three arrays (a head-blocked query, a matrix, a norm): the combinators' tests."""
    full = _params(dtype)
    return {
        "layers": {k: full["layers"][k] for k in ("norm",)} | {"attn": {"q_proj": full["layers"]["attn"]["q_proj"]}},
        "mlp": full["layers"]["mlp"]["up"],
    }


def _grads(params, seed):
    rng = np.random.default_rng(100 + seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * rng.uniform(0.1, 3.0), p.dtype), params)


# ---------------------------------------------------------------------------
# The NumPy reference: blocks as integer labels of the entries, not reshapes.
# ---------------------------------------------------------------------------


def reference_labels(path, shape):
    """Each entry's block, by the paper's rules written out per entry (Flax (in, out) layout)."""
    idx = np.indices(shape).reshape(len(shape), -1)
    names = adam_mini.path_names(path)
    if names & {"embed", "embedding", "lm_head"}:
        keys = list(idx)  # every entry its own block
    elif len(shape) <= 1:
        keys = []  # one block
    elif names & {"q_proj", "k_proj"}:
        keys = [idx[-1] // (shape[-1] // HEADS)]  # the head of the output column
    else:
        keys = [idx[-1]]  # the output column
    if not keys:
        return np.zeros(int(np.prod(shape)), int)
    return np.unique(np.stack(keys, 1), axis=0, return_inverse=True)[1].reshape(-1)


def reference_trajectory(params, grads_seq, labels_fn=reference_labels, b1=B1, b2=B2, eps=EPS):
    """Adam-mini's updates for a sequence of gradients, in float64, one array at a time."""
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    shapes = [np.shape(x) for x in jax.tree.leaves(params)]
    labels = [labels_fn(p, s) for p, s in zip(paths, shapes, strict=True)]
    m = [np.zeros(int(np.prod(s))) for s in shapes]
    v = [np.zeros(lab.max() + 1) for lab in labels]
    out = []
    for t, grads in enumerate(grads_seq, start=1):
        step = []
        for i, g in enumerate(jax.tree.leaves(grads)):
            g = np.asarray(g, np.float64).reshape(-1)
            m[i] = b1 * m[i] + (1 - b1) * g
            block_mean = np.bincount(labels[i], g * g) / np.bincount(labels[i])
            v[i] = b2 * v[i] + (1 - b2) * block_mean
            v_hat = v[i][labels[i]] / (1 - b2**t)
            step.append((m[i] / (1 - b1**t) / (np.sqrt(v_hat) + eps)).reshape(shapes[i]))
        out.append(jax.tree.unflatten(jax.tree.structure(params), step))
    return out


def _close(a, b, rtol=1e-6, atol=1e-7):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def _trajectory(tx, params, grads_seq):
    state, step, out = tx.init(params), jax.jit(tx.update), []
    for g in grads_seq:
        u, state = step(g, state, params)
        out.append(u)
    return out, state


def _mini(**kw):
    return optax_gwt.scale_by_adam_mini(B1, B2, EPS, block_axes=optax_gwt.adam_mini_blocks(num_heads=HEADS), **kw)


# ---------------------------------------------------------------------------
# Against the reference.
# ---------------------------------------------------------------------------


def test_matches_numpy_reference_float64(x64):
    params = _params(jnp.float64)
    grads_seq = [_grads(params, s) for s in range(6)]
    got, state = _trajectory(_mini(), params, grads_seq)
    for g, want in zip(got, reference_trajectory(params, grads_seq), strict=True):
        _close(g, want, rtol=1e-12, atol=1e-14)
    nu = state.nu
    assert nu["layers"]["attn"]["q_proj"]["kernel"].shape == (1, HEADS, 1)
    assert nu["layers"]["mlp"]["down"]["kernel"].shape == (1, 8)
    assert nu["layers"]["norm"]["scale"].shape == (1,)
    assert nu["conv"]["kernel"].shape == (1, 1, 5)
    assert nu["embed"]["embedding"].shape == (10, 8) and nu["lm_head"]["kernel"].shape == (8, 10)


def test_user_partitions_match_reference(x64):
    """Axes from a user function (PyTorch's (out, in) layout: one value per row), and per-entry = Adam."""
    params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((6, 4)))}
    grads_seq = [_grads(params, s) for s in range(4)]
    rows = lambda path, shape: np.repeat(np.arange(shape[0]), shape[1])  # noqa: E731
    got, _ = _trajectory(optax_gwt.scale_by_adam_mini(B1, B2, EPS, block_axes=lambda p, x: (1,)), params, grads_seq)
    for g, want in zip(got, reference_trajectory(params, grads_seq, rows), strict=True):
        _close(g, want, rtol=1e-12, atol=1e-14)
    torch_layout = optax_gwt.scale_by_adam_mini(B1, B2, EPS, block_axes=optax_gwt.adam_mini_blocks(output_axis=0))
    _close(_trajectory(torch_layout, params, grads_seq)[0], got, rtol=0, atol=0)
    per_entry, _ = _trajectory(
        optax_gwt.scale_by_adam_mini(B1, B2, EPS, block_axes=lambda p, x: None), params, grads_seq
    )
    adam, _ = _trajectory(optax.scale_by_adam(B1, B2, EPS), params, grads_seq)
    _close(per_entry, adam, rtol=1e-12, atol=1e-14)


def test_head_blocks_on_the_input_axis(x64):
    """Heads cut any axis: a PyTorch (heads * head_dim, in) query, one value per head."""
    params = {"attn": {"wq": jnp.asarray(np.random.default_rng(2).standard_normal((6, 5)))}}
    grads_seq = [_grads(params, s) for s in range(3)]
    tx = optax_gwt.scale_by_adam_mini(B1, B2, EPS, block_axes=lambda p, x: optax_gwt.head_blocks(x, 3, head_axis=0))
    got, state = _trajectory(tx, params, grads_seq)
    heads = lambda path, shape: np.repeat(np.arange(3), 2 * 5)  # noqa: E731
    for g, want in zip(got, reference_trajectory(params, grads_seq, heads), strict=True):
        _close(g, want, rtol=1e-12, atol=1e-14)
    assert state.nu["attn"]["wq"].shape == (3, 1, 1)


def test_bad_partition_is_refused():
    tx = optax_gwt.scale_by_adam_mini(block_axes=lambda p, x: optax_gwt.head_blocks(x, 3))
    with pytest.raises(ValueError, match="cannot cut axis 1 into 3 heads"):
        tx.init({"q": jnp.zeros((4, 8))})


def test_mu_dtype_and_bfloat16_gradients():
    params = {"w": jnp.zeros((8, 4), jnp.bfloat16)}
    tx = optax_gwt.scale_by_adam_mini(mu_dtype=jnp.float32)
    u, state = tx.update({"w": jnp.ones((8, 4), jnp.bfloat16)}, tx.init(params))
    assert u["w"].dtype == jnp.bfloat16 and state.mu["w"].dtype == jnp.float32 and state.nu["w"].dtype == jnp.float32


# ---------------------------------------------------------------------------
# Optax's combinators and flax.nnx.Optimizer.
# ---------------------------------------------------------------------------


def _apply(tx, params, grads_seq):
    state = tx.init(params)
    for g in grads_seq:
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def test_chain_with_learning_rate():
    params = _small()
    grads_seq = [_grads(params, s) for s in range(3)]
    got, _ = _trajectory(optax.chain(_mini(), optax.scale_by_learning_rate(0.1)), params, grads_seq)
    want = reference_trajectory(params, grads_seq)
    for g, w in zip(got, want, strict=True):
        _close(g, jax.tree.map(lambda x: -0.1 * x, w), rtol=2e-5, atol=1e-6)


def test_multi_transform_group_equals_alone():
    params = _params()
    labels = {k: ("mini" if k == "layers" else "adam") for k in params}
    tx = optax.multi_transform({"mini": _mini(), "adam": optax.scale_by_adam()}, labels)
    grads_seq = [_grads(params, s) for s in range(3)]
    got, state = _trajectory(tx, params, grads_seq)
    alone, _ = _trajectory(_mini(), params["layers"], [g["layers"] for g in grads_seq])
    _close([g["layers"] for g in got], alone)
    assert state.inner_states["mini"].inner_state.nu["layers"]["attn"]["q_proj"]["kernel"].shape == (1, HEADS, 1)


def test_masked_passes_others_through():
    params = _params()
    mask = jax.tree_util.tree_map_with_path(lambda path, x: "mlp" in adam_mini.path_names(path), params)
    tx = optax.masked(_mini(), mask)
    g = _grads(params, 0)
    u, _ = tx.update(g, tx.init(params), params)
    np.testing.assert_array_equal(u["embed"]["embedding"], g["embed"]["embedding"])
    want = reference_trajectory(params, [g])[0]
    _close(u["layers"]["mlp"], want["layers"]["mlp"], rtol=1e-5)


def test_multisteps_equals_mean_gradient():
    params = _small()
    tx = optax.MultiSteps(_mini(), every_k_schedule=2)
    g1, g2 = _grads(params, 1), _grads(params, 2)
    state, step = tx.init(params), jax.jit(tx.update)
    u0, state = step(g1, state, params)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u0))
    u, _ = step(g2, state, params)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
    _close(u, reference_trajectory(params, [mean])[0], rtol=1e-5, atol=1e-6)


def test_apply_if_finite_skips_a_nan_step():
    params = _small()
    tx = optax.apply_if_finite(_mini(), max_consecutive_errors=2)
    step = jax.jit(tx.update)
    _, state = step(_grads(params, 0), tx.init(params), params)
    bad = _grads(params, 1)
    bad["mlp"]["kernel"] = bad["mlp"]["kernel"].at[0, 0].set(jnp.nan)
    u, new_state = step(bad, state, params)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u))
    _close(new_state.inner_state, state.inner_state, rtol=0, atol=0)
    assert int(new_state.notfinite_count) == 1


def test_inject_hyperparams():
    params = _small()
    make = optax.inject_hyperparams(optax_gwt.scale_by_adam_mini, static_args=("block_axes", "mu_dtype"))
    tx = make(b1=B1, b2=B2, eps=EPS, block_axes=optax_gwt.adam_mini_blocks(num_heads=HEADS))
    grads_seq = [_grads(params, s) for s in range(3)]
    got, state = _trajectory(tx, params, grads_seq)
    _close(got, reference_trajectory(params, grads_seq), rtol=2e-5, atol=1e-6)
    assert float(state.hyperparams["b2"]) == pytest.approx(B2)


@pytest.mark.slow
def test_flax_nnx_optimizer():
    nnx = pytest.importorskip("flax.nnx")

    class Attn(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(8, 8, use_bias=False, rngs=rngs)
            self.out = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.q_proj(x)))

    model = Attn(nnx.Rngs(0))
    tx = optax.chain(_mini(), optax.scale_by_learning_rate(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = jax.random.normal(jax.random.key(1), (32, 8)), jax.random.normal(jax.random.key(2), (32, 3))
    loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    params0 = nnx.state(model, nnx.Param)
    u, _ = tx.update(nnx.grad(loss_fn)(model), tx.init(params0), params0)
    expected = optax.apply_updates(params0, u)

    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    first = float(train_step(model, optimizer))
    _close(nnx.state(model, nnx.Param), expected, rtol=1e-5, atol=1e-6)
    losses = [float(train_step(model, optimizer)) for _ in range(5)]
    assert losses[-1] < first
    nu = optimizer.opt_state[0].nu
    assert nu["q_proj"]["kernel"].shape == (1, HEADS, 1) and nu["out"]["kernel"].shape == (1, 3)


# ---------------------------------------------------------------------------
# As GWT's base, and its state's size.
# ---------------------------------------------------------------------------


def test_gwt_base_runs_adam_mini_on_the_approximation(x64):
    params = {
        "layers": {"attn": {"q_proj": {"kernel": jnp.asarray(np.random.default_rng(3).standard_normal((16, 8)))}}},
        "mlp": {"kernel": jnp.asarray(np.random.default_rng(4).standard_normal((16, 12)))},
    }
    tx = optax_gwt.scale_by_gwt(_mini(), level=2, detail_rule="norm_ratio")
    grads_seq = [_grads(params, s) for s in range(4)]
    _, state = _trajectory(tx, params, grads_seq)
    inner = state[1].inner_state
    assert inner.mu["mlp"]["kernel"].shape == (4, 12) and inner.nu["mlp"]["kernel"].shape == (1, 12)
    assert inner.nu["layers"]["attn"]["q_proj"]["kernel"].shape == (1, HEADS, 1)
    # Its state is Adam-mini's on the level-2 Haar approximation of each gradient.
    approx = lambda g: jax.tree.map(lambda x: optax_gwt.wavedec(x, "haar", "zero", level=2, axis=0)[0], g)  # noqa: E731
    _, alone = _trajectory(_mini(), approx(params), [approx(g) for g in grads_seq])
    _close(inner, alone, rtol=1e-10, atol=1e-12)


def test_gwt_base_trains():
    target = jnp.asarray(np.random.default_rng(5).standard_normal((32, 16)), jnp.float32)
    params = {"w": jnp.zeros((32, 16))}
    tx = optax.chain(
        optax_gwt.scale_by_gwt(optax_gwt.scale_by_adam_mini(), level=2, detail_rule="norm_ratio"),
        optax.scale_by_learning_rate(3e-2),
    )
    loss = lambda p: jnp.mean((p["w"] - target) ** 2)  # noqa: E731
    state, step = tx.init(params), jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
    start = float(loss(params))
    for _ in range(60):
        u, state = step(params, state)
        params = optax.apply_updates(params, u)
    assert float(loss(params)) < 0.5 * start


def test_state_bytes():
    params = _params()
    got = optax_gwt.optimizer_state_bytes(_mini(), params)
    per = got.per_param
    assert per["layers"]["mlp"]["up"]["kernel"] == 4 * (8 * 12 + 12)
    assert per["layers"]["attn"]["q_proj"]["kernel"] == 4 * (8 * 8 + HEADS)
    assert per["layers"]["norm"]["scale"] == 4 * (8 + 1)
    assert per["embed"]["embedding"] == 4 * 2 * 10 * 8  # full Adam
    assert got.shared == 4  # the step count
    adam = optax_gwt.optimizer_state_bytes(optax.scale_by_adam(), params).total
    assert got.total < adam
    gwt_mini = optax_gwt.scale_by_gwt(_mini(), level=2, detail_rule="norm_ratio")
    w = {"mlp": {"kernel": jax.ShapeDtypeStruct((64, 32), jnp.float32)}}
    gwt_bytes = optax_gwt.optimizer_state_bytes(gwt_mini, w).per_param["mlp"]["kernel"]
    assert gwt_bytes == 4 * (16 * 32 + 32) + 2 * 4  # m on the approximation, v per column, the limiter's norm, lam


def test_docstring_examples_run():
    result = doctest.testmod(adam_mini, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
