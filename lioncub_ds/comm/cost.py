"""The α-β model of a collective's time: used by ``comm="auto"`` and by ``bench scaling``.

time = messages·α + bytes_sent·β + bytes_processed·γ

α: per-message latency (s), β: seconds per byte on the wire (8 / bandwidth in bit/s),
γ: seconds per byte of vote data a rank counts locally (kernel time; the allgather
algorithm counts N planes, the others about one). One implementation for both uses.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from . import make_algorithm

log = logging.getLogger("lioncub_ds")

EXACT_SIGN_ALGORITHMS = ("1bit", "pbit", "allgather")  # all give the identical Δ


@dataclass(frozen=True)
class CostModel:
    alpha_s: float = 50e-6
    beta_s_per_byte: float = 8 / 10e9
    gamma_s_per_byte: float = 0.0

    @classmethod
    def from_network(cls, bandwidth_gbit: float, latency_us: float, gamma_s_per_byte: float = 0.0):
        return cls(latency_us * 1e-6, 8.0 / (bandwidth_gbit * 1e9), gamma_s_per_byte)

    def collective_time(self, messages: int, bytes_sent: float, bytes_processed: float = 0.0) -> float:
        return messages * self.alpha_s + bytes_sent * self.beta_s_per_byte + bytes_processed * self.gamma_s_per_byte

    def predict(self, algorithm: str, numel: int, world_size: int, *, vote="majority", tie_break="hash",
                abstain=False, pbit_bits=None) -> float:
        """Predicted communication time of one vote over ``numel`` elements (or of a baseline
        all-reduce: algorithm 'fp32_allreduce' / 'bf16_allreduce')."""
        n = world_size
        if n <= 1:
            return 0.0
        if algorithm in ("fp32_allreduce", "bf16_allreduce"):
            width = 4 if algorithm.startswith("fp32") else 2
            return self.collective_time(2 * (n - 1), 2 * (n - 1) * width * numel / n, width * numel)
        algo = make_algorithm(algorithm, pbit_bits=pbit_bits)
        padded = (numel + 8 * n - 1) // (8 * n) * (8 * n)
        sent = algo.wire_bytes(padded, n, abstain=abstain, vote=vote, tie_break=tie_break)
        processed = padded / 8 * (n if algorithm == "allgather" else 1)
        return self.collective_time(algo.messages(n), sent, processed)

    def choose(self, numel: int, world_size: int, candidates=EXACT_SIGN_ALGORITHMS, **kw) -> str:
        """The cheapest candidate; ties go to the earlier one in ``candidates``."""
        usable = []
        for name in candidates:
            try:
                usable.append((self.predict(name, numel, world_size, **kw), name))
            except ValueError:  # e.g. pbit with N > 255
                continue
        return min(usable, key=lambda x: x[0])[1]
