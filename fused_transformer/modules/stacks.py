"""The encoder and decoder stacks and ``Transformer``: with bool padding masks the tokens are packed once for every
layer and the final norm."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from .. import route
from .base import FusedTwin, any_nested, is_causal_mask, twin_of, with_fused_children
from .layers import TransformerDecoderLayer, TransformerEncoderLayer
from .packing import batch_first_of, fits_padding, pack, row_wise_norm, seq_len, unpack, zero_padding

__all__ = ["TransformerEncoder", "TransformerDecoder", "Transformer"]


@twin_of(nn.TransformerEncoder)
class TransformerEncoder(FusedTwin, nn.TransformerEncoder):
    """``torch.nn.TransformerEncoder`` over fused layers.

    Padding is handled without the nested-tensor conversion torch.nn makes in eval mode
    (``enable_nested_tensor`` is kept as an attribute only): with a bool ``src_key_padding_mask`` the real
    tokens are packed once, every layer and the final norm run on them, and the output is zero at padded
    positions, in training and eval (torch.nn writes zeros there only where it converts). See the module's
    docstring for what runs padded instead.
    """

    __init__ = with_fused_children(nn.TransformerEncoder.__init__)

    def forward(
        self, src: Tensor, mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
        is_causal: Optional[bool] = None,
    ) -> Tensor:
        if any_nested(src, mask, src_key_padding_mask):
            route.ran_elsewhere(type(self).__name__, "module", "nested tensors")
            return super().forward(src, mask, src_key_padding_mask, is_causal)
        first = self.layers[0]
        is_causal = is_causal_mask(mask, is_causal, seq_len(first, src))
        batch_first = batch_first_of(first)
        padding = src_key_padding_mask if fits_padding(src_key_padding_mask, src, batch_first) else None
        causal = None
        if padding is not None and _stack_packs(self, TransformerEncoderLayer, src, batch_first):
            causal = first._packing_causal(src, mask, padding, is_causal)
        if causal is not None:
            tokens, packing = pack(src, padding, batch_first)
            for layer in self.layers:
                tokens = layer(tokens, is_causal=causal, _packing=packing)
            return unpack(tokens if self.norm is None else self.norm(tokens), packing)
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal,
                           **_padded_layer_kwargs(layer))
        return zero_padding(output if self.norm is None else self.norm(output), padding, batch_first)


@twin_of(nn.TransformerDecoder)
class TransformerDecoder(FusedTwin, nn.TransformerDecoder):
    """``torch.nn.TransformerDecoder`` over fused layers.

    With a bool ``tgt_key_padding_mask`` and/or ``memory_key_padding_mask`` (``tgt_mask`` None or causal,
    ``memory_mask`` None) the target and memory tokens are packed once for every layer; the output is zero at
    padded target positions.
    """

    __init__ = with_fused_children(nn.TransformerDecoder.__init__)

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None, memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False,
    ) -> Tensor:
        first = self.layers[0]
        tgt_is_causal = is_causal_mask(tgt_mask, tgt_is_causal, seq_len(first, tgt))
        batch_first = batch_first_of(first)
        causal = None
        if not any_nested(tgt, memory) and _stack_packs(self, TransformerDecoderLayer, tgt, batch_first):
            causal = first._packing_causal(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                                           memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        if causal is not None:
            tokens, tgt_packing = pack(tgt, tgt_key_padding_mask, batch_first)
            memory_tokens, memory_packing = pack(memory, memory_key_padding_mask, batch_first)
            for layer in self.layers:
                tokens = layer(tokens, memory_tokens, tgt_is_causal=causal, _packing=(tgt_packing, memory_packing))
            return unpack(tokens if self.norm is None else self.norm(tokens), tgt_packing)
        output = tgt
        for layer in self.layers:
            output = layer(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                           tgt_key_padding_mask=tgt_key_padding_mask,
                           memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                           memory_is_causal=memory_is_causal, **_padded_layer_kwargs(layer))
        output = output if self.norm is None else self.norm(output)
        if any_nested(output) or not fits_padding(tgt_key_padding_mask, tgt, batch_first):
            return output
        return zero_padding(output, tgt_key_padding_mask, batch_first)


def _padded_layer_kwargs(layer: nn.Module) -> dict:
    """What a stack running padded tells its layer, if it is ours: run padded, write no zeros (the stack does). Any
    other callable (a user's module, a test's mock, which may have no ``forward`` on its type) gets torch.nn's
    arguments only."""
    ours = getattr(type(layer), "forward", None) in (TransformerEncoderLayer.forward, TransformerDecoderLayer.forward)
    return {"_in_padded_stack": True} if ours else {}


def _stack_packs(stack: nn.Module, layer_class: type, x: Tensor, batch_first: bool) -> bool:
    """Whether every layer of ``stack`` is a fused ``layer_class`` running its own forward (hooks allowed: the
    stack calls them on packed tokens), with one layout and modules that pack; and the final norm works on
    tokens one by one. The first layer then decides on the inputs (``_packing_causal``)."""
    return row_wise_norm(stack.norm) and all(
        isinstance(layer, layer_class) and getattr(type(layer), "forward", None) is layer_class.forward
        and batch_first_of(layer) == batch_first and layer._fuses(x) and layer._packs_modules()
        for layer in stack.layers)


@twin_of(nn.Transformer)
class Transformer(FusedTwin, nn.Transformer):
    """``torch.nn.Transformer`` whose encoder and decoder are built from the fused modules.

    With bool padding masks each packs its tokens (``TransformerEncoder``, ``TransformerDecoder``). The decoder
    reads the encoder's output as it comes, zero at padded source positions: pass ``memory_key_padding_mask``
    (usually ``src_key_padding_mask``) so that it ignores them, as with torch.nn.
    """

    __init__ = with_fused_children(nn.Transformer.__init__)
