"""GWT on the pytrees of other JAX libraries: an Equinox-style model (a callable pytree root
with ``None`` leaves), against the same computation on a plain dict."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Model:
    """Like an Equinox module: a dataclass pytree that is callable, with an absent bias (None)."""

    w: jax.Array
    v: jax.Array
    b: jax.Array | None = None

    def __call__(self, x):
        return x @ self.w @ self.v


def _model(seed=0):
    rng = np.random.default_rng(seed)
    return Model(w=jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), v=jnp.asarray(rng.standard_normal((8, 4))))


def _as_dict(m: Model) -> dict:
    return {"w": m.w, "v": m.v}


def _steps(tx, params, grads_of, n=3):
    state, out = tx.init(params), []
    for i in range(n):
        u, state = jax.jit(tx.update)(grads_of(i), state, params)
        params = optax.apply_updates(params, u)
        out.append(params)
    return out


def _grads(i, like):
    rng = np.random.default_rng(10 + i)
    return Model(w=jnp.asarray(rng.standard_normal(like.w.shape)), v=jnp.asarray(rng.standard_normal(like.v.shape)))


@pytest.mark.parametrize("builder", [optax_gwt.gwt_adamw, optax_gwt.foam_adamw], ids=["gwt", "foam"])
def test_none_leaves_and_a_callable_root(builder):
    """A model with a None bias: the same steps as on a dict of its arrays. The axis and the
    wavelet mask are prefix trees rooted at the (callable) model, not functions."""
    model = _model()
    axis = Model(w=1, v=0, b=None)
    mask = Model(w=True, v=False, b=None)
    kw = dict(level=1, axis=axis, wavelet_mask=mask)
    got = _steps(builder(1e-2, **kw), model, lambda i: _grads(i, model))
    want = _steps(
        builder(1e-2, level=1, axis={"w": 1, "v": 0}, wavelet_mask={"w": True, "v": False}),
        _as_dict(model),
        lambda i: _as_dict(_grads(i, model)),
    )
    for g, w in zip(got, want, strict=True):
        assert g.b is None
        np.testing.assert_array_equal(np.asarray(g.w), np.asarray(w["w"]))
        np.testing.assert_array_equal(np.asarray(g.v), np.asarray(w["v"]))
    state = builder(1e-2, **kw).init(model)
    inner = state[0][1].inner_state
    assert inner.mu.w.shape == (16, 4)  # transformed along axis 1
    assert inner.mu.v.shape == (8, 4)  # masked out: plain Adam
    assert inner.mu.b is None


def test_a_function_is_still_called():
    calls = []

    def axis(path, x):
        calls.append(jax.tree_util.keystr(path))
        return 0 if x.ndim >= 2 else None

    tx = optax_gwt.gwt_adamw(1e-2, level=1, axis=axis)
    tx.init(_model())
    assert calls and all(c in (".w", ".v") for c in calls)


@jax.tree_util.register_pytree_node_class
class Named:
    """A container pytree that wraps one array with axis names, like haliax's NamedArray."""

    def __init__(self, array, axes):
        self.array, self.axes = array, axes

    @property
    def shape(self):
        return dict(zip(self.axes, self.array.shape, strict=True))

    @property
    def dtype(self):
        return self.array.dtype

    def tree_flatten(self):
        return (self.array,), self.axes

    @classmethod
    def tree_unflatten(cls, axes, children):
        return cls(children[0], axes)


def test_limiter_scalars_are_plain_arrays_for_wrapped_params():
    """Params wrapped in a container: the limiter's per-array scalars are plain rank-0 arrays
    (not the container around a scalar), and the steps are those of the unwrapped arrays."""
    model = _model()
    wrapped = {"w": Named(model.w, ("embed", "mlp")), "v": Named(model.v, ("mlp", "out"))}
    tx = optax_gwt.gwt_adamw(1e-2, level=1)
    limiter = tx.init(wrapped)[0][2]
    for tree in (limiter.norm_prev, limiter.scale):
        assert all(
            type(x) is not Named for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Named))
        )
        assert [jnp.shape(x) for x in jax.tree_util.tree_leaves(tree)] == [(), ()]
    got = _steps(tx, wrapped, lambda i: {k: Named(g, wrapped[k].axes) for k, g in _as_dict(_grads(i, model)).items()})
    want = _steps(tx, _as_dict(model), lambda i: _as_dict(_grads(i, model)))
    for g, w in zip(got, want, strict=True):
        for k in w:
            np.testing.assert_array_equal(np.asarray(g[k].array), np.asarray(w[k]))


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
@pytest.mark.parametrize("detail_rule", ["adam", "norm_ratio"])
def test_stacked_matrices_equal_the_matrices_one_by_one(detail_rule, platform):
    """A (layers, in, out) weight with batch_axes=1: each layer's steps are those of the same
    matrix optimized alone (the limiter's norm per matrix, the transform along `in`), to float64
    rounding; also as a TPU program computes them (``FastPath(emulate="tpu")``, run here)."""
    rng = np.random.default_rng(0)
    layers = 3
    stacked = {"w": jnp.asarray(rng.standard_normal((layers, 16, 128))), "b": jnp.zeros(6)}  # 128: a TPU's lanes
    grads = [
        {"w": jnp.asarray(rng.uniform(0.2, 5.0, (layers, 1, 1)) * rng.standard_normal((layers, 16, 128))),
         "b": jnp.asarray(rng.standard_normal(6))}
        for _ in range(5)
    ]  # fmt: skip
    kw = dict(level=2, weight_decay=0.1, detail_rule=detail_rule, fast_path=optax_gwt.FastPath(emulate=platform))
    tx = optax_gwt.gwt_adamw(1e-2, batch_axes=1, **kw)
    got = _steps(tx, stacked, lambda i: grads[i], n=5)[-1]
    state = tx.init(stacked)
    assert state[0][1].inner_state.mu["w"].shape == (layers, 4, 128)
    assert state[0][2].norm_prev["w"].shape == (layers,) and state[0][2].norm_prev["b"].shape == ()
    for layer in range(layers):
        alone = {"w": stacked["w"][layer], "b": stacked["b"]}
        want = _steps(
            optax_gwt.gwt_adamw(1e-2, **kw), alone, lambda i, j=layer: {"w": grads[i]["w"][j], "b": grads[i]["b"]}, n=5
        )[-1]
        # float64 rounding: XLA sums a stacked array's matrices in another order than one alone.
        np.testing.assert_allclose(np.asarray(got["w"][layer]), np.asarray(want["w"]), rtol=1e-12, atol=1e-14)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_a_layer_axis_in_the_middle_equals_the_matrices_one_by_one(platform):
    """MaxText's layout, ``(embed, layers, mlp)``: ``batch_axes`` naming the middle axis gives each
    layer's matrix the steps it has alone (its own limiter norm), to float64 rounding; a layout the
    stack-walking formulations do not take (they walk leading axes)."""
    rng = np.random.default_rng(2)
    layers = 3
    stacked = {"w": jnp.asarray(rng.standard_normal((16, layers, 128))), "b": jnp.zeros(6)}
    grads = [
        {"w": jnp.asarray(rng.uniform(0.2, 5.0, (1, layers, 1)) * rng.standard_normal((16, layers, 128))),
         "b": jnp.asarray(rng.standard_normal(6))}
        for _ in range(5)
    ]  # fmt: skip
    kw = dict(level=2, weight_decay=0.1, fast_path=optax_gwt.FastPath(emulate=platform))
    middle = lambda path, x: (1,) if x.ndim == 3 else 0  # noqa: E731
    tx = optax_gwt.gwt_adamw(1e-2, batch_axes=middle, **kw)
    state = tx.init(stacked)
    assert state[0][1].inner_state.mu["w"].shape == (4, layers, 128)
    assert state[0][2].norm_prev["w"].shape == (layers,)
    got = _steps(tx, stacked, lambda i: grads[i], n=5)[-1]
    one_norm = _steps(optax_gwt.gwt_adamw(1e-2, **kw), stacked, lambda i: grads[i], n=5)[-1]
    assert not np.allclose(np.asarray(got["w"]), np.asarray(one_norm["w"]), rtol=1e-6)  # the limiter acted
    for layer in range(layers):
        alone = {"w": stacked["w"][:, layer], "b": stacked["b"]}
        want = _steps(
            optax_gwt.gwt_adamw(1e-2, **kw), alone, lambda i, j=layer: {"w": grads[i]["w"][:, j], "b": grads[i]["b"]},
            n=5,
        )[-1]  # fmt: skip
        np.testing.assert_allclose(np.asarray(got["w"][:, layer]), np.asarray(want["w"]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_vmapped_over_layers_equals_the_matrices_one_by_one(platform):
    """``jax.vmap`` of the update over stacked layers (as the planner's ``over_layers``): in float32,
    where GPU and TPU programs take a matrix's block means from its gradient but a vmapped one
    from its approximation (rows ``*-means-from-gradient``), each layer's steps are those of
    the matrix alone, to float32 rounding."""
    rng = np.random.default_rng(1)
    layers = 3
    stacked = {"w": jnp.asarray(rng.standard_normal((layers, 16, 128)), jnp.float32)}  # 128: a TPU's lanes
    grads = [{"w": jnp.asarray(rng.standard_normal((layers, 16, 128)), jnp.float32)} for _ in range(4)]
    tx = optax_gwt.gwt_adamw(1e-2, level=2, weight_decay=0.1, fast_path=optax_gwt.FastPath(emulate=platform))
    vmapped = optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))
    got = _steps(vmapped, stacked, lambda i: grads[i], n=4)[-1]
    for layer in range(layers):
        alone = _steps(tx, {"w": stacked["w"][layer]}, lambda i, j=layer: {"w": grads[i]["w"][j]}, n=4)[-1]
        np.testing.assert_allclose(np.asarray(got["w"][layer]), np.asarray(alone["w"]), rtol=2e-6, atol=2e-6)


def test_batch_axes_errors_and_selection():
    params = {"w": jnp.zeros((2, 8, 4)), "v": jnp.zeros((2, 8)), "b": jnp.zeros(4)}
    specs, _ = optax_gwt.WaveletProjection(level=1, batch_axes=1).leaf_specs(params)
    assert specs[0] is None and specs[1] is None  # "b": rank 1; "v": one axis besides its batch axis
    assert specs[2].axis == 1 and specs[2].approx_shape == (2, 4, 4) and specs[2].batch_shape == (2,)
    message = r"\['w'\]: the batch axes \(0,\) \(from batch_axes\) must leave the transform axis 0"
    with pytest.raises(ValueError, match=message):
        optax_gwt.WaveletProjection(level=1, axis={"w": 0, "v": None, "b": None}, batch_axes=1).leaf_specs(params)
    proj = optax_gwt.WaveletProjection(level=1, batch_axes=1)
    tx = optax.chain(
        optax_gwt.wavelet_project(proj),
        optax_gwt.on_approximation(optax_gwt.scale_by_reference_adam(), proj),
        optax_gwt.limit_norm_growth(1.01),  # built without the projection: one scalar per array
        optax_gwt.wavelet_inverse(),
    )
    with pytest.raises(ValueError, match="build limit_norm_growth"):
        tx.update(params, tx.init(params))
