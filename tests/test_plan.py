"""The planner (optax_gwt.plan): memory from XLA's analysis, the batch search, the roofline.

Most tests plan a toy two-matrix model (compiles in a fraction of a second);
one subprocess plans it on 4 simulated devices; the LLaMA planner is checked
on a tiny config (slow: a few compiles of the scanned decoder).
"""

from __future__ import annotations

import doctest
import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt
from optax_gwt import plan


def toy_loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def toy_params(width: int = 64, hidden: int = 256) -> dict:
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    return {"w1": f32(width, hidden), "w2": f32(hidden, width)}


def toy_batch(b: int, width: int = 64) -> tuple:
    return (jax.ShapeDtypeStruct((16 * b, width), jnp.float32),) * 2


def total(tx, params, b, width=64) -> plan.StepMemory:
    compiled, state = plan.compile_step(toy_loss, tx, params, toy_batch(b, width))
    return plan.step_memory(compiled, state, toy_batch(b, width), params=params)


def test_largest_batch_is_exact_with_few_probes():
    for per, fixed, budget in [(100, 1000, 5050), (37, 0, 10_000), (1, 5, 6)]:
        batch, probes = plan.largest_batch(
            lambda b, fixed=fixed, per=per: fixed + per * b + (b * b) // 50, budget, max_batch=500
        )
        expected = max(b for b in range(1, 501) if fixed + per * b + (b * b) // 50 <= budget)
        assert batch == expected and len(probes) <= 12
    assert plan.largest_batch(lambda b: 10 * b, 5) == (0, {1: 10})


def test_memory_grows_with_batch_and_model_size():
    adam = optax.adamw(1e-3)
    by_batch = [total(adam, toy_params(), b).total for b in (1, 4, 16)]
    assert by_batch == sorted(set(by_batch))
    assert total(adam, toy_params(hidden=512), 1).total > by_batch[0]


def test_gwt_below_adam_and_state_matches_optimizer_state_bytes():
    params = toy_params()
    adam, gwt = total(optax.adamw(1e-3), params, 2), total(optax_gwt.gwt_adamw(1e-3, level=2), params, 2)
    assert gwt.opt_state < adam.opt_state and gwt.total < adam.total
    assert gwt.opt_state == optax_gwt.optimizer_state_bytes(optax_gwt.gwt_adamw(1e-3, level=2), params).total
    assert adam.params == adam.grads == 2 * 64 * 256 * 4


def test_plan_step_fits_the_budget_and_roofline():
    params, tx = toy_params(), optax_gwt.gwt_adamw(1e-3, level=2)
    one = total(tx, params, 1).total
    result = plan.plan_step(toy_loss, tx, params, toy_batch, one + 40_000)
    assert result.batch >= 2 and result.memory.total <= one + 40_000
    assert result.probes[result.batch + 1] > one + 40_000
    speed = plan.roofline(result, plan.ACCELERATORS["h100"], tokens_per_step=16 * result.batch)
    assert speed.tokens_per_s > 0 and 0 < speed.update_share < 1


def test_a_micro_batch_the_compiler_refuses_does_not_fit(monkeypatch):
    """A TPU's compiler raises RESOURCE_EXHAUSTED for a program over the chip's memory, where
    others give its memory analysis: that micro-batch does not fit; any other error is raised."""
    compile_step = plan.compile_step

    def refusing(loss_fn, tx, params, batch, message="RESOURCE_EXHAUSTED: Ran out of memory on HBM"):
        if batch[0].shape[0] > 16 * 5:  # micro-batch 6 and up
            raise jax.errors.JaxRuntimeError(message)
        return compile_step(loss_fn, tx, params, batch)

    monkeypatch.setattr(plan, "compile_step", refusing)
    tx = optax_gwt.gwt_adamw(1e-3, level=2)
    result = plan.plan_step(toy_loss, tx, toy_params(), toy_batch, budget=2**40)
    assert result.batch == 5 and result.probes[6] == math.inf
    # Even micro-batch 1 refused: no fit, and the sizes the compiler said it needed, not a traceback.
    needed = "RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (1.50G) exceeds available HBM"
    monkeypatch.setattr(plan, "compile_step", lambda *args: refusing(*args[:3], toy_batch(6), message=needed))
    refused = plan.plan_step(toy_loss, tx, toy_params(), toy_batch, budget=2**40)
    assert refused.batch == 0 and refused.memory.refused and refused.memory.total == int(1.5 * 2**30)
    assert refused.memory.opt_state == plan.shard_bytes(plan.abstract_state(tx, toy_params()))
    monkeypatch.setattr(plan, "compile_step", functools.partial(refusing, message="INTERNAL: something else"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        plan.plan_step(toy_loss, tx, toy_params(), toy_batch, budget=2**40)


def test_docstring_examples():
    result = doctest.testmod(plan, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and not result.failed


def test_linear_extrapolation():
    cost = plan.linear_extrapolation(lambda n: plan.Cost(10.0 + 3 * n, 1.0 * n), 32)
    assert cost == plan.Cost(10.0 + 3 * 32, 32.0)


SHARDED = """
import json, jax, jax.numpy as jnp, numpy as np, optax, optax_gwt
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from optax_gwt import plan
from tests.test_plan import toy_loss, toy_params, toy_batch
out = {}
for n in (1, 2, 4):
    mesh = Mesh(np.array(jax.devices()[:n]), ("fsdp",))
    put = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    # Matrices large enough that their shards, not the per-device constants, decide the totals.
    params = {k: put(v, P(None, "fsdp")) for k, v in toy_params(256, 1024).items()}
    batch = tuple(put(x, P("fsdp")) for x in toy_batch(n, 256))  # micro-batch 1 per device
    tx = optax_gwt.gwt_adamw(1e-3, level=2)  # its compressed moments split like their params
    compiled, state = plan.compile_step(toy_loss, tx, params, batch)
    out[n] = plan.step_memory(compiled, state, batch, params=params).total
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_totals_fall_with_devices():
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["1"] > out["2"] > out["4"]


@pytest.mark.slow
def test_llama_planner_on_a_tiny_config():
    pytest.importorskip("flax")
    from optax_gwt.models.llama_config import LlamaConfig
    from optax_gwt.plan import llama

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=2, num_layers=2)
    mesh = llama.make_mesh({})
    params = llama.sharded(llama.abstract_params(cfg), mesh)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    memory = {}
    for name in ("adamw", "gwt-2"):
        tx = llama.make_optimizer(name, cfg)
        compiled, state = plan.compile_step(llama.loss_fn(cfg, mesh=mesh), tx, params, llama.batch_at(mesh, 16)(2))
        memory[name] = plan.step_memory(compiled, state, llama.batch_at(mesh, 16)(2), params=params)
    assert memory["adamw"].params == 4 * n_params
    assert memory["adamw"].opt_state >= 2 * 4 * n_params > memory["gwt-2"].opt_state
    assert memory["gwt-2"].total < memory["adamw"].total
    foam = plan.shard_bytes(plan.abstract_state(llama.make_optimizer("foam-2", cfg), params))
    assert foam < memory["gwt-2"].opt_state < memory["adamw"].opt_state  # FOAM-2: GWT-2's moments, no limiter


def test_a_model_that_does_not_fit_is_a_row_not_a_traceback(monkeypatch):
    """Micro-batch 1 refused by the chip's compiler: the report says "does not fit" with the total
    the compiler said the step needed, and every row states the optimizer state it saves."""
    from optax_gwt.plan import report

    needed = "RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (2.00G) exceeds available HBM"

    def refusing(*args):
        raise jax.errors.JaxRuntimeError(needed)

    rows = []
    for name, tx in (("adamw", optax.adamw(1e-3)), ("gwt-2", optax_gwt.gwt_adamw(1e-3, level=2))):
        if name == "gwt-2":  # the train step refused at every micro-batch, and the update alone too
            monkeypatch.setattr(plan, "compile_step", refusing)
            monkeypatch.setattr(plan, "compile_update", refusing)
        result = plan.plan_step(toy_loss, tx, toy_params(), toy_batch, budget=2**40, max_batch=4)
        rows.append(report.row("toy", name, 2 * 64 * 256, result, plan.ACCELERATORS["v5e"], 16, 1))
        monkeypatch.undo()
    adamw, gwt = report.with_state_saved(rows)
    assert adamw["batch_text"] == "4" and gwt["batch_text"] == "does not fit"
    assert gwt["total_b1_gib"] == pytest.approx(2.0)  # what the compiler said the step needed
    assert adamw["state_saved_gib"] == 0 and gwt["state_saved_gib"] > 0
    assert "does not fit" in report.table([adamw, gwt]) and math.isnan(gwt["update_tflops"])


@pytest.mark.parametrize("kind", ["gwt", "foam"])
def test_llama_planner_runs_gwt_on_the_stacks_as_per_layer(kind):
    """The planner's GWT and FOAM run on the stacked layers (``batch_axes=1``): their updates equal
    the same optimizer's on each layer under ``jax.vmap`` (`over_layers`), to float32 rounding."""
    pytest.importorskip("flax")
    from optax_gwt import modular
    from optax_gwt.models.llama_config import LlamaConfig
    from optax_gwt.plan import llama

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=2, num_layers=3)
    stacked = llama.make_optimizer(f"{kind}-2", cfg)
    block = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), llama.abstract_params(cfg)["layers"])
    per_layer = llama.over_layers(modular.make_optimizer(kind, block, steps=10_000, level=2))
    keys = iter(jax.random.split(jax.random.key(0), 64))
    params = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), llama.abstract_params(cfg))
    layers = params["layers"]
    got, want = stacked.init(params), per_layer.init(layers)
    for _ in range(3):
        grads = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), params)
        u, got = jax.jit(stacked.update)(grads, got, params)
        v, want = jax.jit(per_layer.update)(grads["layers"], want, layers)
        for a, b in zip(jax.tree.leaves(u["layers"]), jax.tree.leaves(v), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
