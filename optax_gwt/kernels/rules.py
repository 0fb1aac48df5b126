"""The table of fast paths, and the one function that chooses among them.

Each computation of a Haar GWT step that has a faster formulation on some chip (an
*op*: block sums, block repeats, block means, the moments, the limiter's norms, the
full-size update) has a plain formulation in the math modules (`optax_gwt.haar`,
`optax_gwt.adam`, `optax_gwt.stages`) and zero or more rows in `RULES`. A row names
the platform it is for (as `jax.lax.platform_dependent` names them), whether it is for a
program that runs as written on each device or one that XLA partitions, the condition
on the arrays under which it is chosen, and its formulation (a function of this
subpackage, imported when first chosen). `select` is the one function that reads the
table; `switch` builds the program: the rows chosen for each platform under
`jax.lax.platform_dependent` (so that the platform the program is lowered for picks),
the plain formulation as the default.

Every row computes what the plain formulation computes (exactly, or to float rounding
where it sums in another order); ``tests/test_kernels.py`` runs each one under `jax.jit`
against the float64 reference. ``docs/fast_paths.md`` is this table in words
(`markdown_table`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["FastPath", "Case", "Rule", "RULES", "OPS", "select", "switch", "recording", "markdown_table"]

#: The platforms that rows name (`jax.lax.platform_dependent`'s names).
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
#: The computations that have rows, each with its plain formulation.
OPS = {
    "block_sums": "`haar.block_sums`: strided slices",
    "repeat": "`haar.repeat_blocks`: a broadcast",
    "block_means": "the block means of `haar.adam_update`: from the approximation",
    "update": "`haar.adam_update`: one XLA expression",
    "moments": "the moments of `scale_by_reference_adam`: XLA",
    "limiter": "the norms of `limit_norm_growth`: one reduction per array",
}
_PARTITIONINGS = ("any", "one device", "partitioned")


@dataclasses.dataclass(frozen=True)
class FastPath:
    """Which fast paths a GWT step may take (the ``fast_path`` option of the builders and stages).

    ``"auto"`` is ``FastPath()``, ``"xla"`` is ``FastPath(enabled=False)``.

    Attributes:
      enabled: take the rows of `RULES` where they apply (False: the plain formulation
        on every chip).
      cpu_kernel: also the compiled C++ kernel for the moments on a CPU (opt-in: it
        compiles with the system's compiler on first use, and its derivatives are not
        defined; `optax_gwt.kernels.cpu_ffi`).
      pallas: the Pallas kernel for the full-size update on a TPU where its row applies.
      emulate: None (default): each platform lowers its own rows. A platform name
        (``"tpu"``, ``"cuda"``, ...): that platform's rows on whatever backend lowers
        the program (Pallas kernels in its interpreter), to check a chip's numerics on
        a CPU.

    Example:
      >>> import jax.numpy as jnp, optax_gwt
      >>> as_a_tpu = optax_gwt.FastPath(emulate="tpu")  # a TPU's formulations, run here
      >>> tx = optax_gwt.gwt_adamw(1e-3, fast_path=as_a_tpu)
      >>> params = {"w": jnp.ones((256, 128))}
      >>> u, _ = tx.update(params, tx.init(params), params)
      >>> u["w"].shape, optax_gwt.FastPath.of("xla").enabled
      ((256, 128), False)
    """

    enabled: bool = True
    cpu_kernel: bool = False
    pallas: bool = True
    emulate: str | None = None

    def __post_init__(self):
        if self.emulate is not None and self.emulate not in PLATFORMS:
            raise ValueError(f"FastPath.emulate must be None or one of {PLATFORMS}, got {self.emulate!r}")

    @classmethod
    def of(cls, value: str | FastPath) -> FastPath:
        """`value` as a `FastPath`: ``"auto"``, ``"xla"`` or a `FastPath`."""
        if isinstance(value, FastPath):
            return value
        if value == "auto":
            return cls()
        if value == "xla":
            return cls(enabled=False)
        raise ValueError(f"fast_path must be 'auto', 'xla' or an optax_gwt.kernels.FastPath, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Case:
    """What a row's condition may read of one op's arrays (static: shapes and dtypes).

    Attributes:
      op: a key of `OPS`.
      shape, dtype: the full-size array's (the gradient; for ``"repeat"`` the per-block
        array repeated, for ``"limiter"`` unused).
      axis: the transform axis; block: ``B = 2^level``.
      length: ``"repeat"``: the result's length along `axis`.
      state_dtype: the moments' dtype (``"block_means"``, ``"update"``, ``"moments"``);
        mixed_state: the two moments have different dtypes.
      explicit_mesh: the array lives on a mesh of explicit axes.
      wide: some operand has more than 32 bits (``"update"``).
      per_block_shape: the per-block arrays' shape (``"update"``).
      energy: the second moment reads the blocks' energy (``"moments"``, FOAM).
      devices: the process's device count (``"moments"``).
      batch_axes: leading axes that stack matrices (``"update"``).
    """

    op: str
    shape: tuple[int, ...] = ()
    dtype: Any = np.float32
    axis: int = 0
    block: int = 1
    length: int | None = None
    state_dtype: Any = None
    mixed_state: bool = False
    explicit_mesh: bool = False
    wide: bool = False
    per_block_shape: tuple[int, ...] | None = None
    energy: bool = False
    devices: int = 1
    batch_axes: int = 0

    @property
    def entries(self) -> int:
        return math.prod(self.shape)

    @property
    def float32(self) -> bool:
        """The array and the moments are float32."""
        return np.dtype(self.dtype) == np.float32 and np.dtype(self.state_dtype or self.dtype) == np.float32


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the table: a formulation of `op` on `platform`, and when it is taken.

    Attributes:
      name: the row's name (as the docs and the tests call it).
      op, platform: what it computes, on which platform.
      when: its condition on the `Case`; condition: the same in words.
      formulation: ``"module:function"`` in `optax_gwt.kernels`: ``function(case, plain,
        fast_path)`` returns the op's function (same arguments as ``plain``).
      saves: what it saves against the plain formulation, in words; measured: the command
        that measured it.
      partitioning: ``"any"``; ``"one device"``: where the program runs as written on
        each device (`lowering.one_device_or`); ``"partitioned"``: where XLA partitions it.
      option: the `FastPath` field that must be True, or None.
    """

    name: str
    op: str
    platform: str
    when: Callable[[Case], bool]
    condition: str
    formulation: str
    saves: str
    measured: str
    partitioning: str = "any"
    option: str | None = None

    def __post_init__(self):
        assert self.op in OPS and self.platform in PLATFORMS and self.partitioning in _PARTITIONINGS, self

    def build(self, case: Case, plain: Callable, fast_path: FastPath) -> Callable:
        module, function = self.formulation.split(":")
        return getattr(importlib.import_module(f"optax_gwt.kernels.{module}"), function)(case, plain, fast_path)


#: Where `xla_chips` and `pallas_tpu` were measured (compiled for the chip without it).
_DEVICELESS = "compiled for the chip, deviceless (`benchmarks.target_compile`)"
#: The most float32 entries whose level-2 block means XLA for an H100 fuses into the pass (see the row).
GPU_MEANS_FROM_G_MAX = 7 * 2**18
#: The fewest entries of a matrix that takes the Pallas update (see the row).
PALLAS_MIN_ENTRIES = 2**23
#: Lanes of a TPU tile.
LANES = 128


def _means_from_g(case: Case) -> bool:
    return case.float32 and case.block <= 4 and len(case.shape) == 2


def _tpu_repeat(case: Case) -> bool:
    return (
        case.block == 4
        and case.axis == len(case.shape) - 2
        and case.length == case.shape[case.axis] * case.block
        and not case.explicit_mesh
    )


def _pallas(case: Case) -> bool:
    matrix = len(case.shape) == 2 and case.axis == 0 and case.block in (2, 4)
    tiles = case.per_block_shape == (-(-case.shape[0] // case.block), case.shape[-1]) if matrix else False
    return tiles and not case.wide and case.entries >= PALLAS_MIN_ENTRIES


def _ffi_moments(case: Case) -> bool:
    dtypes = {np.dtype(case.dtype), np.dtype(case.state_dtype or case.dtype)}
    return (
        not case.energy
        and not case.mixed_state
        and len(dtypes) == 1
        and dtypes <= {np.dtype(np.float32), np.dtype(np.float64)}
    )


def _means_row(platform: str, sized: bool) -> Rule:
    """Rows ``<platform>-means-from-gradient`` (GPUs: only up to ``GPU_MEANS_FROM_G_MAX`` at level 2)."""
    limit = f"; at level 2 at most {GPU_MEANS_FROM_G_MAX:,} entries" if sized else ""
    return Rule(
        f"{platform}-means-from-gradient", "block_means", platform,
        when=lambda c: _means_from_g(c) and not (sized and c.block == 4 and c.entries > GPU_MEANS_FROM_G_MAX),
        condition="float32 gradient and moments, level 1 or 2, a matrix (not a stack)" + limit,
        formulation="xla_chips:means_from_gradient",
        saves="the means fused into the full-size pass, which then keeps no approximation in memory"
        + ("; above the size limit XLA writes them as a quarter-size array and reads the gradient again" if sized
           else ""),
        measured=_DEVICELESS,
    )  # fmt: skip


def _unguarded_row(platform: str) -> Rule:
    """Rows ``<platform>-update-unguarded``."""
    return Rule(
        f"{platform}-update-unguarded", "update", platform,
        when=lambda c: True,
        condition="always",
        formulation="xla_chips:update_unguarded",
        saves="the full-size ``0 * G`` that keeps the square root after the repeat on the other chips: in a train "
        "step, XLA for GPUs fuses it with the backward pass's zero-initialised gradients of scanned layers and "
        "keeps one more full-size array per matrix shape alive (the update step alone compiles the same without it)",
        measured=_DEVICELESS + " and the planner (`python -m optax_gwt.plan`)",
    )  # fmt: skip


#: The table. Order matters only within one op, platform and partitioning: the first row
#: whose condition holds is taken.
RULES: tuple[Rule, ...] = (
    Rule(
        "tpu-block-sums",
        "block_sums",
        "tpu",
        when=lambda c: c.block > 1 and c.shape[c.axis] % c.block == 0 and len(c.shape) == 2,
        condition="the block divides the axis of a matrix (not a stack: there the contraction's relayouts of "
        "whole stacks cost more than they save)",
        formulation="xla_chips:block_sums_by_contraction",
        saves="a contraction of runs of 128 entries (one lane tile) with a 0/1 matrix, which XLA fuses with the "
        "work around it; no relayout of a gradient whose transform axis lies on the lanes (FSDP shards)",
        measured=_DEVICELESS,
    ),  # fmt: skip
    Rule(
        "tpu-repeat-one-device",
        "repeat",
        "tpu",
        partitioning="one device",
        when=lambda c: _tpu_repeat(c) and c.shape[-1] % LANES == 0,
        condition="level 2 along the second last axis, whose last axis fills whole tiles of 128 lanes",
        formulation="xla_chips:repeat_in_runs_of_32",
        saves="a broadcast over 4 rows is a shuffle inside the chip's 8-row tiles that XLA writes out before the "
        "pass that reads it; as a contraction it stays in that pass (fewer kernels)",
        measured=_DEVICELESS,
    ),  # fmt: skip
    Rule(
        "tpu-repeat-partitioned",
        "repeat",
        "tpu",
        partitioning="partitioned",
        when=lambda c: _tpu_repeat(c) and len(c.shape) > 2,
        condition="level 2 along the second last axis of a stack of matrices",
        formulation="xla_chips:repeat_in_runs_of_128",
        saves="as above, in runs that cut a device's shard cleanly where the layout puts the axis on the lanes",
        measured=_DEVICELESS,
    ),  # fmt: skip
    _means_row("tpu", sized=False),
    _means_row("cuda", sized=True),
    _means_row("rocm", sized=True),
    _unguarded_row("cuda"),
    _unguarded_row("rocm"),
    Rule(
        "tpu-update-layer-by-layer",
        "update",
        "tpu",
        when=lambda c: c.batch_axes > 0,
        condition="a stack of matrices (`batch_axes`)",
        formulation="xla_chips:update_layer_by_layer",
        saves="the stack's full-size pass one matrix at a time, written in place: the TPUs' layouts of a stack "
        "make XLA copy whole stacks (several full-size temporaries); one matrix's copies are a layer's, and each "
        "matrix can take the other rows (the Pallas kernel on one device)",
        measured=_DEVICELESS + " and the planner (`python -m optax_gwt.plan`)",
    ),  # fmt: skip
    Rule(
        "tpu-pallas-update",
        "update",
        "tpu",
        option="pallas",
        when=_pallas,
        condition=f"a matrix of at least {PALLAS_MIN_ENTRIES:,} entries transformed along its rows at level 1 or "
        "2, no operand wider than 32 bits; lowered where the program runs on each device (elsewhere, under "
        "vmap and for derivatives, the XLA formulation)",
        formulation="pallas_tpu:update",
        saves="the repeats never formed: XLA writes repeats over 2 or 4 rows of large matrices to HBM at full size",
        measured=_DEVICELESS,
    ),  # fmt: skip
    Rule(
        "cpu-ffi-moments",
        "moments",
        "cpu",
        option="cpu_kernel",
        when=lambda c: _ffi_moments(c) and c.devices == 1,
        condition="opted in (`FastPath(cpu_kernel=True)`), float32 or float64 gradient and moments of one dtype, "
        "the approximation's square as the second moment, one device in the process, a C++ compiler",
        formulation="cpu_ffi:moments",
        saves="the moments and the limiter's norm in one read of the gradient (XLA: three passes)",
        measured="timed on a CPU (`benchmarks.optimizer_step`)",
    ),  # fmt: skip
    Rule(
        "cpu-one-limiter-vector",
        "limiter",
        "cpu",
        when=lambda c: True,
        condition="always",
        formulation="xla_chips:one_limiter_vector",
        saves="all the arrays' norms and factors as one vector: a few ops instead of a few per array",
        measured="timed on a CPU (`benchmarks.optimizer_step`)",
    ),  # fmt: skip
)

_taken: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("optax_gwt_kernels_taken", default=None)


def select(case: Case, platform: str, fast_path: str | FastPath = "auto") -> tuple[Rule | None, Rule | None]:
    """The rows a program lowered for `platform` takes for `case`: ``(where it runs as written on
    each device, where XLA partitions it)``; None: the plain formulation."""
    fp = FastPath.of(fast_path)
    chosen = []
    for where in ("one device", "partitioned"):
        rows = (
            r
            for r in RULES
            if fp.enabled
            and r.op == case.op
            and r.platform == platform
            and r.partitioning in ("any", where)
            and (r.option is None or getattr(fp, r.option))
            and r.when(case)
        )
        chosen.append(next(rows, None))
    return chosen[0], chosen[1]


def switch(case: Case, fast_path: str | FastPath, plain: Callable, *args: Any) -> Any:
    """``plain(*args)``, or the rows `select` gives for `case` on the platform the program is lowered
    for (with `FastPath.emulate`, that platform's on any backend)."""
    fp = FastPath.of(fast_path)
    branches = {}
    for platform in PLATFORMS if fp.emulate is None else (fp.emulate,):
        one, partitioned = select(case, platform, fp)
        rows = [r.name for r in dict.fromkeys((one, partitioned)) if r is not None]
        log = _taken.get()
        if log is not None:
            log += rows
        if rows:
            branches[platform] = _per_partitioning(case, plain, one, partitioned, fp)
    if fp.emulate is not None:
        return branches.get(fp.emulate, plain)(*args)
    if not branches:
        return plain(*args)
    thunks = {p: functools.partial(f, *args) for p, f in branches.items()}
    return jax.lax.platform_dependent(default=functools.partial(plain, *args), **thunks)


def _per_partitioning(case: Case, plain: Callable, one: Rule | None, part: Rule | None, fp: FastPath) -> Callable:
    def build(rule: Rule | None) -> Callable:
        if rule is None:
            return plain
        fun = rule.build(case, plain, fp)
        return getattr(fun, "emulated", fun) if fp.emulate is not None else fun

    if one is part:
        return build(one)
    from optax_gwt.kernels.lowering import one_device_or

    return lambda *args: one_device_or(build(one), build(part), *args)


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collects the names of the rows selected while tracing inside the block, for every platform
    the program may be lowered for (a program taken from JAX's cache is not traced again; a kernel
    that cannot be built, or whose lowering falls back, still counts as selected).

    Example:
      >>> import jax, jax.numpy as jnp, optax_gwt
      >>> tx = optax_gwt.gwt_adamw(1e-3, level=2)
      >>> params = {"w": jnp.zeros((512, 256))}
      >>> with optax_gwt.kernels.recording() as taken:
      ...     _ = jax.eval_shape(tx.update, params, tx.init(params), params)
      >>> sorted(set(taken))[:3]
      ['cpu-one-limiter-vector', 'cuda-means-from-gradient', 'cuda-update-unguarded']
    """
    log: list[str] = []
    token = _taken.set(log)
    try:
        yield log
    finally:
        _taken.reset(token)


def markdown_table() -> str:
    """The table as Markdown (``docs/fast_paths.md``): when each row is chosen, then what it replaces
    and saves."""
    lines = ["| row | platform, program | chosen when |", "|---|---|---|"]
    for r in RULES:
        option = f" (`FastPath.{r.option}`)" if r.option else ""
        lines.append(f"| `{r.name}` | {r.platform}, {r.partitioning} | {r.condition}{option} |")
    lines += ["", "| row | replaces | what it saves | measured by |", "|---|---|---|---|"]
    lines += [f"| `{r.name}` | {OPS[r.op]} | {r.saves} | {r.measured} |" for r in RULES]
    return "\n".join(lines) + "\n"
