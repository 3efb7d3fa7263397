"""``fuse(model)`` on Hugging Face transformers' Llama-family models: their RMSNorms, gated MLPs, rotary and
causal-LM loss.

A table names, per family, the transformers classes fuse knows (``FAMILIES``); each known class has a fused twin, a
subclass of it that adds no state and overrides ``forward``, and ``fuse_model`` gives a module its twin's class (as
``fuse`` does for torch.nn modules), so that parameters, buffers, hooks and the ``state_dict`` stay as they were.
Only exact classes are swapped (a user's subclass keeps its own ``forward``), and only where ``forward`` is the
class's own: an instance ``forward`` set by Hugging Face's ``kernels.kernelize`` is removed (ours replaces the hub
kernel's), any other one is left and named. A twin keeps its class's ``__name__`` and ``__module__``, so that
``save_pretrained`` writes the same ``architectures`` and a pickle loads the unfused class.

- RMSNorm (Llama, Mistral, Qwen2, Qwen3 with its q/k norms, Phi-3): ``weight * normed`` on ``ops.rms_norm``; Gemma
  2 and 3 (``normed * (1 + weight)`` in float32, rounded once): ``ops.rms_norm`` of the float32 input with
  ``1 + weight``. Parameters of another dtype than the input (mixed precision without autocast) run the class's own
  ``forward``: its output dtype follows type promotion, ours would not.
- The gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``; Phi-3's packed ``gate_up_proj``) on
  ``ops.gated_feed_forward``, its activation read from the module (SiLU, GELU, GELU-tanh).
- Rotary: each attention layer's own copy of ``apply_rotary_pos_emb`` (``_kernel_funcs``) on
  ``ops.apply_rotary_pos_emb``; the module-level function, which unfused models share, is never touched (Phi-3's
  attention calls that one directly: its rotary stays transformers').
- The causal LM (``*ForCausalLM``): in training mode with ``labels``, the head and transformers' ``ForCausalLMLoss``
  run as one ``ops.linear_cross_entropy`` over the last hidden states, the logits never made: labels shifted (padded
  with ``ignore_index``) or ``shift_labels`` as given, ``ignore_index`` (default -100), ``num_items_in_batch`` (sum
  over the targets / num_items) and Gemma's ``final_logit_softcapping``; ``logits_to_keep`` slices the hidden states
  as it slices the logits. The output's ``logits`` is then None. In eval mode, without labels, or where the model's
  ``loss_function`` is not transformers' ``ForCausalLMLoss``, the class's own forward runs (logits and its loss), so
  evaluation with labels still returns the logits a metric needs.

Importing this module imports transformers; ``fuse`` imports it only when transformers is already imported.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections import Counter
from types import MethodType
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import route
from ..ops.gated_feed_forward import gated_feed_forward
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.rms_norm import rms_norm
from ..ops.rotary import apply_rotary_pos_emb

try:
    from transformers import activations
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep
    from transformers.utils.generic import can_return_tuple
except ImportError as exc:  # pragma: no cover - exercised only without the [hf] extra
    raise ImportError(
        "fused_transformer.integrations.transformers_models needs Hugging Face transformers: "
        "pip install fused_transformer[hf]"
    ) from exc

Tensor = torch.Tensor


class Family(NamedTuple):
    """A model family's modeling module and the names of its classes fuse knows, by what their twins do."""

    module: str
    rms_norm: Tuple[str, ...] = ()
    gemma_norm: Tuple[str, ...] = ()
    causal_lm: Tuple[str, ...] = ()
    mlp: Tuple[str, ...] = ()  # gate_proj, up_proj, down_proj and act_fn
    packed_mlp: Tuple[str, ...] = ()  # gate_up_proj, down_proj and activation_fn
    rotary: Tuple[str, ...] = ()  # attention classes whose apply_rotary_pos_emb is a per-instance kernel function


def _family(name: str, prefix: str, *, gemma: bool = False, packed: bool = False) -> Family:
    norm, mlp = (f"{prefix}RMSNorm",), (f"{prefix}MLP",)
    return Family(f"transformers.models.{name}.modeling_{name}", rms_norm=() if gemma else norm,
                  gemma_norm=norm if gemma else (), causal_lm=(f"{prefix}ForCausalLM",), mlp=() if packed else mlp,
                  packed_mlp=mlp if packed else (), rotary=() if packed else (f"{prefix}Attention",))


FAMILIES: Dict[str, Family] = {
    "llama": _family("llama", "Llama"),
    "mistral": _family("mistral", "Mistral"),
    "qwen2": _family("qwen2", "Qwen2"),
    "qwen3": _family("qwen3", "Qwen3"),
    # Phi-3's attention calls its module's apply_rotary_pos_emb with no per-instance hook: its rotary stays
    "phi3": _family("phi3", "Phi3", packed=True),
    "gemma2": _family("gemma2", "Gemma2", gemma=True),
    "gemma3": _family("gemma3", "Gemma3", gemma=True),
}


# ------------------------------------------------------------------------------------------------ the twins' forwards


class TransformersTwin:
    """What every twin shares: a pickle that rebuilds the twin (its class is made at run time, under the name of the
    transformers class it derives from, which pickle would find instead)."""

    def __reduce_ex__(self, protocol):
        cls = type(self)
        return _rebuilt_twin, (cls.fused_twin_of, cls.fused_body, cls.__dict__.get("fused_activation")), \
            self.__getstate__()


def _rebuilt_twin(hf_class: type, body: type, activation: Optional[str]) -> object:
    twin = _twin(hf_class, body, activation)
    return twin.__new__(twin)


class FusedRMSNorm(TransformersTwin):
    """Llama's RMSNorm (``weight * normed``, eps in ``variance_epsilon``) on ``ops.rms_norm``."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.weight.dtype != hidden_states.dtype:
            route.ran_elsewhere("rms_norm", "transformers", "parameters of another dtype than the input")
            return super().forward(hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class FusedGemmaRMSNorm(TransformersTwin):
    """Gemma's RMSNorm (``normed * (1 + weight)`` in float32, then the input's dtype) on ``ops.rms_norm``."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).type_as(x)


class FusedMLP(TransformersTwin):
    """A gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) on ``ops.gated_feed_forward``."""

    fused_activation: str = "silu"  # set on each instance's twin by fuse_model, from its act_fn

    def forward(self, x: Tensor) -> Tensor:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if not (gate.weight.dtype == up.weight.dtype == down.weight.dtype == x.dtype):
            route.ran_elsewhere("gated_feed_forward", "transformers", "parameters of another dtype than the input")
            return super().forward(x)
        return gated_feed_forward(x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias,
                                  activation=self.fused_activation)


class FusedPackedMLP(TransformersTwin):
    """Phi-3's gated MLP (``gate_up_proj`` holding the gate rows then the up rows) on ``ops.gated_feed_forward``."""

    fused_activation: str = "silu"

    def forward(self, hidden_states: Tensor) -> Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if not (gate_up.weight.dtype == down.weight.dtype == hidden_states.dtype):
            route.ran_elsewhere("gated_feed_forward", "transformers", "parameters of another dtype than the input")
            return super().forward(hidden_states)
        return gated_feed_forward(hidden_states, gate_up.weight, None, down.weight, gate_up.bias, None, down.bias,
                                  activation=self.fused_activation)


class FusedRotary(TransformersTwin):
    """An attention layer's own copy of transformers' ``apply_rotary_pos_emb`` (kernels' per-instance function
    module, ``_kernel_funcs``) on ``ops.apply_rotary_pos_emb``."""

    def forward(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def __reduce_ex__(self, protocol):
        # kernels' Func class is local to a function: named by the modeling module that holds its shared instance,
        # and its __setstate__ takes (state, its instance forward)
        return _rebuilt_rotary, (type(self).__module__,), (dict(self.__dict__), None)


def _rebuilt_rotary(modeling_module: str) -> object:
    shared = importlib.import_module(modeling_module).apply_rotary_pos_emb
    return _rebuilt_twin(type(shared), FusedRotary, None)


class FusedCausalLM(TransformersTwin):
    """A transformers ``*ForCausalLM`` whose loss, in training with labels, is one ``ops.linear_cross_entropy``."""

    _forward_names: Tuple[str, ...] = ()  # the class's forward's parameters, in order (set on each twin)

    def forward(self, *args, **kwargs):
        kwargs.update(zip(self._forward_names, args))
        if (kwargs.get("labels") is None or not self.training
                or self.loss_function is not ForCausalLMLoss or not head_fusable(self.lm_head)):
            return super().forward(**kwargs)
        return self._forward_with_fused_loss(**kwargs)

    @can_return_tuple
    def _forward_with_fused_loss(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                                 inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # the name transformers deprecates for ``cache``
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        loss = causal_lm_loss(hidden_states, self.lm_head.weight, labels, self.lm_head.bias,
                              softcap=getattr(self.config, "final_logit_softcapping", None), **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=None, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def causal_lm_loss(hidden_states: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None, *,
                   num_items_in_batch: Optional[object] = None, ignore_index: int = -100,
                   shift_labels: Optional[Tensor] = None, softcap: Optional[float] = None, **_: object) -> Tensor:
    """transformers' ``ForCausalLMLoss`` of the logits ``softcap(hidden_states @ weight^T + bias)``, without them.

    Args:
        hidden_states: ``[B, L, H]`` (or ``[..., H]`` as many rows as the targets), the last hidden states.
        weight: ``[V, H]``, the head's; bias ``[V]`` or None.
        labels: ``[B, L]``, shifted here (row ``i`` predicts ``labels[:, i + 1]``, the last row ignored) unless
            ``shift_labels`` (already shifted, hidden's leading shape) is given.
        num_items_in_batch: None for the mean over the targets not ignored; else the sum divided by it (a tensor or
            a number: the count over a whole gradient-accumulation step).
        ignore_index: targets that count for nothing. softcap: Gemma's ``final_logit_softcapping``.
        **_: the rest of the model's keyword arguments, which the loss does not read (as transformers').

    Returns:
        The loss, a float32 scalar (float64 for float64 inputs).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap)
    loss = linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap,
                                reduction="sum")
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


# ------------------------------------------------------------------------------------------------ matching


def linear_problem(linear: nn.Module) -> Optional[str]:
    """Why a module standing where an ``nn.Linear`` is expected cannot be fused, or None when it is one."""
    if hasattr(linear, "base_layer"):
        return f"a wrapped Linear ({type(linear).__name__}, a PEFT/LoRA adapter): its adapters would be skipped"
    weight = getattr(linear, "weight", None)
    if isinstance(weight, Tensor) and not weight.is_floating_point():
        return f"a quantized Linear ({type(linear).__name__}, {weight.dtype} weight)"
    if type(linear) is not nn.Linear:
        return f"a {type(linear).__name__}, not an nn.Linear"
    return None


def gated_activation(act: object) -> Optional[str]:
    """The name ``ops.gated_feed_forward`` knows a transformers activation module by, or None."""
    kind = type(act)
    if kind in (activations.SiLUActivation, nn.SiLU):
        return "silu"
    if kind in (activations.GELUTanh, activations.NewGELUActivation, activations.FastGELUActivation):
        return "gelu_tanh"
    if kind is activations.GELUActivation:
        return "gelu"
    if kind is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return None


def mlp_problem(mlp: nn.Module, linears: Tuple[str, ...], activation_name: str) -> Optional[str]:
    """Why a known MLP class's instance cannot run ``ops.gated_feed_forward``, or None."""
    for name in linears:
        problem = linear_problem(getattr(mlp, name, None)) if isinstance(getattr(mlp, name, None), nn.Module) else \
            "missing"
        if problem is not None:
            return f"{name} is {problem}"
    act = getattr(mlp, activation_name, None)
    if gated_activation(act) is None:
        return f"{activation_name} {type(act).__name__} is not one the gated op computes (SiLU, GELU, GELU-tanh)"
    if "forward" in getattr(act, "__dict__", {}) and not _kernelized_forward(act):
        return f"{activation_name} has a forward set on the instance"
    gate = getattr(mlp, linears[0])
    down = mlp.down_proj
    d_ff = gate.out_features // 2 if len(linears) == 2 else gate.out_features
    if down.in_features != d_ff or (len(linears) == 3 and mlp.up_proj.out_features != d_ff) or \
            (len(linears) == 3 and mlp.up_proj.in_features != gate.in_features):
        return "projections of another shape than a gated MLP's"
    return None


def head_fusable(lm_head: nn.Module) -> bool:
    return linear_problem(lm_head) is None


_TWINS: Dict[Tuple[type, Optional[str]], type] = {}  # (a transformers class, activation) -> its fused twin


def _twin(hf_class: type, body: type, activation: Optional[str] = None) -> type:
    """``hf_class``'s fused twin: ``body``'s forward over ``hf_class``, under the same name and module (an MLP's,
    one per activation)."""
    twin = _TWINS.get((hf_class, activation))
    if twin is None:
        namespace = {"__module__": hf_class.__module__, "__qualname__": hf_class.__qualname__,
                     "__doc__": f"{hf_class.__name__} fused by fused_transformer ({body.__doc__})",
                     "fused_twin_of": hf_class, "fused_body": body}
        if body is FusedCausalLM:
            # forward(*args) maps positional arguments to the names the class's forward gives them
            names = tuple(inspect.signature(hf_class.forward).parameters)[1:]
            namespace["_forward_names"] = tuple(n for n in names if n != "kwargs")
            namespace["forward"] = _with_signature_of(hf_class.forward)
        if activation is not None:
            namespace["fused_activation"] = activation
        twin = type(hf_class.__name__, (body, hf_class), namespace)
        _TWINS[hf_class, activation] = twin
    return twin


def _with_signature_of(hf_forward: Callable) -> Callable:
    """``FusedCausalLM.forward`` under the signature of ``hf_forward``: ``generate`` and the Trainer read the model's
    forward signature (whether it takes ``logits_to_keep``, ``attention_mask``; which dataset columns to keep)."""
    def forward(self, *args, **kwargs):
        return FusedCausalLM.forward(self, *args, **kwargs)

    return functools.update_wrapper(forward, hf_forward)


def known_classes() -> Dict[type, type]:
    """The transformers classes fuse knows, of the families whose modeling module is imported: class -> body.

    A class counts only where it is still the one its module defined (not one a patching library put in its place)
    and its ``forward`` is its own."""
    found: Dict[type, type] = {}
    for family in FAMILIES.values():
        module = sys.modules.get(family.module)
        if module is None:
            continue
        for names, body in ((family.rms_norm, FusedRMSNorm), (family.gemma_norm, FusedGemmaRMSNorm),
                            (family.causal_lm, FusedCausalLM), (family.mlp, FusedMLP),
                            (family.packed_mlp, FusedPackedMLP), (family.rotary, FusedRotary)):
            for name in names:
                cls = getattr(module, name, None)
                if (isinstance(cls, type) and cls.__module__ == family.module and cls.__qualname__ == name
                        and getattr(cls.forward, "__qualname__", "") == f"{name}.forward"):
                    found[cls] = body
    return found


def _kernelized_forward(module: nn.Module) -> bool:
    """Whether ``module``'s instance ``forward`` is the one ``kernels.kernelize`` set (a hub kernel's forward bound
    to it, with the repository it came from beside it)."""
    forward = module.__dict__.get("forward")
    return (isinstance(forward, MethodType) and forward.__self__ is module and "_kernel_repo" in module.__dict__
            and hasattr(type(module), "kernel_layer_name"))


def fuse_model(model: nn.Module) -> Tuple[Counter, Dict[str, str]]:
    """Give each module of ``model`` whose exact class is a known transformers class its fused twin's class.

    Returns the count of modules swapped per class name, and the modules left, by qualified name, with why."""
    known = known_classes()
    swapped: Counter = Counter()
    skipped: Dict[str, str] = {}
    for path, module in model.named_modules():
        body = known.get(type(module))
        if body is None:
            continue
        name = path or type(module).__name__
        if "forward" in module.__dict__:
            if not _kernelized_forward(module):
                skipped[name] = f"{type(module).__name__} with a forward set on the instance"
                continue
            del module.__dict__["forward"]  # the hub kernel kernelize chose: ours runs instead
        activation = None
        if body is FusedRotary:
            if _fuse_rotary(module):
                swapped["apply_rotary_pos_emb"] += 1
            continue
        if body is FusedCausalLM:
            problem = linear_problem(module.lm_head)
            if problem is not None:
                skipped[f"{path}.lm_head" if path else "lm_head"] = f"loss not fused: {problem}"
                continue
        elif body in (FusedMLP, FusedPackedMLP):
            packed = body is FusedPackedMLP
            act_name = "activation_fn" if packed else "act_fn"
            problem = mlp_problem(module, ("gate_up_proj", "down_proj") if packed else
                                  ("gate_proj", "up_proj", "down_proj"), act_name)
            if problem is not None:
                skipped[name] = f"{type(module).__name__} not fused: {problem}"
                continue
            activation = gated_activation(getattr(module, act_name))
        module.__class__ = _twin(type(module), body, activation)
        swapped[type(module).__name__] += 1
    return swapped, skipped


def _fuse_rotary(attention: nn.Module) -> bool:
    """Give an attention layer's own ``apply_rotary_pos_emb`` function module (kernels' ``use_kernelized_func``: each
    instance has its copy in ``_kernel_funcs``, so the module-level function other models call is untouched) its
    fused twin's class. False where the layer has no such copy."""
    funcs = attention.__dict__.get("_kernel_funcs")
    # the function module of the attention's own modeling module (kernels names the copies by kernel_layer_name)
    shared = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)
    func = funcs.get(getattr(shared, "kernel_layer_name", None)) if isinstance(funcs, dict) else None
    if not isinstance(func, nn.Module) or type(func) is not type(shared):
        return False
    if "forward" in func.__dict__:
        if not _kernelized_forward(func):
            return False
        del func.__dict__["forward"]
    func.__class__ = _twin(type(func), FusedRotary)
    return True
