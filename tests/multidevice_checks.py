"""GWT on 8 simulated CPU devices: run by tests/test_sharding.py in its own process.

The module name does not match ``test_*.py``, so the main test run (one device)
does not collect it; `test_sharding.test_eight_device_checks` runs it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import optax_gwt
from optax_gwt.sharding import per_device_bytes, state_partition_specs, state_shardings, unsharded_axis

sys.path.insert(0, os.path.dirname(__file__))
import sharded_train

if jax.device_count() != 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8", allow_module_level=True)

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
PARAMS = ("w1", "b1", "w2", "w3", "w4")

# name: (mesh axes, params' specs, batch spec, GWT's axis: "free" = unsharded_axis(specs), or 0).
CASES = {
    "data_parallel": ({"data": 8}, {k: P() for k in PARAMS}, P("data"), "free"),
    "fsdp": (
        {"fsdp": 8},
        {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P(None, "fsdp"), "w3": P(None, "fsdp"), "w4": P(None, "fsdp")},
        P("fsdp"),
        "free",
    ),
    # Tensor parallel over model (w3 row-parallel: GWT then transforms its axis 1), data parallel over data.
    "data_x_model": (
        {"data": 2, "model": 4},
        {
            "w1": P(None, "model"),
            "b1": P("model"),
            "w2": P(None, "model"),
            "w3": P("model", None),
            "w4": P(None, "model"),
        },
        P("data"),
        "free",
    ),
    # The transform axis itself is sharded (w2 on both axes; the others along GWT's default axis 0).
    "transform_axis_sharded": (
        {"data": 2, "model": 4},
        {"w1": P("model"), "b1": P("model"), "w2": P("data", "model"), "w3": P("model"), "w4": P(None, "model")},
        P("data"),
        0,
    ),
}


def mesh_of(axes: dict, axis_type=AxisType.Auto):
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(axis_type,) * len(axes))


def shardings(mesh, specs):
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)


def params0():
    return sharded_train.init_params(jax.random.PRNGKey(0))


def chosen_axes(specs, axis) -> tuple:
    """The transform axis of each param, as a hashable tuple."""
    if axis == "free":
        choose = unsharded_axis(specs)
        return tuple(choose((jax.tree_util.DictKey(k),), v) for k, v in sorted(params0().items()))
    return tuple(axis if v.ndim >= 2 else None for _, v in sorted(params0().items()))


BUILDERS = {"gwt": optax_gwt.gwt_adamw, "foam": optax_gwt.foam_adamw}


@functools.cache
def gwt(axes: tuple, builder: str = "gwt"):
    """GWT-AdamW (or FOAM) with the given per-param axes (cached: one compiled reference per choice)."""
    return BUILDERS[builder](1e-3, weight_decay=0.1, axis=dict(zip(sorted(PARAMS), axes, strict=True)))


def grads_at(step: int):
    keys = jax.random.split(jax.random.PRNGKey(100 + step), len(PARAMS))
    return {
        k: (step + 1) * jax.random.normal(kk, v.shape, jnp.float32)
        for (k, v), kk in zip(sorted(params0().items()), keys, strict=True)
    }


@functools.cache
def reference_updates(axes: tuple, steps: int, builder: str = "gwt"):
    """One device: the updates and states of `steps` GWT (or FOAM) steps on `grads_at`."""
    opt, params = gwt(axes, builder), params0()
    state, out = opt.init(params), []
    update = jax.jit(opt.update)
    for t in range(steps):
        updates, state = update(grads_at(t), state, params)
        out.append(jax.device_get((updates, state)))
    return out


@functools.cache
def reference_training(axes: tuple, steps: int):
    """One device: the losses and final params of `steps` training steps."""
    opt, params = gwt(axes), params0()
    step = jax.jit(sharded_train.make_train_step(opt))
    state, losses = opt.init(params), []
    for t in range(steps):
        params, state, loss = step(params, state, *sharded_train.global_batch(t))
        losses.append(float(loss))
    return losses, jax.device_get(params)


def assert_trees_close(actual, expected, rtol):
    """Each leaf within rtol of its largest entry (an update's scale), leaf by leaf."""
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        e = np.asarray(e)
        np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=rtol * max(np.max(np.abs(e)), 1e-30))


def count_collectives(hlo: str) -> dict:
    return {c: len(re.findall(rf"\s{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}


def assert_only_scalar_all_reduces(hlo: str) -> None:
    counts = count_collectives(hlo)
    assert (
        counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == counts["reduce-scatter"] == 0
    ), counts
    for line in hlo.splitlines():
        if re.search(r"\sall-reduce(?:-start)?\(", line):
            result_type = line.split("=", 1)[1].split("all-reduce", 1)[0]
            assert re.fullmatch(r"\s*\(?(f32\[\](,\s*)?)+\)?\s*", result_type), line


@pytest.mark.parametrize(
    "name, builder",
    # FOAM where its layout differs from GWT's path (its energy sums over a sharded or gathered axis)
    [("fsdp", "gwt"), ("fsdp", "foam"), ("data_x_model", "gwt"), ("transform_axis_sharded", "gwt"),
     ("transform_axis_sharded", "foam")],
)  # fmt: skip
def test_sharded_update_equals_single_device(name, builder):
    """Same gradients, 3 steps: the sharded updates and states equal one device's (float32, rtol 1e-5).

    With the transform axes unsharded, the compiled update moves no array
    between devices: its only collective is the all-reduce of the norm-growth
    limiter's per-matrix scalars (FOAM, without a limiter, has none).
    """
    axes_of_mesh, specs, _, axis = CASES[name]
    mesh = mesh_of(axes_of_mesh)
    axes = chosen_axes(specs, axis)
    opt, params = gwt(axes, builder), params0()
    psh = shardings(mesh, specs)
    ssh = state_shardings(opt, params, psh)
    update = jax.jit(opt.update, in_shardings=(psh, ssh, psh), out_shardings=(psh, ssh))
    state = jax.jit(opt.init, out_shardings=ssh)(jax.device_put(params, psh))
    if axis == "free":
        assert_only_scalar_all_reduces(update.lower(params, state, params).compile().as_text())
    for t, expected in enumerate(reference_updates(axes, 3, builder)):
        updates, state = update(jax.device_put(grads_at(t), psh), state, jax.device_put(params, psh))
        assert_trees_close((updates, state), expected, rtol=1e-5)
    for leaf, sharding in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ssh), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


@functools.cache
def sharded_training_step(name: str, optimizer: optax.GradientTransformation | None = None):
    """The compiled train step of a case (GWT, or `optimizer`), and the params', state's and batch's shardings."""
    axes_of_mesh, specs, bspec, axis = CASES[name]
    mesh = mesh_of(axes_of_mesh)
    opt = optimizer or gwt(chosen_axes(specs, axis))
    psh, bsh = shardings(mesh, specs), NamedSharding(mesh, bspec)
    ssh = state_shardings(opt, params0(), psh)
    step = jax.jit(
        sharded_train.make_train_step(opt),
        in_shardings=(psh, ssh, bsh, bsh),
        out_shardings=(psh, ssh, NamedSharding(mesh, P())),
    )
    x, y = sharded_train.global_batch(0)
    return opt, step.lower(params0(), jax.eval_shape(opt.init, params0()), x, y).compile(), psh, ssh, bsh


@pytest.mark.parametrize("name", ["data_parallel", "fsdp", "data_x_model"])
def test_sharded_training_equals_single_device(name):
    """Forward, backward and GWT step on the mesh: the losses and params of 4 steps match one device.

    The gradients are summed in another order on the mesh; GWT's detail rule
    divides a block's details by its approximation's Adam denominator, which
    amplifies those float32 rounding differences where a block's mean is near
    zero, hence a tolerance on params relative to how far they moved.
    """
    opt, step, psh, ssh, bsh = sharded_training_step(name)
    params = params0()
    p = jax.device_put(params, psh)
    s = jax.jit(opt.init, out_shardings=ssh)(p)
    losses = []
    for t in range(4):
        p, s, loss = step(p, s, *jax.device_put(sharded_train.global_batch(t), bsh))
        losses.append(float(loss))
    ref_losses, ref_params = reference_training(chosen_axes(CASES[name][1], CASES[name][3]), 4)
    # Measured: 7e-6 at most with LLVM's optimisations, 2e-5 without them (the tests' setting);
    # a mis-sharded step is off by 1e-2 or more.
    np.testing.assert_allclose(losses, ref_losses, rtol=5e-5)
    moved = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(ref_params), jax.tree_util.tree_leaves(params), strict=True)
    )
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-3 * moved)


def test_fsdp_step_gathers_no_more_than_adamw():
    """A full FSDP train step with GWT compiles to as many all-gathers and all-to-alls as with optax.adamw."""

    def counts(optimizer=None):
        return count_collectives(sharded_training_step("fsdp", optimizer)[1].as_text())

    with_gwt, with_adamw = counts(), counts(optax.adamw(1e-3, weight_decay=0.1))
    assert with_adamw["all-gather"] > 0  # FSDP gathers the params for the forward pass
    for c in ("all-gather", "all-to-all"):
        assert with_gwt[c] == with_adamw[c], (c, with_gwt, with_adamw)


def test_state_bytes_per_device_fall_with_devices():
    """FSDP over n devices: each device holds 1/n of every matrix's compressed moments."""
    params = params0()
    specs = {k: P(None, "fsdp") if v.ndim == 2 else P("fsdp") for k, v in params.items()}
    opt = gwt(chosen_axes(specs, "free"))
    on_device = {}
    for n in (1, 2, 8):
        mesh = (
            mesh_of({"fsdp": n})
            if n == 8
            else jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
        )
        ssh = state_shardings(opt, params, shardings(mesh, specs))
        state = jax.jit(opt.init, out_shardings=ssh)(params)
        device = mesh.devices.flat[0]

        def held(tree, device=device):
            return sum(
                s.data.nbytes
                for leaf in jax.tree_util.tree_leaves(tree)
                for s in leaf.addressable_shards
                if s.device == device
            )

        moments = state[0][1].inner_state
        on_device[n] = {k: held((moments.mu[k], moments.nu[k])) for k in params}
        predicted = per_device_bytes(
            jax.eval_shape(opt.init, params), state_partition_specs(opt, params, specs, mesh), mesh
        )
        assert held(state) == predicted
    for k, v in params.items():
        # Adam's two float32 moments; a matrix's rows compressed 4x by level 2 (all row counts divide by 4).
        assert on_device[1][k] == 2 * 4 * v.size // (4 if v.ndim == 2 else 1), k
        assert on_device[2][k] * 2 == on_device[1][k] and on_device[8][k] * 8 == on_device[1][k], k


def test_compressed_axis_not_divisible_is_replicated():
    """w4 has 40 rows sharded 8 ways; compressed to 10 rows it cannot be, so its state replicates that axis."""
    mesh = mesh_of({"fsdp": 8})
    params = params0()
    specs = {k: P("fsdp") for k in params}
    opt = gwt(chosen_axes(specs, 0))
    ssh = state_shardings(opt, params, shardings(mesh, specs))
    assert ssh[0][1].inner_state.mu["w4"].spec == P()
    assert ssh[0][1].inner_state.mu["w2"].spec == P("fsdp")
    state = jax.jit(opt.init, out_shardings=ssh)(jax.device_put(params, shardings(mesh, specs)))
    assert state[0][1].inner_state.mu["w4"].addressable_shards[0].data.shape == (10, 32)
    assert state[0][1].inner_state.mu["w2"].addressable_shards[0].data.shape == (2, 64)


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_explicit_axes_mesh(builder):
    """On a mesh of explicit axes (`jax.make_mesh`'s default) the FSDP update runs and equals one device's."""
    axes_of_mesh, specs, _, axis = CASES["fsdp"]
    mesh = mesh_of(axes_of_mesh, AxisType.Explicit)
    axes = chosen_axes(specs, axis)
    opt, params = gwt(axes, builder), params0()
    psh = shardings(mesh, specs)
    ssh = state_shardings(opt, params, psh)
    with jax.set_mesh(mesh):
        state = jax.jit(opt.init, out_shardings=ssh)(jax.device_put(params, psh))
        update = jax.jit(opt.update)
        for t, expected in enumerate(reference_updates(axes, 3, builder)):
            updates, state = update(jax.device_put(grads_at(t), psh), state, jax.device_put(params, psh))
            assert_trees_close((updates, state), expected, rtol=1e-5)
    for leaf, sharding in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ssh), strict=True):
        assert leaf.sharding.spec == sharding.spec


# (shape, the param's spec on a data=2 x fsdp=4 mesh of explicit axes, gwt_adamw's arguments)
EXPLICIT_CASES = [
    ((64, 16), P("fsdp", None), dict(level=2)),  # transform axis sharded, blocks divide the mesh
    ((40, 16), P("fsdp", None), dict(level=2)),  # ... compressed length 10 does not divide 4
    ((64, 16), P("fsdp", "data"), dict(level=3)),
    ((48, 16), P("fsdp", None), dict(level=1, wavelet="db2")),  # general wavelet path
    ((64, 16), P(None, "fsdp"), dict(level=2, wavelet="db2", mode="symmetric")),  # unsharded transform axis
    ((37, 16), P(None, "fsdp"), dict(level=2)),
]


@functools.cache
def explicit_case_on_one_device(case: int):
    """The case's GWT, params, 3 gradients and their updates on one device (cached: both
    parametrizations of a case compare with the same reference)."""
    shape, _, kw = EXPLICIT_CASES[case]
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)}
    grads = [{"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)} for _ in range(3)]
    tx = optax_gwt.gwt_adamw(1e-2, **kw)
    state, single, update = tx.init(params), [], jax.jit(tx.update)
    for g in grads:
        u, state = update(g, state, params)
        single.append(u["w"])
    return tx, params, grads, single


@pytest.mark.parametrize("case", range(len(EXPLICIT_CASES)))
@pytest.mark.parametrize("use_helper", [False, True], ids=["inferred", "state_shardings"])
def test_explicit_mesh_transform_axis_sharded_or_not(case, use_helper):
    """Under ``jax.set_mesh`` of explicit axes, 3 updates equal one device's (rtol 1e-5) and keep
    the gradient's sharding, whether or not the transform axis is sharded, with the state's
    shardings inferred by jit or given by `state_shardings`."""
    mesh = mesh_of({"data": 2, "fsdp": 4}, AxisType.Explicit)
    spec = EXPLICIT_CASES[case][1]
    tx, params, grads, single = explicit_case_on_one_device(case)
    with jax.set_mesh(mesh):
        sp = {"w": NamedSharding(mesh, spec)}
        ps = jax.device_put(params, sp)
        ss = state_shardings(tx, params, sp) if use_helper else None
        state = jax.jit(tx.init, out_shardings=ss)(ps)
        update = jax.jit(tx.update, out_shardings=(sp, ss) if use_helper else None)
        for g, want in zip(grads, single, strict=True):
            u, state = update(jax.device_put(g, sp), state, ps)
            assert jax.typeof(u["w"]).sharding.spec == jax.typeof(ps["w"]).sharding.spec
            np.testing.assert_allclose(
                np.asarray(u["w"]), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max())
            )


def _hand_chain():
    proj = optax_gwt.WaveletProjection(level=2)
    return optax.chain(
        optax_gwt.wavelet_project(proj),
        optax_gwt.on_approximation(optax_gwt.scale_by_reference_adam(), proj),
        optax_gwt.limit_norm_growth(),
        optax_gwt.wavelet_inverse(),
        optax.scale_by_learning_rate(1e-3),
    )


@pytest.mark.parametrize("make", [lambda: optax_gwt.gwt_adamw(1e-3), _hand_chain], ids=["gwt_adamw", "hand_chain"])
def test_eager_init_state_follows_the_params(make):
    """An eager ``tx.init(params)`` (what nnx.Optimizer does) lays the compressed moments out like their
    param: split over all 8 devices when the param's split axis is not the transform axis, replicated
    (never one device) where the compressed axis cannot be split."""
    mesh = mesh_of({"fsdp": 8})
    params = {"w": jnp.ones((64, 256)), "t": jnp.ones((40, 16))}
    specs = {"w": P(None, "fsdp"), "t": P("fsdp")}  # t: its transform axis 0 is the split one, 40 / 4 = 10 rows
    sharded = jax.device_put(params, shardings(mesh, specs))
    state = make().init(sharded)

    def of_type(kind):
        leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, kind))
        return [s for s in leaves if isinstance(s, kind)][0]

    moments = of_type(optax_gwt.OnApproximationState).inner_state
    for moment in (moments.mu, moments.nu):
        assert moment["w"].sharding.spec == P(None, "fsdp") and len(moment["w"].sharding.device_set) == 8
        assert moment["w"].addressable_shards[0].data.shape == (16, 32)
        assert moment["t"].sharding.is_fully_replicated and len(moment["t"].sharding.device_set) == 8
    assert all(
        len(x.sharding.device_set) == 8
        for x in jax.tree_util.tree_leaves(of_type(optax_gwt.LimitNormGrowthState).norm_prev)
    )
    # ... and the update runs on that state.
    updates, _ = jax.jit(make().update)(sharded, state, sharded)
    assert updates["w"].sharding.spec == P(None, "fsdp")


@pytest.mark.parametrize("shape,spec,block", [((512, 1024), P("data", "model"), 2), ((512, 1024), P(None, "model"), 4)])
def test_pallas_kernel_runs_per_device_only(shape, spec, block, monkeypatch):
    """optax_gwt.kernels.pallas_tpu (in Pallas's interpreter) on a mesh: a program XLA partitions takes
    the XLA path (a custom call's operands would be gathered); the body of a `jax.shard_map`
    runs the kernel on each device's shard. Both give the one-device update."""
    from optax_gwt import haar
    from optax_gwt.kernels import pallas_tpu

    lowered = []
    pallas_update = pallas_tpu._pallas_update
    monkeypatch.setattr(pallas_tpu, "_pallas_update", lambda *a, **k: lowered.append(1) or pallas_update(*a, **k))
    mesh = mesh_of({"data": 2, "model": 4})
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.normal(size=shape), jnp.float32)
    small = [jnp.asarray(rng.random(size=(shape[0] // block, shape[1])), jnp.float32) for _ in range(3)]
    scalars = jnp.asarray([1e-8, 1.3, 0.7, 0.0, 0.25], jnp.float32)

    def update(g, approx, mu, nu, scalars):
        return pallas_tpu.haar_adam_update(
            g, approx, mu, nu, scalars, block=block, residual=False, compute=jnp.float32, out=jnp.float32,
            fallback=haar.update_from_scalars, interpret=True, fast_path=optax_gwt.FastPath(),
        )  # fmt: skip

    expected = jax.jit(update)(g, *small, scalars)
    assert lowered == [1]
    sharding = NamedSharding(mesh, spec)
    args = [jax.device_put(x, sharding) for x in (g, *small)] + [scalars]
    np.testing.assert_array_equal(jax.jit(update, out_shardings=sharding)(*args), expected)
    assert lowered == [1]
    # check_vma=False: Pallas's interpreter (not Mosaic) mixes varying and replicated values.
    per_shard = jax.shard_map(update, mesh=mesh, in_specs=(spec,) * 4 + (P(),), out_specs=spec, check_vma=False)
    np.testing.assert_array_equal(jax.jit(per_shard)(*args), expected)
    assert lowered == [1, 1]


def test_one_device_or_takes_partitioned_in_an_spmd_program():
    """`kernels.lowering.one_device_or`: a program XLA partitions over 8 devices lowers the partitioned
    function; the body of a `jax.shard_map` manual over the mesh lowers the single one."""
    from optax_gwt.kernels.lowering import one_device_or

    choose = functools.partial(one_device_or, lambda x: x + 1, lambda x: x + 2)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("d")))
    np.testing.assert_array_equal(jax.jit(choose)(x), np.arange(16.0) + 2)
    body = jax.shard_map(choose, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    np.testing.assert_array_equal(jax.jit(body)(x), np.arange(16.0) + 1)


@pytest.mark.parametrize("spec", [P(None, None, "fsdp"), P()], ids=["sharded", "replicated"])
def test_stacked_update_as_a_tpu_partitions_it(spec):
    """Stacked matrices (``batch_axes=1``) split over 8 devices, with the formulations a TPU
    program takes (``FastPath(emulate="tpu")``; rows ``tpu-repeat-partitioned`` in a partitioned
    program, ``tpu-repeat-one-device`` on one device), run here: the steps equal one device's to
    float32 rounding."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(3)
    shape = (3, 64, 128)
    params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)}
    grads = [{"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)} for _ in range(3)]
    tx = optax_gwt.gwt_adamw(1e-2, level=2, weight_decay=0.1, batch_axes=1, fast_path=optax_gwt.FastPath(emulate="tpu"))

    def run(put):
        p = put(params)
        state = jax.jit(tx.init)(p)
        step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
        for g in grads:
            p, state = step(p, state, put(g))
        return np.asarray(p["w"])

    sharded = run(lambda t: jax.device_put(t, NamedSharding(mesh, spec)))
    single = run(lambda t: jax.device_put(t, jax.devices()[0]))
    np.testing.assert_allclose(sharded, single, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("spec", [P(None, None, "fsdp"), P()], ids=["sharded", "replicated"])
@pytest.mark.parametrize("name", [r.name for r in optax_gwt.kernels.RULES if r.partitioning == "partitioned"])
def test_partitioned_rows_equal_the_reference(name, spec, x64):
    """The rows for programs that XLA partitions (`test_kernels`' cases, on 8 devices): the
    float64 reference's trajectory, and the row chosen."""
    import test_kernels

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    test_kernels.check_row(name, lambda tree: jax.device_put(tree, NamedSharding(mesh, spec)))
