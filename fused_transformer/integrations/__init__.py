"""Doors from other libraries' attention calls to fused_transformer's kernels.

``sdpa``          torch's flash-attention registry (``F.scaled_dot_product_attention``, ``varlen_attn``); imported
                  with the package, which registers (never activates) it.
``transformers``  Hugging Face transformers' attention interface; imported on first use (``integrations.transformers``),
                  since transformers is an optional extra.
"""
import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    if name == "transformers":
        return importlib.import_module(f"{__name__}.transformers")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
