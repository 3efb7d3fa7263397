"""The Triton backend: its raw functions under the names of the interface ``fused_transformer.contract`` writes down,
gathered from the attention modules (the other ops find their launchers themselves:
``fused_transformer.ops``). The attention LSE is differentiable here (the backward kernels take its gradient)."""
from .attention.decode import attention_with_kvcache
from .attention.ops import (
    attention_bwd, attention_fwd, attention_varlen_bwd, attention_varlen_fwd, attention_weights,
)

DIFFERENTIABLE_LSE = True

__all__ = [
    "attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd", "attention_weights",
    "attention_with_kvcache", "DIFFERENTIABLE_LSE",
]
