"""The α-β model of a collective's time: used by ``comm="auto"`` and by ``bench scaling``.

time = messages·α + bytes_sent·β + bytes_processed·γ

α: per-message latency (s), β: seconds per byte on the wire (8 / bandwidth in bit/s),
γ: seconds per byte of vote data a rank counts locally (kernel time; the allgather
algorithm counts N planes, the others about one); the fp32/bf16 all-reduce baselines
use γ_reduce per byte they sum when it is set (bench scaling measures both).
One implementation for both uses.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..telemetry import ring_bytes
from . import make_algorithm

log = logging.getLogger("lioncub_ds")

EXACT_SIGN_ALGORITHMS = ("1bit", "pbit", "allgather")  # all give the identical Δ


@dataclass(frozen=True)
class CostModel:
    alpha_s: float = 50e-6
    beta_s_per_byte: float = 8 / 10e9
    gamma_s_per_byte: float = 0.0
    # Kernel time per byte the baseline all-reduces sum (fp32/bf16 adds); None: gamma_s_per_byte.
    gamma_reduce_s_per_byte: float | None = None

    @classmethod
    def from_network(cls, bandwidth_gbit: float, latency_us: float, gamma_s_per_byte: float = 0.0):
        return cls(latency_us * 1e-6, 8.0 / (bandwidth_gbit * 1e9), gamma_s_per_byte)

    def collective_time(self, messages: int, bytes_sent: float, bytes_processed: float = 0.0) -> float:
        return messages * self.alpha_s + bytes_sent * self.beta_s_per_byte + bytes_processed * self.gamma_s_per_byte

    def predict(self, algorithm: str, numel: int, world_size: int, *, vote="majority", tie_break="hash",
                mode="list", pbit_bits=None) -> float:
        """Predicted communication time of one vote over ``numel`` elements (or of a baseline
        all-reduce: algorithm 'fp32_allreduce' / 'bf16_allreduce')."""
        n = world_size
        if n <= 1:
            return 0.0
        if algorithm in ("fp32_allreduce", "bf16_allreduce"):
            width = 4 if algorithm.startswith("fp32") else 2
            gamma = self.gamma_s_per_byte if self.gamma_reduce_s_per_byte is None else self.gamma_reduce_s_per_byte
            return self.collective_time(*self.collective_terms("all_reduce", width * numel, n)) + width * numel * gamma
        algo = make_algorithm(algorithm, pbit_bits=pbit_bits)
        padded = (numel + 8 * n - 1) // (8 * n) * (8 * n)
        sent = algo.wire_bytes(padded, n, mode=mode, vote=vote, tie_break=tie_break)
        processed = padded / 8 * (n if algorithm == "allgather" else 1)
        return self.collective_time(algo.messages(n), sent, processed)

    # ------------------------------------------------------------------ calibration (bench scaling)
    def with_network(self, bandwidth_gbit: float, latency_us: float) -> "CostModel":
        """The same kernel time γ on another network (α from ``latency_us``, β from ``bandwidth_gbit``):
        calibrate on this machine, then predict for the target network."""
        return CostModel(latency_us * 1e-6, 8.0 / (bandwidth_gbit * 1e9), self.gamma_s_per_byte,
                         self.gamma_reduce_s_per_byte)

    @property
    def bandwidth_gbit(self) -> float:
        return 8.0 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else float("inf")

    @staticmethod
    def collective_terms(kind: str, nbytes: int, world_size: int) -> tuple[int, float]:
        """(messages, bytes one rank sends) of one collective over ``nbytes`` (the full tensor), by
        the ring model the telemetry counts with (:func:`lioncub_ds.telemetry.ring_bytes`):
        all_reduce 2(N−1) rounds, all_gather / all_to_all / reduce_scatter N−1."""
        n = world_size
        if n <= 1:
            return 0, 0.0
        if kind not in ("all_reduce", "all_gather", "all_to_all", "reduce_scatter"):
            raise ValueError(f"unknown collective kind {kind!r}")
        sent = ring_bytes(kind, nbytes, n)
        return (2 * (n - 1) if kind == "all_reduce" else n - 1), float(sent)

    @classmethod
    def fit(cls, samples, gamma_s_per_byte: float = 0.0, gamma_reduce_s_per_byte: float | None = None) -> "CostModel":
        """α and β from measured collectives: ``samples`` = [(messages, bytes_sent, seconds), ...].

        Least squares on the relative error (each row divided by its measured time, so
        microsecond and second samples weigh alike); both coefficients kept >= 0.
        """
        import numpy as np

        rows = [(float(m), float(b), float(t)) for m, b, t in samples if t > 0]
        if len(rows) < 2:
            raise ValueError("CostModel.fit needs at least two samples with a positive time")
        a = np.array([[m / t, b / t] for m, b, t in rows])
        y = np.ones(len(rows))
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        alpha, beta = float(coef[0]), float(coef[1])
        if alpha < 0 or beta < 0:  # refit the one that stays meaningful
            if alpha < 0:
                alpha, beta = 0.0, float(np.linalg.lstsq(a[:, 1:], y, rcond=None)[0][0])
            else:
                alpha, beta = float(np.linalg.lstsq(a[:, :1], y, rcond=None)[0][0]), 0.0
        return cls(max(alpha, 0.0), max(beta, 0.0), gamma_s_per_byte, gamma_reduce_s_per_byte)

    @staticmethod
    def fit_gamma(samples) -> tuple[float, float]:
        """Kernel time per counted byte: ``samples`` = [(bytes_processed, seconds), ...] of a vote
        kernel at several voter counts. Returns (γ, intercept): the slope of a least-squares line
        (the intercept, applying Δ to the parameters, is the same for every algorithm)."""
        import numpy as np

        x = np.array([float(b) for b, _ in samples])
        y = np.array([float(t) for _, t in samples])
        if len(x) < 2 or np.ptp(x) == 0:
            raise ValueError("CostModel.fit_gamma needs samples at two or more different sizes")
        slope, intercept = np.polyfit(x, y, 1)
        return max(float(slope), 0.0), float(intercept)

    def choose(self, numel: int, world_size: int, candidates=EXACT_SIGN_ALGORITHMS, **kw) -> str:
        """The cheapest candidate; ties go to the earlier one in ``candidates``."""
        usable = []
        for name in candidates:
            try:
                usable.append((self.predict(name, numel, world_size, **kw), name))
            except ValueError:  # e.g. pbit with N > 255
                continue
        return min(usable, key=lambda x: x[0])[1]
