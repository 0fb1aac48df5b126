"""A small self-contained GWT training run on a device mesh, for the sharding tests.

Run as a program (in its own process, so that the number of simulated devices
and `jax.distributed` can be set before JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/sharded_train.py --mesh data=2,fsdp=4 --steps 6 --save /tmp/ckpt --losses /tmp/l.json
    python tests/sharded_train.py --mesh data=1 --restore /tmp/ckpt --steps 9 --losses /tmp/l2.json

Two processes on one machine (4 simulated devices each, one 8-device mesh):

    python tests/sharded_train.py --mesh data=2,fsdp=4 --steps 4 --devices-per-process 4 \\
        --coordinator localhost:12345 --num-processes 2 --process-id {0,1}

The model is a 3-layer MLP regressing a fixed random teacher; the batch of
step t is a function of t only, so runs split across processes, meshes and
checkpoints see the same data. Matrices are sharded along their output axis
over ``fsdp`` and ``model`` (``w3`` along its input axis, as a row-parallel
layer), the batch over ``data`` and ``fsdp``; GWT's transform axis is chosen by
`optax_gwt.sharding.unsharded_axis`, and the optimizer state's shardings come
from `optax_gwt.sharding.state_shardings`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

IN, HIDDEN, OUT, BATCH = 32, 64, 32, 16


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"data=2,fsdp=4"`` -> ``(("data", "fsdp"), (2, 4))``."""
    names, sizes = [], []
    for item in text.split(","):
        name, _, size = item.partition("=")
        names.append(name.strip())
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


AXES = ("data", "fsdp", "model")


def make_mesh(text: str, devices: Sequence[Any] | None = None):
    """A mesh with the axes data, fsdp and model; those `text` leaves out have size 1.

    Every run names all three axes, so the params' PartitionSpecs, hence GWT's
    transform axes and the state's shapes, are the same on every mesh and a
    checkpoint restores on any of them.
    """
    import jax
    from jax.sharding import AxisType

    names, sizes = parse_mesh(text)
    unknown = set(names) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {AXES}")
    size = dict(zip(names, sizes, strict=True))
    shape = tuple(size.get(a, 1) for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def param_specs() -> dict:
    """The params' PartitionSpecs: matrices split over fsdp and model."""
    from jax.sharding import PartitionSpec as P

    split = ("fsdp", "model")
    return {"w1": P(None, split), "b1": P(split), "w2": P(None, split), "w3": P(split, None), "w4": P(None, split)}


def batch_spec():
    from jax.sharding import PartitionSpec as P

    return P(("data", "fsdp"))


def init_params(key):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(key, 4)
    f32 = jnp.float32
    return {
        "w1": jax.random.normal(k[0], (IN, HIDDEN), f32) / IN**0.5,
        "b1": jnp.zeros((HIDDEN,), f32),
        "w2": jax.random.normal(k[1], (HIDDEN, HIDDEN), f32) / HIDDEN**0.5,
        "w3": jax.random.normal(k[2], (HIDDEN, OUT), f32) / HIDDEN**0.5,
        "w4": jax.random.normal(k[3], (40, OUT), f32) / 40**0.5,
    }


def loss_fn(params, x, y):
    import jax
    import jax.numpy as jnp

    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = jax.nn.gelu(h @ params["w2"])
    z = jnp.concatenate([x, x[:, :8]], axis=1)
    out = h @ params["w3"] + z @ params["w4"]
    return jnp.mean(jnp.square(out - y))


def global_batch(step: int):
    """The (x, y) of a step, as NumPy arrays: the same in every process."""
    import jax
    import numpy as np

    key = jax.random.fold_in(jax.random.PRNGKey(1234), step)
    kx, kt = jax.random.split(key)
    x = np.asarray(jax.random.normal(kx, (BATCH, IN)), np.float32)
    teacher = np.asarray(jax.random.normal(jax.random.PRNGKey(99), (IN, OUT)), np.float32)
    return x, np.tanh(x @ teacher).astype(np.float32)


def make_optimizer(specs: Any):
    import optax_gwt
    from optax_gwt.sharding import unsharded_axis

    return optax_gwt.gwt_adamw(1e-3, weight_decay=0.1, axis=unsharded_axis(specs))


def make_train_step(optimizer):
    import jax
    import optax

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class Run:
    """Everything a sharded run needs on one mesh: shardings and jitted functions."""

    def __init__(self, mesh):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from optax_gwt.sharding import state_shardings

        self.mesh = mesh
        specs = param_specs()
        self.optimizer = make_optimizer(specs)
        self.param_shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
        self.abstract_params = jax.eval_shape(init_params, jax.random.PRNGKey(0))
        self.state_shardings = state_shardings(self.optimizer, self.abstract_params, self.param_shardings)
        self.batch_sharding = NamedSharding(mesh, batch_spec())
        replicated = NamedSharding(mesh, P())
        self.init_params = jax.jit(init_params, out_shardings=self.param_shardings)
        self.init_state = jax.jit(self.optimizer.init, out_shardings=self.state_shardings)
        self.step = jax.jit(
            make_train_step(self.optimizer),
            in_shardings=(self.param_shardings, self.state_shardings, self.batch_sharding, self.batch_sharding),
            out_shardings=(self.param_shardings, self.state_shardings, replicated),
            donate_argnums=(0, 1),
        )

    def batch(self, step: int):
        import jax

        return tuple(
            jax.make_array_from_callback(a.shape, self.batch_sharding, lambda idx, a=a: a[idx])
            for a in global_batch(step)
        )

    def abstract_checkpoint(self) -> dict:
        """The checkpoint's pytree as `jax.ShapeDtypeStruct`s placed on this mesh."""
        import jax

        def place(tree, shardings):
            return jax.tree_util.tree_map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
            )

        state = jax.eval_shape(self.optimizer.init, self.abstract_params)
        return {
            "params": place(self.abstract_params, self.param_shardings),
            "opt_state": place(state, self.state_shardings),
        }


def train(run: Run, params, opt_state, start: int, stop: int):
    losses = []
    for t in range(start, stop):
        params, opt_state, loss = run.step(params, opt_state, *run.batch(t))
        losses.append(float(loss))
    return params, opt_state, losses


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="data=1", help="mesh axes and sizes, e.g. data=2,fsdp=4")
    p.add_argument("--steps", type=int, required=True, help="train until this step")
    p.add_argument("--restore", default=None, help="Orbax checkpoint to start from")
    p.add_argument("--save", default=None, help="where to save an Orbax checkpoint at the end")
    p.add_argument("--losses", default=None, help="JSON file for {'start', 'losses', 'params'} (process 0)")
    p.add_argument("--devices-per-process", type=int, default=None, help="simulated CPU devices of this process")
    p.add_argument("--coordinator", default=None, help="host:port of process 0, for jax.distributed")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    args = p.parse_args(argv)

    if args.devices_per_process is not None:
        count = f" --xla_force_host_platform_device_count={args.devices_per_process}"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + count  # the last count given wins
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    if args.coordinator is not None:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)

    run = Run(make_mesh(args.mesh))
    start = 0
    if args.restore:
        restored = ocp.StandardCheckpointer().restore(os.path.abspath(args.restore), run.abstract_checkpoint())
        params, opt_state = restored["params"], restored["opt_state"]
        start = int(opt_state[0][2].count)  # the limiter counts the steps
    else:
        params = run.init_params(jax.random.PRNGKey(0))
        opt_state = run.init_state(params)
    params, opt_state, losses = train(run, params, opt_state, start, args.steps)

    if args.save:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.abspath(args.save), {"params": params, "opt_state": opt_state})
        checkpointer.wait_until_finished()
    if args.losses:
        final = jax.tree_util.tree_map(
            lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)).tolist(), params
        )
        if jax.process_index() == 0:
            with open(args.losses, "w") as f:
                json.dump({"start": start, "losses": losses, "params": final}, f)


if __name__ == "__main__":
    sys.exit(main())
