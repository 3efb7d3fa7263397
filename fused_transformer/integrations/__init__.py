"""Doors from other libraries' attention calls to fused_transformer's kernels.

``sdpa``          torch's flash-attention registry (``F.scaled_dot_product_attention``, ``varlen_attn``); imported
                  with the package, which registers (never activates) it.
``transformers``  Hugging Face transformers' attention interface; imported on first use (``integrations.transformers``),
                  since transformers is an optional extra.
``hf_kernels``    Hugging Face ``kernels``' layer mapping (``kernels.kernelize``), our layers for transformers' RMSNorm
                  layers; imported on first use (``integrations.hf_kernels``).
"""
import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    if name in ("transformers", "hf_kernels"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
