"""The functional ops, each described once in its own module under ``fused_transformer.ops`` (contract, reference,
route facts, Function, public function, cases): ``attention``, ``attention_varlen``, ``attention_with_kvcache`` and
``attention_weights`` (``ops.attention``), ``layer_norm``, ``rms_norm``, ``feed_forward``,
``linear_cross_entropy`` and ``apply_rotary_pos_emb`` (``ops.rotary``).

Each checks its arguments once, then runs where ``fused_transformer.route`` decides: a backend of ours, torch's own
path, or the reference. Under ``torch.autocast`` the ops follow autocast's own policy for what they replace:
``attention``, ``attention_weights`` and ``feed_forward`` (matrix products) run in the autocast dtype, the norms in
float32; float16 / bfloat16 / float32 tensor arguments are cast (masks and float64 are left alone) and the op runs
with autocast off inside, so each backend sees one dtype.
"""
from __future__ import annotations

from .contract import CAUSAL_ALIGNMENTS, FLOAT_DTYPES  # noqa: F401
from .ops.attention import attention, attention_varlen, attention_weights, attention_with_kvcache  # noqa: F401
from .ops.feed_forward import ACTIVATIONS, feed_forward  # noqa: F401
from .ops.layer_norm import layer_norm  # noqa: F401
from .ops.linear_cross_entropy import linear_cross_entropy  # noqa: F401
from .ops.rms_norm import rms_norm  # noqa: F401
from .ops.rotary import apply_rotary_pos_emb  # noqa: F401

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "attention_weights", "layer_norm", "rms_norm",
           "feed_forward", "linear_cross_entropy", "apply_rotary_pos_emb", "ACTIVATIONS", "FLOAT_DTYPES", "CAUSAL_ALIGNMENTS"]
