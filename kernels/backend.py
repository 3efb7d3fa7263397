"""The Triton backend: its raw functions under the names of the interface ``fused_transformer.contract`` writes down,
gathered from the op modules. The attention LSE is differentiable here (the backward kernels take its gradient)."""
from .attention.decode import attention_with_kvcache
from .attention.ops import (
    attention_bwd, attention_fwd, attention_varlen_bwd, attention_varlen_fwd, attention_weights,
)
from .feed_forward import feed_forward_bwd, feed_forward_fwd
from .layer_norm import layer_norm_bwd, layer_norm_fwd

DIFFERENTIABLE_LSE = True

__all__ = [
    "attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd", "attention_weights",
    "attention_with_kvcache", "layer_norm_fwd", "layer_norm_bwd", "feed_forward_fwd", "feed_forward_bwd",
    "DIFFERENTIABLE_LSE",
]
