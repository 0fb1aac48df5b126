"""GWT composes with Optax's combinators and with flax.nnx.Optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt


def hand_gwt_adamw(learning_rate, level=2, weight_decay=None):
    """`gwt_adamw` written as the chain of public stages, as a user would."""
    proj = optax_gwt.WaveletProjection(level=level)
    stages = [
        optax_gwt.wavelet_project(proj),
        optax_gwt.on_approximation(optax_gwt.scale_by_reference_adam(eps=1e-6), proj),
        optax_gwt.limit_norm_growth(1.01),
        optax_gwt.wavelet_inverse(scale=0.25),
        optax.scale_by_learning_rate(learning_rate),
    ]
    if weight_decay is not None:
        stages.append(optax_gwt.decay_weights_after_step(learning_rate, weight_decay))
    return optax.chain(*stages)


@pytest.fixture(params=["builder", "hand_chain", "foam"])
def make(request):
    """Each composition runs with the builder, with the hand-built chain and with FOAM's builder."""
    return {"builder": optax_gwt.gwt_adamw, "hand_chain": hand_gwt_adamw, "foam": optax_gwt.foam_adamw}[request.param]


def _moments(state):
    """The base's state inside any composition (the OnApproximationState's)."""
    found = [
        s
        for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, optax_gwt.OnApproximationState))
        if isinstance(s, optax_gwt.OnApproximationState)
    ]
    return found[0].inner_state


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "attn": {"kernel": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)},
        "mlp": {"kernel": jnp.asarray(rng.standard_normal((12, 16)), jnp.float32)},
        "norm": {"scale": jnp.ones((8,), jnp.float32)},
        "embed": {"embedding": jnp.asarray(rng.standard_normal((10, 8)), jnp.float32)},
    }


def _grads(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)


def _run(opt, params, steps=3, seed=1):
    state = opt.init(params)
    step = jax.jit(opt.update)
    for i in range(steps):
        u, state = step(_grads(params, seed + i), state, params)
        params = optax.apply_updates(params, u)
    return params, state


def _assert_tree_close(a, b, rtol=1e-6, atol=1e-7):
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b
    )


def test_chain_equals_parts():
    """chain(scale_by_gwt, scale_by_learning_rate) is gwt_adamw."""
    params = _tree()
    direct, _ = _run(optax_gwt.gwt_adamw(1e-2, level=1), params)
    chained, _ = _run(optax.chain(optax_gwt.scale_by_gwt(level=1), optax.scale_by_learning_rate(1e-2)), params)
    _assert_tree_close(direct, chained, rtol=0, atol=0)
    clipped, _ = _run(optax.chain(optax.clip_by_global_norm(1.0), optax_gwt.gwt_adamw(1e-2)), params)
    assert jax.tree_util.tree_structure(clipped) == jax.tree_util.tree_structure(params)


def _label(path, _):
    keys = [getattr(k, "key", None) for k in path]
    return "gwt" if ("attn" in keys or "mlp" in keys) and keys[-1] == "kernel" else "adam"


def test_multi_transform_modular_learning_rates(make):
    params = _tree()
    labels = jax.tree_util.tree_map_with_path(_label, params)
    opt = optax.multi_transform(
        {"gwt": make(1e-2 * 0.25, level=2), "adam": optax.adamw(1e-2, eps=1e-6, weight_decay=0.0)}, labels
    )
    out, state = _run(opt, params)
    moments = _moments(state.inner_states["gwt"])
    assert moments.mu["attn"]["kernel"].shape == (4, 8)
    assert moments.mu["mlp"]["kernel"].shape == (3, 16)
    # Each group equals its optimizer run alone on its own subtree.
    sub = {"attn": params["attn"], "mlp": params["mlp"]}
    alone_state = make(1e-2 * 0.25, level=2).init(sub)
    p = sub
    for i in range(3):
        g = _grads(params, 1 + i)
        u, alone_state = make(1e-2 * 0.25, level=2).update({"attn": g["attn"], "mlp": g["mlp"]}, alone_state, p)
        p = optax.apply_updates(p, u)
    _assert_tree_close({"attn": out["attn"], "mlp": out["mlp"]}, p)


def test_masked_leaves_others_untouched(make):
    params = _tree()
    mask = jax.tree_util.tree_map_with_path(lambda path, _: _label(path, _) == "gwt", params)
    opt = optax.masked(make(1e-2), mask)
    state = opt.init(params)
    g = _grads(params, 3)
    u, _ = opt.update(g, state, params)
    # optax.masked passes the masked-out updates through unchanged.
    np.testing.assert_array_equal(u["norm"]["scale"], g["norm"]["scale"])
    assert not np.allclose(u["attn"]["kernel"], g["attn"]["kernel"])


def test_inject_hyperparams_changes_lr_without_recompiling(make):
    params = _tree()
    static = {optax_gwt.gwt_adamw: optax_gwt.STATIC_ARGS, optax_gwt.foam_adamw: optax_gwt.FOAM_STATIC_ARGS}.get(
        make, ("level",)
    )
    opt = optax.inject_hyperparams(make, static_args=static)(learning_rate=1e-2, level=2)
    state = opt.init(params)
    traces = []

    @jax.jit
    def step(state, g):
        traces.append(1)
        return opt.update(g, state, params)

    g = _grads(params, 5)
    u1, _ = step(state, g)
    state = state._replace(hyperparams={**state.hyperparams, "learning_rate": jnp.asarray(2e-2, jnp.float32)})
    u2, _ = step(state, g)
    assert len(traces) == 1
    _assert_tree_close(u2, jax.tree_util.tree_map(lambda x: 2 * x, u1))
    # The same as the un-injected optimizer.
    u_ref, _ = make(1e-2, level=2).update(g, make(1e-2, level=2).init(params), params)
    _assert_tree_close(u1, u_ref, rtol=1e-4, atol=1e-6)  # float32, jit vs eager, traced constants


def test_schedule_learning_rate(make):
    params = _tree()
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    out, _ = _run(make(sched), params, steps=4)
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(out))
    # Step 1 has learning rate 0: nothing moves.
    first, _ = _run(make(sched), params, steps=1)
    _assert_tree_close(first, params, rtol=0, atol=0)


def test_multisteps_equals_mean_gradient(make):
    params = _tree()
    inner = make(1e-2)
    acc = optax.MultiSteps(inner, every_k_schedule=2)
    state = acc.init(params)
    g1, g2 = _grads(params, 7), _grads(params, 8)
    u0, state = acc.update(g1, state, params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree_util.tree_leaves(u0))
    u, state = acc.update(g2, state, params)
    mean = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, g1, g2)
    want, _ = inner.update(mean, inner.init(params), params)
    _assert_tree_close(u, want, rtol=1e-4, atol=1e-6)  # float32 sums in another order


def test_apply_if_finite_skips_bad_steps(make):
    params = _tree()
    opt = optax.apply_if_finite(make(1e-2), max_consecutive_errors=3)
    state = opt.init(params)
    good = _grads(params, 9)
    _, state = opt.update(good, state, params)
    bad = jax.tree_util.tree_map(lambda x: x, good)
    bad["attn"]["kernel"] = bad["attn"]["kernel"].at[3, 2].set(jnp.nan)
    u, new_state = opt.update(bad, state, params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree_util.tree_leaves(u))
    _assert_tree_close(new_state.inner_state, state.inner_state, rtol=0, atol=0)
    assert int(new_state.notfinite_count) == 1


@pytest.mark.slow
def test_flax_nnx_optimizer(make):
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.down = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    model = MLP(nnx.Rngs(0))
    tx = make(1e-2, level=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (64, 16))
    y = jax.random.normal(jax.random.key(2), (64, 4))

    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    # The same step done functionally, from the same initial params.
    params0 = nnx.state(model, nnx.Param)
    grads0 = nnx.grad(loss_fn)(model)
    u, _ = tx.update(grads0, tx.init(params0), params0)
    expected = optax.apply_updates(params0, u)

    losses = [float(train_step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    gwt_state = jax.tree_util.tree_leaves(
        optimizer.opt_state, is_leaf=lambda s: isinstance(s, optax_gwt.OnApproximationState)
    )
    assert any(isinstance(s, optax_gwt.OnApproximationState) for s in gwt_state)

    fresh = MLP(nnx.Rngs(0))
    fresh_opt = nnx.Optimizer(fresh, tx, wrt=nnx.Param)
    train_step(fresh, fresh_opt)
    _assert_tree_close(nnx.state(fresh, nnx.Param), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["lion", "rms", "factored_rms", "muon"])
def test_other_base_optimizers(name):
    """Any Optax scaling can be the base; its state is built on the compressed shapes."""
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)), jnp.float32)}
    base, kw = {
        "lion": (optax.scale_by_lion(), {}),
        # RMSProp has no momentum and no bias correction: b1 = b2 = 0 says so to rule "adam".
        "rms": (optax.scale_by_rms(), dict(b1=0.0, b2=0.0)),
        "factored_rms": (optax.scale_by_factored_rms(min_dim_size_to_factor=8), {}),
        "muon": (
            optax.contrib.scale_by_muon(
                weight_dimension_numbers=lambda t: jax.tree_util.tree_map(
                    lambda _: optax.contrib.MuonDimensionNumbers(), t
                )
            ),
            {},
        ),
    }[name]
    opt = optax.chain(optax_gwt.scale_by_gwt(base, level=2, **kw), optax.scale_by_learning_rate(1e-3))
    state = opt.init(params)
    shapes = [x.shape for x in jax.tree_util.tree_leaves(state) if x.ndim]
    assert max(int(np.prod(s)) for s in shapes) <= 64 * 32 // 4, shapes
    target = jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)), jnp.float32)

    def loss(p):
        return jnp.mean((p["w"] - target) ** 2)

    step = jax.jit(lambda p, s: (lambda g: opt.update(g, s, p))(jax.grad(loss)(p)))
    start = float(loss(params))
    for _ in range(50):
        u, state = step(params, state)
        params = optax.apply_updates(params, u)
    assert float(loss(params)) < start
