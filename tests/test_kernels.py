"""The fast-path table (`optax_gwt.kernels`), row by row, against the float64 reference.

Each row of `RULES` has a case here that takes it: jitted `gwt_adamw` steps (or `foam_adamw`'s)
whose trajectory must equal the NumPy reference of the authors' optimizer (`reference.py`),
to float64 rounding or, for the rows that need float32 arrays, within the float32 bound of
`test_transform`. CPU rows run through `jax.lax.platform_dependent` as a CPU program lowers
it; other platforms' rows run here with ``FastPath(emulate=...)`` (Pallas in its
interpreter). The row for programs that XLA partitions runs on 8 devices
(`multidevice_checks.test_partitioned_rows_equal_the_reference`). The table in the docs is
the table in the code.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt
from optax_gwt.kernels import RULES, Case, FastPath, markdown_table, recording, select
from reference import ReferenceFOAM, ReferenceGWTAdamW, problem, random_grads

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "fast_paths.md"


class RowCase(NamedTuple):
    shapes: dict
    dtype: type = np.float64
    fast_path: FastPath | str = "auto"
    foam: bool = False
    steps: int = 3
    batch_axes: int = 0
    detail_clip: float | None = None  # a bound that never binds: the inverse's general path


TPU, CUDA, ROCM = (FastPath(emulate=p) for p in ("tpu", "cuda", "rocm"))
CASES = {
    "tpu-block-sums": RowCase({"w": (64, 8), "bias": (7,)}, fast_path=TPU),
    "tpu-repeat-one-device": RowCase({"w": (32, 128)}, fast_path=TPU),
    # on 8 devices; a stack's closed-form update walks its matrices (tpu-update-layer-by-layer), the
    # general inverse repeats the stack
    "tpu-repeat-partitioned": RowCase({"w": (3, 16, 128)}, fast_path=TPU, batch_axes=1, detail_clip=1e30),
    "tpu-means-from-gradient": RowCase({"w": (64, 8), "v": (37, 6)}, np.float32, TPU),
    "cuda-means-from-gradient": RowCase({"w": (64, 8), "v": (37, 6)}, np.float32, CUDA, foam=True),
    "rocm-means-from-gradient": RowCase({"w": (64, 8)}, np.float32, ROCM),
    "cuda-update-unguarded": RowCase({"w": (64, 8), "v": (37, 6)}, fast_path=CUDA),
    "rocm-update-unguarded": RowCase({"w": (3, 16, 8)}, fast_path=ROCM, batch_axes=1),
    "tpu-update-layer-by-layer": RowCase({"w": (3, 16, 8), "v": (2, 37, 6)}, fast_path=TPU, batch_axes=1),
    "tpu-pallas-update": RowCase({"w": (4096, 2048)}, np.float32, TPU, steps=1),
    "cpu-ffi-moments": RowCase({"w": (64, 8), "v": (37, 6)}, fast_path=FastPath(cpu_kernel=True)),
    "cpu-one-limiter-vector": RowCase({"w": (64, 8), "v": (37, 6), "bias": (7,)}),
}
ONE_DEVICE = [r.name for r in RULES if r.partitioning != "partitioned"]


def test_every_row_has_a_case_that_selects_it():
    assert sorted(CASES) == sorted(r.name for r in RULES)
    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)


def optimizer(case: RowCase, level: int = 2):
    if case.foam:
        return optax_gwt.foam_adamw(
            1e-2, weight_decay=0.1, level=level, fast_path=case.fast_path, batch_axes=case.batch_axes
        )
    return optax_gwt.gwt_adamw(
        1e-2, weight_decay=0.1, level=level, fast_path=case.fast_path, batch_axes=case.batch_axes,
        detail_clip=case.detail_clip,
    )  # fmt: skip


def reference(case: RowCase, level: int = 2):
    if case.foam:
        return ReferenceFOAM(lr=1e-2, weight_decay=0.1, level=level)
    return ReferenceGWTAdamW(lr=1e-2, weight_decay=0.1, level=level)


def check_row(name: str, put: Callable = lambda tree: tree) -> None:
    """`CASES[name]`'s jitted trajectory (its arrays placed by `put`) equals the reference's (in
    float32, as closely as the plain formulation's does), and the row was chosen while tracing it."""
    case = CASES[name]
    if name == "cpu-ffi-moments":
        from optax_gwt.kernels import cpu_ffi

        if not cpu_ffi.available():
            pytest.skip("no C++ compiler: the opt-in CPU kernel is not built")
    with recording() as taken:
        got, want, start = trajectories(case, put)
    assert name in taken, sorted(set(taken))
    plain = None if case.dtype == np.float64 else trajectories(case._replace(fast_path="xla"), put)[0]
    for k in want:
        error = np.abs(np.asarray(got[k], np.float64) - want[k]).max()
        if plain is None:
            assert error <= 1e-9, (k, error)
        else:  # float32: within a few times the plain formulation's own rounding error
            rounding = np.abs(plain[k] - want[k]).max()
            assert error <= 4 * rounding + 1e-7 * np.abs(want[k] - start[k]).max(), (k, error, rounding)


def trajectories(case: RowCase, put: Callable) -> tuple[dict, dict, dict]:
    """``(ours, the reference's, the start)`` after `case.steps` steps, as float64 NumPy arrays by
    matrix (a stack's matrices are the reference's arrays one by one)."""
    params, rng = problem(case.shapes, 0, case.dtype)

    def split(tree: dict) -> dict:
        tree = {k: np.asarray(v, np.float64) for k, v in tree.items()}
        if not case.batch_axes:
            return tree
        return {f"{k}[{i}]": v[i] if v.ndim == 3 else v for k, v in tree.items() for i in range(len(v))}

    opt, ref, want = optimizer(case), reference(case), split(params)
    p = put(jax.tree.map(jnp.asarray, params))
    state, update = jax.jit(opt.init)(p), jax.jit(opt.update)
    for _ in range(case.steps):
        g = random_grads(rng, params, case.dtype)
        want = ref.step(want, split(g))
        u, state = update(put(jax.tree.map(jnp.asarray, g)), state, p)
        p = optax.apply_updates(p, u)
    return split(jax.device_get(p)), want, split(params)


@pytest.mark.parametrize("name", ONE_DEVICE)
def test_row_equals_the_reference(name, x64):
    check_row(name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_close_over_no_arrays(name, x64):
    """A row's program holds no array built outside it: JAX (0.12 and up) passes each such
    constant to every call as one more argument, counted in the step's memory."""
    case = CASES[name]
    params = {k: jax.ShapeDtypeStruct(s, case.dtype) for k, s in case.shapes.items()}
    opt = optimizer(case)
    state = jax.eval_shape(opt.init, params)
    consts = jax.make_jaxpr(opt.update)(params, state, params).consts
    assert [np.shape(c) for c in consts if np.ndim(c)] == []


def test_rows_are_chosen_by_their_conditions():
    """`select` on cases just outside each condition takes the plain formulation."""
    f32 = dict(dtype=np.float32, state_dtype=np.float32)
    assert select(Case("block_sums", (66, 8), axis=0, block=4), "tpu")[0] is None  # 4 does not divide 66
    assert select(Case("block_means", (64, 8), axis=0, block=8, **f32), "tpu")[0] is None  # level 3
    assert select(Case("block_means", (3, 64, 8), axis=1, block=4, **f32), "cuda")[0] is None  # a stack
    big = Case("block_means", (2048, 1024), axis=0, block=4, **f32)
    assert select(big, "cuda")[0] is None and select(big, "tpu")[0] is not None
    assert select(Case("repeat", (8, 100), axis=0, block=4, length=32), "tpu") == (None, None)  # 100 lanes
    assert select(Case("limiter"), "cpu", "xla") == (None, None)
    assert select(Case("limiter"), "tpu") == (None, None)


def test_the_docs_table_is_the_table():
    text = DOCS.read_text()
    assert markdown_table() in text, "docs/fast_paths.md: paste optax_gwt.kernels.markdown_table()"


@pytest.mark.parametrize("build", [optax_gwt.gwt_adamw, optax_gwt.foam_adamw], ids=["gwt", "foam"])
def test_the_default_update_is_differentiable_and_has_no_custom_call(build):
    """Meta-learning and hypergradients differentiate through `update`: jitted `jax.grad` and
    `jax.jvp` against central differences in float64, and the default step compiles to XLA alone."""
    with jax.enable_x64(True):
        params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(16, 8))), "b": jnp.zeros(8)}
        tx = build(1e-2, weight_decay=0.1, level=2)
        g0 = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(1).normal(size=p.shape)), params)
        _, state = tx.update(g0, tx.init(params), params)  # a step in: the moments are not zero

        def loss(g):
            u, _ = tx.update(g, state, params)
            return jnp.sum(jnp.sin(u["w"])) + jnp.sum(u["b"] ** 2)

        grad = jax.jit(jax.grad(loss))(g0)
        direction = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(2).normal(size=p.shape)), params)
        _, slope = jax.jit(lambda g, t: jax.jvp(loss, (g,), (t,)))(g0, direction)
        h = 1e-6
        shifted = [jax.tree.map(lambda g, t, s=s: g + s * h * t, g0, direction) for s in (1, -1)]
        numeric = (loss(shifted[0]) - loss(shifted[1])) / (2 * h)
        along = sum(jnp.vdot(grad[k], direction[k]) for k in grad)
        np.testing.assert_allclose(float(slope), float(numeric), rtol=1e-5)
        np.testing.assert_allclose(float(along), float(numeric), rtol=1e-5)
        text = jax.jit(tx.update).lower(g0, state, params).compile().as_text()
    assert "custom-call" not in text


@pytest.mark.parametrize("fast_path", ["auto", TPU], ids=["auto", "tpu"])
def test_derivatives_through_the_rows_equal_the_plain_ones(fast_path, x64):
    """float32 matrices of 128 lanes at level 2, where the means and repeat rows apply: jitted
    `jax.grad` and `jax.jvp` through `update` equal the plain formulation's in float64, as closely
    as the plain formulation's own in float32 do (the update divides by small denominators)."""
    rng = np.random.default_rng(3)
    arrays = [rng.normal(size=(16, 128)) for _ in range(3)]
    got = {}
    for fp, dtype in ((fast_path, jnp.float32), ("xla", jnp.float32), ("xla", jnp.float64)):
        params, g0, direction = ({"w": jnp.asarray(a, dtype)} for a in arrays)
        tx = optax_gwt.gwt_adamw(1e-2, weight_decay=0.1, level=2, fast_path=fp)
        _, state = tx.update(g0, tx.init(params), params)

        def loss(g, tx=tx, state=state, params=params):
            return jnp.sum(jnp.sin(tx.update(g, state, params)[0]["w"]))

        with recording() as taken:
            grad = jax.jit(jax.grad(loss))(g0)["w"]
            slope = jax.jit(lambda g, t, loss=loss: jax.jvp(loss, (g,), (t,))[1])(g0, direction)
        got[fp, dtype] = np.asarray(grad, np.float64), float(slope), taken
    (grad, slope, taken), (plain_grad, plain_slope, _), (want, want_slope, _) = got.values()
    assert any("means-from-gradient" in name for name in taken), taken
    assert np.abs(grad - want).max() <= 2 * np.abs(plain_grad - want).max() + 1e-6 * np.abs(want).max()
    assert abs(slope - want_slope) <= 2 * abs(plain_slope - want_slope) + 1e-6 * abs(want_slope)
