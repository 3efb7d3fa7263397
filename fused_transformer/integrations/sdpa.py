"""torch's SDPA flash-attention registry: ``F.scaled_dot_product_attention`` and ``varlen_attn`` on our kernels.

``import fused_transformer`` registers the implementation ``"fused_transformer"`` where torch has the registry
(torch 2.11+); nothing changes until the user opts in::

    torch.nn.attention.activate_flash_attention_impl("fused_transformer")   # process-wide
    torch.nn.attention.restore_flash_attention_impl()                       # back to torch's own kernels

Activation overrides SDPA's flash ops in the dispatcher, for each device the kernel its backend has:

  CPU (the C++ kernels)   ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (what SDPA picks on
                          CPU tensors), ``_flash_attention_forward`` / ``_backward`` /
                          ``_flash_attention_forward_no_dropout_inplace`` (``varlen_attn``'s ops, which torch has
                          no CPU kernel for; the last one from torch 2.13).
  CUDA (Triton)           ``_scaled_dot_product_flash_attention`` and its backward, and the three ops above.

Results follow the layouts of torch's meta kernels (``torch.compile`` asserts them). A call the kernels do not
serve (ALiBi slopes, a paged or ``seqused_k`` cache, ``num_splits``, a debug mask, dropout through the CPU op,
whose outputs have no slot for a seed, empty dims) goes to the kernel registered before ours, so it gets exactly
the result or the error it would have had. Dropout through the flash ops keeps our seed in the ``rng_state``
output: the backward regenerates the same mask.

Activation is process-wide, so by default it must not make any model slower: ``fused_transformer.route`` decides
per call (the forward and its backward decide alike; ``ops.attention.facts.sdpa_door``), whether our kernel or the
one registered before runs it: that one where the call has a fact only it serves (the list above,
``route.Call.torch_keeps``), else from the shapes, by the route table's rows for this door
(``ops.attention.facts.MEASURED``: on the CPU ours for ``is_causal`` calls with ``128 <= Lk <= 1024``, measured
interleaved against torch's CPU flash kernel, docs/integrations.md) and for every door (a GPU's measured rows). Each
decision is recorded for ``fused_transformer.explain()`` (door ``"sdpa"``; ``"torch"`` where torch's kernel runs,
whatever backend was named). The varlen ops, which torch lacks on CPU, always run ours (where ours does not serve
one either, torch's ``NotImplementedError`` stays). ``use_backend("cpu")`` / ``use_backend("triton")`` runs every
call our kernels serve on them (testing, or our edge semantics everywhere), as it does for the functional ops.
"""
from __future__ import annotations

import threading
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import backend, contract
from ..ops.attention import facts as attention_facts

Tensor = torch.Tensor

NAME = "fused_transformer"


# ------------------------------------------------------------------------------------------------- kernels
# One device's kernels behind one interface: q [B, H, Lq, D] (dense) or [T, H, D] (packed), window a
# contract.Window, seed a one-element int64 tensor or None. Outputs as the kernels lay them out; the ops below copy
# them into torch's layouts only where those differ.


_NO_MODS = contract.NO_SCORE_MODS  # SDPA's calls have no score modifier


class _Kernels:
    """A backend's raw attention functions (``fused_transformer.contract``'s interface) as the aten ops call them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _spec(self, is_causal: bool, bottom_right: bool, window: contract.Window, scale: float,
              dropout_p: float) -> contract.AttentionSpec:
        return contract.AttentionSpec(is_causal, "bottom_right" if bottom_right else "top_left", window, dropout_p,
                                      scale)

    def dense_fwd(self, q, k, v, mask, is_causal, bottom_right, window, scale, dropout_p, seed):
        spec = self._spec(is_causal, bottom_right, window, scale, dropout_p)
        return backend.ops(self.name).attention_fwd(q, k, v, contract.AttentionMasks(mask), spec, _NO_MODS, None,
                                                    seed, False)

    def dense_bwd(self, do, q, k, v, o, lse, mask, is_causal, bottom_right, window, scale, dropout_p, seed):
        spec = self._spec(is_causal, bottom_right, window, scale, dropout_p)
        return backend.ops(self.name).attention_bwd(do, None, q, k, v, o, lse, contract.AttentionMasks(mask), spec,
                                                    _NO_MODS, seed)

    def varlen_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, is_causal, bottom_right, window, scale, dropout_p, seed):
        spec = self._spec(is_causal, bottom_right, window, scale, dropout_p)
        seqs = contract.PackedSequences(cu_q, cu_k, max_q, max_k)
        return backend.ops(self.name).attention_varlen_fwd(q, k, v, seqs, spec, _NO_MODS, None, seed, False)

    def varlen_bwd(self, do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, is_causal, bottom_right, window, scale,
                   dropout_p, seed):
        spec = self._spec(is_causal, bottom_right, window, scale, dropout_p)
        seqs = contract.PackedSequences(cu_q, cu_k, max_q, max_k)
        return backend.ops(self.name).attention_varlen_bwd(do, None, q, k, v, o, lse, seqs, spec, _NO_MODS, seed)


# -------------------------------------------------------------------------------------------- the aten ops

_FLOAT_DTYPES = contract.FLOAT_DTYPES


def _into(result: Tensor, target: Tensor) -> Tensor:
    """``result`` in ``target``'s layout: itself when the strides already agree, else copied into ``target``."""
    if result.stride() == target.stride() and result.dtype == target.dtype:
        return result
    return target.copy_(result)


def _unsupported(q: Tensor, k: Tensor, v: Tensor, heads_dim: int) -> Optional[str]:
    """Why our kernels do not serve these tensors (None when they do)."""
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return "dtypes"
    if min(q.numel(), k.numel(), v.numel()) == 0:
        return "an empty dim"
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return "head dims that differ"
    if q.shape[heads_dim] % k.shape[heads_dim] or k.shape[heads_dim] != v.shape[heads_dim]:
        return "head counts"
    return None


def _window(left: Optional[int], right: Optional[int], is_causal: bool) -> contract.Window:
    """FlashAttention's window sizes (``None`` or negative: no limit) as our window; causal keys end at the query."""
    return contract.window_of_bounds(left, 0 if is_causal else right)


def _seed_in(rng_state: Tensor) -> Tensor:
    """The int64 seed the forward kept in element 0 of the ``rng_state`` output."""
    return rng_state.view(torch.int64)[:1]


def _rng_outputs(seed: Optional[contract.Seed], device: torch.device) -> Tuple[Tensor, Tensor]:
    rng_state = torch.zeros(2, dtype=torch.uint64, device=device)
    if isinstance(seed, int):
        rng_state.view(torch.int64)[:1].fill_(seed)
    elif seed is not None:
        rng_state.view(torch.int64)[:1].copy_(seed)
    return rng_state, torch.zeros((), dtype=torch.uint64, device=device)


class _Previous:
    """The kernels registered for one dispatch key before ours: what a call we do not take runs on."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
        self.kernels: Dict[str, object] = {}

    def capture(self, name: str) -> None:
        try:
            self.kernels[name] = torch.library.get_kernel(getattr(torch.ops.aten, name).default, self.key)
        except RuntimeError:  # no kernel for this key (torch has no CPU kernel for the varlen ops)
            self.kernels[name] = None

    def __call__(self, name: str, why: str, *args, **kwargs):
        kernel = self.kernels.get(name)
        if kernel is None:
            raise NotImplementedError(f"aten::{name} has no {self.key} kernel for these arguments: fused_transformer's "
                                      f"does not serve {why}, and torch has none")
        # A keyword left at None is the schema's default, and older releases lack some (torch 2.11: block_table,
        # num_splits), so only the ones given travel.
        given = {keyword: value for keyword, value in kwargs.items() if value is not None}
        return kernel.call_boxed(self.keyset, *args, **given)


class _DeviceOps:
    """The aten ops' implementations for one device: ``kernels`` for the calls ``route`` gives us, ``previous``
    for the rest. ``sdpa_top_left``: how the dense SDPA op of this device aligns ``is_causal`` when Lq != Lk (the
    CPU kernel top-left, as SDPA documents; the CUDA one, FlashAttention's, bottom-right)."""

    def __init__(self, key: str, kernels, sdpa_op: str, sdpa_top_left: bool, available: Callable[[], bool]):
        self.key, self.kernels, self.sdpa_op, self.sdpa_top_left = key, kernels, sdpa_op, sdpa_top_left
        self.available = available
        self.previous = _Previous(key)
        self.device_type = key.lower()

    def _route(self, op: str, q: Tensor, key_length: int, is_causal: bool, keeps: Optional[str]) -> Optional[str]:
        """None when the route gives the call to our kernel, else why not. ``keeps``: what of the call only torch's
        kernel serves (None: nothing, the route decides from the shapes). Where torch has no kernel for ``op`` on
        this device the route gives the call to ours; where neither serves it nothing is decided (``_Previous``
        raises)."""
        has_kernel = self.previous.kernels.get(op) is not None
        if keeps and not has_kernel:
            return keeps
        decision = attention_facts.sdpa_door(q, int(key_length), is_causal, self.kernels.name, keeps or "",
                                             has_kernel)
        return None if decision.ours else keeps or f"this call (route: {decision.reason})"

    # ---- SDPA's dense op: q [B, H, Lq, D]

    def _sdpa_lse_layout(self, q: Tensor) -> Tensor:
        batch, heads, length, _ = q.shape
        if self.key == "CPU":
            dtype = contract.stats_dtype(q.dtype)
            return torch.empty((batch, length, heads), dtype=dtype, device=q.device).transpose(1, 2)
        return torch.empty((batch, heads, length), dtype=torch.float32, device=q.device)

    def _sdpa_takes(self, q, k, v, dropout_p, is_causal, attn_mask=None, return_debug_mask=False) -> Optional[str]:
        """None when our kernel runs this call of the dense SDPA op, else why the kernel torch had does: what of
        the call only torch's kernel serves, else the route's reason (both decided by ``route.at_door``)."""
        if not self.available():
            why = "this machine (kernels unavailable)"
        elif q.dim() != 4 or k.dim() != 4:
            why = "a query or key that is not 4-D"
        else:
            why = _unsupported(q, k, v, heads_dim=1)
        if why is None and return_debug_mask:
            why = "return_debug_mask"
        if why is None and dropout_p > 0.0 and self.key == "CPU":
            why = "dropout (the CPU op's outputs keep no seed for its backward)"
        if why is None and attn_mask is not None and attn_mask.dtype not in (torch.bool, *_FLOAT_DTYPES):
            why = "attn_mask's dtype"
        return self._route(self.sdpa_op, q, k.shape[2] if k.dim() == 4 else 0, is_causal, why)

    def sdpa_forward(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                     attn_mask=None, scale=None):
        extra = () if self.key == "CPU" else (return_debug_mask,)
        why = self._sdpa_takes(query, key, value, dropout_p, is_causal, attn_mask, return_debug_mask)
        if why is not None:
            kwargs = dict(scale=scale) if self.key != "CPU" else dict(attn_mask=attn_mask, scale=scale)
            return self.previous(self.sdpa_op, why, query, key, value, dropout_p, is_causal, *extra, **kwargs)
        seed = contract.draw_dropout_seed(query.device) if dropout_p > 0.0 else None
        o, lse = self.kernels.dense_fwd(query, key, value, attn_mask, is_causal,
                                        not self.sdpa_top_left, None,
                                        contract.softmax_scale(query.shape[-1], scale), dropout_p, seed)
        out = _into(o, torch.empty_like(query))
        lse = _into(lse, self._sdpa_lse_layout(query))
        if self.key == "CPU":
            return out, lse
        rng_state, offset = _rng_outputs(seed, query.device)
        debug = torch.empty(0, dtype=query.dtype, device=query.device)
        return out, lse, None, None, query.shape[2], key.shape[2], rng_state, offset, debug

    def sdpa_backward(self, grad_out, query, key, value, out, logsumexp, *args, attn_mask=None, scale=None):
        if self.key == "CPU":
            dropout_p, is_causal = args
            rng_state = None
        else:
            _cum_q, _cum_k, _max_q, _max_k, dropout_p, is_causal, rng_state, _offset = args
        why = self._sdpa_takes(query, key, value, dropout_p, is_causal, attn_mask)
        if why is not None:
            kwargs = dict(scale=scale) if self.key != "CPU" else dict(attn_mask=attn_mask, scale=scale)
            return self.previous(self.sdpa_op + "_backward", why, grad_out, query, key, value, out, logsumexp, *args,
                                 **kwargs)
        seed = _seed_in(rng_state) if dropout_p > 0.0 else None
        grads = self.kernels.dense_bwd(grad_out, query, key, value, out, logsumexp, attn_mask,
                                       is_causal, not self.sdpa_top_left, None,
                                       contract.softmax_scale(query.shape[-1], scale), dropout_p, seed)
        if self.key == "CPU":
            return tuple(_into(g, torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device))
                         for g, t in zip(grads, (query, key, value)))
        return tuple(_into(g, torch.empty_like(t)) for g, t in zip(grads, (query, key, value)))

    # ---- FlashAttention's ops: q [B, Lq, H, D], or packed [T, H, D] with cum_seq_q / cum_seq_k

    def _flash_takes(self, query, key, value, cum_seq_q, cum_seq_k, max_k, is_causal, return_debug_mask=False,
                     seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None,
                     no_dropout_op_dropped=False) -> Optional[str]:
        """As ``_sdpa_takes``, for FlashAttention's ops (``no_dropout_op_dropped``: dropout asked of
        ``_flash_attention_forward_no_dropout_inplace``)."""
        packed = cum_seq_q is not None
        return self._route("_flash_attention_forward", query,
                           max_k if packed else key.shape[1] if key.dim() > 1 else 0, is_causal,
                           self._flash_keeps(query, key, value, packed, cum_seq_k, return_debug_mask, seqused_k,
                                             alibi_slopes, block_table, num_splits, no_dropout_op_dropped))

    def _flash_keeps(self, query, key, value, packed, cum_seq_k, return_debug_mask, seqused_k, alibi_slopes,
                     block_table, num_splits, no_dropout_op_dropped) -> Optional[str]:
        """What of a FlashAttention call only torch's kernel serves (None: nothing)."""
        if not self.available():
            return "this machine (kernels unavailable)"
        if packed and (cum_seq_k is None or query.dim() != 3 or key.dim() != 3):
            return "packed queries without packed keys"
        if not packed and (cum_seq_k is not None or query.dim() != 4 or key.dim() != 4):
            return "this layout"
        for name, given in (("return_debug_mask", return_debug_mask), ("seqused_k", seqused_k is not None),
                            ("alibi_slopes", alibi_slopes is not None), ("block_table", block_table is not None),
                            ("num_splits", num_splits not in (None, 0, 1))):
            if given:
                return name
        why = _unsupported(query, key, value, heads_dim=-2)
        if why is None and no_dropout_op_dropped:
            why = "dropout in the no-dropout op"
        return why

    def _flash_run(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale,
                   window_size_left, window_size_right, seed):
        window = _window(window_size_left, window_size_right, is_causal)
        scale = contract.softmax_scale(query.shape[-1], scale)
        if cum_seq_q is not None:
            return self.kernels.varlen_fwd(query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k), is_causal,
                                           True, window, scale, dropout_p, seed)
        o, lse = self.kernels.dense_fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None,
                                        is_causal, True, window, scale, dropout_p, seed)
        return o.transpose(1, 2), lse

    def flash_forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                      return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                      alibi_slopes=None, block_table=None, num_splits=None):
        why = self._flash_takes(query, key, value, cum_seq_q, cum_seq_k, max_k, is_causal, return_debug_mask,
                                seqused_k, alibi_slopes, block_table, num_splits)
        if why is not None:
            return self.previous(
                "_flash_attention_forward", why, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, return_debug_mask, scale=scale, window_size_left=window_size_left,
                window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                block_table=block_table, num_splits=num_splits)
        seed = contract.draw_dropout_seed(query.device) if dropout_p > 0.0 else None
        o, lse = self._flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale,
                                 window_size_left, window_size_right, seed)
        out = _into(o, torch.empty_like(query))
        lse = _into(lse, torch.empty(lse.shape, dtype=torch.float32, device=query.device))
        rng_state, offset = _rng_outputs(seed, query.device)
        return out, lse, rng_state, offset, torch.empty(0, dtype=query.dtype, device=query.device)

    def flash_forward_inplace(self, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                              is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                              window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                              num_splits=None):
        why = self._flash_takes(query, key, value, cum_seq_q, cum_seq_k, max_k, is_causal, return_debug_mask,
                                seqused_k, alibi_slopes, block_table, num_splits, dropout_p > 0.0)
        if why is not None:
            return self.previous(
                "_flash_attention_forward_no_dropout_inplace", why, out, query, key, value, cum_seq_q, cum_seq_k,
                max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=scale, window_size_left=window_size_left,
                window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                block_table=block_table, num_splits=num_splits)
        o, lse = self._flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, is_causal, scale,
                                 window_size_left, window_size_right, None)
        out.copy_(o)
        return _into(lse, torch.empty(lse.shape, dtype=torch.float32, device=query.device))

    def flash_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                       window_size_right=None):
        why = self._flash_takes(query, key, value, cum_seq_q, cum_seq_k, max_k, is_causal)
        if why is not None:
            return self.previous(
                "_flash_attention_backward", why, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                max_q, max_k, dropout_p, is_causal, rng_state, unused, scale=scale,
                window_size_left=window_size_left, window_size_right=window_size_right)
        seed = _seed_in(rng_state) if dropout_p > 0.0 else None
        window = _window(window_size_left, window_size_right, is_causal)
        scale = contract.softmax_scale(query.shape[-1], scale)
        lse = logsumexp.to(contract.stats_dtype(query.dtype))
        if cum_seq_q is not None:
            grads = self.kernels.varlen_bwd(grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, int(max_q),
                                            int(max_k), is_causal, True, window, scale, dropout_p, seed)
        else:
            heads_second = [t.transpose(1, 2) for t in (grad_out, query, key, value, out)]
            grads = [g.transpose(1, 2) for g in self.kernels.dense_bwd(*heads_second, lse, None, is_causal, True,
                                                                        window, scale, dropout_p, seed)]
        return tuple(_into(g, torch.empty_like(t)) for g, t in zip(grads, (query, key, value)))

    def implementations(self) -> List[Tuple[str, Callable]]:
        """(aten op, our implementation) for each op this torch has (2.11 has no
        ``_flash_attention_forward_no_dropout_inplace``)."""
        every = [(self.sdpa_op, self.sdpa_forward), (self.sdpa_op + "_backward", self.sdpa_backward),
                 ("_flash_attention_forward", self.flash_forward),
                 ("_flash_attention_forward_no_dropout_inplace", self.flash_forward_inplace),
                 ("_flash_attention_backward", self.flash_backward)]
        return [(name, implementation) for name, implementation in every if hasattr(torch.ops.aten, name)]


def _cpu_kernels_available() -> bool:
    return backend.cpu_unavailable_reason() is None


def _triton_available() -> bool:
    return backend.triton_unavailable_reason() is None


CPU = _DeviceOps("CPU", _Kernels("cpu"), "_scaled_dot_product_flash_attention_for_cpu", True, _cpu_kernels_available)
CUDA = _DeviceOps("CUDA", _Kernels("triton"), "_scaled_dot_product_flash_attention", False, _triton_available)
DEVICES: Sequence[_DeviceOps] = (CPU, CUDA)


# ------------------------------------------------------------------------------------------------ registry


class Handle:
    """What ``activate`` returns to torch's registry: ``remove()`` takes our kernels out of the dispatcher, which
    then runs the kernels registered before them again."""

    def __init__(self, library: torch.library.Library) -> None:
        self.library: Optional[torch.library.Library] = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


_activation_lock = threading.Lock()


def activate() -> Handle:
    """Override SDPA's flash ops with ours (what torch's registry calls on
    ``activate_flash_attention_impl("fused_transformer")``)."""
    with _activation_lock:
        library = torch.library.Library("aten", "IMPL")
        try:
            for device in DEVICES:
                for name, implementation in device.implementations():
                    device.previous.capture(name)
                    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
                        warnings.simplefilter("ignore")
                        library.impl(name, implementation, device.key)
        except BaseException:
            # All or nothing: a half-made override left in the dispatcher would be captured as "previous" by the
            # next activation, which would then call itself.
            library._destroy()
            raise
        return Handle(library)


def register() -> bool:
    """Register ``"fused_transformer"`` with torch's flash-attention registry (never activating it); False where
    torch has no registry (torch 2.11 has it)."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(NAME, register_fn=activate)
    return True
