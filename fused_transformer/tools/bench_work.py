"""The rates of a benchmark case: its counted work over each implementation's time.

Work counted is the work actually needed, whatever the implementation: each op counts its own (``Op.work``: the FLOPs
of its products, the (query, key) pairs attention attends (``fused_transformer.ops.attention.cases.attention_flops``),
or the bytes it must move). Every implementation of a case divides the same count by its own time.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

# Peak DRAM bandwidth in GB/s, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_BANDWIDTH_GBPS = {
    "H100 PCIe": 2000.0, "H100": 3350.0, "H200": 4800.0, "A100-SXM4-80GB": 2039.0, "A100": 1555.0,
    "L40S": 864.0, "RTX 4090": 1008.0, "A10G": 600.0,
}


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
