"""scale_by_gwt / gwt_adamw against the NumPy reference of the algorithm."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt
from reference import ReferenceGWTAdamW, problem as _problem, random_grads as _grads, run_both as _run_both

pytestmark = pytest.mark.usefixtures("x64")


SHAPES = {"w": (37, 6), "v": (16, 5), "sq": (8, 8), "bias": (7,)}


@pytest.mark.parametrize("wavelet", ["haar", "db2"])
@pytest.mark.parametrize("mode", ["zero", "symmetric"])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_trajectory_equals_reference_float64(wavelet, mode, level):
    kw = dict(level=level, wavelet=wavelet, mode=mode)
    opt = optax_gwt.gwt_adamw(3e-2, weight_decay=0.1, **kw)
    ref = ReferenceGWTAdamW(lr=3e-2, weight_decay=0.1, **kw)
    got, want, _ = _run_both(opt, ref, SHAPES, steps=6)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.slow
def test_schedule_and_weight_decay_after_the_step():
    sched = optax.linear_schedule(1e-2, 4e-2, 5)
    opt = optax_gwt.gwt_adamw(sched, weight_decay=0.5, level=2, wavelet="db2")
    ref = ReferenceGWTAdamW(weight_decay=0.5, level=2, wavelet="db2")
    params, rng = _problem(SHAPES)
    want = {k: v.copy() for k, v in params.items()}
    state, update = opt.init(params), jax.jit(opt.update)
    for t in range(5):
        grads = _grads(rng, params)
        ref.lr = float(sched(jnp.asarray(t, jnp.int32)))  # the float32 value optax computes from its int32 count
        want = ref.step(want, grads)
        u, state = update(grads, state, params)
        params = optax.apply_updates(params, u)
    for k in want:
        np.testing.assert_allclose(np.asarray(params[k]), want[k], rtol=1e-9, atol=1e-12, err_msg=k)
    # A weight-decay mask leaves the masked-out params undecayed.
    masked = optax_gwt.gwt_adamw(1e-2, weight_decay=0.5, mask={k: k != "bias" for k in SHAPES})
    plain = optax_gwt.gwt_adamw(1e-2)
    g = _grads(rng, params)
    u1, _ = masked.update(g, masked.init(params), params)
    u2, _ = plain.update(g, plain.init(params), params)
    np.testing.assert_array_equal(u1["bias"], u2["bias"])
    assert not np.allclose(u1["w"], u2["w"])


@pytest.mark.parametrize("mode", ["periodization", "reflect", "periodic"])
def test_other_modes_and_families(mode):
    for wavelet in ("haar", "sym3", "coif1"):
        kw = dict(level=2, wavelet=wavelet, mode=mode)
        got, want, _ = _run_both(
            optax_gwt.gwt_adamw(1e-2, **kw), ReferenceGWTAdamW(lr=1e-2, **kw), {"w": (29, 3), "x": (32, 2)}, steps=3
        )
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-12, err_msg=f"{wavelet} {k}")


def test_wavelet_given_as_pywt_object():
    import pywt

    kw = dict(level=2, mode="zero")
    got, want, _ = _run_both(
        optax_gwt.gwt_adamw(1e-2, wavelet=pywt.Wavelet("db2"), **kw),
        ReferenceGWTAdamW(lr=1e-2, wavelet="db2", **kw),
        {"w": (21, 4)},
        steps=3,
    )
    np.testing.assert_allclose(np.asarray(got["w"]), want["w"], rtol=1e-9, atol=1e-12)
    assert optax_gwt.WaveletProjection(wavelet=pywt.Wavelet("haar")).wavelet == "haar"


def test_last_axis_and_axis_spec():
    shapes = {"w": (5, 23), "v": (4, 12)}
    got, want, _ = _run_both(optax_gwt.gwt_adamw(1e-2, axis=-1), ReferenceGWTAdamW(lr=1e-2, axis=1), shapes)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-12)
    # A callable choosing the axis per array; None leaves it to plain Adam.
    opt = optax_gwt.gwt_adamw(1e-2, axis=lambda path, x: None if x.shape[0] < 5 else 1)
    got, want, _ = _run_both(opt, ReferenceGWTAdamW(lr=1e-2, axis=1), {"w": (5, 23)})
    np.testing.assert_allclose(np.asarray(got["w"]), want["w"], rtol=1e-9, atol=1e-12)
    state = opt.init({"w": jnp.zeros((5, 23)), "v": jnp.zeros((4, 12))})
    assert state[0][1].inner_state.mu["w"].shape == (5, 6)
    assert state[0][1].inner_state.mu["v"].shape == (4, 12)
    # A pytree prefix of axes: None leaves a whole subtree to plain Adam.
    nested = {"a": {"w": jnp.zeros((8, 4)), "v": jnp.zeros((4, 8))}, "b": jnp.zeros((8, 8))}
    mu = optax_gwt.gwt_adamw(1e-2, axis={"a": 1, "b": None}).init(nested)[0][1].inner_state.mu
    assert (mu["a"]["w"].shape, mu["a"]["v"].shape, mu["b"].shape) == ((8, 1), (4, 2), (8, 8))
    with pytest.raises(ValueError, match="prefix of the params"):
        optax_gwt.gwt_adamw(1e-2, axis={"zz": 1}).init(nested)


def test_detail_bias_correction_off():
    kw = dict(level=2, wavelet="db2", mode="symmetric")
    opt = optax_gwt.gwt_adamw(1e-2, bias_correct_details=False, **kw)
    ref = ReferenceGWTAdamW(lr=1e-2, bias_correct_details=False, **kw)
    got, want, _ = _run_both(opt, ref, SHAPES, steps=5)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-12, err_msg=k)
    # And it is a real change: the default differs.
    other, _, _ = _run_both(optax_gwt.gwt_adamw(1e-2, **kw), ReferenceGWTAdamW(lr=1e-2, **kw), SHAPES, steps=5)
    assert not np.allclose(np.asarray(other["w"]), want["w"], rtol=1e-6)


@pytest.mark.parametrize("wavelet,mode", [("haar", "zero"), ("db2", "symmetric")])
def test_delayed_limiter_divides_each_step_by_the_factor_before(wavelet, mode):
    """``norm_growth_delayed=True`` against the reference with the previous step's factor."""
    kw = dict(level=2, wavelet=wavelet, mode=mode)
    opt = optax_gwt.gwt_adamw(1e-2, norm_growth_delayed=True, **kw)
    got, want, _ = _run_both(opt, ReferenceGWTAdamW(lr=1e-2, delayed=True, **kw), SHAPES, steps=6)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-12, err_msg=k)
    other, _, _ = _run_both(optax_gwt.gwt_adamw(1e-2, **kw), ReferenceGWTAdamW(lr=1e-2, **kw), SHAPES, steps=6)
    assert not np.allclose(np.asarray(other["w"]), want["w"], rtol=1e-6)  # the limiter acted: a real change


def test_delayed_limiter_on_stacked_matrices_is_per_matrix():
    """With batch axes each matrix of the stack keeps its own delayed factor."""
    stack = {"w": jnp.zeros((3, 16, 8))}
    apart = {f"w{i}": jnp.zeros((16, 8)) for i in range(3)}
    stacked_tx = optax_gwt.gwt_adamw(1e-2, norm_growth_delayed=True, batch_axes=1)
    apart_tx = optax_gwt.gwt_adamw(1e-2, norm_growth_delayed=True)
    s1, s2 = stacked_tx.init(stack), apart_tx.init(apart)
    for t in range(5):
        g = jax.random.normal(jax.random.key(t), (3, 16, 8)) * jnp.array([1.0, 5.0, 25.0])[:, None, None] ** t
        u1, s1 = stacked_tx.update({"w": g}, s1, stack)
        u2, s2 = apart_tx.update({f"w{i}": g[i] for i in range(3)}, s2, apart)
        for i in range(3):
            np.testing.assert_allclose(u1["w"][i], u2[f"w{i}"], rtol=2e-6, atol=1e-9)
    assert float(jnp.max(s1[0][2].scale["w"])) > 1.0  # some matrix was limited


@pytest.mark.parametrize("rule", ["norm_ratio", "zero"])
def test_other_detail_rules_with_reference_adam(rule):
    kw = dict(level=2, wavelet="haar", mode="zero")
    got, want, _ = _run_both(
        optax_gwt.gwt_adamw(1e-2, detail_rule=rule, **kw),
        ReferenceGWTAdamW(lr=1e-2, detail_rule=rule, **kw),
        SHAPES,
        steps=4,
    )
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-12, err_msg=k)


def test_float32_close_to_float64_reference():
    # In float32 two things limit agreement: the params themselves are rounded to
    # float32 every step (|p| * 6e-8 per step), and the detail path divides by
    # sqrt(v) + eps, which amplifies the rounding of approximation coefficients that
    # are near zero. Measured over seeds: max error ~1e-5 of the largest parameter
    # movement. The bound 1e-4 of it still catches any algorithmic difference
    # (a wrong factor, slice or limiter moves the result by >= 1e-2 of it).
    for seed in range(3):
        got, want, _ = _run_both(
            optax_gwt.gwt_adamw(1e-2, level=2),
            ReferenceGWTAdamW(lr=1e-2, level=2),
            SHAPES,
            steps=5,
            dtype=np.float32,
            seed=seed,
        )
        start, _ = _problem(SHAPES, seed)
        for k in want:
            assert got[k].dtype == jnp.float32
            err = np.abs(np.asarray(got[k], np.float64) - want[k]).max()
            assert err <= 1e-4 * np.abs(want[k] - start[k]).max(), (seed, k, err)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_what_a_gpu_or_tpu_compiles_equals_reference(platform, dtype, level):
    """The formulations chosen for GPUs and TPUs when lowering (the limiter's scalars per array,
    block sums and repeats as contractions, block means from the gradient), run here on the CPU: the
    float64 reference's trajectory, to float64 rounding, or in float32 within the bound of
    `test_float32_close_to_float64_reference`. Axis lengths that the block divides and ones
    that it does not (a short last block), rows of 128 lanes (row ``tpu-repeat-one-device``).
    (Stacked matrices: `test_pytrees`; each row: `test_kernels`.)"""
    shapes = {"w": (37, 6), "v": (16, 5), "sq": (64, 8), "lanes": (32, 128), "bias": (7,)}
    fast_path = optax_gwt.FastPath(emulate=platform)
    opt = optax_gwt.gwt_adamw(1e-2, weight_decay=0.1, level=level, fast_path=fast_path)
    got, want, _ = _run_both(opt, ReferenceGWTAdamW(lr=1e-2, weight_decay=0.1, level=level), shapes, 5, dtype=dtype)
    start, _ = _problem(shapes)
    for k in want:
        scale = 1e-9 if dtype == np.float64 else 1e-4 * np.abs(want[k] - start[k]).max()
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=0, atol=scale, err_msg=k)


def test_reference_adam_matches_optax_adam_without_eps():
    # eps placement is the only difference between the two forms of Adam.
    params, rng = _problem({"a": (6, 3)})
    ours, theirs = optax_gwt.scale_by_reference_adam(eps=0.0), optax.scale_by_adam(eps=0.0)
    s1, s2 = ours.init(params), theirs.init(params)
    for _ in range(4):
        g = _grads(rng, params)
        u1, s1 = ours.update(g, s1)
        u2, s2 = theirs.update(g, s2)
        np.testing.assert_allclose(u1["a"], u2["a"], rtol=1e-12)


def test_untransformed_params_are_plain_adam():
    params, rng = _problem({"b": (9,), "w": (4, 4)})
    opt = optax_gwt.gwt_adamw(1e-2, wavelet_mask={"b": False, "w": False})
    adam = optax.chain(optax_gwt.scale_by_reference_adam(), optax.scale_by_learning_rate(1e-2))
    s1, s2 = opt.init(params), adam.init(params)
    for _ in range(3):
        g = _grads(rng, params)
        u1, s1 = opt.update(g, s1, params)
        u2, s2 = adam.update(g, s2, params)
        for k in params:
            np.testing.assert_allclose(u1[k], u2[k], rtol=1e-12)


def test_given_base_adam_uses_its_moments():
    """With optax.scale_by_adam as the base, rule 'adam' is picked and details follow its denominator."""
    shapes = {"w": (16, 3)}
    params, rng = _problem(shapes)
    opt = optax_gwt.scale_by_gwt(optax.scale_by_adam(eps=1e-6), level=2, norm_growth_limit=None, scale=1.0)
    state = opt.init(params)
    m = v = 0.0
    for t in range(1, 4):
        g = _grads(rng, params)
        u, state = opt.update(g, state)
        blocks = g["w"].reshape(4, 4, 3)
        mean = blocks.mean(axis=1, keepdims=True)
        a = blocks.sum(axis=1) / 2.0
        m = 0.9 * m + 0.1 * a
        v = 0.999 * v + 0.001 * a * a
        den = np.sqrt(v / (1 - 0.999**t)) + 1e-6
        n = m / (1 - 0.9**t) / den
        want = (blocks - mean) / (den * (1 - 0.9**t))[:, None, :] + (n / 2.0)[:, None, :]
        np.testing.assert_allclose(u["w"], want.reshape(16, 3), rtol=1e-10)


def test_base_without_second_moment_uses_norm_ratio():
    params, rng = _problem({"w": (16, 3)})
    opt = optax_gwt.scale_by_gwt(optax.scale_by_lion(), level=2, norm_growth_limit=None, scale=1.0)
    state = opt.init(params)
    g = _grads(rng, params)
    u, _ = opt.update(g, state)
    blocks = g["w"].reshape(4, 4, 3)
    a = blocks.sum(axis=1) / 2.0
    n = np.sign(0.1 * a)  # lion's first step: sign((1 - b1) * g)
    ratio = np.linalg.norm(n) / np.linalg.norm(a)
    want = (blocks - blocks.mean(axis=1, keepdims=True)) * ratio + (n / 2.0)[:, None, :]
    np.testing.assert_allclose(u["w"], want.reshape(16, 3), rtol=1e-10)
    with pytest.raises(ValueError, match="denominator"):
        bad = optax_gwt.scale_by_gwt(optax.scale_by_lion(), detail_rule="adam")
        bad.update(g, bad.init(params))


def test_projection_stages_roundtrip():
    """project -> identity on the approximation -> inverse with unit weight gives the gradient back."""
    params, _ = _problem({"w": (19, 4), "b": (3,)})
    proj = optax_gwt.WaveletProjection(level=2, wavelet="db2", mode="symmetric")
    project = optax_gwt.wavelet_project(proj)
    coeffs, _ = project.update(params, project.init(params))
    assert coeffs["b"] is params["b"] and len(coeffs["w"].details) == 2
    assert coeffs["w"].approx.shape == coeffs["w"].spec.approx_shape
    tx = optax.chain(
        project,
        optax_gwt.on_approximation(optax.identity(), proj),
        optax_gwt.wavelet_inverse(scale=1.0, detail_rule="norm_ratio"),
    )
    back, _ = tx.update(params, tx.init(params))
    np.testing.assert_allclose(back["w"], params["w"], atol=1e-12)


def test_llama60m_state_is_a_quarter():
    hidden, inter, layers = 512, 1376, 8
    params = {}
    for i in range(layers):
        params[f"layer{i}"] = {
            "q": jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
            "k": jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
            "v": jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
            "o": jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
            "gate": jax.ShapeDtypeStruct((hidden, inter), jnp.float32),
            "up": jax.ShapeDtypeStruct((hidden, inter), jnp.float32),
            "down": jax.ShapeDtypeStruct((inter, hidden), jnp.float32),
        }
    gwt_state = jax.eval_shape(optax_gwt.gwt_adamw(1e-3, level=2).init, params)
    adam_state = jax.eval_shape(optax.adam(1e-3).init, params)
    gwt_base = gwt_state[0][1].inner_state
    for moment in ("mu", "nu"):
        g_bytes = optax_gwt.memory.tree_bytes(getattr(gwt_base, moment))
        a_bytes = optax_gwt.memory.tree_bytes(getattr(adam_state[0], moment))
        assert 4 * g_bytes == a_bytes
    # Nothing full-size stays in the state: every leaf is at most a quarter of its param.
    biggest = max(x.size for x in jax.tree_util.tree_leaves(gwt_state))
    assert biggest == inter * hidden // 4
    report = optax_gwt.optimizer_state_bytes(optax_gwt.gwt_adamw(1e-3, level=2), params)
    assert report.per_param["layer0"]["down"] == 2 * (inter // 4) * hidden * 4 + 2 * 4  # mu, nu, r_prev, lam


def test_zero_gradients_give_zero_update():
    params, _ = _problem(SHAPES)
    opt = optax_gwt.gwt_adamw(1e-2, level=3, wavelet="db2")
    state = opt.init(params)
    zeros = jax.tree_util.tree_map(np.zeros_like, params)
    update = jax.jit(opt.update)
    for _ in range(3):
        u, state = update(zeros, state, params)
        for x in jax.tree_util.tree_leaves(u):
            assert np.all(np.asarray(x) == 0)


class TestErrors:
    def test_level_too_deep_names_the_path(self):
        with pytest.raises(ValueError, match=r"\['small'\].*level 3 is too deep for length 4"):
            optax_gwt.gwt_adamw(1e-3, level=3).init({"small": jnp.zeros((4, 8))})
        # min_dim_size leaves it to the base optimizer instead.
        st = optax_gwt.gwt_adamw(1e-3, level=3, min_dim_size=8).init({"small": jnp.zeros((4, 8))})
        assert st[0][1].inner_state.mu["small"].shape == (4, 8)

    def test_unknown_wavelet_and_mode(self):
        with pytest.raises(ValueError, match="wavelet"):
            optax_gwt.gwt_adamw(1e-3, wavelet="db99")
        with pytest.raises(ValueError, match="mode"):
            optax_gwt.scale_by_gwt(mode="wrap")
        with pytest.raises(ValueError, match="detail_rule"):
            optax_gwt.scale_by_gwt(detail_rule="high")
        with pytest.raises(ValueError, match="level"):
            optax_gwt.scale_by_gwt(level=0)

    def test_axis_out_of_range(self):
        with pytest.raises(ValueError, match=r"\['w'\].*axis 2 is out of range"):
            optax_gwt.gwt_adamw(1e-3, axis=2).init({"w": jnp.zeros((8, 8))})

    def test_bad_dtypes(self):
        with pytest.raises(TypeError, match=r"\['i'\].*floating-point"):
            optax_gwt.gwt_adamw(1e-3).init({"i": jnp.zeros((8, 8), jnp.int32)})
        with pytest.raises(TypeError, match=r"\['c'\].*complex"):
            optax_gwt.gwt_adamw(1e-3).init({"c": jnp.zeros((8, 8), jnp.complex64)})

    def test_update_tree_mismatch(self):
        opt = optax_gwt.gwt_adamw(1e-3)
        state = opt.init({"w": jnp.zeros((8, 8))})
        with pytest.raises(ValueError, match="do not match the optimizer state"):
            opt.update({"w": jnp.zeros((8, 8)), "extra": jnp.zeros(3)}, state, None)

    def test_traced_level_is_refused_clearly(self):
        with pytest.raises(TypeError, match="static_args"):
            optax_gwt.scale_by_gwt(level=jnp.asarray(2))
