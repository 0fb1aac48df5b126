"""optax_gwt.levanter: GWT and FOAM by name in Levanter (runs where ``optax-gwt[levanter]`` is installed;
skipped elsewhere). Levanter's own Llama, built small; 8 simulated devices in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("levanter")
hax = pytest.importorskip("haliax")
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402
from levanter.optim import AdamConfig, OptimizerConfig  # noqa: E402

import optax_gwt  # noqa: E402
import optax_gwt.levanter as gl  # noqa: E402

CONFIG = LlamaConfig(max_seq_len=32, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2)


def _params():
    model = CONFIG.build(hax.Axis("vocab", 100), key=jax.random.PRNGKey(0))
    return eqx.filter(model, eqx.is_array)


def test_registered_by_name():
    assert OptimizerConfig.get_choice_class("gwt") is gl.GWTConfig
    assert OptimizerConfig.get_choice_class("foam") is gl.FOAMConfig


def test_axes_by_name_never_the_layer_or_the_fsdp_axis():
    params = _params()
    layers = params.transformer.layers.stacked
    for weight in (layers.mlp.gate_proj.weight, layers.mlp.down_proj.weight, layers.self_attn.q_proj.weight):
        axis, batch = gl.choose_axes(weight)
        assert batch == 1 and weight.axis_names[axis] not in ("layer", "embed"), (weight.axis_names, axis)
    assert gl.choose_axes(layers.mlp.gate_proj.weight) == (1, 1)  # (layer, mlp, embed): mlp
    assert (
        gl.choose_axes(layers.self_attn.q_proj.weight)[0] == 3
    )  # (layer, kv_head, q_heads_per_group, head_size, embed)
    assert gl.choose_axes(params.transformer.norm.weight) == (None, 0)


@pytest.mark.parametrize("name", ["gwt", "foam"])
def test_state_of_the_hidden_matrices_is_a_quarter_of_adams(name):
    params = _params()
    tx = OptimizerConfig.get_choice_class(name)(learning_rate=1e-2, level=2).build(100)
    state = tx.init(params)
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
    ratio = gl.hidden_state_bytes(tx, params) / gl.hidden_state_bytes(AdamConfig().build(100), params)
    print(f"{name}: hidden matrices' state / AdamW's = {ratio:.4f}")
    assert ratio == pytest.approx(0.25, abs=1e-3)
    # The limiter's scalars: plain arrays, one per layer's matrix (GWT; FOAM has no limiter).
    scalars = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax_gwt_limiter_state()))
        if isinstance(x, optax_gwt_limiter_state())
    ]
    assert len(scalars) == (1 if name == "gwt" else 0)
    for s in scalars:
        wrapped = lambda x: hax.is_named_array(x) and isinstance(x.array, jax.Array)  # noqa: E731  (not masked out)
        leaves = jax.tree.leaves(s.norm_prev, is_leaf=wrapped)
        assert leaves and all(not hax.is_named_array(x) and x.shape in ((), (2,)) for x in leaves), [
            (type(x), x.shape) for x in leaves
        ]


def test_the_delayed_limiter_by_config():
    """``norm_growth_delayed: true`` reaches the limiter: the same first steps, then other updates."""
    params = _params()
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape), params)
    runs = []
    for delayed in (False, True):
        tx = gl.GWTConfig(learning_rate=1e-2, level=2, norm_growth_delayed=delayed).build(100)
        state, out = tx.init(params), []
        for t in range(4):  # gradients that grow, so that the limiter acts
            scaled = jax.tree.map(lambda g, k=4.0**t: g * k, grads)
            updates, state = jax.jit(tx.update)(scaled, state, params)
            out.append(jax.tree.leaves(updates))
        runs.append(out)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    assert not all(bool(jnp.allclose(a, b)) for a, b in zip(runs[0][3], runs[1][3], strict=True))


def test_type_gwt_bounds_a_repeated_gradient_by_default():
    """The same gradient every step, no warm-up: by default the hidden matrices' update stays
    within `SAFE_DETAIL_CLIP` Adam steps (times lr x scale); ``detail_clip: null`` (the paper's)
    goes far beyond."""
    params = _params()
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape), params)
    largest = {}
    for clip in (optax_gwt.SAFE_DETAIL_CLIP, None):
        config = gl.GWTConfig(learning_rate=1.0, level=2, scale=1.0, warmup=0.0, max_grad_norm=None,
                              detail_clip=clip, weight_decay=0.0)  # fmt: skip
        tx = config.build(100)
        state, update, worst = tx.init(params), jax.jit(tx.update), 0.0
        for _ in range(5):
            updates, state = update(grads, state, params)
            worst = max(worst, float(jnp.abs(updates.transformer.layers.stacked.mlp.up_proj.weight.array).max()))
        largest[clip] = worst
    assert largest[optax_gwt.SAFE_DETAIL_CLIP] <= optax_gwt.SAFE_DETAIL_CLIP + 1.0, largest
    assert largest[None] > 10 * optax_gwt.SAFE_DETAIL_CLIP, largest


def optax_gwt_limiter_state():
    import optax_gwt

    return optax_gwt.LimitNormGrowthState


SHARDED = r"""
import json, jax, equinox as eqx, haliax as hax
from jax.sharding import Mesh
import numpy as np
from levanter.models.llama import LlamaConfig
import optax_gwt, optax_gwt.levanter as gl
cfg = LlamaConfig(max_seq_len=32, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2)
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
mapping = {"embed": "data", "mlp": "model", "heads": "model", "kv_head": "model"}
with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
    params = eqx.filter(cfg.build(hax.Axis("vocab", 128), key=jax.random.PRNGKey(0)), eqx.is_array)
    params = hax.shard(params)
    tx = gl.GWTConfig(learning_rate=1e-2, level=2).build(10)
    state = eqx.filter_jit(tx.init)(params)
    state = hax.shard(state)
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if "up_proj" in name or "norm_prev" in name:
            out[name] = [list(x.shape), str(x.sharding.spec)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_moments_sharded_like_their_params_on_eight_devices():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (shape, spec) in sorted(out.items()):
        print(name, shape, spec)
    moments = {k: v for k, v in out.items() if "up_proj" in k and (".mu" in k or ".nu" in k)}
    assert moments and all(shape == [2, 32, 64] for shape, _ in moments.values())  # mlp 128 -> 32
    assert all(spec.endswith("(None, 'model', 'data')") for _, spec in moments.values()), moments  # as up_proj
    scalars = {k: v for k, v in out.items() if "norm_prev" in k}
    assert scalars and all(spec.endswith("()") for _, spec in scalars.values()), scalars  # replicated


@pytest.mark.slow
def test_train_lm_with_gwt_trains_and_resumes_bit_for_bit(tmp_path):
    """Levanter's own train_lm, ``type: gwt``, 8 simulated devices, offline: the loss is finite and
    falls, a run resumed from the step-4 checkpoint repeats the next losses bit for bit, and the
    hidden matrices' state is a quarter of Levanter's adam's."""
    from benchmarks import levanter_run

    r = levanter_run.run_all(tmp_path, steps=8, baseline=False)  # adam's losses are the benchmark's, not asserted
    print(levanter_run.markdown(r))
    gwt = r["gwt"]
    assert all(np.isfinite(v) for v in gwt.values()) and gwt[max(gwt)] < gwt[min(gwt)]
    resumed = r["resume"]["then"]
    assert resumed and all(resumed[s] == gwt[s] for s in resumed), (resumed, gwt)
    # A quarter of adam's moments, and the limiter's norm and factor per layer's matrix (7 matrices, 2 layers).
    assert r["gwt_bytes"] == r["adam_bytes"] // 4 + 2 * 4 * 7 * 2
