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

Padding costs nothing. Given a bool key padding mask ``[B, S]`` (True = padding), the encoder and decoder
layers and stacks (and so ``Transformer``) gather the real tokens once, packed sequence after sequence
(right or left padding and holes alike), run projections, attention (``attention_varlen``), LayerNorm and
feed-forward on those tokens only, and scatter the result back: **the output at padded positions is zero**
(torch.nn's eval fast path writes zeros there too; its other paths leave values no later computation
should read), and a sequence of padding only gives zeros. Real positions equal the padded computation to
round-off, gradients included. The stacks pack once for all their layers, whose forward hooks then see the
packed ``[tokens, d_model]`` tensors (as torch.nn's fast path shows its layers nested tensors). What cannot
be packed runs padded and still writes zeros at padded positions: other attention masks than the causal
one, a ``memory_mask``, a hooked ``MultiheadAttention``, ``add_bias_kv`` / ``add_zero_attn``, norms other
than a LayerNorm over the last dim, and ``torch.compile`` / ``torch.export`` (packing has data-dependent
shapes).
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

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


def _mixed_dtypes(*modules: nn.Module) -> bool:
    """Whether the parameters the given modules hold themselves (not their children's) differ in dtype. Read
    from each ``_parameters`` dict: ``parameters()`` or an attribute per parameter costs tens of microseconds
    per call, as much as a decoding step's kernels."""
    dtype = None
    for module in modules:
        for p in module._parameters.values():
            if p is not None:
                if dtype is None:
                    dtype = p.dtype
                elif p.dtype != dtype:
                    return True
    return False


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
        if _any_nested(query, key, value) or _mixed_dtypes(self, self.out_proj):
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
        heads, head_dim = self.num_heads, self.head_dim
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
        # tensor_split, not split: a C method (no Python wrapper per call), and three parts even when e = 0.
        b_q, b_k, b_v = (None, None, None) if bias is None else bias.tensor_split(3)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, b_q), F.linear(key, self.k_proj_weight, b_k),
                    F.linear(value, self.v_proj_weight, b_v))
        w = self.in_proj_weight
        # A packed product's parts by unbind (backward: one stack of the gradients), not by slicing (backward: one
        # zero-filled full-width gradient per part, then summed).
        if key is value:
            if query is key:
                qkv = F.linear(query, w, bias)
                return qkv.view(*qkv.shape[:-1], 3, e).unbind(-2)
            kv_bias = None if bias is None else bias[e:]
            kv = F.linear(key, w[e:], kv_bias)
            return (F.linear(query, w[:e], b_q), *kv.view(*kv.shape[:-1], 2, e).unbind(-2))
        return F.linear(query, w[:e], b_q), F.linear(key, w[e:2 * e], b_k), F.linear(value, w[2 * e:], b_v)

    def _packs(self) -> bool:
        """Whether ``_packed_forward`` computes what ``forward`` would: this class's forward, no extra keys, one
        parameter dtype, and no hooks (they would expect to see ``forward`` called)."""
        return (type(self).forward is MultiheadAttention.forward and self.bias_k is None and not self.add_zero_attn
                and not _has_hooks(self) and not _mixed_dtypes(self, self.out_proj))

    def _packed_forward(
        self, query: Tensor, key: Tensor, query_packing: "_Packing", key_packing: "_Packing", is_causal: bool,
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
        weight, bias = self.weight, self.bias
        if input.is_nested or (weight is not None and bias is not None and weight.dtype != bias.dtype):
            return super().forward(input)
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


# ------------------------------------------------------------------------------------------ packing


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run any hook (its own or a global one)."""
    hooks = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def _row_wise_norm(norm: Optional[nn.Module]) -> bool:
    """Whether ``norm`` (None: absent) normalises each token on its own, so packed tokens get the same result."""
    return norm is None or (isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) and len(norm.normalized_shape) == 1)


def _fits_padding(mask: Optional[Tensor], x: Tensor, batch_first: bool) -> bool:
    """Whether ``mask`` is None or a bool key padding mask of ``x`` (``[B, L]`` for ``x`` ``[B, L, d]`` or
    ``[L, B, d]``, ``[L]`` for unbatched ``x`` ``[L, d]``): one that packing can take."""
    if mask is None:
        return True
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or x.dim() not in (2, 3) or mask.is_nested:
        return False
    if x.dim() == 2:
        return tuple(mask.shape) == (x.shape[0],)
    return tuple(mask.shape) == ((x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0]))


# False: never pack, run every module padded (with zeros at padding all the same). For tests and measurements.
_PACK_PADDING = True


def _packing_allowed() -> bool:
    """Whether inputs are packed at all: not while compiling (boolean indexing has data-dependent
    shapes: a graph break, and an error under ``fullgraph`` and ``torch.export``)."""
    return _PACK_PADDING and not torch.compiler.is_compiling()


def _causal_or_none(mask: Optional[Tensor], is_causal: bool, size: int) -> Optional[bool]:
    """What the self-attention mask means for packing: False for no mask, True for the causal mask (by the
    ``is_causal`` hint or by value), None for any other mask (not packed). With the hint but no mask, None:
    the padded path raises torch.nn's error."""
    if mask is None:
        return None if is_causal else False
    if tuple(mask.shape) != (size, size):
        return None
    return True if is_causal or _is_causal_mask(mask, None, size) else None


class _Packing(NamedTuple):
    """Where the real tokens of a padded batch sit. They are packed sequence after sequence, each in its
    order, so that right padding, left padding and holes all work."""

    # [T] int64: each real token's row in the input seen as [B * L, d] (or [L * B, d]) in its layout; None when
    # the tokens are the input's own rows in order (batch-first with no padding: packing is a view).
    index: Optional[Tensor]
    cu_seqlens: Tensor  # [B + 1] int32: 0, then the running sums of the sequence lengths
    max_seqlen: int
    shape: Tuple[int, ...]  # the input's shape without its feature dim


def _pack(x: Tensor, padding: Optional[Tensor], batch_first: bool) -> Tuple[Tensor, _Packing]:
    """``x`` ``[B, L, d]``, ``[L, B, d]`` (``batch_first=False``) or ``[L, d]`` -> its real tokens ``[T, d]``
    (``padding``: True = padding, as ``_fits_padding`` checked; None = every token) and where they were. Reads
    the lengths on the host (one synchronisation)."""
    shape = tuple(x.shape[:-1])
    seq_first = x.dim() == 3 and not batch_first
    batch, length = (shape[1], shape[0]) if seq_first else ((1, shape[0]) if x.dim() == 2 else shape)
    ranks = None  # batch-major positions of the real tokens; None: all of them
    if padding is None:
        lengths = torch.full((batch,), length, dtype=torch.int32, device=x.device)
        max_seqlen = length
    else:
        keep = ~padding.reshape(batch, length)
        lengths = keep.sum(1, dtype=torch.int32)
        ranks = keep.flatten().nonzero().squeeze(1)
        max_seqlen = int(lengths.max()) if batch else 0
        if ranks.shape[0] == batch * length:
            ranks = None
    if ranks is None and seq_first:
        ranks = torch.arange(batch * length, device=x.device)
    # Tokens go sequence after sequence; a seq-first input holds token l of sequence b at row l * B + b.
    index = (ranks % length) * batch + ranks // length if seq_first and length else ranks
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    rows = x.reshape(-1, x.shape[-1])
    # Advanced indexing (and index_put in _unpack): their backward is deterministic on every device.
    return rows if index is None else rows[index], _Packing(index, cu_seqlens, max_seqlen, shape)


def _unpack(tokens: Tensor, packing: _Packing) -> Tensor:
    """Packed tokens ``[T, d]`` back to the padded input's layout ``[*shape, d]``, zeros at padding."""
    if packing.index is None:
        return tokens.reshape(*packing.shape, tokens.shape[-1])
    rows = tokens.new_zeros(math.prod(packing.shape), tokens.shape[-1]).index_put((packing.index,), tokens)
    return rows.view(*packing.shape, tokens.shape[-1])


def _zero_padding(x: Tensor, padding: Optional[Tensor], batch_first: bool) -> Tensor:
    """The padded path's output with zeros at padding, as the packed path gives (``padding`` as
    ``_fits_padding`` checked; None: nothing to zero)."""
    if padding is None:
        return x
    if x.dim() == 3 and not batch_first:
        padding = padding.t()
    return x.masked_fill(padding[..., None], 0.0)


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
    _ATTENTIONS: Tuple[str, ...]

    def _fuses(self, *inputs: Optional[Tensor]) -> bool:
        """Whether the fused path takes these inputs and this layer's modules; else torch.nn's forward runs.
        (The attention modules check their own parameters.)"""
        if _any_nested(*inputs) or any(type(getattr(self, name)) is not nn.Dropout for name in self._DROPOUTS):
            return False
        linear1, linear2 = self.linear1, self.linear2
        if type(linear1) is not nn.Linear or type(linear2) is not nn.Linear:
            return False
        return not _mixed_dtypes(linear1, linear2, *(getattr(self, name) for name in self._NORMS))

    def _packs_modules(self) -> bool:
        """Whether, past ``_fuses``, this layer's modules give on packed tokens what they give padded: norms
        over the last dim only, attention modules that pack (``MultiheadAttention._packs``)."""
        return all(_row_wise_norm(getattr(self, name)) for name in self._NORMS) and all(
            isinstance(attn, MultiheadAttention) and attn._packs()
            for attn in (getattr(self, name) for name in self._ATTENTIONS))

    def _packs_input(self, x: Tensor) -> bool:
        """Whether ``x`` (a layer's or stack's input) can be packed for this layer."""
        return (x.dim() in (2, 3) and x.shape[-1] == self.self_attn.embed_dim and _packing_allowed()
                and self._packs_modules())

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
    """``torch.nn.TransformerEncoderLayer`` on fused attention, feed-forward and add & LayerNorm.

    With a bool ``src_key_padding_mask`` it runs on the real tokens only and its output is zero at padded
    positions (see the module's docstring); ``src_mask`` may then be None or the causal mask to be packed.
    """

    __init__ = _with_fused_children(nn.TransformerEncoderLayer.__init__)
    _DROPOUTS, _NORMS, _ATTENTIONS = ("dropout", "dropout1", "dropout2"), ("norm1", "norm2"), ("self_attn",)

    def forward(
        self, src: Tensor, src_mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
        is_causal: bool = False, *, _packing: Optional[_Packing] = None, _in_padded_stack: bool = False,
    ) -> Tensor:
        # Private arguments, from the stacks: _packing, packed tokens [T, d_model] in src and where they sit (the
        # masks are in it); _in_padded_stack, from a stack running padded: run padded and write no zeros (the
        # stack writes them once at its end), so that every layer computes what torch.nn's does everywhere.
        if _packing is not None:
            return self._packed_forward(src, _packing, is_causal)
        if not self._fuses(src, src_mask, src_key_padding_mask):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        batch_first = self.self_attn.batch_first
        padding = src_key_padding_mask if _fits_padding(src_key_padding_mask, src, batch_first) else None
        causal = None if _in_padded_stack else self._packing_causal(src, src_mask, padding, is_causal)
        if causal is not None:
            tokens, packing = _pack(src, padding, batch_first)
            return _unpack(self._packed_forward(tokens, packing, causal), packing)

        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn(
                x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, need_weights=False,
                is_causal=is_causal,
            )[0]

        out = self._residual_blocks(
            src, [self_attention, self._feed_forward], [self.norm1, self.norm2], [self.dropout1, self.dropout2]
        )
        return _zero_padding(out, None if _in_padded_stack else padding, batch_first)

    def _packing_causal(
        self, src: Tensor, src_mask: Optional[Tensor], padding: Optional[Tensor], is_causal: bool,
    ) -> Optional[bool]:
        """None when the padded path runs (no bool padding to pack away, or inputs packing cannot take), else
        whether the packed self-attention is causal."""
        if padding is None or not self._packs_input(src):
            return None
        return _causal_or_none(src_mask, is_causal, _seq_len(self, src))

    def _packed_forward(self, x: Tensor, packing: _Packing, causal: bool) -> Tensor:
        """The layer on packed tokens ``[T, d_model]``."""

        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn._packed_forward(x, x, packing, packing, causal)

        return self._residual_blocks(
            x, [self_attention, self._feed_forward], [self.norm1, self.norm2], [self.dropout1, self.dropout2]
        )


class TransformerDecoderLayer(_FusedLayerMixin, nn.TransformerDecoderLayer):
    """``torch.nn.TransformerDecoderLayer`` on fused attention, feed-forward and add & LayerNorm.

    With a bool ``tgt_key_padding_mask`` and/or ``memory_key_padding_mask`` it runs on the real target and
    memory tokens only, when ``tgt_mask`` is None or the causal mask and ``memory_mask`` is None; the output is
    zero at padded target positions (see the module's docstring).
    """

    __init__ = _with_fused_children(nn.TransformerDecoderLayer.__init__)
    _DROPOUTS, _NORMS = ("dropout", "dropout1", "dropout2", "dropout3"), ("norm1", "norm2", "norm3")
    _ATTENTIONS = ("self_attn", "multihead_attn")

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None, memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: bool = False, memory_is_causal: bool = False, *,
        _packing: Optional[Tuple[_Packing, _Packing]] = None, _in_padded_stack: bool = False,
    ) -> Tensor:
        # Private arguments as in TransformerEncoderLayer.forward: _packing holds the target's and the memory's.
        if _packing is not None:
            return self._packed_forward(tgt, memory, *_packing, tgt_is_causal)
        if not self._fuses(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask):
            return super().forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                                   tgt_is_causal, memory_is_causal)
        batch_first = self.self_attn.batch_first
        causal = None if _in_padded_stack else self._packing_causal(
            tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal,
            memory_is_causal)
        if causal is not None:
            tokens, tgt_packing = _pack(tgt, tgt_key_padding_mask, batch_first)
            memory_tokens, memory_packing = _pack(memory, memory_key_padding_mask, batch_first)
            out = self._packed_forward(tokens, memory_tokens, tgt_packing, memory_packing, causal)
            return _unpack(out, tgt_packing)

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
        zeroed = not _in_padded_stack and _fits_padding(tgt_key_padding_mask, tgt, batch_first)
        return _zero_padding(out, tgt_key_padding_mask if zeroed else None, batch_first)

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
        if not (_fits_padding(tgt_key_padding_mask, tgt, batch_first)
                and _fits_padding(memory_key_padding_mask, memory, batch_first)):
            return None
        if memory_mask is not None or memory_is_causal or memory.dim() != tgt.dim() or not self._packs_input(tgt):
            return None
        attn = self.multihead_attn
        batch_dim = 0 if batch_first else 1
        if memory.shape[-1] != attn.kdim or attn.kdim != attn.vdim or (
                tgt.dim() == 3 and memory.shape[batch_dim] != tgt.shape[batch_dim]):
            return None
        return _causal_or_none(tgt_mask, tgt_is_causal, _seq_len(self, tgt))

    def _packed_forward(
        self, x: Tensor, memory: Tensor, tgt_packing: _Packing, memory_packing: _Packing, causal: bool,
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


# ------------------------------------------------------------------------------------------- stacks


class TransformerEncoder(_FusedTwin, nn.TransformerEncoder):
    """``torch.nn.TransformerEncoder`` over fused layers.

    Padding is handled without the nested-tensor conversion torch.nn makes in eval mode
    (``enable_nested_tensor`` is kept as an attribute only): with a bool ``src_key_padding_mask`` the real
    tokens are packed once, every layer and the final norm run on them, and the output is zero at padded
    positions, in training and eval (torch.nn writes zeros there only where it converts). See the module's
    docstring for what runs padded instead.
    """

    __init__ = _with_fused_children(nn.TransformerEncoder.__init__)

    def forward(
        self, src: Tensor, mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
        is_causal: Optional[bool] = None,
    ) -> Tensor:
        if _any_nested(src, mask, src_key_padding_mask):
            return super().forward(src, mask, src_key_padding_mask, is_causal)
        first = self.layers[0]
        is_causal = _is_causal_mask(mask, is_causal, _seq_len(first, src))
        batch_first = _batch_first(first)
        padding = src_key_padding_mask if _fits_padding(src_key_padding_mask, src, batch_first) else None
        causal = None
        if padding is not None and _stack_packs(self, TransformerEncoderLayer, src, batch_first):
            causal = first._packing_causal(src, mask, padding, is_causal)
        if causal is not None:
            tokens, packing = _pack(src, padding, batch_first)
            for layer in self.layers:
                tokens = layer(tokens, is_causal=causal, _packing=packing)
            return _unpack(tokens if self.norm is None else self.norm(tokens), packing)
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal,
                           **_padded_layer_kwargs(layer))
        return _zero_padding(output if self.norm is None else self.norm(output), padding, batch_first)


class TransformerDecoder(_FusedTwin, nn.TransformerDecoder):
    """``torch.nn.TransformerDecoder`` over fused layers.

    With a bool ``tgt_key_padding_mask`` and/or ``memory_key_padding_mask`` (``tgt_mask`` None or causal,
    ``memory_mask`` None) the target and memory tokens are packed once for every layer; the output is zero at
    padded target positions.
    """

    __init__ = _with_fused_children(nn.TransformerDecoder.__init__)

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None, memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False,
    ) -> Tensor:
        first = self.layers[0]
        tgt_is_causal = _is_causal_mask(tgt_mask, tgt_is_causal, _seq_len(first, tgt))
        batch_first = _batch_first(first)
        causal = None
        if not _any_nested(tgt, memory) and _stack_packs(self, TransformerDecoderLayer, tgt, batch_first):
            causal = first._packing_causal(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                                           memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        if causal is not None:
            tokens, tgt_packing = _pack(tgt, tgt_key_padding_mask, batch_first)
            memory_tokens, memory_packing = _pack(memory, memory_key_padding_mask, batch_first)
            for layer in self.layers:
                tokens = layer(tokens, memory_tokens, tgt_is_causal=causal, _packing=(tgt_packing, memory_packing))
            return _unpack(tokens if self.norm is None else self.norm(tokens), tgt_packing)
        output = tgt
        for layer in self.layers:
            output = layer(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                           tgt_key_padding_mask=tgt_key_padding_mask,
                           memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                           memory_is_causal=memory_is_causal, **_padded_layer_kwargs(layer))
        output = output if self.norm is None else self.norm(output)
        if _any_nested(output) or not _fits_padding(tgt_key_padding_mask, tgt, batch_first):
            return output
        return _zero_padding(output, tgt_key_padding_mask, batch_first)


def _padded_layer_kwargs(layer: nn.Module) -> dict:
    """What a stack running padded tells its layer, if it is ours: run padded, write no zeros (the stack does). Any
    other callable (a user's module, a test's mock, which may have no ``forward`` on its type) gets torch.nn's
    arguments only."""
    ours = getattr(type(layer), "forward", None) in (TransformerEncoderLayer.forward, TransformerDecoderLayer.forward)
    return {"_in_padded_stack": True} if ours else {}


def _batch_first(layer: nn.Module) -> bool:
    return bool(getattr(getattr(layer, "self_attn", None), "batch_first", False))


def _stack_packs(stack: nn.Module, layer_class: type, x: Tensor, batch_first: bool) -> bool:
    """Whether every layer of ``stack`` is a fused ``layer_class`` running its own forward (hooks allowed: the
    stack calls them on packed tokens), with one layout and modules that pack; and the final norm works on
    tokens one by one. The first layer then decides on the inputs (``_packing_causal``)."""
    return _row_wise_norm(stack.norm) and all(
        isinstance(layer, layer_class) and getattr(type(layer), "forward", None) is layer_class.forward
        and _batch_first(layer) == batch_first and layer._fuses(x) and layer._packs_modules()
        for layer in stack.layers)


def _seq_len(layer: nn.Module, x: Tensor) -> int:
    """The sequence length of a stack's input, laid out as its first layer's attention expects."""
    batch_first = getattr(getattr(layer, "self_attn", None), "batch_first", False)
    return x.shape[1 if batch_first and x.dim() == 3 else 0]


class Transformer(_FusedTwin, nn.Transformer):
    """``torch.nn.Transformer`` whose encoder and decoder are built from the fused modules.

    With bool padding masks each packs its tokens (``TransformerEncoder``, ``TransformerDecoder``). The decoder
    reads the encoder's output as it comes, zero at padded source positions: pass ``memory_key_padding_mask``
    (usually ``src_key_padding_mask``) so that it ignores them, as with torch.nn.
    """

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
