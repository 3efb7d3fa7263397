"""What bench times beside attention's torch path and ours (``ops.Rivals``): SDPA under each of its backends on the
device, FlashAttention and xFormers where installed, and the baselines the bench prepares before its timed calls (the
masks SDPA takes in its own form).
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import Example, RivalCalls, Rivals
from .torch_paths import _same_sequence, sdpa_mask

Tensor = torch.Tensor


@functools.lru_cache(maxsize=None)
def third_party(name: str) -> Optional[object]:
    """The flash_attn / xformers.ops module, or None when it is not installed."""
    try:
        return importlib.import_module({"flash_attn": "flash_attn", "xformers": "xformers.ops"}[name])
    except ImportError:
        return None


def sdpa_backends(device: torch.device) -> Dict[str, object]:
    """``sdpa:<name>`` -> ``SDPBackend`` for the backends SDPA has on this device type."""
    from torch.nn.attention import SDPBackend

    names = ("math", "flash_attention") if device.type == "cpu" else (
        "flash_attention", "efficient_attention", "cudnn_attention", "math")
    return {f"sdpa:{name}": SDPBackend.__members__[name.upper()] for name in names}


def sdpa_dispatch(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: bool) -> Optional[str]:
    """The backend SDPA's default dispatch picks for these inputs (a private torch function: None if absent)."""
    try:
        choice = int(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, causal))
        from torch.nn.attention import SDPBackend

        return next(name.lower() for name, member in SDPBackend.__members__.items() if int(member.value) == choice)
    except Exception:  # noqa: BLE001 (private API: any failure only loses a note)
        return None


class SdpaRivals(Rivals):
    """SDPA with its default dispatch (the baseline, ``sdpa``, its masks made before the timed calls) and under each
    of its backends on this device (``sdpa:math``, ``sdpa:flash_attention``, on CUDA ``sdpa:efficient_attention``
    and ``sdpa:cudnn_attention``), FlashAttention (with its ALiBi slopes) and xFormers on CUDA where installed,
    without padding (their padding needs their varlen APIs)."""

    def names(self, example: Example, device: torch.device) -> Tuple[str, ...]:
        found = tuple(sdpa_backends(device))
        if device.type == "cuda" and not example.shape.get("padding"):
            alibi = example.label.endswith("alibi")  # xFormers has no ALiBi of its own (a bias, as SDPA's)
            found += tuple(name for name in ("flash_attn", "xformers")
                           if third_party(name) is not None and not (alibi and name == "xformers"))
        return found

    def calls(self, example: Example, tensors: Dict[str, Tensor], names: Sequence[str],
              backward: bool) -> RivalCalls:
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
        causal = bool(example.options.get("is_causal"))
        slopes = tensors.get("alibi_slopes")
        mask, sdpa_causal = sdpa_mask(q, k, key_padding_mask=tensors.get("key_padding_mask"), is_causal=causal,
                                      alibi_slopes=slopes)

        def sdpa() -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=sdpa_causal)

        def under(backend: object) -> Callable[[], Tensor]:
            def run() -> Tensor:
                from torch.nn.attention import sdpa_kernel

                with sdpa_kernel([backend]):
                    return sdpa()
            return run

        found = RivalCalls({"sdpa": sdpa})
        found.calls.update({name: under(backend) for name, backend in sdpa_backends(q.device).items() if name in names})
        if "flash_attn" in names or "xformers" in names:
            # Both take [B, L, H, D]: transposed copies made here, outside the timed call.
            qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(backward) for t in (q, k, v))
            found.leaves += [qt, kt, vt]
            if "flash_attn" in names:
                found.calls["flash_attn"] = lambda: third_party("flash_attn").flash_attn_func(
                    qt, kt, vt, causal=causal, alibi_slopes=slopes)
            if "xformers" in names:
                xops = third_party("xformers")
                found.calls["xformers"] = lambda: xops.memory_efficient_attention(
                    qt, kt, vt, attn_bias=xops.LowerTriangularMask() if causal else None)
            for name in ("flash_attn", "xformers"):
                found.grads[name] = lambda grad: grad.transpose(1, 2).contiguous()
        dispatch = sdpa_dispatch(q, k, v, mask, sdpa_causal)
        if dispatch:
            found.notes["sdpa"] = f"dispatch {dispatch}"
        return found

    def may_refuse(self, impl: str) -> bool:
        return impl.startswith("sdpa:") or impl in ("flash_attn", "xformers")

    def about(self, device: torch.device) -> List[str]:
        notes = [f"sdpa backends tried: {', '.join(name[5:] for name in sdpa_backends(device))} "
                 "(a backend that refuses a case is left out of it, and the table says so)"]
        if device.type != "cuda":
            notes.append("flash_attn, xformers: CUDA only, not measured on this device")
            return notes
        for name, pip in (("flash_attn", "flash-attn"), ("xformers", "xformers")):
            if third_party(name) is None:
                notes.append(f"{name}: NOT INSTALLED, its rows are left out (pip install {pip})")
            else:
                notes.append(f"{name}: measured without padding (padding needs its varlen API, not measured here)")
        return notes


class DecodeRivals(Rivals):
    """SDPA on the same cache after the same write (the baseline), and FlashAttention's ``flash_attn_with_kvcache``
    on CUDA where installed."""

    def names(self, example: Example, device: torch.device) -> Tuple[str, ...]:
        return ("flash_attn",) if device.type == "cuda" and third_party("flash_attn") is not None else ()

    def calls(self, example: Example, tensors: Dict[str, Tensor], names: Sequence[str],
              backward: bool) -> RivalCalls:
        q, k_cache, v_cache, k_new, v_new = (tensors[n] for n in ("q", "k_cache", "v_cache", "k_new", "v_new"))
        length = example.shape["seq_len"]
        enable_gqa = q.shape[2] != k_cache.shape[2]

        def sdpa() -> Tensor:
            k_cache[:, length - 1:] = k_new
            v_cache[:, length - 1:] = v_new
            return F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                                  enable_gqa=enable_gqa).transpose(1, 2)

        found = RivalCalls({"sdpa": sdpa})
        if "flash_attn" in names:
            lengths = tensors["cache_seqlens"].to(q.device)
            found.calls["flash_attn"] = lambda: third_party("flash_attn").flash_attn_with_kvcache(
                q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths, causal=True)
        return found

    def may_refuse(self, impl: str) -> bool:
        return impl == "flash_attn"


class VarlenRivals(Rivals):
    """The baseline, SDPA over the packed tokens, with its block-diagonal mask made before the timed calls."""

    def calls(self, example: Example, tensors: Dict[str, Tensor], names: Sequence[str],
              backward: bool) -> RivalCalls:
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
        mask = _same_sequence(tensors["cu_seqlens_q"], tensors["cu_seqlens_k"], q.shape[0], k.shape[0], False)
        return RivalCalls({"sdpa": lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)})
