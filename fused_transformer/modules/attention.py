"""``MultiheadAttention`` on the fused ``attention`` op: torch.nn's masks converted once, q/k/v projected in one
product where torch.nn does, heads merged by a view."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as ops
from .. import route
from .base import FusedTwin, InputShapeError, mixed_dtypes, tensor_key, twin_of
from .packing import Packing, has_hooks

__all__ = ["MultiheadAttention"]


@twin_of(nn.MultiheadAttention)
class MultiheadAttention(FusedTwin, nn.MultiheadAttention):
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
        facts = tensor_key(query, None if key is query else key, None if value is key else value, key_padding_mask,
                           attn_mask)
        if facts is None:
            route.ran_elsewhere(type(self).__name__, "module", "nested tensors")
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        # The modules' door first, as the layers' (torch.nn's forward calls no fused module: no depth to keep).
        facts += (need_weights, average_attn_weights, is_causal, self.training, query is key, key is value)
        verdict = self._torch_nn_runs(facts)
        if verdict:
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                   is_causal)
        if verdict is None:
            return self._first_call(facts, lambda: self._fused(query, key, value, key_padding_mask, need_weights,
                                                               attn_mask, average_attn_weights, is_causal))
        return self._fused(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                           is_causal)

    def _fused(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
               need_weights: bool, attn_mask: Optional[Tensor], average_attn_weights: bool,
               is_causal: bool) -> Tuple[Tensor, Optional[Tensor]]:
        if mixed_dtypes(self, self.out_proj):
            route.ran_elsewhere(type(self).__name__, "module", "parameters of mixed dtypes")
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

        heads, head_dim = self.num_heads, self.head_dim
        if query is key and key is value and self._qkv_same_embed_dim and self.bias_k is None:
            # Self-attention: the packed product split into heads by one view and one unbind (its parts, then a view
            # each, take two calls more); unbound from the [B, L, 3, H, D] view, whose backward stacks the three
            # gradients in that layout, with no copy.
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            q, k, v = (t.transpose(1, 2) for t in qkv.view(batch, tgt_len, 3, heads, head_dim).unbind(2))
        else:
            q, k, v = self._project_inputs(query, key, value)
            if self.bias_k is not None:
                k = torch.cat([k, self.bias_k.expand(batch, 1, -1)], dim=1)
                v = torch.cat([v, self.bias_v.expand(batch, 1, -1)], dim=1)
            q, k, v = (t.view(batch, t.shape[1], heads, head_dim).transpose(1, 2) for t in (q, k, v))
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
        w = self.in_proj_weight
        # A packed product's parts by unbind (backward: one stack of the gradients), not by slicing (backward: one
        # zero-filled full-width gradient per part, then summed).
        if self._qkv_same_embed_dim and query is key and key is value:
            qkv = F.linear(query, w, bias)
            return qkv.view(*qkv.shape[:-1], 3, e).unbind(-2)
        # tensor_split, not split: a C method (no Python wrapper per call), and three parts even when e = 0.
        b_q, b_k, b_v = (None, None, None) if bias is None else bias.tensor_split(3)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, b_q), F.linear(key, self.k_proj_weight, b_k),
                    F.linear(value, self.v_proj_weight, b_v))
        if key is value:
            kv_bias = None if bias is None else bias[e:]
            kv = F.linear(key, w[e:], kv_bias)
            return (F.linear(query, w[:e], b_q), *kv.view(*kv.shape[:-1], 2, e).unbind(-2))
        return F.linear(query, w[:e], b_q), F.linear(key, w[e:2 * e], b_k), F.linear(value, w[2 * e:], b_v)

    def _packs(self) -> bool:
        """Whether ``_packed_forward`` computes what ``forward`` would: this class's forward, no extra keys, one
        parameter dtype, and no hooks (they would expect to see ``forward`` called)."""
        return (type(self).forward is MultiheadAttention.forward and self.bias_k is None and not self.add_zero_attn
                and not has_hooks(self) and not mixed_dtypes(self, self.out_proj))

    def _packed_forward(
        self, query: Tensor, key: Tensor, query_packing: "Packing", key_packing: "Packing", is_causal: bool,
    ) -> Tensor:
        """Attention of packed queries ``[Tq, E]`` to packed keys (= values) ``[Tk, kdim]``, sequence by sequence
        (``attention_varlen``); ``query is key`` for self-attention. Returns ``[Tq, E]``."""
        q, k, v = self._project_inputs(query, key, key)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)) for t in (q, k, v))
        out = ops.attention_varlen(
            q, k, v, query_packing.cu_seqlens, key_packing.cu_seqlens, query_packing.max_seqlen,
            key_packing.max_seqlen, is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0,
        )
        return F.linear(out.flatten(1), self.out_proj.weight, self.out_proj.bias)

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
            pad_value = False if key_padding_mask.dtype == torch.bool else 0.0
            key_padding_mask = F.pad(key_padding_mask, (0, extra_keys), value=pad_value)
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
