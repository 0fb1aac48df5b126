"""optax_gwt.sharding: state layouts from the params' (one device, abstract meshes), and
multi-device / multi-process / Orbax runs in subprocesses with 8 simulated CPU devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import optax_gwt
from optax_gwt.sharding import per_device_bytes, state_partition_specs, state_shardings, unsharded_axis

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
import sharded_train  # noqa: E402

MESH = AbstractMesh((2, 4), ("data", "fsdp"))
PARAMS = {
    "dense": {"kernel": jax.ShapeDtypeStruct((64, 32), jnp.float32), "bias": jax.ShapeDtypeStruct((32,), jnp.float32)},
    "odd": jax.ShapeDtypeStruct((40, 16), jnp.float32),
}
SPECS = {"dense": {"kernel": P("fsdp", "data"), "bias": P("fsdp")}, "odd": P("fsdp")}


def leaves_by_path(tree, is_leaf=None):
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def specs_by_path(opt, params=PARAMS, specs=SPECS, mesh=MESH):
    out = state_partition_specs(opt, params, specs, mesh)
    return leaves_by_path(out, is_leaf=lambda x: isinstance(x, P))


@pytest.mark.parametrize("builder", [optax_gwt.gwt_adamw, optax_gwt.foam_adamw], ids=["gwt", "foam"])
def test_gwt_adamw_state_specs(builder):
    """Moments get the param's spec; the compressed axis keeps its mesh axis only where divisible."""
    specs = specs_by_path(builder(1e-3, weight_decay=0.1, level=2))
    for moment in ("mu", "nu"):
        # kernel rows 64 -> 16 compressed, divisible by fsdp=4: sharded like the param.
        assert specs[f"[0][1].inner_state.{moment}['dense']['kernel']"] == P("fsdp", "data")
        assert specs[f"[0][1].inner_state.{moment}['dense']['bias']"] == P("fsdp")
        # odd rows 40 -> 10 compressed, not divisible by 4: replicated along that axis.
        assert specs[f"[0][1].inner_state.{moment}['odd']"] == P()
    scalars = [k for k in specs if "count" in k or "norm_prev" in k]
    assert scalars and all(specs[k] == P() for k in scalars)
    assert ("norm_prev" in " ".join(specs)) == (builder is optax_gwt.gwt_adamw)  # FOAM has no limiter


def test_level_decides_divisibility():
    """Level 3 compresses the kernel's 64 rows to 8: still divisible by fsdp=4; level 5 to 2: not."""
    assert specs_by_path(optax_gwt.gwt_adamw(1e-3, level=3))["[0][1].inner_state.mu['dense']['kernel']"] == P(
        "fsdp", "data"
    )
    assert specs_by_path(optax_gwt.gwt_adamw(1e-3, level=5, min_dim_size=64))[
        "[0][1].inner_state.mu['dense']['kernel']"
    ] == P(None, "data")


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax_gwt.gwt_adamw(1e-3)),
        lambda: optax.inject_hyperparams(optax_gwt.gwt_adamw, static_args=optax_gwt.STATIC_ARGS)(learning_rate=1e-3),
        lambda: optax.multi_transform(
            {"gwt": optax_gwt.gwt_adamw(1e-3), "adam": optax.adam(1e-3)},
            {"dense": {"kernel": "gwt", "bias": "adam"}, "odd": "adam"},
        ),
    ],
    ids=["chain", "inject_hyperparams", "multi_transform"],
)
def test_composed_states(make):
    """Inside chains and multi_transform: every array of a param's shape family gets a spec derived from it."""
    opt = make()
    state = leaves_by_path(jax.eval_shape(opt.init, PARAMS))
    specs = specs_by_path(opt)
    assert specs.keys() == state.keys()
    kernel = [k for k in state if k.endswith("['dense']['kernel']") and state[k].ndim == 2]
    full_odd = [k for k in state if k.endswith("['odd']") and state[k].shape == (40, 16)]
    assert kernel and all(specs[k] == P("fsdp", "data") for k in kernel)
    # Adam's full-size moments of "odd" (multi_transform) keep the param's own spec.
    assert all(specs[k] == P("fsdp") for k in full_odd)
    assert all(specs[k] == P() for k in state if state[k].ndim == 0)


def test_state_shardings_are_named_on_the_params_mesh():
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), SPECS)
    opt = optax_gwt.gwt_adamw(1e-3)
    out = state_shardings(opt, PARAMS, shardings)
    flat = jax.tree_util.tree_leaves(out)
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in flat)
    assert out[0][1].inner_state.mu["odd"].spec == P("fsdp")  # size-1 axes divide everything
    # the params' own shardings are used when none are given
    placed = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), PARAMS, shardings)
    assert state_shardings(opt, placed) == out


def test_unsharded_axis():
    choose = unsharded_axis({"a": P("fsdp", None), "b": P(None, "fsdp"), "c": P("x", "y"), "v": P("fsdp"), "t": None})
    key = lambda name: (jax.tree_util.DictKey(name),)  # noqa: E731
    assert choose(key("a"), jnp.zeros((8, 4))) == 1
    assert choose(key("b"), jnp.zeros((8, 4))) == 0
    assert choose(key("c"), jnp.zeros((8, 4))) == 0  # every axis sharded: the default
    assert choose(key("v"), jnp.zeros((8,))) is None  # vectors are not transformed
    assert choose(key("t"), jnp.zeros((8, 4, 2))) == 0
    with pytest.raises(KeyError):
        choose(key("missing"), jnp.zeros((8, 4)))
    # as gwt_adamw's axis: the compressed axis is the unsharded one
    opt = optax_gwt.gwt_adamw(1e-3, axis=unsharded_axis({"w": P("fsdp", None)}))
    assert jax.eval_shape(opt.init, {"w": jnp.zeros((16, 8))})[0][1].inner_state.mu["w"].shape == (16, 2)


def test_per_device_bytes_against_shard_shapes():
    tree = {"a": jax.ShapeDtypeStruct((64, 30), jnp.float32), "s": jax.ShapeDtypeStruct((), jnp.int32)}
    specs = {"a": P("fsdp", "data"), "s": P()}
    # (64 / 4) x (30 / 2) float32 + one int32 on every device
    assert per_device_bytes(tree, specs, MESH) == 16 * 15 * 4 + 4
    assert per_device_bytes(tree, {"a": P(("data", "fsdp")), "s": P()}, MESH) == 8 * 30 * 4 + 4


# ---------------------------------------------------------------------------
# Subprocesses: 8 simulated devices, two processes, Orbax across meshes.
# ---------------------------------------------------------------------------


def _env(devices=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # The last of two device counts wins: this one, not one the caller may have set.
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices or 1}"
    return env


def _run(args, devices=None, timeout=300):
    proc = subprocess.run(
        [sys.executable, *args], env=_env(devices), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def _train(tmp_path, name, devices, *args):
    """tests/sharded_train.py on `devices` simulated devices in a subprocess; None: one device, here."""
    out = tmp_path / f"{name}.json"
    if devices is None:
        sharded_train.main([*args, "--losses", str(out)])
    else:
        _run([str(TESTS / "sharded_train.py"), *args, "--losses", str(out)], devices=devices)
    return json.loads(out.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two_processes(args, devices_each):
    """Runs `args` as processes 0 and 1 of a jax.distributed job on localhost; returns their logs."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                *args,
                "--coordinator",
                f"localhost:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=_env(devices_each),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    return logs


@pytest.mark.slow
@pytest.mark.long
def test_eight_device_checks():
    """tests/multidevice_checks.py with 8 simulated devices: sharded == single device, no gathers, bytes/device."""
    _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "multidevice_checks.py")], devices=8)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One device, 9 steps without a break: the reference run."""
    return _train(tmp_path_factory.mktemp("ref"), "reference", None, "--steps", "9")


def _assert_same_run(run, reference):
    """Losses within float32 noise; params within 0.2% of how far the reference moved them.

    Summation orders differ between meshes, and GWT's details are divided by
    their block's Adam denominator, which magnifies float32 rounding where a
    block's mean gradient is near zero (see multidevice_checks).
    """
    np.testing.assert_allclose(run["losses"], reference["losses"][: len(run["losses"])], rtol=1e-4)
    start = sharded_train.init_params(jax.random.PRNGKey(0))
    for k, e in reference["params"].items():
        e = np.asarray(e)
        moved = np.max(np.abs(e - np.asarray(start[k])))
        np.testing.assert_allclose(np.asarray(run["params"][k]), e, rtol=0, atol=2e-3 * moved, err_msg=k)


@pytest.mark.slow
@pytest.mark.long
def test_two_processes_then_orbax_across_meshes(tmp_path, uninterrupted):
    """jax.distributed on localhost (2 processes x 4 CPU devices, gloo) trains 3 steps on data=2 x fsdp=4
    like one process and saves an Orbax checkpoint; one device resumes it to step 6 and saves; 8 devices
    (fsdp=2 x model=4) resume to step 9: the losses and params are those of the uninterrupted run."""
    out = tmp_path / "two.json"
    _run_two_processes(
        [
            str(TESTS / "sharded_train.py"),
            "--mesh",
            "data=2,fsdp=4",
            "--steps",
            "3",
            "--devices-per-process",
            "4",
            "--save",
            str(tmp_path / "ckpt3"),
            "--losses",
            str(out),
        ],
        devices_each=None,
    )
    two = json.loads(out.read_text())
    assert two["start"] == 0
    np.testing.assert_allclose(two["losses"], uninterrupted["losses"][:3], rtol=1e-5)

    one = _train(
        tmp_path,
        "one",
        None,
        "--mesh",
        "data=1",
        "--steps",
        "6",
        "--restore",
        str(tmp_path / "ckpt3"),
        "--save",
        str(tmp_path / "ckpt6"),
    )
    eight = _train(
        tmp_path, "eight", 8, "--mesh", "fsdp=2,model=4", "--steps", "9", "--restore", str(tmp_path / "ckpt6")
    )
    assert (one["start"], eight["start"]) == (3, 6)
    _assert_same_run(
        {"losses": two["losses"] + one["losses"] + eight["losses"], "params": eight["params"]}, uninterrupted
    )


@pytest.mark.slow
@pytest.mark.long
def test_llama_example_with_mesh_and_two_processes(tmp_path):
    """examples.llama.train: the mesh data=2,fsdp=4 over two processes (jax.distributed, 4 devices each)
    logs the losses of the same run on one device (in this process), to float32 summation order."""
    from examples.llama import train

    flags = [
        "--model",
        "num_layers=1",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--eval-batches",
        "1",
        "--no-progress",
        "--optimizer",
        "gwt",
        "--steps",
        "3",
        "--eval-every",
        "3",
    ]
    one = [
        r["loss"]
        for r in train.run(train.parse_args([*flags, "--run-dir", str(tmp_path / "one"), "--quiet"]))["history"]
    ]
    _run_two_processes(
        [
            "-m",
            "examples.llama.train",
            *flags,
            "--mesh",
            "data=2,fsdp=4",
            "--metrics",
            str(tmp_path / "two.jsonl"),
            "--run-dir",
            str(tmp_path / "two"),
        ],
        devices_each=4,
    )
    two = [json.loads(line)["loss"] for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert len(one) == 3
    np.testing.assert_allclose(two, one, rtol=1e-5)
