"""The Seq2Seq Transformer of the classic tutorials, built on the fused modules, with cached decoding.

The model: token embedding scaled by ``sqrt(hid_dim)`` plus a learned positional embedding, ``n_layers``
encoder and decoder layers (post-LN, or pre-LN with ``norm_first=True`` and a final LayerNorm), a
position-wise feed-forward (ReLU, or GELU by default in the pre-LN variant) and an output projection.
``Seq2SeqTransformer(..., fused=False)`` builds the same model on plain ``torch.nn`` modules: the two
builds have identical ``state_dict`` keys, so weights move between them with ``load_state_dict``.

Masks. The tutorials build a source mask ``[B, 1, 1, S]`` and a target mask ``pad & tril`` ``[B, 1, T, T]``
(True = may attend); our modules take torch.nn's: ``src_key_padding_mask`` ``[B, S]`` True = padding and a
causal ``tgt_mask`` with ``tgt_is_causal=True``. ``make_src_mask`` / ``make_tgt_mask`` build the former,
``src_mask_to_key_padding`` / ``tgt_mask_to_torch`` convert them to the latter. The model builds its
masks from ``pad_idx`` itself.

Incremental decoding. ``start_cache(memory, src_padding)`` projects the encoder output to the
cross-attention keys/values of every decoder layer once; ``decode_step(tokens, cache)`` runs only the new
tokens through each layer, with that layer's own parameters, writing their self-attention keys/values into
the cache's preallocated buffers, so a greedy step costs O(L) instead of O(L^2). ``greedy_decode`` and
``beam_search`` are batched and stop per sequence at ``eos_idx``.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as ops
from .. import modules as fused_modules
from ..modules.base import active_p
from ..modules.layers import _add_and_norm as add_and_norm

__all__ = [
    "Seq2SeqTransformer", "DecoderCache", "make_src_mask", "make_tgt_mask", "src_mask_to_key_padding",
    "tgt_mask_to_torch",
]


# ------------------------------------------------------------------------------------------------ masks


def make_src_mask(src: Tensor, pad_idx: int) -> Tensor:
    """The tutorials' source mask: bool ``[B, 1, 1, S]``, True = a real token (may be attended)."""
    return (src != pad_idx)[:, None, None, :]


def make_tgt_mask(tgt: Tensor, pad_idx: int) -> Tensor:
    """The tutorials' target mask ``pad & tril``: bool ``[B, 1, T, T]``, True = query ``i`` may see key ``j``."""
    length = tgt.shape[1]
    tril = torch.ones(length, length, dtype=torch.bool, device=tgt.device).tril()
    return (tgt != pad_idx)[:, None, None, :] & tril


def src_mask_to_key_padding(src_mask: Tensor) -> Tensor:
    """``[B, 1, 1, S]`` (True = keep) -> torch.nn's ``src_key_padding_mask`` ``[B, S]`` (True = padding)."""
    if not isinstance(src_mask, Tensor) or src_mask.dim() != 4 or src_mask.shape[1:3] != (1, 1):
        raise ValueError(f"src_mask must be a [B, 1, 1, S] tensor, got {_shape_of(src_mask)}")
    return ~src_mask[:, 0, 0, :].bool()


def tgt_mask_to_torch(tgt_mask: Tensor) -> Tuple[Tensor, Tensor]:
    """``pad & tril`` ``[B, 1, T, T]`` (True = may attend) -> torch.nn's ``(tgt_mask, tgt_key_padding_mask)``:
    the causal mask ``[T, T]`` (True = may NOT attend, pass ``tgt_is_causal=True``) and ``[B, T]`` (True =
    padding). Raises ValueError for a mask that is not of that form."""
    if not isinstance(tgt_mask, Tensor) or tgt_mask.dim() != 4 or tgt_mask.shape[1] != 1 \
            or tgt_mask.shape[2] != tgt_mask.shape[3]:
        raise ValueError(f"tgt_mask must be a [B, 1, T, T] tensor, got {_shape_of(tgt_mask)}")
    keep = tgt_mask.bool()
    padding = ~keep[:, 0, -1, :]  # the last query sees every real key
    length = keep.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=keep.device).triu(1)
    if not torch.equal(keep, (~padding)[:, None, None, :] & ~causal):
        raise ValueError("tgt_mask is not of the form pad & tril (padding mask AND lower-triangular causal mask)")
    return causal, padding


def _shape_of(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


# ------------------------------------------------------------------------------------------------ cache


@dataclass
class DecoderCache:
    """What incremental decoding keeps between steps, per decoder layer.

    ``cross_kv[i]``: the cross-attention keys and values of layer ``i``, ``[B, H, S, D]`` each, projected
    from the encoder output once. ``self_kv[i]``: buffers ``[B, H, capacity, D]`` for the self-attention keys
    and values of layer ``i``, of which the first ``length`` positions are filled (``keys_values(i)``), so a
    step writes only its new positions. ``src_padding``: ``[B, S]``, True = padding.
    """

    src_padding: Tensor
    cross_kv: List[Tuple[Tensor, Tensor]]
    capacity: int
    self_kv: List[Tuple[Tensor, Tensor]] = field(default_factory=list)
    length: int = 0

    def buffers(self, layer: int, like: Tensor) -> Tuple[Tensor, Tensor]:
        """The key and value buffers ``[B, H, capacity, D]`` of ``layer``, allocated like ``like`` ``[B, H, n, D]``
        on first use; checks that ``n`` more positions fit."""
        end = self.length + like.shape[2]
        if end > self.capacity:
            raise ValueError(f"the decoding cache holds {self.capacity} positions; {end} were asked for")
        if layer == len(self.self_kv):
            shape = (like.shape[0], like.shape[1], self.capacity, like.shape[3])
            self.self_kv.append((like.new_empty(shape), like.new_empty(shape)))
        return self.self_kv[layer]

    def append(self, layer: int, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Write the new keys and values ``[B, H, n, D]`` of ``layer`` after the cached ones (at position
        ``length``, which ``decode_step`` advances once every layer has appended); returns all of them so far."""
        keys, values = self.buffers(layer, k)
        end = self.length + k.shape[2]
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def keys_values(self, layer: int) -> Tuple[Tensor, Tensor]:
        """The cached self-attention keys and values of ``layer``, ``[B, H, length, D]`` each (views)."""
        keys, values = self.self_kv[layer]
        return keys[:, :, :self.length], values[:, :, :self.length]

    def select(self, rows: Tensor) -> None:
        """Keep rows ``rows`` of the self-attention cache, in that order (beam search's reordering). The
        cross-attention cache is not reordered: ``rows`` must map each row to a row of the same source."""
        self.self_kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.self_kv]

    def repeat_interleave(self, repeats: int) -> "DecoderCache":
        """A cache with every row repeated ``repeats`` times in place (``[b0, b0, b1, b1, ...]``)."""
        def rep(t: Tensor) -> Tensor:
            return t.repeat_interleave(repeats, dim=0)

        return DecoderCache(
            rep(self.src_padding), [(rep(k), rep(v)) for k, v in self.cross_kv], self.capacity,
            [(rep(k), rep(v)) for k, v in self.self_kv], self.length,
        )


# ------------------------------------------------------------------------------------------------ model


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer for token sequences, on the fused modules (or torch.nn's, ``fused=False``).

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes.
        hid_dim, n_layers, n_heads, ff_dim: model width, encoder and decoder depth, heads, feed-forward width.
        dropout: on embeddings, attention probabilities, and every residual branch.
        max_len: the longest source or target sequence (size of the positional embeddings).
        pad_idx, bos_idx, eos_idx: special target tokens (``pad_idx`` is also the source padding token).
        norm_first: pre-LN layers (and a final LayerNorm after each stack) instead of post-LN.
        activation: ``"relu"`` or ``"gelu"``; default ReLU for post-LN, GELU for pre-LN.
        fused: build on ``fused_transformer`` modules (True) or on ``torch.nn`` ones (False).
    """

    def __init__(
        self, src_vocab_size: int, tgt_vocab_size: int, hid_dim: int = 256, n_layers: int = 3, n_heads: int = 8,
        ff_dim: int = 512, dropout: float = 0.1, max_len: int = 100, pad_idx: int = 0, bos_idx: int = 1,
        eos_idx: int = 2, norm_first: bool = False, activation: Optional[str] = None, fused: bool = True,
    ) -> None:
        super().__init__()
        if activation is None:
            activation = "gelu" if norm_first else "relu"
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation={activation!r} must be 'relu' or 'gelu'")
        for name, value in (("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size),
                            ("hid_dim", hid_dim), ("n_layers", n_layers), ("n_heads", n_heads), ("ff_dim", ff_dim),
                            ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if hid_dim % n_heads:
            raise ValueError(f"hid_dim={hid_dim} must be divisible by n_heads={n_heads}")
        for name, idx in (("pad_idx", pad_idx), ("bos_idx", bos_idx), ("eos_idx", eos_idx)):
            if not 0 <= idx < tgt_vocab_size:
                raise ValueError(f"{name}={idx} is not a token of the target vocabulary (size {tgt_vocab_size})")
        self.config: Dict[str, object] = dict(
            src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, hid_dim=hid_dim, n_layers=n_layers,
            n_heads=n_heads, ff_dim=ff_dim, dropout=dropout, max_len=max_len, pad_idx=pad_idx, bos_idx=bos_idx,
            eos_idx=eos_idx, norm_first=norm_first, activation=activation,
        )
        self.fused = fused
        self.hid_dim, self.n_heads, self.max_len = hid_dim, n_heads, max_len
        self.pad_idx, self.bos_idx, self.eos_idx = pad_idx, bos_idx, eos_idx
        self.tgt_vocab_size = tgt_vocab_size
        self.norm_first = norm_first
        self.embedding_scale = math.sqrt(hid_dim)

        lib = fused_modules if fused else nn
        layer_args = dict(d_model=hid_dim, nhead=n_heads, dim_feedforward=ff_dim, dropout=dropout,
                          activation=activation, batch_first=True, norm_first=norm_first)
        self.src_token_embedding = nn.Embedding(src_vocab_size, hid_dim)
        self.src_position_embedding = nn.Embedding(max_len, hid_dim)
        self.tgt_token_embedding = nn.Embedding(tgt_vocab_size, hid_dim)
        self.tgt_position_embedding = nn.Embedding(max_len, hid_dim)
        self.encoder = lib.TransformerEncoder(
            lib.TransformerEncoderLayer(**layer_args), n_layers,
            norm=lib.LayerNorm(hid_dim) if norm_first else None, enable_nested_tensor=False,
        )
        self.decoder = lib.TransformerDecoder(
            lib.TransformerDecoderLayer(**layer_args), n_layers, norm=lib.LayerNorm(hid_dim) if norm_first else None,
        )
        self.output_projection = nn.Linear(hid_dim, tgt_vocab_size)
        self.dropout = nn.Dropout(dropout)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    @classmethod
    def torch_nn_twin(cls, model: "Seq2SeqTransformer") -> "Seq2SeqTransformer":
        """The same model built on ``torch.nn`` modules, holding a copy of ``model``'s weights."""
        twin = cls(**model.config, fused=False)
        twin.load_state_dict(model.state_dict())
        return twin.to(next(model.parameters()).device).train(model.training)

    # ----------------------------------------------------------------------------------------- forward

    def forward(self, src: Tensor, tgt: Tensor, return_attention: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Teacher-forced logits.

        Args:
            src: ``[B, S]`` source tokens, padded with ``pad_idx``.
            tgt: ``[B, T]`` target input tokens (starting with ``bos_idx``), padded with ``pad_idx``.
            return_attention: also return the cross-attention probabilities of the last decoder layer,
                ``[B, n_heads, T, S]``.

        Returns:
            logits ``[B, T, tgt_vocab_size]`` (and the attention if asked).
        """
        self._check_tokens("src", src, self.src_token_embedding.num_embeddings)
        self._check_tokens("tgt", tgt, self.tgt_vocab_size)
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(f"src {tuple(src.shape)} and tgt {tuple(tgt.shape)} have different batch sizes")
        memory, src_padding = self.encode(src)
        if not return_attention:
            return self.decode(tgt, memory, src_padding)
        with self._capture_last_cross_attention() as captured:
            logits = self.decode(tgt, memory, src_padding)
        return logits, captured[0]

    def loss(self, src: Tensor, tgt: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """Cross-entropy of predicting ``tgt[:, 1:]`` from ``tgt[:, :-1]``, padding ignored.

        ``tgt``: ``[B, T]`` full targets ``BOS ... EOS PAD ...``."""
        logits = self(src, tgt[:, :-1])
        return F.cross_entropy(
            logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=self.pad_idx, label_smoothing=label_smoothing
        )

    def encode(self, src: Tensor) -> Tuple[Tensor, Tensor]:
        """Source tokens ``[B, S]`` -> encoder output ``[B, S, hid_dim]`` and its padding ``[B, S]`` (True = pad)."""
        self._check_tokens("src", src, self.src_token_embedding.num_embeddings)
        src_padding = src == self.pad_idx
        x = self._embed(src, self.src_token_embedding, self.src_position_embedding, start=0)
        return self.encoder(x, src_key_padding_mask=src_padding), src_padding

    def decode(self, tgt: Tensor, memory: Tensor, src_padding: Tensor) -> Tensor:
        """Target input tokens ``[B, T]`` and the encoder output -> logits ``[B, T, tgt_vocab_size]``."""
        self._check_tokens("tgt", tgt, self.tgt_vocab_size)
        length = tgt.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=tgt.device).triu(1)
        x = self._embed(tgt, self.tgt_token_embedding, self.tgt_position_embedding, start=0)
        x = self.decoder(
            x, memory, tgt_mask=causal, tgt_key_padding_mask=tgt == self.pad_idx,
            memory_key_padding_mask=src_padding, tgt_is_causal=True,
        )
        return self.output_projection(x)

    def _embed(self, tokens: Tensor, token_embedding: nn.Embedding, position_embedding: nn.Embedding,
               start: int) -> Tensor:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.dropout(token_embedding(tokens) * self.embedding_scale + position_embedding(positions))

    def _check_tokens(self, name: str, tokens: object, vocab_size: int) -> None:
        if not isinstance(tokens, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must hold integer token ids (int64 or int32), got {tokens.dtype}")
        if tokens.dim() != 2:
            raise ValueError(f"{name} must be [batch, seq_len], got shape {tuple(tokens.shape)}")
        if not 1 <= tokens.shape[1] <= self.max_len:
            raise ValueError(f"{name} has length {tokens.shape[1]}; the model takes 1..max_len={self.max_len}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
            raise ValueError(f"{name} holds token ids outside [0, {vocab_size})")

    @contextlib.contextmanager
    def _capture_last_cross_attention(self) -> Iterator[List[Tensor]]:
        """Collect the per-head cross-attention probabilities of the last decoder layer. The decoder layer
        asks its attention for no weights, so they are recomputed from the very inputs it was called with."""
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            kwargs = {**kwargs, "need_weights": True, "average_attn_weights": False}
            captured.append(module.forward(*args, **kwargs)[1])

        captured: List[Tensor] = []
        handle = self.decoder.layers[-1].multihead_attn.register_forward_hook(hook, with_kwargs=True)
        try:
            yield captured
        finally:
            handle.remove()

    # ------------------------------------------------------------------------------ incremental decoding

    def start_cache(self, memory: Tensor, src_padding: Tensor, capacity: Optional[int] = None) -> DecoderCache:
        """An empty decoding cache holding the cross-attention keys/values of ``memory`` for every layer, with
        room for ``capacity`` target positions (default ``max_len``)."""
        capacity = self.max_len if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= self.max_len:
            raise ValueError(f"capacity={capacity!r} must be an int in [1, max_len={self.max_len}]")
        cross_kv = []
        for layer in self.decoder.layers:
            attn = layer.multihead_attn
            bias = None if attn.in_proj_bias is None else attn.in_proj_bias[self.hid_dim:]
            k, v = F.linear(memory, attn.in_proj_weight[self.hid_dim:], bias).chunk(2, dim=-1)
            # One copy here makes every step read each head from contiguous memory.
            cross_kv.append((self._split_heads(k).contiguous(), self._split_heads(v).contiguous()))
        return DecoderCache(src_padding=src_padding, cross_kv=cross_kv, capacity=capacity)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Run the next target tokens ``[B, n]`` (usually ``n = 1``) through the decoder, appending their
        keys/values to ``cache``; returns their logits ``[B, n, tgt_vocab_size]``. Equals the last ``n``
        positions of ``decode`` on the whole prefix (without target padding), to float32 round-off."""
        self._check_tokens("tokens", tokens, self.tgt_vocab_size)
        if cache.length + tokens.shape[1] > self.max_len:
            raise ValueError(f"decoding past max_len={self.max_len} positions")
        x = self._embed(tokens, self.tgt_token_embedding, self.tgt_position_embedding, start=cache.length)
        for i, layer in enumerate(self.decoder.layers):
            x = self._cached_layer(layer, i, x, cache)
        cache.length += tokens.shape[1]
        if self.decoder.norm is not None:
            x = self.decoder.norm(x)
        return self.output_projection(x)

    def _cached_layer(self, layer: nn.TransformerDecoderLayer, index: int, x: Tensor, cache: DecoderCache) -> Tensor:
        """``layer.forward`` for the new positions only, reading earlier positions from ``cache``."""
        def self_attention(h: Tensor) -> Tensor:
            attn = layer.self_attn
            q, k, v = (self._split_heads(t) for t in F.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1))
            if self.fused and not torch.is_grad_enabled():
                # Decoding: one op writes the new keys into the cache and attends (split-KV kernels on a GPU).
                keys, values = cache.buffers(index, k)
                out = ops.attention_with_kvcache(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 cache_seqlens=cache.length, k_new=k.transpose(1, 2),
                                                 v_new=v.transpose(1, 2))
                return attn.out_proj(out.flatten(2))
            k, v = cache.append(index, k, v)
            return attn.out_proj(self._attend(q, k, v, causal=True))

        def cross_attention(h: Tensor) -> Tensor:
            attn = layer.multihead_attn
            bias = None if attn.in_proj_bias is None else attn.in_proj_bias[:self.hid_dim]
            q = self._split_heads(F.linear(h, attn.in_proj_weight[:self.hid_dim], bias))
            k, v = cache.cross_kv[index]
            return attn.out_proj(self._attend(q, k, v, padding=cache.src_padding))

        def feed_forward(h: Tensor) -> Tensor:
            return layer.linear2(layer.dropout(layer.activation(layer.linear1(h))))

        blocks = ((self_attention, layer.norm1, layer.dropout1), (cross_attention, layer.norm2, layer.dropout2),
                  (feed_forward, layer.norm3, layer.dropout3))
        for block, norm, dropout in blocks:
            if layer.norm_first:
                x = x + dropout(block(norm(x)))
            elif self.fused:  # dropout, the residual add and the LayerNorm in one op, as the fused layer's forward
                x = add_and_norm(norm, block(x), residual=x, dropout_p=active_p(dropout))
            else:
                x = norm(x + dropout(block(x)))
        return x

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                padding: Optional[Tensor] = None) -> Tensor:
        """Attention over cached keys, ``[B, H, n, D]`` -> ``[B, n, hid_dim]``. The new queries are the last
        ``n`` positions, so the causal mask is aligned bottom-right. torch.nn builds use SDPA."""
        if self.fused:
            out = ops.attention(q, k, v, key_padding_mask=padding, is_causal=causal, causal_alignment="bottom_right")
        else:
            lq, lk = q.shape[2], k.shape[2]
            keep = None
            if causal:
                keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
            if padding is not None:
                keep_keys = ~padding[:, None, None, :]
                keep = keep_keys if keep is None else keep & keep_keys
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).flatten(2)

    def _split_heads(self, x: Tensor) -> Tensor:
        """``[B, L, hid_dim]`` -> ``[B, n_heads, L, head_dim]``."""
        return x.unflatten(-1, (self.n_heads, self.hid_dim // self.n_heads)).transpose(1, 2)

    # ------------------------------------------------------------------------------------------ search

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """Eval mode and no autograd for the duration; the training flag is restored afterwards."""
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.train(was_training)

    def _check_max_len(self, max_len: Optional[int]) -> int:
        max_len = self.max_len - 1 if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len < self.max_len:
            raise ValueError(f"max_len={max_len!r} must be an int in [1, {self.max_len - 1}] (BOS takes a position)")
        return max_len

    def _next_token_scores(self, logits: Tensor) -> Tensor:
        """Logits with PAD and BOS forbidden: they are never generated, only written after EOS."""
        logits = logits.float().clone()
        logits[:, [self.pad_idx, self.bos_idx]] = float("-inf")
        return logits

    def greedy_decode(self, src: Tensor, max_len: Optional[int] = None, use_cache: bool = True) -> Tensor:
        """Greedy decoding, batched, in eval mode.

        Args:
            src: ``[B, S]`` source tokens.
            max_len: most tokens to generate (default ``max_len - 1`` of the model).
            use_cache: decode incrementally with the key/value cache (O(L) per token), or re-run the decoder
                on the whole prefix at every step (O(L^2) per token; the two give the same tokens).

        Returns:
            ``[B, T]`` generated tokens, without BOS, each row ending at its EOS and padded after it with
            ``pad_idx``; ``T`` is the step at which every row had ended (or ``max_len``); ``[0, 0]`` for an
            empty batch.
        """
        max_len = self._check_max_len(max_len)
        with self._evaluating():
            memory, src_padding = self.encode(src)
            tokens = torch.full((src.shape[0], 1), self.bos_idx, dtype=torch.long, device=src.device)
            finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
            cache = self.start_cache(memory, src_padding, capacity=max_len) if use_cache else None
            for _ in range(max_len):
                if bool(finished.all()):  # at the top: an empty batch decodes nothing
                    break
                if cache is not None:
                    logits = self.decode_step(tokens[:, -1:], cache)[:, -1]
                else:
                    logits = self.decode(tokens, memory, src_padding)[:, -1]
                next_token = self._next_token_scores(logits).argmax(dim=-1)
                next_token = next_token.masked_fill(finished, self.pad_idx)
                tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                finished |= next_token == self.eos_idx
        return tokens[:, 1:]

    def beam_search(
        self, src: Tensor, beam_size: int = 4, max_len: Optional[int] = None, length_penalty: float = 0.6,
    ) -> Tuple[Tensor, Tensor]:
        """Beam search, batched over ``B * beam_size`` beams, with the key/value cache, in eval mode.

        Beams are ranked by ``log p(tokens) / ((5 + length) / 6) ** length_penalty`` (GNMT), ``length``
        counting the generated tokens up to and including EOS. A beam that emits EOS is finished: it keeps
        its score and length and only extends with padding; decoding stops when every beam has finished
        or after ``max_len`` tokens. ``beam_size=1`` is greedy decoding.

        Returns:
            the best beam per source, ``[B, T]`` in ``greedy_decode``'s format (long), and its normalised score
            ``[B]`` (float32); ``[0, 0]`` and ``[0]`` for an empty batch.
        """
        if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= self.tgt_vocab_size - 2:
            raise ValueError(f"beam_size={beam_size!r} must be an int in [1, {self.tgt_vocab_size - 2}]")
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, numbers.Real):
            raise TypeError(f"length_penalty={length_penalty!r} must be a real number, "
                            f"got {type(length_penalty).__name__}")
        if not math.isfinite(length_penalty):
            raise ValueError(f"length_penalty={length_penalty!r} must be finite (GNMT's alpha, usually 0..1)")
        max_len = self._check_max_len(max_len)
        batch, k, vocab = src.shape[0], beam_size, self.tgt_vocab_size

        def penalty(length: Tensor) -> Tensor:
            return ((5.0 + length.float()) / 6.0) ** length_penalty

        with self._evaluating():
            memory, src_padding = self.encode(src)
            cache = self.start_cache(memory, src_padding, capacity=max_len).repeat_interleave(k)
            device = src.device
            tokens = torch.full((batch * k, 1), self.bos_idx, dtype=torch.long, device=device)
            # Only the first beam of each source is live at the start, so the first step does not pick k copies.
            log_prob = torch.full((batch, k), float("-inf"), device=device)
            log_prob[:, 0] = 0.0
            log_prob = log_prob.flatten()
            lengths = torch.zeros(batch * k, dtype=torch.long, device=device)
            finished = torch.zeros(batch * k, dtype=torch.bool, device=device)
            for _ in range(max_len):
                if bool(finished.all()):  # at the top: an empty batch decodes nothing
                    break
                step_log_prob = torch.log_softmax(self._next_token_scores(self.decode_step(tokens[:, -1:], cache)[:, -1]), -1)
                # A finished beam has one continuation, padding, that leaves its log-probability unchanged.
                step_log_prob[finished] = float("-inf")
                step_log_prob[finished, self.pad_idx] = 0.0
                candidate_log_prob = log_prob[:, None] + step_log_prob
                candidate_length = (lengths + ~finished)[:, None].expand(-1, vocab)
                candidate_score = candidate_log_prob / penalty(candidate_length)
                _, best = candidate_score.view(batch, k * vocab).topk(k, dim=-1)
                rows = (best // vocab + torch.arange(batch, device=device)[:, None] * k).flatten()
                next_token = (best % vocab).flatten()
                log_prob = candidate_log_prob.flatten()[rows * vocab + next_token]
                lengths = candidate_length.flatten()[rows * vocab + next_token]
                tokens = torch.cat([tokens.index_select(0, rows), next_token[:, None]], dim=1)
                finished = finished.index_select(0, rows) | (next_token == self.eos_idx)
                cache.select(rows)
            # topk sorts, so the best beam of each source is its first.
            best_rows = torch.arange(batch, device=device) * k
            width = max(lengths[best_rows].tolist(), default=0)
            return tokens[best_rows, 1:1 + width], (log_prob / penalty(lengths))[best_rows]
