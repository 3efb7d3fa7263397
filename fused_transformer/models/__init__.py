"""Models built on the fused modules: the classic Seq2Seq Transformer, a synthetic task and training loop for
it and its checkpoints (written atomically); ``python -m fused_transformer demo`` (``tools/demo.py``) trains it
against its torch.nn twin."""
from .checkpoint import (
    CheckpointMismatch,
    atomic_write,
    load_checkpoint,
    model_from_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from .seq2seq import (
    DecoderCache,
    Seq2SeqTransformer,
    make_src_mask,
    make_tgt_mask,
    src_mask_to_key_padding,
    tgt_mask_to_torch,
)
from .synthetic import (
    SequenceTask,
    TrainConfig,
    TrainResult,
    exact_match_accuracy,
    train,
)

__all__ = [
    "Seq2SeqTransformer", "DecoderCache", "make_src_mask", "make_tgt_mask", "src_mask_to_key_padding",
    "tgt_mask_to_torch", "SequenceTask", "TrainConfig", "TrainResult", "train", "exact_match_accuracy",
    "save_checkpoint", "load_checkpoint", "model_from_checkpoint", "read_checkpoint", "atomic_write",
    "CheckpointMismatch",
]
