"""The public stages chained by hand: equal to the builders bit for bit, to the
NumPy reference in float64, with other bases against their own references, and
clear errors when the chain is assembled wrong."""

import doctest

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import pywt

import optax_gwt
from reference import ReferenceGWTAdamW

LR, WD = 2e-2, 0.1
SHAPES = {"w": (37, 6), "v": (16, 5), "bias": (7,)}


def hand_chain(proj, base=None, lr=LR, wd=WD, **inverse):
    """WaveAdamW written as the user's chain of public stages."""
    base = base or optax_gwt.scale_by_reference_adam(eps=1e-6)
    return optax.chain(
        optax_gwt.wavelet_project(proj),
        optax_gwt.on_approximation(base, proj),
        optax_gwt.limit_norm_growth(1.01),
        optax_gwt.wavelet_inverse(**inverse),
        optax.scale_by_learning_rate(lr),
        optax_gwt.decay_weights_after_step(lr, wd),
    )


def grads_seq(shapes, steps, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        scale = rng.uniform(0.2, 5.0)  # the limiter acts on some steps
        out.append({k: (scale * rng.standard_normal(s)).astype(dtype) for k, s in shapes.items()})
    return out


def trajectory(tx, shapes, steps=5, seed=0, dtype=np.float64):
    """Params after each step of `tx`, and the final state."""
    params = {
        k: jnp.asarray(np.random.default_rng(seed + 1).standard_normal(s).astype(dtype)) for k, s in shapes.items()
    }
    state, update, out = tx.init(params), jax.jit(tx.update), []
    for g in grads_seq(shapes, steps, seed, dtype):
        u, state = update(jax.tree.map(jnp.asarray, g), state, params)
        params = optax.apply_updates(params, u)
        out.append(params)
    return out, state


@pytest.mark.parametrize("kernel", [False, True])
def test_hand_chain_equals_gwt_adamw_bit_for_bit(kernel):
    fast_path = optax_gwt.FastPath(cpu_kernel=kernel)
    proj = optax_gwt.WaveletProjection(level=2, fast_path=fast_path)
    base = optax_gwt.scale_by_reference_adam(eps=1e-6, fast_path=fast_path)
    got, _ = trajectory(hand_chain(proj, base), SHAPES, dtype=np.float32)
    builder = optax_gwt.gwt_adamw(LR, weight_decay=WD, level=2, fast_path=fast_path)
    want, _ = trajectory(builder, SHAPES, dtype=np.float32)
    chex.assert_trees_all_equal(got, want)


@pytest.mark.slow
class HandChainWithAndWithoutJit(chex.TestCase):
    """The stages run eagerly and under jit, and agree with the jitted builder (as Optax tests its transforms)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_chain_step(self):
        shapes = {"w": (37, 6), "b": (6,)}
        proj = optax_gwt.WaveletProjection(level=2, wavelet="db2", mode="symmetric")
        tx = hand_chain(proj)
        params = {
            k: jnp.asarray(np.random.default_rng(1).standard_normal(s).astype(np.float32)) for k, s in shapes.items()
        }
        state, update = tx.init(params), self.variant(tx.update)
        for g in grads_seq(shapes, 3, dtype=np.float32):
            u, state = update(jax.tree.map(jnp.asarray, g), state, params)
            params = optax.apply_updates(params, u)
        want, _ = trajectory(
            optax_gwt.gwt_adamw(LR, weight_decay=WD, level=2, wavelet="db2", mode="symmetric"),
            shapes,
            steps=3,
            dtype=np.float32,
        )
        chex.assert_trees_all_close(params, want[-1], rtol=1e-5, atol=1e-6)
        chex.assert_shape(state[1].inner_state.mu["w"], (11, 6))  # pywt: 37 -> 20 -> 11


CASES = [
    dict(level=1, wavelet="haar", mode="zero"),
    dict(level=2, wavelet="haar", mode="symmetric"),
    dict(level=3, wavelet="haar", mode="periodization"),
    dict(level=2, wavelet="db2", mode="symmetric"),
    dict(level=1, wavelet="sym3", mode="reflect"),
    dict(level=2, wavelet="coif1", mode="zero"),
    dict(level=3, wavelet="db2", mode="periodic"),
]


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_hand_chain_equals_numpy_reference(case):
    shapes = {"w": (45, 3), "v": (16, 5), "bias": (7,)}  # odd and even lengths
    got, _ = trajectory(hand_chain(optax_gwt.WaveletProjection(**case)), shapes)
    ref = ReferenceGWTAdamW(lr=LR, weight_decay=WD, **case)
    params = {k: np.random.default_rng(1).standard_normal(s) for k, s in shapes.items()}
    for g in grads_seq(shapes, 5):
        params = ref.step(params, g)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got[-1]), params, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------
# Other bases against their own references.
# ---------------------------------------------------------------------------


def numpy_lion(b1=0.9, b2=0.99):
    """Lion (Chen et al. 2023) in NumPy: sign(b1 m + (1 - b1) g), then m <- b2 m + (1 - b2) g."""

    def step(g, st):
        m = st.get("m", np.zeros_like(g))
        st["m"] = b2 * m + (1 - b2) * g
        return np.sign(b1 * m + (1 - b1) * g)

    return step


def optax_on_numpy(tx):
    """An Optax transformation applied alone to one NumPy array: its own reference."""

    def step(g, st):
        if "s" not in st:
            st["s"] = tx.init(jnp.asarray(g))
        u, st["s"] = tx.update(jnp.asarray(g), st["s"], jnp.zeros_like(g))  # params: their shapes only
        return np.asarray(u, np.float64)

    return step


def reference_gwt_norm_ratio(base_step, grads, shapes, level=2, wavelet="haar", mode="zero", gamma=1.01, scale=0.25):
    """GWT with any base in NumPy/PyWavelets: base on cA, limiter, details times ||N|| / ||A||."""
    states, out = {k: {} for k in shapes}, []
    for t, g in enumerate(grads):
        upd = {}
        for k, x in g.items():
            st = states[k]
            if x.ndim < 2:
                upd[k] = base_step(x, st)
                continue
            a, *details = pywt.wavedec(x, wavelet, mode=mode, level=level, axis=0)
            n = base_step(a, st)
            r = np.linalg.norm(n)
            lam = 1.0 if t == 0 else max(r / (st["r"] + 1e-8), gamma) / gamma
            st["r"], n = r / lam, n / lam
            w = np.linalg.norm(n) / np.linalg.norm(a)
            upd[k] = scale * pywt.waverec([n] + [d * w for d in details], wavelet, mode=mode, axis=0)[: x.shape[0]]
        out.append(upd)
    return out


BASES = {
    "lion": (lambda: optax.scale_by_lion(), numpy_lion),
    "muon": (
        # every leaf a matrix with Muon's default dimension numbers, as the reference's lone arrays
        lambda: optax.contrib.scale_by_muon(
            weight_dimension_numbers=lambda u: jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(), u)
        ),
        lambda: optax_on_numpy(optax.contrib.scale_by_muon()),
    ),
    "factored_rms": (
        lambda: optax.scale_by_factored_rms(min_dim_size_to_factor=2),
        lambda: optax_on_numpy(optax.scale_by_factored_rms(min_dim_size_to_factor=2)),
    ),
}


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("name", sorted(BASES))
def test_other_bases_against_their_references(name):
    make, make_ref = BASES[name]
    shapes = {"w": (32, 6), "u": (19, 8)} if name == "muon" else {"w": (32, 6), "u": (19, 8), "bias": (5,)}
    proj = optax_gwt.WaveletProjection(level=2, wavelet="db2", mode="symmetric")
    tx = optax.chain(
        optax_gwt.wavelet_project(proj),
        optax_gwt.on_approximation(make(), proj),
        optax_gwt.limit_norm_growth(1.01),
        optax_gwt.wavelet_inverse(scale=0.25),
    )
    grads = grads_seq(shapes, 4)
    want = reference_gwt_norm_ratio(make_ref(), grads, shapes, wavelet="db2", mode="symmetric")
    params = jax.tree.map(jnp.zeros_like, grads[0])
    state = tx.init(params)
    for g, w in zip(grads, want, strict=True):
        u, state = tx.update(jax.tree.map(jnp.asarray, g), state, params)
        chex.assert_trees_all_close(jax.tree.map(np.asarray, u), w, rtol=1e-8, atol=1e-12)


# ---------------------------------------------------------------------------
# Fast paths against the plain chain.
# ---------------------------------------------------------------------------


def test_cpu_kernel_path_agrees_with_xla_path_per_step():
    """Per step, on identical inputs, in float32: within float32 rounding (the documented promise)."""
    from optax_gwt.kernels import cpu_ffi

    if not cpu_ffi.available():
        pytest.skip("no C++ compiler: the kernel is not built")
    params = {"w": jnp.ones((64, 24)), "o": jnp.ones((33, 8))}
    fast, plain = (optax_gwt.gwt_adamw(LR, fast_path=optax_gwt.FastPath(cpu_kernel=k)) for k in (True, False))
    state = fast.init(params)
    for g in grads_seq({k: v.shape for k, v in params.items()}, 4, dtype=np.float32):
        g = jax.tree.map(jnp.asarray, g)
        u_fast, new_state = jax.jit(fast.update)(g, state, params)
        u_plain, _ = jax.jit(plain.update)(g, state, params)
        chex.assert_trees_all_close(u_fast, u_plain, rtol=2e-6, atol=1e-9)
        state = new_state


def _haar_chain(proj, dtype, fused: bool):
    """GWT's four stages with the reference Adam. With ``fused=False`` the reference Adam's
    preconditioner is passed as another function, so the fused Haar update
    (`haar.adam_update`, which rebuilds the step from the moments) does not apply and the
    inverse takes the plain path (`inverse_leaf` on the base's step)."""
    base = optax_gwt.scale_by_reference_adam(eps=1e-6, mu_dtype=dtype, nu_dtype=dtype)
    preconditioner = None if fused else (lambda s: base.preconditioner(s))
    return optax.chain(
        optax_gwt.wavelet_project(proj),
        optax_gwt.on_approximation(base, proj, preconditioner=preconditioner),
        optax_gwt.limit_norm_growth(1.01),
        optax_gwt.wavelet_inverse(),
    )


@pytest.mark.parametrize(
    "param_dtype, moment_dtype, rtol",
    [(jnp.float32, jnp.float32, 2e-6), (jnp.float32, jnp.bfloat16, 2e-6), (jnp.bfloat16, jnp.bfloat16, 1e-2)],
)
@pytest.mark.parametrize("level, axis", [(1, 0), (2, 0), (3, 1)])
def test_fused_haar_update_agrees_with_plain_inverse(param_dtype, moment_dtype, rtol, level, axis):
    """The fused Haar closed form (whole full-size pass from the moments, any moment dtype)
    against `inverse_leaf` on the base's step, per step on identical inputs (odd lengths
    included): within float32 rounding, and one bfloat16 rounding of the update for
    bfloat16 params (both compute in float32, then round)."""
    proj = optax_gwt.WaveletProjection(level=level, axis=axis)
    shapes = {"w": (37, 19), "v": (32, 24)}
    params = {k: jnp.ones(s, param_dtype) for k, s in shapes.items()}
    fused, plain = (_haar_chain(proj, moment_dtype, fused=f) for f in (True, False))
    state = fused.init(params)
    for g in grads_seq(shapes, 4, dtype=np.float32):
        g = jax.tree.map(lambda x: jnp.asarray(x, param_dtype), g)
        u_fused, new_state = jax.jit(fused.update)(g, state, params)
        u_plain, plain_state = jax.jit(plain.update)(g, state, params)
        chex.assert_trees_all_close(new_state, plain_state, rtol=1e-6)  # the same state, up to rounding
        for k in shapes:
            a, b = (np.asarray(u[k], np.float32) for u in (u_fused, u_plain))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max()))
        state = new_state


# ---------------------------------------------------------------------------
# Clear errors.
# ---------------------------------------------------------------------------

PROJ = optax_gwt.WaveletProjection(level=2)
G = {"w": jnp.ones((16, 4))}


def _update(*stages):
    tx = optax.chain(*stages)
    return tx.update(G, tx.init(G), G)


def test_error_base_before_project():
    with pytest.raises(ValueError, match=r"\['w'\] is not projected: wavelet_project must come before"):
        _update(optax_gwt.on_approximation(optax.scale_by_adam(), PROJ), optax_gwt.wavelet_project(PROJ))


def test_error_projected_twice():
    with pytest.raises(ValueError, match="already projected"):
        _update(optax_gwt.wavelet_project(PROJ), optax_gwt.wavelet_project(PROJ))


def test_error_limiter_or_inverse_before_base():
    with pytest.raises(ValueError, match="limit_norm_growth.*has not been through on_approximation"):
        _update(optax_gwt.wavelet_project(PROJ), optax_gwt.limit_norm_growth())
    with pytest.raises(ValueError, match="wavelet_inverse.*has not been through on_approximation"):
        _update(optax_gwt.wavelet_project(PROJ), optax_gwt.wavelet_inverse())


def test_error_stages_with_different_projections():
    with pytest.raises(ValueError, match="same WaveletProjection"):
        _update(
            optax_gwt.wavelet_project(PROJ),
            optax_gwt.on_approximation(optax.scale_by_adam(), optax_gwt.WaveletProjection(level=3)),
        )


def test_error_adam_rule_without_denominator():
    with pytest.raises(ValueError, match="denominator"):
        _update(
            optax_gwt.wavelet_project(PROJ),
            optax_gwt.on_approximation(optax.scale_by_adam(), PROJ),
            optax_gwt.wavelet_inverse(detail_rule="adam"),
        )


def test_error_names_leaf_and_shapes_when_updates_change_shape():
    tx = optax_gwt.gwt_adamw(1e-3)
    state = tx.init({"w": jnp.zeros((16, 8))})
    with pytest.raises(ValueError, match=r"mu\['w'\].*\(4, 8\) at init.*\(2, 8\)"):
        tx.update({"w": jnp.ones((8, 8))}, state)
    with pytest.raises(ValueError, match="do not match the optimizer state"):
        tx.update({"w": jnp.ones((16, 8)), "extra": jnp.ones(3)}, state)


def test_optax_adam_with_its_preconditioner_is_the_adam_rule():
    """optax.scale_by_adam plus adam_preconditioner(eps) gives scale_by_gwt's result for that base."""
    base = optax.scale_by_adam(eps=1e-6)
    hand = optax.chain(
        optax_gwt.wavelet_project(PROJ),
        optax_gwt.on_approximation(base, PROJ, preconditioner=optax_gwt.adam_preconditioner(eps=1e-6)),
        optax_gwt.limit_norm_growth(),
        optax_gwt.wavelet_inverse(),
    )
    built = optax_gwt.scale_by_gwt(base, level=2, eps=1e-6)
    u1, _ = hand.update(G, hand.init(G))
    u2, _ = built.update(G, built.init(G))
    chex.assert_trees_all_equal(u1, u2)


# ---------------------------------------------------------------------------
# Every public function's example runs.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", ["adam", "stages", "transform", "projection", "memory", "sharding", "wavelets", "haar"]
)
def test_docstring_examples_run(module):
    mod = (
        getattr(optax_gwt, module) if hasattr(optax_gwt, module) else __import__(f"optax_gwt.{module}", fromlist=["_"])
    )
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_public_names_have_examples():
    """Every public function and class of the package says what it is with an example (run above)."""
    missing = [
        name
        for name in optax_gwt.__all__
        if callable(obj := getattr(optax_gwt, name)) and ">>>" not in (obj.__doc__ or "")
    ]
    assert not missing, missing


@pytest.mark.parametrize("shape,axis,level", [((16, 6), 0, 1), ((13, 5), 0, 2), ((4, 10), 1, 2), ((3, 9, 4), 1, 3)])
def test_block_means_from_the_gradient_equal_those_from_the_approximation(shape, axis, level):
    """GPUs and TPUs take the full-size pass's block means from g (`haar.block_means`), the CPU from the
    approximation: the same values (to rounding), also with a short last block."""
    from optax_gwt import haar

    g = jnp.asarray(np.random.default_rng(level).standard_normal(shape), jnp.float32)
    block = 2**level
    approx = haar.block_sums(g, axis, block) / np.sqrt(block)
    want = haar.repeat_blocks(approx, axis, block, shape[axis]) / np.sqrt(block)
    np.testing.assert_allclose(haar.block_means(g, axis, block), want, rtol=1e-6, atol=1e-7)
    # Against NumPy: each block's sum (zero-padded) over B, repeated in place.
    blocks = -(-shape[axis] // block)
    padded = np.concatenate(
        [np.asarray(g), np.zeros(shape[:axis] + (blocks * block - shape[axis],) + shape[axis + 1 :], np.float32)], axis
    )
    sums = padded.reshape(shape[:axis] + (blocks, block) + shape[axis + 1 :]).sum(axis + 1)
    ref = np.repeat(sums / block, block, axis=axis).take(range(shape[axis]), axis=axis)
    np.testing.assert_allclose(haar.block_means(g, axis, block), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "shape,axis,block,max_chunk",
    [((128, 12), 0, 4, 32), ((6, 344), 1, 4, 32), ((3, 64, 5), 1, 4, 128), ((20, 3), 0, 2, 8), ((2, 2), 0, 64, 32)],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_repeat_equals_numpy_repeat(shape, axis, block, max_chunk, dtype):
    """The TPU's block repeat (a contraction per run of the axis) is NumPy's repeat, bit for bit."""
    from optax_gwt.kernels import xla_chips

    x = jnp.asarray(np.random.default_rng(block).standard_normal(shape) * 1e3, dtype)
    got = xla_chips.chunked_repeat(x, axis, block, max_chunk)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.repeat(np.asarray(x, np.float64), block, axis=axis))


@pytest.mark.parametrize(
    "shape,axis,block,max_chunk",
    [((512, 12), 0, 4, 128), ((6, 1376), 1, 4, 32), ((3, 96, 5), 1, 8, 128), ((40, 3), 0, 2, 8), ((128, 2), 0, 64, 32)],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_block_sums_equal_numpy(shape, axis, block, max_chunk, dtype):
    """The TPU's block sums (a contraction per run of the axis) against NumPy's in float64: to float32
    rounding, and exact for bfloat16 inputs of up to 8 entries per block summed into float32."""
    from optax_gwt.kernels import xla_chips

    x = np.asarray(jnp.asarray(np.random.default_rng(block).standard_normal(shape), dtype), np.float64)
    want = np.add.reduceat(x, np.arange(0, shape[axis], block), axis=axis)
    got = xla_chips.chunked_block_sums(jnp.asarray(x, jnp.float32), axis, block, max_chunk)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=4e-7 * np.abs(x).max() * block)
    if dtype == jnp.bfloat16 and block <= 8:
        np.testing.assert_array_equal(np.asarray(got, np.float64), want)
