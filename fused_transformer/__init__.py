"""fused_transformer: fused attention, LayerNorm, RMSNorm, feed-forward, LM-loss and rotary-embedding kernels behind drop-in torch.nn
modules."""
from . import backend, integrations, reference
from .backend import current, set_backend, use_backend
from .functional import (
    apply_rotary_pos_emb, attention, attention_varlen, attention_weights, attention_with_kvcache, feed_forward,
    layer_norm, linear_cross_entropy, rms_norm,
)
from .integrations import sdpa as _sdpa_registry
from .route import explain
from .modules import (
    LayerNorm,
    MultiheadAttention,
    RMSNorm,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    fuse,
)

__version__ = "0.1.0"

# torch's SDPA flash-attention registry gets "fused_transformer" (activated only by the user: integrations/sdpa.py).
_sdpa_registry.register()

__all__ = [
    "attention", "attention_varlen", "attention_weights", "attention_with_kvcache", "layer_norm", "rms_norm",
    "feed_forward", "linear_cross_entropy", "apply_rotary_pos_emb", "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
    "TransformerDecoder", "Transformer", "LayerNorm", "RMSNorm", "fuse", "explain",
    "backend", "reference", "current", "set_backend", "use_backend", "integrations",
]
