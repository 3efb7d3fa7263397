"""The encoder and decoder layers (and ``LayerNorm``, ``RMSNorm``, ``GatedFeedForward``): fused attention,
feed-forward and add & LayerNorm, post-LN and pre-LN, padded or on packed tokens."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as ops
from .. import route
from .attention import MultiheadAttention
from .base import (
    FusedTwin, InputShapeError, active_p, any_nested, fused_activation, mixed_dtypes, tensor_key, twin_of,
    with_fused_children,
)
from .packing import (
    Packing, causal_or_none, fits_padding, pack, packing_allowed, row_wise_norm, seq_len, unpack, zero_padding,
)

__all__ = ["LayerNorm", "RMSNorm", "GatedFeedForward", "TransformerEncoderLayer", "TransformerDecoderLayer"]


@twin_of(nn.LayerNorm)
class LayerNorm(FusedTwin, nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by the fused ``layer_norm`` op (statistics in float32)."""

    def forward(self, input: Tensor) -> Tensor:
        params = self._parameters  # not self.weight: nn.Module's __getattr__ costs half a microsecond a parameter
        weight, bias = params["weight"], params["bias"]
        if input.is_nested or (weight is not None and bias is not None and weight.dtype != bias.dtype):
            route.ran_elsewhere(type(self).__name__, "module", "nested tensors or parameters of mixed dtypes")
            return super().forward(input)
        # The key is the input's alone: a shape checked once is checked for every call with that key.
        key = (input.shape, input.dtype, input.device, input.requires_grad, self.training)
        verdict = self._torch_nn_runs(key)
        if verdict:
            # torch.nn's forward: F.layer_norm, whose native op a plain tensor reaches without the wrapper's
            # __torch_function__ check (0.6 us of a 4-token call's 7).
            if type(input) is not Tensor:
                return super().forward(input)
            return torch.layer_norm(input, self.normalized_shape, weight, bias, self.eps, torch.backends.cudnn.enabled)
        if verdict is None:
            return self._first_call(key, lambda: self._fused(input, weight, bias))
        return self._fused(input, weight, bias)

    def _fused(self, input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
        shape = self.normalized_shape
        dims = len(shape)
        if input.shape[input.dim() - dims:] != shape:
            raise InputShapeError(
                f"input of shape {tuple(input.shape)} does not end in normalized_shape {list(shape)}"
            )
        if dims == 1:
            return ops.layer_norm(input, weight, bias, self.eps)
        weight = None if weight is None else weight.flatten()
        bias = None if bias is None else bias.flatten()
        return ops.layer_norm(input.flatten(input.dim() - dims), weight, bias, self.eps).view(input.shape)


@twin_of(nn.RMSNorm)
class RMSNorm(FusedTwin, nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by the fused ``rms_norm`` op (statistics in float32)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.is_nested:
            route.ran_elsewhere(type(self).__name__, "module", "nested tensors")
            return super().forward(x)
        shape = self.normalized_shape
        dims = len(shape)
        if tuple(x.shape[x.dim() - dims:]) != tuple(shape):
            raise InputShapeError(f"input of shape {tuple(x.shape)} does not end in normalized_shape {list(shape)}")
        if dims == 1:
            return ops.rms_norm(x, self.weight, self.eps)
        weight = None if self.weight is None else self.weight.flatten()
        return ops.rms_norm(x.flatten(x.dim() - dims), weight, self.eps).view(x.shape)



class GatedFeedForward(nn.Module):
    """The gated MLP of Llama, Gemma and Phi-3 on the fused ``gated_feed_forward`` op:
    ``down_proj(dropout(act(gate_proj(x)) * up_proj(x)))``.

    Its submodules are ``nn.Linear``s named as Hugging Face's: ``gate_proj``, ``up_proj`` and ``down_proj``
    (LlamaMLP's ``state_dict``), or with ``packed=True`` ``gate_up_proj`` (``Linear(d_model, 2 * d_ff)``, gate rows
    then up rows) and ``down_proj`` (Phi3MLP's). ``d_out`` defaults to ``d_model``; ``activation`` is ``"silu"``,
    ``"gelu"`` or ``"gelu_tanh"``; ``bias`` gives every projection a bias (Llama's ``mlp_bias``); ``dropout`` drops
    the gated product in training mode."""

    def __init__(self, d_model: int, d_ff: int, d_out: Optional[int] = None, *, activation: str = "silu",
                 bias: bool = False, dropout: float = 0.0, packed: bool = False, device=None, dtype=None):
        super().__init__()
        if activation not in ops.GATED_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} must be one of {ops.GATED_ACTIVATIONS}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be a number in [0, 1)")
        factory = {"device": device, "dtype": dtype}
        self.activation, self.dropout, self.packed = activation, float(dropout), bool(packed)
        if packed:
            self.gate_up_proj = nn.Linear(d_model, 2 * d_ff, bias=bias, **factory)
        else:
            self.gate_proj = nn.Linear(d_model, d_ff, bias=bias, **factory)
            self.up_proj = nn.Linear(d_model, d_ff, bias=bias, **factory)
        self.down_proj = nn.Linear(d_ff, d_model if d_out is None else d_out, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        dropout_p = self.dropout if self.training else 0.0
        down = self.down_proj
        if self.packed:
            gate = self.gate_up_proj
            return ops.gated_feed_forward(x, gate.weight, None, down.weight, gate.bias, None, down.bias,
                                          activation=self.activation, dropout_p=dropout_p)
        gate, up = self.gate_proj, self.up_proj
        return ops.gated_feed_forward(x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias,
                                      activation=self.activation, dropout_p=dropout_p)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}, packed={self.packed}"

def _add_and_norm(
    norm: nn.Module, x: Tensor, residual: Optional[Tensor] = None, dropout_p: float = 0.0, prenorm: bool = False,
):
    """``norm(dropout(x) + residual)`` (and the sum, with ``prenorm``), fused when ``norm`` is a LayerNorm
    over the last dim; any other norm module is called on the sum."""
    if isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1:
        return ops.layer_norm(x, norm.weight, norm.bias, norm.eps, residual=residual, dropout_p=dropout_p,
                              prenorm=prenorm)
    total = F.dropout(x, dropout_p) if dropout_p else x
    if residual is not None:
        total = total + residual
    return (norm(total), total) if prenorm else norm(total)


class _FusedLayerMixin(FusedTwin):
    """The residual wiring shared by the encoder and decoder layers, post-LN and pre-LN."""

    _DROPOUTS: Tuple[str, ...]  # the layer's dropout modules, by attribute name
    _NORMS: Tuple[str, ...]
    _ATTENTIONS: Tuple[str, ...]

    def _fuses(self, *inputs: Optional[Tensor]) -> bool:
        """Whether the fused path takes these inputs and this layer's modules; else torch.nn's forward runs.
        (The attention modules check their own parameters.)"""
        if any_nested(*inputs) or any(type(getattr(self, name)) is not nn.Dropout for name in self._DROPOUTS):
            return False
        linear1, linear2 = self.linear1, self.linear2
        if type(linear1) is not nn.Linear or type(linear2) is not nn.Linear:
            return False
        return not mixed_dtypes(linear1, linear2, *(getattr(self, name) for name in self._NORMS))

    def _packs_modules(self) -> bool:
        """Whether, past ``_fuses``, this layer's modules give on packed tokens what they give padded: norms
        over the last dim only, attention modules that pack (``MultiheadAttention._packs``)."""
        return all(row_wise_norm(getattr(self, name)) for name in self._NORMS) and all(
            isinstance(attn, MultiheadAttention) and attn._packs()
            for attn in (getattr(self, name) for name in self._ATTENTIONS))

    def _packs_input(self, x: Tensor) -> bool:
        """Whether ``x`` (a layer's or stack's input) can be packed for this layer."""
        return (x.dim() in (2, 3) and x.shape[-1] == self.self_attn.embed_dim and packing_allowed()
                and self._packs_modules())

    def _feed_forward(self, x: Tensor) -> Tensor:
        activation = fused_activation(self.activation)
        if activation is None:
            return self.linear2(self.dropout(self.activation(self.linear1(x))))
        return ops.feed_forward(
            x, self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias,
            activation=activation, dropout_p=active_p(self.dropout),
        )

    def _residual_blocks(
        self, x: Tensor, blocks: Sequence[Callable[[Tensor], Tensor]], norms: Sequence[nn.Module],
        dropouts: Sequence[nn.Dropout],
    ) -> Tensor:
        """Post-LN: ``x = norm_i(x + dropout_i(block_i(x)))``. Pre-LN: ``x = x + dropout_i(block_i(norm_i(x)))``,
        where each norm also adds the previous block's output to the residual stream in the same pass."""
        if not self.norm_first:
            for block, norm, dropout in zip(blocks, norms, dropouts):
                x = _add_and_norm(norm, block(x), residual=x, dropout_p=active_p(dropout))
            return x
        normed = _add_and_norm(norms[0], x)
        for i, block in enumerate(blocks):
            out = block(normed)
            if i + 1 < len(blocks):
                normed, x = _add_and_norm(norms[i + 1], out, residual=x, dropout_p=active_p(dropouts[i]), prenorm=True)
            else:
                x = x + F.dropout(out, active_p(dropouts[i]))
        return x


@twin_of(nn.TransformerEncoderLayer)
class TransformerEncoderLayer(_FusedLayerMixin, nn.TransformerEncoderLayer):
    """``torch.nn.TransformerEncoderLayer`` on fused attention, feed-forward and add & LayerNorm.

    With a bool ``src_key_padding_mask`` it runs on the real tokens only and its output is zero at padded
    positions (see the module's docstring); ``src_mask`` may then be None or the causal mask to be packed.
    """

    __init__ = with_fused_children(nn.TransformerEncoderLayer.__init__)
    _DROPOUTS, _NORMS, _ATTENTIONS = ("dropout", "dropout1", "dropout2"), ("norm1", "norm2"), ("self_attn",)

    def forward(
        self, src: Tensor, src_mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
        is_causal: bool = False, *, _packing: Optional[Packing] = None, _in_padded_stack: bool = False,
    ) -> Tensor:
        # Private arguments, from the stacks: _packing, packed tokens [T, d_model] in src and where they sit (the
        # masks are in it); _in_padded_stack, from a stack running padded: run padded and write no zeros (the
        # stack writes them once at its end), so that every layer computes what torch.nn's does everywhere.
        if _packing is not None:
            return self._packed_forward(src, _packing, is_causal)
        facts = tensor_key(src, src_mask, src_key_padding_mask)
        if facts is None:
            route.ran_elsewhere(type(self).__name__, "module", "nested tensors")
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        # The modules' door first: a key whose first call ran torch's ops only skips the checks below (its checks
        # passed then, and torch.nn's forward gives its own result whatever they would say now).
        return self._fused_or_torch_nn(
            facts + (is_causal, self.training, _in_padded_stack),
            lambda: self._fused(src, src_mask, src_key_padding_mask, is_causal, _in_padded_stack),
            lambda: super(TransformerEncoderLayer, self).forward(src, src_mask, src_key_padding_mask, is_causal))

    def _fused(self, src: Tensor, src_mask: Optional[Tensor], src_key_padding_mask: Optional[Tensor], is_causal: bool,
               in_padded_stack: bool) -> Tensor:
        if not self._fuses(src, src_mask, src_key_padding_mask):
            route.ran_elsewhere(type(self).__name__, "module", "an input or a part it does not fuse")
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        batch_first = self.self_attn.batch_first
        padding = src_key_padding_mask if fits_padding(src_key_padding_mask, src, batch_first) else None
        causal = None if in_padded_stack else self._packing_causal(src, src_mask, padding, is_causal)
        if causal is not None:
            tokens, packing = pack(src, padding, batch_first)
            return unpack(self._packed_forward(tokens, packing, causal), packing)
        return self._padded_forward(src, src_mask, src_key_padding_mask, is_causal,
                                    None if in_padded_stack else padding)

    def _padded_forward(self, src: Tensor, src_mask: Optional[Tensor], src_key_padding_mask: Optional[Tensor],
                        is_causal: bool, padding: Optional[Tensor]) -> Tensor:
        """The layer on padded ``src``, its output zeroed where ``padding`` says."""
        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn(
                x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, need_weights=False,
                is_causal=is_causal,
            )[0]

        out = self._residual_blocks(
            src, [self_attention, self._feed_forward], [self.norm1, self.norm2], [self.dropout1, self.dropout2]
        )
        return zero_padding(out, padding, self.self_attn.batch_first)

    def _packing_causal(
        self, src: Tensor, src_mask: Optional[Tensor], padding: Optional[Tensor], is_causal: bool,
    ) -> Optional[bool]:
        """None when the padded path runs (no bool padding to pack away, or inputs packing cannot take), else
        whether the packed self-attention is causal."""
        if padding is None or not self._packs_input(src):
            return None
        return causal_or_none(src_mask, is_causal, seq_len(self, src))

    def _packed_forward(self, x: Tensor, packing: Packing, causal: bool) -> Tensor:
        """The layer on packed tokens ``[T, d_model]``."""

        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn._packed_forward(x, x, packing, packing, causal)

        return self._residual_blocks(
            x, [self_attention, self._feed_forward], [self.norm1, self.norm2], [self.dropout1, self.dropout2]
        )


@twin_of(nn.TransformerDecoderLayer)
class TransformerDecoderLayer(_FusedLayerMixin, nn.TransformerDecoderLayer):
    """``torch.nn.TransformerDecoderLayer`` on fused attention, feed-forward and add & LayerNorm.

    With a bool ``tgt_key_padding_mask`` and/or ``memory_key_padding_mask`` it runs on the real target and
    memory tokens only, when ``tgt_mask`` is None or the causal mask and ``memory_mask`` is None; the output is
    zero at padded target positions (see the module's docstring).
    """

    __init__ = with_fused_children(nn.TransformerDecoderLayer.__init__)
    _DROPOUTS, _NORMS = ("dropout", "dropout1", "dropout2", "dropout3"), ("norm1", "norm2", "norm3")
    _ATTENTIONS = ("self_attn", "multihead_attn")

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None, memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: bool = False, memory_is_causal: bool = False, *,
        _packing: Optional[Tuple[Packing, Packing]] = None, _in_padded_stack: bool = False,
    ) -> Tensor:
        # Private arguments as in TransformerEncoderLayer.forward: _packing holds the target's and the memory's.
        if _packing is not None:
            return self._packed_forward(tgt, memory, *_packing, tgt_is_causal)
        masks = (tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        facts = tensor_key(tgt, None if memory is tgt else memory, *masks)
        if facts is None:
            route.ran_elsewhere(type(self).__name__, "module", "nested tensors")
            return super().forward(tgt, memory, *masks)
        return self._fused_or_torch_nn(  # the modules' door first, as the encoder layer's
            facts + (self.training, _in_padded_stack, memory is tgt),
            lambda: self._fused(tgt, memory, *masks, in_padded_stack=_in_padded_stack),
            lambda: super(TransformerDecoderLayer, self).forward(tgt, memory, *masks))

    def _fused(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor], memory_mask: Optional[Tensor],
               tgt_key_padding_mask: Optional[Tensor], memory_key_padding_mask: Optional[Tensor], tgt_is_causal: bool,
               memory_is_causal: bool, in_padded_stack: bool) -> Tensor:
        masks = (tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        if not self._fuses(tgt, memory, *masks[:4]):
            route.ran_elsewhere(type(self).__name__, "module", "an input or a part it does not fuse")
            return super().forward(tgt, memory, *masks)
        batch_first = self.self_attn.batch_first
        causal = None if in_padded_stack else self._packing_causal(tgt, memory, *masks)
        if causal is not None:
            tokens, tgt_packing = pack(tgt, tgt_key_padding_mask, batch_first)
            memory_tokens, memory_packing = pack(memory, memory_key_padding_mask, batch_first)
            out = self._packed_forward(tokens, memory_tokens, tgt_packing, memory_packing, causal)
            return unpack(out, tgt_packing)
        return self._padded_forward(tgt, memory, *masks, zeroed=not in_padded_stack)

    def _padded_forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor], memory_mask: Optional[Tensor],
                        tgt_key_padding_mask: Optional[Tensor], memory_key_padding_mask: Optional[Tensor],
                        tgt_is_causal: bool, memory_is_causal: bool, zeroed: bool) -> Tensor:
        """The layer on padded ``tgt`` and ``memory``; with ``zeroed``, its output zero at padded target positions."""
        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn(
                x, x, x, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask, need_weights=False,
                is_causal=tgt_is_causal,
            )[0]

        def cross_attention(x: Tensor) -> Tensor:
            return self.multihead_attn(
                x, memory, memory, attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask,
                need_weights=False, is_causal=memory_is_causal,
            )[0]

        out = self._residual_blocks(
            tgt, [self_attention, cross_attention, self._feed_forward], [self.norm1, self.norm2, self.norm3],
            [self.dropout1, self.dropout2, self.dropout3],
        )
        batch_first = self.self_attn.batch_first
        zeroed = zeroed and fits_padding(tgt_key_padding_mask, tgt, batch_first)
        return zero_padding(out, tgt_key_padding_mask if zeroed else None, batch_first)

    def _packing_causal(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor], memory_mask: Optional[Tensor],
        tgt_key_padding_mask: Optional[Tensor], memory_key_padding_mask: Optional[Tensor], tgt_is_causal: bool,
        memory_is_causal: bool,
    ) -> Optional[bool]:
        """None when the padded path runs (no bool padding to pack away, or inputs packing cannot take), else
        whether the packed self-attention is causal."""
        batch_first = self.self_attn.batch_first
        if tgt_key_padding_mask is None and memory_key_padding_mask is None:
            return None
        if not (fits_padding(tgt_key_padding_mask, tgt, batch_first)
                and fits_padding(memory_key_padding_mask, memory, batch_first)):
            return None
        if memory_mask is not None or memory_is_causal or memory.dim() != tgt.dim() or not self._packs_input(tgt):
            return None
        attn = self.multihead_attn
        batch_dim = 0 if batch_first else 1
        if memory.shape[-1] != attn.kdim or attn.kdim != attn.vdim or (
                tgt.dim() == 3 and memory.shape[batch_dim] != tgt.shape[batch_dim]):
            return None
        return causal_or_none(tgt_mask, tgt_is_causal, seq_len(self, tgt))

    def _packed_forward(
        self, x: Tensor, memory: Tensor, tgt_packing: Packing, memory_packing: Packing, causal: bool,
    ) -> Tensor:
        """The layer on packed target tokens ``[Tt, d_model]`` and memory tokens ``[Tm, d_model]``."""

        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn._packed_forward(x, x, tgt_packing, tgt_packing, causal)

        def cross_attention(x: Tensor) -> Tensor:
            return self.multihead_attn._packed_forward(x, memory, tgt_packing, memory_packing, False)

        return self._residual_blocks(
            x, [self_attention, cross_attention, self._feed_forward], [self.norm1, self.norm2, self.norm3],
            [self.dropout1, self.dropout2, self.dropout3],
        )
