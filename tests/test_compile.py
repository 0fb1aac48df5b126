"""A GWT train step compiles once: 100 steps with a schedule and inject_hyperparams never retrace."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gwt


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"].astype(jnp.float32) + params["b1"].astype(jnp.float32))
    return jnp.mean((h @ params["w2"].astype(jnp.float32) - y) ** 2)


@pytest.mark.parametrize(
    "dtype, kw",
    [
        (jnp.float32, dict(level=2)),
        (
            jnp.bfloat16,
            dict(
                level=3, wavelet="db2", mode="symmetric", mu_dtype=jnp.bfloat16, nu_dtype=jnp.float32, detail_clip=5.0
            ),
        ),
    ],
)
def test_train_step_compiles_once_over_100_steps(dtype, kw):
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(0.3 * rng.standard_normal((24, 16)), dtype),
        "b1": jnp.zeros((16,), dtype),
        "w2": jnp.asarray(0.3 * rng.standard_normal((16, 8)), dtype),
    }
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, 100, 3e-3)
    opt = optax.apply_if_finite(
        # hyperparam_dtype: by default Optax casts the hyperparameters to the params' dtype,
        # and b2 = 0.999 is 1.0 in bfloat16 (v stays 0 and the bias-corrected step is 0).
        optax.inject_hyperparams(optax_gwt.gwt_adamw, static_args=optax_gwt.STATIC_ARGS, hyperparam_dtype=jnp.float32)(
            learning_rate=sched, weight_decay=0.01, **kw
        ),
        max_consecutive_errors=3,
    )
    state = opt.init(params)
    traces = []

    @jax.jit
    def step(params, state, x, y):
        traces.append(1)  # runs only while tracing
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    x = jnp.asarray(rng.standard_normal((32, 24)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    losses = []
    for i in range(100):
        if i == 50:  # a hyperparameter changed by hand mid-run is a new value, not a new program
            hp = state.inner_state.hyperparams
            state = state._replace(
                inner_state=state.inner_state._replace(
                    hyperparams={**hp, "weight_decay": jnp.asarray(0.02, hp["weight_decay"].dtype)}
                )
            )
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    assert len(traces) == 1
    assert step._cache_size() == 1
    assert jax.tree_util.tree_map(lambda p: p.dtype, params) == {"w1": dtype, "b1": dtype, "w2": dtype}
    assert losses[-1] < 0.9 * losses[0]
    # The schedule was applied: the last learning rate is the schedule's.
    np.testing.assert_allclose(float(state.inner_state.hyperparams["learning_rate"]), float(sched(99)), rtol=1e-5)
