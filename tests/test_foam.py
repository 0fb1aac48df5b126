"""FOAM (optax_gwt.foam) and its two ideas as GWT options, against the NumPy float64
reference written from the authors' PyTorch optimizer (reference.ReferenceFOAM)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_gwt
from reference import ReferenceFOAM, ReferenceGWTAdamW, problem, run_both

# Odd and even lengths along the fold axis (37 is not a multiple of 2, 4 or 8), a vector.
SHAPES = {"w": (37, 6), "v": (16, 5), "sq": (8, 8), "bias": (7,)}


def _assert_close(got, want, rtol=1e-9, atol=1e-12):
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_trajectory_equals_reference_float64(level, weight_decay):
    kw = dict(level=level, weight_decay=weight_decay)
    got, want, _ = run_both(optax_gwt.foam_adamw(3e-2, **kw), ReferenceFOAM(lr=3e-2, **kw), SHAPES, steps=6)
    _assert_close(got, want)


@pytest.mark.usefixtures("x64")
def test_authors_script_settings_schedule_and_other_axis():
    """beta2 0.95, scale 0.25, res_scale 0.5, a warm-up schedule, the fold along axis 1."""
    sched = optax.linear_schedule(2.0**-10, 2.0**-6, 4)  # values exact in float32, as optax computes them
    kw = dict(b2=0.95, eps=1e-6, weight_decay=0.1, level=2, scale=0.25)
    opt = optax_gwt.foam_adamw(sched, **kw, residual_scale=0.5, axis=1)
    ref = ReferenceFOAM(**kw, res_scale=0.5, axis=1)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s) for k, s in {"w": (6, 37), "b": (5,)}.items()}
    want, got = dict(params), jax.tree.map(jnp.asarray, params)
    state, update = opt.init(got), jax.jit(opt.update)
    for t in range(6):
        grads = {k: rng.uniform(0.2, 5.0) * rng.standard_normal(p.shape) for k, p in params.items()}
        ref.lr = float(sched(t))
        want = ref.step(want, grads)
        u, state = update(jax.tree.map(jnp.asarray, grads), state, got)
        got = optax.apply_updates(got, u)
    _assert_close(got, want)


@pytest.mark.usefixtures("x64")
def test_bfloat16_moments_round_like_the_reference():
    """bfloat16 state: the moments are rounded after each step, as the reference's are. At
    level 2 the approximation's units are the block mean times 2, a power of two, so both
    round the same numbers: the stored moments are equal. The update's scalar factors are
    float32 with float32-or-narrower moments, and ``1 - b2^t`` loses about 1e-5 of its
    relative precision in float32 at t = 1, so the params agree to 1e-5 of what they moved."""
    kw = dict(level=2, weight_decay=0.1)
    opt = optax_gwt.foam_adamw(1e-2, **kw, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
    ref = ReferenceFOAM(lr=1e-2, **kw, moment_dtype=ml_dtypes.bfloat16)
    start, _ = problem(SHAPES)
    got, want, state = run_both(opt, ref, SHAPES, steps=5)
    inner = state[0][1].inner_state
    assert inner.nu["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(inner.mu["w"], np.float64).T / 2, ref.state["w"]["m"])
    np.testing.assert_array_equal(np.asarray(inner.nu["w"], np.float64).T / 4, ref.state["w"]["v"])
    for k in want:
        moved = np.abs(want[k] - start[k]).max()
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=0, atol=1e-5 * moved, err_msg=k)


def test_float32_close_to_the_float64_reference():
    """float32 params and state: within float32 rounding of the params (4 steps)."""
    shapes = {"w": (36, 6), "bias": (6,)}
    got, want, _ = run_both(optax_gwt.foam_adamw(1e-2), ReferenceFOAM(lr=1e-2), shapes, steps=4, dtype=np.float32)
    assert got["w"].dtype == np.float32
    for k in want:
        bound = 4 * np.finfo(np.float32).eps * np.abs(want[k]).max()
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=0, atol=bound, err_msg=k)


def test_state_is_a_quarter_of_adams_at_level_2():
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    foam = optax_gwt.optimizer_state_bytes(optax_gwt.foam_adamw(1e-2), params)
    adam = optax_gwt.optimizer_state_bytes(optax.adamw(1e-2), params)
    inner = optax_gwt.foam_adamw(1e-2).init(params)[0][1].inner_state
    assert inner.mu["w"].shape == inner.nu["w"].shape == (16, 32)
    assert inner.mu["b"].shape == (32,)
    # Moments: (16 * 32 + 32) * 2 floats against (64 * 32 + 32) * 2; counts are a few scalars.
    assert foam.total < 0.27 * adam.total


@pytest.mark.usefixtures("x64")
def test_energy_second_moment_alone_in_gwt():
    """GWT's chain with FOAM's second moment only (the limiter and the Adam detail rule kept)."""
    kw = dict(level=2, weight_decay=0.1)
    opt = optax_gwt.gwt_adamw(3e-2, **kw, second_moment="energy")
    got, want, _ = run_both(opt, ReferenceGWTAdamW(lr=3e-2, **kw, second_moment="energy"), SHAPES)
    _assert_close(got, want)


@pytest.mark.usefixtures("x64")
def test_residual_rule_alone_in_gwt():
    """GWT's chain with FOAM's residual rule only (the second moment of the block mean)."""
    opt = optax_gwt.gwt_adamw(3e-2, eps=1e-8, level=2, norm_growth_limit=None, detail_rule="residual")
    got, want, _ = run_both(opt, ReferenceFOAM(lr=3e-2, level=2, energy=False), SHAPES)
    _assert_close(got, want)


def test_stages_by_hand_equal_the_builder_bit_for_bit():
    proj = optax_gwt.WaveletProjection(level=2)
    hand = optax.chain(
        optax_gwt.wavelet_project(proj),
        optax_gwt.on_approximation(optax_gwt.scale_by_reference_adam(eps=1e-8, second_moment="energy"), proj),
        optax_gwt.wavelet_inverse(scale=0.25, detail_rule="residual"),
        optax.scale_by_learning_rate(1e-2),
    )
    built = optax_gwt.foam_adamw(1e-2)
    params = {"w": jnp.ones((20, 8)), "b": jnp.zeros(8)}
    s_hand, s_built = hand.init(params), built.init(params)
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = {k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in params.items()}
        u_hand, s_hand = jax.jit(hand.update)(g, s_hand, params)
        u_built, s_built = jax.jit(built.update)(g, s_built, params)
        for k in params:
            np.testing.assert_array_equal(np.asarray(u_hand[k]), np.asarray(u_built[k]))


def test_constant_blocks_make_foam_plain_adam_on_the_blocks():
    """Gradients constant on each block have no residual and an energy equal to the mean's
    square: FOAM's update is then Adam's on the block means, repeated (an independent check)."""
    g = jnp.repeat(jnp.arange(1.0, 5.0)[:, None] * jnp.array([1.0, -2.0]), 4, axis=0)  # (16, 2), blocks of 4
    foam = optax_gwt.foam_adamw(1.0, scale=1.0)
    adam = optax.adam(1.0, eps=1e-8, eps_root=0.0)
    u, _ = foam.update({"w": g}, foam.init({"w": g}), {"w": g})
    mean = g[::4]
    want, _ = adam.update(mean, adam.init(mean))
    np.testing.assert_allclose(np.asarray(u["w"]), np.repeat(np.asarray(want), 4, axis=0), rtol=1e-5)


@pytest.mark.parametrize("build", ["energy", "residual"])
def test_ideas_need_haar_blocks(build):
    kw = {"energy": dict(second_moment="energy"), "residual": dict(detail_rule="residual")}[build]
    tx = optax_gwt.gwt_adamw(1e-2, wavelet="db2", **kw)
    params = {"w": jnp.ones((16, 4))}
    with pytest.raises(ValueError, match=r"\['w'\].*needs Haar blocks"):
        tx.update(params, tx.init(params), params)


def test_second_moment_is_checked():
    with pytest.raises(ValueError, match="second_moment must be one of"):
        optax_gwt.scale_by_reference_adam(second_moment="mean")
    with pytest.raises(ValueError, match="with a given base"):
        optax_gwt.scale_by_gwt(optax.scale_by_adam(), second_moment="energy")
    with pytest.raises(ValueError, match="not to 'residual'"):
        optax_gwt.wavelet_inverse(detail_rule="residual", detail_clip=1.0)


def test_bfloat16_params_use_float32_math():
    """bfloat16 gradients: the energy and the residual rule run in float32, the update is bfloat16."""
    params = {"w": jnp.ones((32, 8), jnp.bfloat16)}
    g = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((32, 8)), jnp.bfloat16)}
    tx = optax_gwt.foam_adamw(1e-2)
    u, state = jax.jit(tx.update)(g, tx.init(params), params)
    assert u["w"].dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(u["w"])))
    ref = ReferenceFOAM(lr=1e-2)
    want = ref.step({"w": np.ones((32, 8))}, {"w": np.asarray(g["w"], np.float64)})["w"] - 1.0
    np.testing.assert_allclose(np.asarray(u["w"], np.float64), want, rtol=1e-2, atol=1e-6)


def test_orbax_checkpoint_resumes_bit_for_bit(tmp_path):
    """FOAM's state saved with Orbax after 2 steps and restored: steps 3-4 equal the uninterrupted run's."""
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = optax_gwt.foam_adamw(1e-2, weight_decay=0.1)
    params = {"w": jnp.ones((20, 8)), "b": jnp.zeros(8)}
    rng = np.random.default_rng(0)
    grads = [{k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in params.items()} for _ in range(4)]
    update = jax.jit(tx.update)

    def run(params, state, gs):
        for g in gs:
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        return params, state

    p2, s2 = run(params, tx.init(params), grads[:2])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step2", {"params": p2, "state": s2})
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "step2", jax.eval_shape(lambda: {"params": p2, "state": s2}))
    want, _ = run(p2, s2, grads[2:])
    got, _ = run(restored["params"], restored["state"], grads[2:])
    for k in params:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
