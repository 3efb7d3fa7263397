"""Models built on the fused modules: the classic Seq2Seq Transformer, a synthetic task to train it on, and
the ``python -m fused_transformer demo`` that trains it and compares it with its torch.nn twin."""
from .seq2seq import (
    DecoderCache,
    Seq2SeqTransformer,
    make_src_mask,
    make_tgt_mask,
    src_mask_to_key_padding,
    tgt_mask_to_torch,
)

__all__ = [
    "Seq2SeqTransformer", "DecoderCache", "make_src_mask", "make_tgt_mask", "src_mask_to_key_padding",
    "tgt_mask_to_torch",
]
