"""Run as a script with 8 simulated devices (test_explicit_mesh.py does): GWT on a
mesh of explicit axes, transform axis sharded or not, equals one device."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import optax_gwt  # noqa: E402
from optax_gwt.sharding import state_shardings  # noqa: E402

CASES = [
    ((64, 16), P("fsdp", None), dict(level=2)),  # transform axis sharded, blocks divide the mesh
    ((40, 16), P("fsdp", None), dict(level=2)),  # ... compressed length 10 does not divide 4
    ((64, 16), P("fsdp", "data"), dict(level=3)),
    ((48, 16), P("fsdp", None), dict(level=1, wavelet="db2")),  # general wavelet path
    ((64, 16), P(None, "fsdp"), dict(level=2, wavelet="db2", mode="symmetric")),  # unsharded transform axis
    ((37, 16), P(None, "fsdp"), dict(level=2)),
]


def main():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    for shape, spec, kw in CASES:
        params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)}
        grads = [{"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)} for _ in range(3)]
        tx = optax_gwt.gwt_adamw(1e-2, **kw)
        state, single = tx.init(params), []
        for g in grads:
            u, state = jax.jit(tx.update)(g, state, params)
            single.append(u["w"])
        for use_helper in (False, True):
            with jax.set_mesh(mesh):
                sp = {"w": NamedSharding(mesh, spec)}
                ps = jax.device_put(params, sp)
                ss = state_shardings(tx, params, sp) if use_helper else None
                state = jax.jit(tx.init, out_shardings=ss)(ps)
                update = jax.jit(tx.update, out_shardings=(sp, ss) if use_helper else None)
                for g, want in zip(grads, single):
                    u, state = update(jax.device_put(g, sp), state, ps)
                    assert jax.typeof(u["w"]).sharding.spec == jax.typeof(ps["w"]).sharding.spec
                    err = float(jnp.abs(u["w"] - want).max() / jnp.abs(want).max())
                    assert err < 1e-5, (shape, spec, kw, use_helper, err)
    print("explicit mesh checks passed")


if __name__ == "__main__":
    main()
