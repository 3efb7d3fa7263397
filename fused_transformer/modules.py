"""Drop-in twins of the torch.nn Transformer modules, running on the fused functional ops.

Each class subclasses its ``torch.nn`` namesake and adds no state: constructor, defaults, attributes,
``state_dict`` keys, parameter initialisation (the same random draws) and ``isinstance`` checks are
torch's own. Only ``forward`` changes: it composes ``fused_transformer.functional`` ops.

One intended difference: a query that may attend to no key at all (every key masked) gives an output
row of zeros where torch.nn gives NaN. Weights returned with ``need_weights=True`` are the attention
probabilities before dropout (torch.nn returns them after dropout in training mode).

What the fused path does not handle runs torch.nn's own ``forward`` instead, with torch.nn's results and
errors: NestedTensor inputs, parameters of mixed dtypes, dropout modules replaced by other modules, and
``torch.jit.script`` (which scripts the torch.nn module sharing these parameters). Under ``torch.compile`` a
mask is not compared with the causal mask (that branches on data): it is applied as given, with the same
result; pass ``is_causal=True`` to get the causal kernel there.
"""
from __future__ import annotations

import copy
import functools
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import functional as ops

__all__ = [
    "InputShapeError", "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
    "TransformerDecoder", "Transformer", "LayerNorm", "fuse",
]


class InputShapeError(ValueError, AssertionError):
    """Input shapes a module cannot take: a ``ValueError``, and an ``AssertionError`` as torch.nn raises there."""


def _active_p(dropout: nn.Dropout) -> float:
    return dropout.p if dropout.training else 0.0


def _mixed_dtypes(*tensors: Optional[Tensor]) -> bool:
    """Whether the given parameters (None: absent) differ in dtype. Named one by one: walking a module's
    parameters costs tens of microseconds per call, as much as a decoding step's kernels."""
    return len({t.dtype for t in tensors if t is not None}) > 1


def _any_nested(*tensors: Optional[Tensor]) -> bool:
    return any(isinstance(t, Tensor) and t.is_nested for t in tensors)


class _FusedTwin:
    """What every fused module shares: ``torch.jit.script`` gets the torch.nn module holding the same
    parameters (the fused ``forward`` is plain Python, not TorchScript)."""

    def __prepare_scriptable__(self) -> nn.Module:
        torch_class = next(c for c in type(self).__mro__ if c.__module__.startswith("torch.nn"))
        twin = torch_class.__new__(torch_class)
        # Fresh containers (scripting swaps the children of the twin, not of this module), same tensors.
        twin.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()})
        return twin


def _fused_activation(fn: Callable) -> Optional[str]:
    """The name ``feed_forward`` knows ``fn`` by, or None for an activation it does not fuse."""
    if fn in (F.relu, torch.relu) or type(fn) is nn.ReLU:
        return "relu"
    if fn is F.gelu:
        return "gelu"
    if type(fn) is nn.GELU:
        return "gelu_tanh" if fn.approximate == "tanh" else "gelu"
    return None


def _is_causal_mask(mask: Optional[Tensor], is_causal: Optional[bool], size: int) -> bool:
    """``is_causal`` if given, else whether ``mask`` is exactly the square causal mask of ``size``
    (bool True = masked above the diagonal, or float -inf above and 0 elsewhere), as torch.nn detects it."""
    if is_causal is not None or mask is None or torch.compiler.is_compiling():
        return bool(is_causal)
    if tuple(mask.shape) != (size, size):
        return False
    above = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, above))
    return bool(((mask == float("-inf")) == above).all() and (mask[~above] == 0).all())


# ---------------------------------------------------------------------------------------- attention


class MultiheadAttention(_FusedTwin, nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` computed by the fused ``attention`` op.

    Masks follow torch.nn: ``attn_mask`` ``[L, S]`` or ``[B * num_heads, L, S]``, bool True = may NOT attend
    or float added; ``key_padding_mask`` ``[B, S]``, bool True = padding or float added. With
    ``is_causal=True`` (a hint that ``attn_mask`` is the causal mask, which torch.nn requires) the causal
    mask is applied inside the kernel and ``attn_mask`` itself is not read.
    """

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if _any_nested(query, key, value) or _mixed_dtypes(
            self.in_proj_weight, self.in_proj_bias, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
            self.bias_k, self.bias_v, self.out_proj.weight, self.out_proj.bias,
        ):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        # As torch.nn: with is_causal and nothing else to merge into it, attn_mask is dropped unread.
        mask_read = not (is_causal and key_padding_mask is None and not need_weights)
        batched = self._check_shapes(query, key, value, key_padding_mask, attn_mask if mask_read else None)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint (as torch.nn.MultiheadAttention); "
                "nn.Transformer.generate_square_subsequent_mask makes one"
            )
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, _ = query.shape

        q, k, v = self._project_inputs(query, key, value)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(batch, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(batch, 1, -1)], dim=1)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(batch, self.num_heads, 1, self.head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(batch, self.num_heads, 1, self.head_dim)], dim=2)
        src_len = k.shape[2]

        extra_keys = src_len - key.shape[1]
        mask, padding = self._convert_masks(
            None if is_causal else attn_mask, key_padding_mask, batch, tgt_len, src_len, extra_keys, query.dtype
        )
        mask_args = dict(attn_mask=mask, key_padding_mask=padding, is_causal=is_causal)
        dropout_p = self.dropout if self.training else 0.0
        out = ops.attention(q, k, v, dropout_p=dropout_p, return_lse=need_weights, **mask_args)
        weights = None
        if need_weights:
            out, lse = out
            weights = ops.attention_weights(q, k, lse, **mask_args)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        out = F.linear(out.transpose(1, 2).flatten(2), self.out_proj.weight, self.out_proj.bias)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _check_shapes(
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
    ) -> bool:
        """Whether the input is batched; raises ``InputShapeError`` on shapes torch.nn.MultiheadAttention rejects."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise InputShapeError(
                "query, key and value must all be 3-D (batched) or all 2-D (unbatched), got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        batched = query.dim() == 3
        if query.shape[-1] != self.embed_dim:
            raise InputShapeError(
                f"query's last dim must be embed_dim={self.embed_dim}, got shape {tuple(query.shape)}")
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise InputShapeError(
                f"key and value must end in kdim={self.kdim} and vdim={self.vdim}, "
                f"got shapes {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if key.shape[:-1] != value.shape[:-1]:
            raise InputShapeError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in all but the last dim")
        seq_dim = 1 if batched and self.batch_first else 0
        batch_dim = 1 - seq_dim
        if batched and key.shape[batch_dim] != query.shape[batch_dim]:
            raise InputShapeError(f"query {tuple(query.shape)} and key {tuple(key.shape)} have different batch sizes")
        batch = query.shape[batch_dim] if batched else 1
        tgt_len, src_len = query.shape[seq_dim], key.shape[seq_dim]
        if key_padding_mask is not None:
            expected = (batch, src_len) if batched else (src_len,)
            if tuple(key_padding_mask.shape) != expected:
                raise InputShapeError(f"key_padding_mask must be {list(expected)}, got {tuple(key_padding_mask.shape)}")
            if key_padding_mask.dtype != torch.bool and not key_padding_mask.is_floating_point():
                raise TypeError(f"key_padding_mask must be bool or float, got {key_padding_mask.dtype}")
        if attn_mask is not None:
            allowed = [(tgt_len, src_len), (batch * self.num_heads, tgt_len, src_len)]
            if tuple(attn_mask.shape) not in allowed:
                raise InputShapeError(
                    f"attn_mask must be one of {[list(s) for s in allowed]}, got {tuple(attn_mask.shape)}")
            if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
                raise TypeError(f"attn_mask must be bool or float, got {attn_mask.dtype}")
        return batched

    def _project_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The input projections, one matrix product for self-attention and two for shared key/value."""
        e = self.embed_dim
        bias = self.in_proj_bias
        b_q, b_k, b_v = (None, None, None) if bias is None else bias.split(e)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, b_q), F.linear(key, self.k_proj_weight, b_k),
                    F.linear(value, self.v_proj_weight, b_v))
        w = self.in_proj_weight
        if key is value:
            if query is key:
                return F.linear(query, w, bias).split(e, dim=-1)
            kv_bias = None if bias is None else bias[e:]
            return (F.linear(query, w[:e], b_q), *F.linear(key, w[e:], kv_bias).split(e, dim=-1))
        return F.linear(query, w[:e], b_q), F.linear(key, w[e:2 * e], b_k), F.linear(value, w[2 * e:], b_v)

    def _convert_masks(
        self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], batch: int, tgt_len: int,
        src_len: int, extra_keys: int, dtype: torch.dtype,
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """torch.nn masks -> the functional op's: ``attn_mask`` bool True = may attend, or float added,
        broadcastable to ``[B, H, L, S]``; ``key_padding_mask`` bool True = padding. The ``extra_keys``
        appended by ``add_bias_kv`` / ``add_zero_attn`` are never masked."""
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = ~attn_mask
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.unflatten(0, (batch, self.num_heads))
            attn_mask = F.pad(attn_mask, (0, extra_keys), value=True if attn_mask.dtype == torch.bool else 0.0)
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, extra_keys), value=False if key_padding_mask.dtype == torch.bool else 0.0)
            if key_padding_mask.is_floating_point() or (attn_mask is not None and attn_mask.is_floating_point()):
                # Mixed or float masks are summed into one additive mask, as torch.nn does.
                additive = _to_additive(key_padding_mask, dtype, padding=True)[:, None, None, :]
                attn_mask = additive if attn_mask is None else _to_additive(attn_mask, dtype) + additive
                key_padding_mask = None
        return attn_mask, key_padding_mask


def _to_additive(mask: Tensor, dtype: torch.dtype, padding: bool = False) -> Tensor:
    """A bool mask (True = may attend, or True = padding) or a float one as a float mask to add."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    blocked = mask if padding else ~mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(blocked, float("-inf"))


class LayerNorm(_FusedTwin, nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by the fused ``layer_norm`` op (statistics in float32)."""

    def forward(self, input: Tensor) -> Tensor:
        if input.is_nested or _mixed_dtypes(self.weight, self.bias):
            return super().forward(input)
        dims = len(self.normalized_shape)
        if tuple(input.shape[input.dim() - dims:]) != tuple(self.normalized_shape):
            raise InputShapeError(
                f"input of shape {tuple(input.shape)} does not end in normalized_shape {list(self.normalized_shape)}"
            )
        flat = input.flatten(input.dim() - dims) if dims > 1 else input
        weight = None if self.weight is None else self.weight.flatten()
        bias = None if self.bias is None else self.bias.flatten()
        return ops.layer_norm(flat, weight, bias, self.eps).view(input.shape)


# ------------------------------------------------------------------------------------------- layers


def _add_and_norm(
    norm: nn.Module, x: Tensor, residual: Optional[Tensor] = None, dropout_p: float = 0.0, prenorm: bool = False,
):
    """``norm(dropout(x) + residual)`` (and the sum, with ``prenorm``), fused when ``norm`` is a LayerNorm
    over the last dim; any other norm module is called on the sum."""
    if isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1:
        return ops.layer_norm(x, norm.weight, norm.bias, norm.eps, residual=residual, dropout_p=dropout_p, prenorm=prenorm)
    total = F.dropout(x, dropout_p) if dropout_p else x
    if residual is not None:
        total = total + residual
    return (norm(total), total) if prenorm else norm(total)


class _FusedLayerMixin(_FusedTwin):
    """The residual wiring shared by the encoder and decoder layers, post-LN and pre-LN."""

    _DROPOUTS: Tuple[str, ...]  # the layer's dropout modules, by attribute name
    _NORMS: Tuple[str, ...]

    def _fuses(self, *inputs: Optional[Tensor]) -> bool:
        """Whether the fused path takes these inputs and this layer's modules; else torch.nn's forward runs.
        (The attention modules check their own parameters.)"""
        if _any_nested(*inputs) or any(type(getattr(self, name)) is not nn.Dropout for name in self._DROPOUTS):
            return False
        linear1, linear2 = self.linear1, self.linear2
        if type(linear1) is not nn.Linear or type(linear2) is not nn.Linear:
            return False
        norms = [getattr(self, name) for name in self._NORMS]
        return not _mixed_dtypes(linear1.weight, linear1.bias, linear2.weight, linear2.bias,
                                 *(getattr(norm, p, None) for norm in norms for p in ("weight", "bias")))

    def _feed_forward(self, x: Tensor) -> Tensor:
        activation = _fused_activation(self.activation)
        if activation is None:
            return self.linear2(self.dropout(self.activation(self.linear1(x))))
        return ops.feed_forward(
            x, self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias,
            activation=activation, dropout_p=_active_p(self.dropout),
        )

    def _residual_blocks(
        self, x: Tensor, blocks: Sequence[Callable[[Tensor], Tensor]], norms: Sequence[nn.Module],
        dropouts: Sequence[nn.Dropout],
    ) -> Tensor:
        """Post-LN: ``x = norm_i(x + dropout_i(block_i(x)))``. Pre-LN: ``x = x + dropout_i(block_i(norm_i(x)))``,
        where each norm also adds the previous block's output to the residual stream in the same pass."""
        if not self.norm_first:
            for block, norm, dropout in zip(blocks, norms, dropouts):
                x = _add_and_norm(norm, block(x), residual=x, dropout_p=_active_p(dropout))
            return x
        normed = _add_and_norm(norms[0], x)
        for i, block in enumerate(blocks):
            out = block(normed)
            if i + 1 < len(blocks):
                normed, x = _add_and_norm(norms[i + 1], out, residual=x, dropout_p=_active_p(dropouts[i]), prenorm=True)
            else:
                x = x + F.dropout(out, _active_p(dropouts[i]))
        return x


def _with_fused_children(torch_init: Callable) -> Callable:
    """Wrap a torch.nn ``__init__`` so the sub-modules it builds are swapped for their fused twins."""

    @functools.wraps(torch_init)
    def __init__(self, *args, **kwargs) -> None:
        torch_init(self, *args, **kwargs)
        for child in self.children():
            fuse(child)

    return __init__


class TransformerEncoderLayer(_FusedLayerMixin, nn.TransformerEncoderLayer):
    """``torch.nn.TransformerEncoderLayer`` on fused attention, feed-forward and add & LayerNorm."""

    __init__ = _with_fused_children(nn.TransformerEncoderLayer.__init__)
    _DROPOUTS, _NORMS = ("dropout", "dropout1", "dropout2"), ("norm1", "norm2")

    def forward(
        self, src: Tensor, src_mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
        is_causal: bool = False,
    ) -> Tensor:
        if not self._fuses(src, src_mask, src_key_padding_mask):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)

        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn(
                x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, need_weights=False,
                is_causal=is_causal,
            )[0]

        return self._residual_blocks(
            src, [self_attention, self._feed_forward], [self.norm1, self.norm2], [self.dropout1, self.dropout2]
        )


class TransformerDecoderLayer(_FusedLayerMixin, nn.TransformerDecoderLayer):
    """``torch.nn.TransformerDecoderLayer`` on fused attention, feed-forward and add & LayerNorm."""

    __init__ = _with_fused_children(nn.TransformerDecoderLayer.__init__)
    _DROPOUTS, _NORMS = ("dropout", "dropout1", "dropout2", "dropout3"), ("norm1", "norm2", "norm3")

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None, memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: bool = False, memory_is_causal: bool = False,
    ) -> Tensor:
        if not self._fuses(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask):
            return super().forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                                   tgt_is_causal, memory_is_causal)

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

        return self._residual_blocks(
            tgt, [self_attention, cross_attention, self._feed_forward], [self.norm1, self.norm2, self.norm3],
            [self.dropout1, self.dropout2, self.dropout3],
        )


# ------------------------------------------------------------------------------------------- stacks


class TransformerEncoder(_FusedTwin, nn.TransformerEncoder):
    """``torch.nn.TransformerEncoder`` over fused layers.

    Padding is handled inside the attention kernel, so the nested-tensor conversion torch.nn makes in
    eval mode is not needed (``enable_nested_tensor`` is kept as an attribute only). Where torch.nn
    converts, it also writes zeros at padded query positions; here those positions hold the layers'
    outputs, which no later computation reads through attention.
    """

    __init__ = _with_fused_children(nn.TransformerEncoder.__init__)

    def forward(
        self, src: Tensor, mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
        is_causal: Optional[bool] = None,
    ) -> Tensor:
        if _any_nested(src, mask, src_key_padding_mask):
            return super().forward(src, mask, src_key_padding_mask, is_causal)
        is_causal = _is_causal_mask(mask, is_causal, _seq_len(self.layers[0], src))
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        return output if self.norm is None else self.norm(output)


class TransformerDecoder(_FusedTwin, nn.TransformerDecoder):
    """``torch.nn.TransformerDecoder`` over fused layers."""

    __init__ = _with_fused_children(nn.TransformerDecoder.__init__)

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None, memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False,
    ) -> Tensor:
        tgt_is_causal = _is_causal_mask(tgt_mask, tgt_is_causal, _seq_len(self.layers[0], tgt))
        output = tgt
        for layer in self.layers:
            output = layer(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                           tgt_key_padding_mask=tgt_key_padding_mask,
                           memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                           memory_is_causal=memory_is_causal)
        return output if self.norm is None else self.norm(output)


def _seq_len(layer: nn.Module, x: Tensor) -> int:
    """The sequence length of a stack's input, laid out as its first layer's attention expects."""
    batch_first = getattr(getattr(layer, "self_attn", None), "batch_first", False)
    return x.shape[1 if batch_first and x.dim() == 3 else 0]


class Transformer(_FusedTwin, nn.Transformer):
    """``torch.nn.Transformer`` whose encoder and decoder are built from the fused modules."""

    __init__ = _with_fused_children(nn.Transformer.__init__)


# --------------------------------------------------------------------------------------------- fuse

_FUSED_TWINS = {
    nn.MultiheadAttention: MultiheadAttention,
    nn.LayerNorm: LayerNorm,
    nn.TransformerEncoderLayer: TransformerEncoderLayer,
    nn.TransformerDecoderLayer: TransformerDecoderLayer,
    nn.TransformerEncoder: TransformerEncoder,
    nn.TransformerDecoder: TransformerDecoder,
    nn.Transformer: Transformer,
}


def fuse(model: nn.Module) -> nn.Module:
    """Make every ``torch.nn`` Transformer module in ``model`` (itself included) its fused twin, in place.

    The fused classes add no state, so each module keeps its identity: only its class changes. Parameters,
    buffers, hooks, optimizers and every reference the caller holds stay valid. Only exact ``torch.nn`` types
    change: user subclasses keep their own ``forward``. Returns ``model``.
    """
    for module in model.modules():
        twin_class = _FUSED_TWINS.get(type(module))
        if twin_class is not None:
            module.__class__ = twin_class
    return model
