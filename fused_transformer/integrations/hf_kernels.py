"""Hugging Face ``kernels``' door: our ops as the layers ``kernels.kernelize`` swaps into transformers' models.

transformers marks what a hub kernel may replace: ``@use_kernel_forward_from_hub("RMSNorm")`` on ``LlamaRMSNorm``
and the 130-odd RMSNorm classes written like it, ``"rotary_pos_emb"`` on ``apply_rotary_pos_emb``, which
``@use_kernelized_func`` attaches to the attention modules that call it. ``kernels.kernelize(model, mode=...)``
replaces their ``forward`` with that of the layer the mapping in force names for the name, the device type and the
mode. ``mapping()`` is such a mapping, whose entries are our layers, by name, in this module::

    import kernels
    from fused_transformer.integrations import hf_kernels

    with kernels.use_kernel_mapping(hf_kernels.mapping(), inherit_mapping=False):
        model = kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")

Its entries are ``Repository`` objects: ``kernels`` asks a repository for ``load()`` (the layer class, which it
checks against the layer it replaces) and uses it as a cache key; nothing is downloaded and no kernel tree exists
on disk. The layers are stateless, as ``kernels`` requires: ``RMSNorm.forward`` reads the replaced module's
``weight`` and ``variance_epsilon``. docs/integrations.md says in which order to call it against
``from_pretrained``'s own kernelizing.
"""
from __future__ import annotations

from typing import Dict, Tuple, Type

import torch
from torch import Tensor, nn

from ..functional import apply_rotary_pos_emb, rms_norm

# The device types whose models the mapping kernelizes: ``kernels``' names, which are torch's ("cpu": the C++
# kernels, "cuda": Triton's).
DEVICE_TYPES: Tuple[str, ...] = ("cpu", "cuda")


class RMSNorm(nn.Module):
    """The forward of transformers' ``RMSNorm`` layers (``LlamaRMSNorm`` and those written like it: ``weight``
    ``[N]``, ``variance_epsilon``) through ``fused_transformer.rms_norm``.

    ``hidden_states`` ``[..., N]`` gives the same shape and, as transformers' layer, the dtype of
    ``weight * hidden_states``: in the input's dtype when the weight has it (one rounding of the product, where
    transformers rounds the normalized input before multiplying), promoted when they differ (a float32 weight over
    bfloat16 activations: the normalized input rounded to bfloat16, then multiplied, as transformers does).
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.weight.dtype == hidden_states.dtype:
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return self.weight * rms_norm(hidden_states, None, self.variance_epsilon)


class RotaryPosEmb(nn.Module):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (the function its models mark
    ``rotary_pos_emb``) through ``fused_transformer.apply_rotary_pos_emb``: ``(q_embed, k_embed)`` in q's dtype,
    computed in float32 and rounded once.

    Those functions take cos and sin at q's full head dim, except gpt-oss's, which takes them at half of it and uses
    them for both halves: there (``2 * cos.shape[-1] == q.shape[-1]``) the tables are repeated to the full width,
    the same rotation.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tuple[Tensor, Tensor]:
        if 2 * cos.shape[-1] == q.shape[-1]:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


class Repository:
    """One of our layers, as a ``kernels`` layer repository: ``layer_name`` and ``load()``, which returns the layer
    class from this module; equal when they name the same layer (``kernels`` caches loaded layers by repository)."""

    def __init__(self, layer_name: str):
        if layer_name not in LAYERS:
            raise ValueError(f"layer_name={layer_name!r} is not one of fused_transformer's layers: "
                             f"{', '.join(LAYERS)}")
        self.layer_name = layer_name

    def load(self) -> Type[nn.Module]:
        return LAYERS[self.layer_name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Repository) and other.layer_name == self.layer_name

    def __hash__(self) -> int:
        return hash((Repository, self.layer_name))

    def __repr__(self) -> str:
        return f"Repository({self.layer_name!r})"

    def __str__(self) -> str:
        return f"fused_transformer layer `{self.layer_name}`"


# transformers' hub-kernel name -> our layer that replaces its forward
LAYERS: Dict[str, Type[nn.Module]] = {"RMSNorm": RMSNorm, "rotary_pos_emb": RotaryPosEmb}


def mapping() -> Dict[str, Dict[str, Repository]]:
    """``{transformers' layer name: {device type: Repository}}`` for ``kernels.use_kernel_mapping`` (or
    ``register_kernel_mapping``): every layer of ours on every device type in ``DEVICE_TYPES``, in every mode
    (``kernels`` files an entry given without modes under ``Mode.FALLBACK``, which every mode falls back to; the
    layers support training and ``torch.compile``)."""
    return {name: {device: Repository(name) for device in DEVICE_TYPES} for name in LAYERS}


__all__ = ["DEVICE_TYPES", "LAYERS", "RMSNorm", "Repository", "RotaryPosEmb", "mapping"]
