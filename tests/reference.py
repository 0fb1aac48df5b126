"""An independent NumPy + PyWavelets reference of the GWT-AdamW step.

Written from the six steps of the algorithm (and the authors' PyTorch
WaveAdamW, galore_torch/waveadamw.py): wavelet decomposition, Adam on the
approximation without bias correction, the norm-growth limiter, details divided
by the approximation's denominator (repeated in place per level), inverse
transform cut to size times `scale`, and the bias-corrected step. Weight decay
is decoupled and applied to the stepped parameter, as in the PyTorch original.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pywt


class ReferenceGWTAdamW:
    def __init__(
        self,
        lr=1e-2,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        weight_decay=0.0,
        level=2,
        wavelet="haar",
        mode="zero",
        scale=0.25,
        gamma=1.01,
        axis=0,
        bias_correct_details=True,
        detail_rule="adam",
        second_moment="approx",
        delayed=False,
    ):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        self.state = {}
        self.t = 0

    def transformed(self, p):
        return p.ndim >= 2 and self.axis is not None

    def step(self, params: dict, grads: dict) -> dict:
        self.t += 1
        t, b1, b2 = self.t, self.b1, self.b2
        step_size = self.lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        new = {}
        for name, p in params.items():
            g = np.asarray(grads[name], np.float64)
            st = self.state.setdefault(name, {})
            if not self.transformed(p):
                m = st["m"] = b1 * st.get("m", 0.0) + (1 - b1) * g
                v = st["v"] = b2 * st.get("v", 0.0) + (1 - b2) * g * g
                u = step_size * m / (np.sqrt(v) + self.eps)
            else:
                u = step_size * self._wave_update(g, st, t)
                if not self.bias_correct_details:
                    u = u + self.lr * np.sqrt(1 - b2**t) * (1 - 1 / (1 - b1**t)) * self._details_only
            # Decoupled weight decay on the stepped parameter, as the PyTorch original.
            new[name] = (p - u) * (1 - self.lr * self.weight_decay)
        return new

    def _second_moment_input(self, g, a):
        """``a^2``, or (``second_moment="energy"``, Haar) each block's sum of ``g^2``, the last zero-padded."""
        if self.second_moment == "approx":
            return a * a
        assert self.wavelet == "haar", "the block energy is defined for Haar blocks"
        block, n = 2**self.level, g.shape[self.axis]
        sq = np.moveaxis(g * g, self.axis, -1)
        sq = np.pad(sq, [(0, 0)] * (sq.ndim - 1) + [(0, (-n) % block)])
        sums = sq.reshape(sq.shape[:-1] + (sq.shape[-1] // block, block)).sum(-1)
        return np.moveaxis(sums, -1, self.axis)

    def _wave_update(self, g, st, t):
        ax = self.axis
        coeffs = pywt.wavedec(g, self.wavelet, mode=self.mode, level=self.level, axis=ax)
        a = coeffs[0]
        m = st["m"] = self.b1 * st.get("m", 0.0) + (1 - self.b1) * a
        v = st["v"] = self.b2 * st.get("v", 0.0) + (1 - self.b2) * self._second_moment_input(g, a)
        denom = np.sqrt(v) + self.eps
        n = m / denom
        r = np.linalg.norm(n)
        if "r" not in st:
            lam = 1.0
            st["r"] = r
        else:
            lam = max(r / (st["r"] + 1e-8), self.gamma) / self.gamma
            st["r"] = r / lam
        # delayed (not the authors'): this step is divided by the factor of the step before
        lam, st["lam"] = (st.get("lam", 1.0), lam) if self.delayed else (lam, lam)
        n = n / lam
        details = []
        den = denom
        for d in coeffs[1:]:
            if self.detail_rule == "adam":
                details.append(d / (np.take(den, np.arange(d.shape[ax]), axis=ax) * lam))
            elif self.detail_rule == "norm_ratio":
                details.append(d * np.linalg.norm(n) / np.linalg.norm(a))
            else:
                details.append(np.zeros_like(d))
            den = np.repeat(den, 2, axis=ax)
        length = g.shape[ax]
        full = pywt.waverec([n] + details, self.wavelet, mode=self.mode, axis=ax)
        rec = np.take(full, np.arange(length), axis=ax) * self.scale
        zeros = [np.zeros_like(n)] + details
        only_d = pywt.waverec(zeros, self.wavelet, mode=self.mode, axis=ax)
        # The details' contribution, for the variant without their b1 bias correction.
        self._details_only = np.take(only_d, np.arange(length), axis=ax) * self.scale
        return rec


class ReferenceFOAM:
    """FOAM (Wen et al., arXiv 2512.07112), written from the authors' PyTorch optimizer
    (zqOuO/FOAM, ``foam_torch/foam_adam.py``) in NumPy float64.

    Arrays of rank >= 2 are folded along `axis` (the authors' last axis of a PyTorch
    weight) in blocks of ``2^level`` entries, zero-padded at the end: Adam's moments of
    the block means of ``g`` and of ``g^2``, unfolded by repetition, plus the residual
    ``g - unfold(mean)`` (times `res_scale`, squared into the second moment); the
    update times `scale` and the bias-corrected learning rate. Other arrays: Hugging
    Face's AdamW. Weight decay after the step, ``p <- p - lr * wd * p``.
    `moment_dtype` rounds the stored moments after each step (bfloat16 state);
    ``energy=False`` averages the square of the block mean instead of the block mean
    of ``g^2`` (the residual rule alone).
    """

    def __init__(
        self,
        lr=1e-2,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        level=2,
        scale=0.25,
        res_scale=1.0,
        axis=0,
        energy=True,
        moment_dtype=None,
    ):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        self.state = {}
        self.t = 0

    def _round(self, x):
        return x if self.moment_dtype is None else np.asarray(x, self.moment_dtype).astype(np.float64)

    def _fold(self, x):
        """Block means of `x` and of `x^2` along the last axis (zero-padded), and the pad."""
        factor = 2**self.level
        pad = (-x.shape[-1]) % factor
        widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
        xp, sq = np.pad(x, widths), np.pad(x * x, widths)
        shape = x.shape[:-1] + (xp.shape[-1] // factor, factor)
        return xp.reshape(shape).mean(-1), sq.reshape(shape).mean(-1)

    def _unfold(self, x, size):
        return np.repeat(x, 2**self.level, axis=-1)[..., :size]

    def step(self, params: dict, grads: dict) -> dict:
        self.t += 1
        t, b1, b2 = self.t, self.b1, self.b2
        step_size = self.lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        new = {}
        for name, p in params.items():
            g = np.asarray(grads[name], np.float64)
            st = self.state.setdefault(name, {"m": 0.0, "v": 0.0})
            if g.ndim < 2:
                st["m"] = self._round(b1 * st["m"] + (1 - b1) * g)
                st["v"] = self._round(b2 * st["v"] + (1 - b2) * g * g)
                u = st["m"] / (np.sqrt(st["v"]) + self.eps)
            else:
                g = np.moveaxis(g, self.axis, -1)
                mean, mean_sq = self._fold(g)
                res = g - self._unfold(mean, g.shape[-1])
                st["m"] = self._round(b1 * st["m"] + (1 - b1) * mean)
                st["v"] = self._round(b2 * st["v"] + (1 - b2) * (mean_sq if self.energy else mean * mean))
                m = self._unfold(st["m"], g.shape[-1]) + self.res_scale * res
                v = self._unfold(st["v"], g.shape[-1]) + self.res_scale**2 * res * res
                u = np.moveaxis(self.scale * m / (np.sqrt(v) + self.eps), -1, self.axis)
            p = p - step_size * u
            new[name] = p - self.lr * self.weight_decay * p
        return new


def problem(shapes: dict, seed: int = 0, dtype=np.float64) -> tuple[dict, np.random.Generator]:
    """Standard-normal params of the given shapes, and the generator that made them."""
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    return params, rng


def random_grads(rng: np.random.Generator, params: dict, dtype=np.float64) -> dict:
    """Gradients with a scale that changes from step to step (so that a limiter acts on some)."""
    scale = rng.uniform(0.2, 5.0)
    return {k: (scale * rng.standard_normal(p.shape)).astype(dtype) for k, p in params.items()}


def run_both(opt, ref, shapes: dict, steps: int = 6, seed: int = 0, dtype=np.float64):
    """`steps` jitted steps of the Optax `opt` and of a reference (``ref.step(params, grads)``) on
    the same gradients: the Optax params, the reference's (float64) and the Optax state."""
    params, rng = problem(shapes, seed, dtype)
    ref_params = {k: v.astype(np.float64) for k, v in params.items()}
    jparams = jax.tree_util.tree_map(jnp.asarray, params)
    state = opt.init(jparams)
    update = jax.jit(opt.update)
    for _ in range(steps):
        grads = random_grads(rng, params, dtype)
        ref_params = ref.step(ref_params, {k: g.astype(np.float64) for k, g in grads.items()})
        u, state = update(jax.tree_util.tree_map(jnp.asarray, grads), state, jparams)
        jparams = optax.apply_updates(jparams, u)
    return jparams, ref_params, state
