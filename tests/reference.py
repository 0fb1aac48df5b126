"""An independent NumPy + PyWavelets reference of the GWT-AdamW step.

Written from the six steps of the algorithm (and the authors' PyTorch
WaveAdamW, galore_torch/waveadamw.py): wavelet decomposition, Adam on the
approximation without bias correction, the norm-growth limiter, details divided
by the approximation's denominator (repeated in place per level), inverse
transform cut to size times `scale`, and the bias-corrected step. Weight decay
is decoupled and applied to the stepped parameter, as in the PyTorch original.
"""

from __future__ import annotations

import numpy as np
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

    def _wave_update(self, g, st, t):
        ax = self.axis
        coeffs = pywt.wavedec(g, self.wavelet, mode=self.mode, level=self.level, axis=ax)
        a = coeffs[0]
        m = st["m"] = self.b1 * st.get("m", 0.0) + (1 - self.b1) * a
        v = st["v"] = self.b2 * st.get("v", 0.0) + (1 - self.b2) * a * a
        denom = np.sqrt(v) + self.eps
        n = m / denom
        r = np.linalg.norm(n)
        if "r" not in st:
            lam = 1.0
            st["r"] = r
        else:
            lam = max(r / (st["r"] + 1e-8), self.gamma) / self.gamma
            st["r"] = r / lam
        st["lam"] = lam
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
