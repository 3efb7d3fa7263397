"""fused_transformer: fused attention, LayerNorm and feed-forward kernels behind drop-in torch.nn modules."""
from . import backend, reference
from .backend import current, set_backend, use_backend
from .functional import attention, attention_varlen, attention_weights, feed_forward, layer_norm
from .modules import (
    LayerNorm,
    MultiheadAttention,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    fuse,
)

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_varlen", "attention_weights", "layer_norm", "feed_forward",
    "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
    "TransformerDecoder", "Transformer", "LayerNorm", "fuse",
    "backend", "reference", "current", "set_backend", "use_backend",
]
