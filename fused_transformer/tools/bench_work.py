"""The work a benchmark case needs, whatever the implementation.

Work counted is the work actually needed: attention (``attention_flops``) counts ``4 * D`` FLOPs per (query, key)
pair a query may attend, so causal (top-left) counts ``L (L + 1) / 2`` pairs per head (about half) and padding
counts only the kept keys; forward+backward is 3.5x the forward (the backward does five matmuls to the forward's
two). A registered op counts its own (``Op.work``: FLOPs of its products, or the bytes it must move). Every
implementation of a case divides the same count by its own time.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

# Peak DRAM bandwidth in GB/s, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_BANDWIDTH_GBPS = {
    "H100 PCIe": 2000.0, "H100": 3350.0, "H200": 4800.0, "A100-SXM4-80GB": 2039.0, "A100": 1555.0,
    "L40S": 864.0, "RTX 4090": 1008.0, "A10G": 600.0,
}


def kept_lengths(batch: int, length: int, padding: float) -> List[int]:
    """Keys kept per sequence for a padding ratio p: alternately ``1 - p - s`` and ``1 - p + s`` of ``length``,
    ``s = min(p, 1 - p) / 2``."""
    if not 0.0 <= padding < 1.0:
        raise ValueError(f"padding={padding} must be in [0, 1)")
    spread = min(padding, 1.0 - padding) / 2
    fractions = (1.0 - padding - spread, 1.0 - padding + spread)
    return [max(1, round(length * fractions[b % 2])) for b in range(batch)]


def padding_ratio(kept: Sequence[int], length: int) -> float:
    return 1.0 - sum(kept) / (len(kept) * length)


def attention_pairs(q_len: int, kept: int, causal: bool) -> int:
    """(query, key) pairs one head attends: every query sees ``kept`` keys, or with a top-left causal mask
    query ``i`` sees ``min(i + 1, kept)``."""
    if not causal:
        return q_len * kept
    if kept >= q_len:
        return q_len * (q_len + 1) // 2
    return kept * (kept + 1) // 2 + (q_len - kept) * kept


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, *, causal: bool = False,
                    kept: Optional[Sequence[int]] = None, backward: bool = False) -> float:
    """FLOPs attention needs: ``4 * head_dim`` per attended (query, key) pair (``q kᵀ`` and ``p v``), summed over
    the batch's key lengths ``kept`` (default: no padding); 3.5x that with the backward."""
    kept = [seq_len] * batch if kept is None else kept
    if len(kept) != batch:
        raise ValueError(f"kept has {len(kept)} entries for batch {batch}")
    pairs = sum(attention_pairs(seq_len, k, causal) for k in kept)
    return 4.0 * head_dim * heads * pairs * (3.5 if backward else 1.0)


def peak_bandwidth_gbps(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbps for key, gbps in PEAK_BANDWIDTH_GBPS.items() if key in name), None)


def tflops_of(case, ms: float) -> Optional[float]:
    return case.flops / ms / 1e9 if case.flops is not None else None


def gbps_of(case, ms: float) -> Optional[float]:
    return case.nbytes / ms / 1e6 if case.nbytes is not None else None


def tokens_per_s(case, ms: float) -> float:
    return case.tokens / ms * 1e3


def finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)
