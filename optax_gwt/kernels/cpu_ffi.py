"""An opt-in compiled CPU kernel for the first pass of Haar GWT with Adam (row ``cpu-ffi-moments``).

XLA on the CPU compiles the approximation's Adam step of Haar GWT into three
passes: the moments ``m`` and ``v`` are two fusions that each read the full
gradient, and the norm-growth limiter's ``||m / (sqrt(v) + eps)||`` is a
separate reduction. `haar_adam_moments` does all three in one read of the
gradient, as an XLA FFI custom call (``csrc/haar_adam.cc``) that runs on XLA's
intra-op thread pool; the full-size second pass (the update, fused by XLA with
the learning rate, weight decay and ``apply_updates``) stays in XLA.

The kernel is compiled on first use with the system's C++ compiler (``$CXX``,
else ``c++``) against the FFI headers that ship with jaxlib, and cached in
``$OPTAX_GWT_CACHE_DIR`` (default ``~/.cache/optax_gwt``) under a key of the
source, the jaxlib version and the CPU. Without a compiler `available` is False and
GWT uses its XLA path, which computes the same values (it is the reference the kernel
is tested against). It is taken only where asked for (``FastPath(cpu_kernel=True)``):
a custom call has no derivatives, and its float rounding depends on the machine's
compiler and CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from optax_gwt.kernels.rules import Case

__all__ = ["available", "haar_adam_moments", "moments"]

_SOURCE = Path(__file__).parent / "csrc" / "haar_adam.cc"
_TARGETS = {
    np.dtype(np.float32): "optax_gwt_haar_adam_moments_f32",
    np.dtype(np.float64): "optax_gwt_haar_adam_moments_f64",
}
_SYMBOLS = {np.dtype(np.float32): "GwtHaarAdamMomentsF32", np.dtype(np.float64): "GwtHaarAdamMomentsF64"}


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    """The compiled library's path, compiling it into the cache if it is not there."""
    import jaxlib

    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC"]
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (_SOURCE.read_text(), jaxlib.__version__, compiler, *flags, _cpu_signature()))
    ).hexdigest()[:16]
    cache = Path(os.environ.get("OPTAX_GWT_CACHE_DIR", Path.home() / ".cache" / "optax_gwt"))
    target = cache / f"haar_adam_{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *flags, "-isystem", include, str(_SOURCE), "-o", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(out, target)  # atomic: concurrent builds leave one complete file
    return target


@functools.cache
def available() -> bool:
    """Whether the kernel is compiled and registered with XLA (compiles it on first call)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        for dtype, name in _TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, _SYMBOLS[dtype])), platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(
            f"optax_gwt: the CPU kernel could not be built, GWT uses its XLA path ({detail.strip()[:500]})",
            stacklevel=2,
        )
        return False
    return True


def haar_adam_moments(
    g: jax.Array, mu: jax.Array, nu: jax.Array, *, axis: int, block: int, b1, b2, eps
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adam's moments of `g`'s Haar approximation, and the squared norm of Adam's step on it.

    With ``a`` the sums of blocks of ``B = block`` consecutive entries of `g`
    along `axis` (the last block zero-padded) over ``sqrt(B)``, returns
    ``m = (1 - b1) a + b1 mu``, ``v = (1 - b2) a^2 + b2 nu`` (in the buffers of
    `mu` and `nu`) and ``sum((m / (sqrt(v) + eps))^2)``, in one read of `g`.

    Args:
      g: the gradient; ``n`` entries along `axis`.
      mu, nu: the moments, shaped like `g` with ``ceil(n / B)`` along `axis`.
      axis: a non-negative axis of `g`.
      block: ``B = 2^level``.
      b1, b2, eps: Adam's hyperparameters (floats or traced scalars).

    Returns:
      ``(m, v, sq)``: the new moments and a scalar, all in `g`'s dtype.
    """
    if not available():
        raise RuntimeError("optax_gwt.kernels.cpu_ffi is not available (see its module docstring); use the XLA path")
    dtype = jnp.dtype(g.dtype)
    if dtype not in _TARGETS or {jnp.dtype(mu.dtype), jnp.dtype(nu.dtype)} != {dtype}:
        raise TypeError(
            f"haar_adam_moments: g, mu and nu must all be float32 or all float64, got {g.dtype}, {mu.dtype}, {nu.dtype}"
        )
    n = g.shape[axis]
    outer = math.prod(g.shape[:axis])
    inner = math.prod(g.shape[axis + 1 :])
    # ``1 - b`` before the cast, as the XLA path computes it (in Python for a float).
    coefficients = jnp.stack([jnp.asarray(c, dtype) for c in (1 - b1, b1, 1 - b2, b2, eps, block**-0.5)])
    moment = jax.ShapeDtypeStruct(mu.shape, dtype)
    call = jax.ffi.ffi_call(
        _TARGETS[dtype],
        (moment, moment, jax.ShapeDtypeStruct((), dtype)),
        input_output_aliases={1: 0, 2: 1},
        vmap_method="sequential",
    )
    m, v, sq = call(
        g, mu, nu, coefficients, outer=np.int64(outer), n=np.int64(n), inner=np.int64(inner), block=np.int64(block)
    )
    return m, v, sq


def moments(case: Case, plain, fast_path):
    """Row ``cpu-ffi-moments``: ``f(g, m, v, signal, b1, b2, eps)`` of `optax_gwt.adam`'s moments,
    or `plain` itself where the CPU is not JAX's backend (nothing is built on a GPU or TPU host)
    or the kernel could not be built."""
    if jax.default_backend() != "cpu" or not available():
        return plain

    def f(g, m, v, signal, b1, b2, eps):
        gradient, axis, block = signal
        return haar_adam_moments(gradient, m, v, axis=axis, block=block, b1=b1, b2=b2, eps=eps)

    return f
