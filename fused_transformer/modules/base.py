"""What every fused module shares: the base class, the checks that send an input back to torch.nn's own forward,
and the registry ``fuse`` swaps classes by (each fused class registers as the twin of its torch.nn class)."""
from __future__ import annotations

import copy
import functools
import logging
import sys
import threading
import warnings
from collections import Counter
from types import MappingProxyType
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Tuple, Type, TypeVar, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import route

__all__ = ["InputShapeError", "FuseSummary", "fuse"]

T = TypeVar("T")


logger = logging.getLogger("fused_transformer")

# torch.nn class -> its fused twin (twin_of registers them).
_FUSED_TWINS: Dict[Type[nn.Module], Type[nn.Module]] = {}


def twin_of(torch_class: Type[nn.Module]) -> Callable[[type], type]:
    """Class decorator: the decorated class is ``torch_class``'s fused twin, the class ``fuse`` gives its instances."""
    def register(cls: type) -> type:
        _FUSED_TWINS[torch_class] = cls
        return cls

    return register


class InputShapeError(ValueError, AssertionError):
    """Input shapes a module cannot take: a ``ValueError``, and an ``AssertionError`` as torch.nn raises there."""


def active_p(dropout: nn.Dropout) -> float:
    return dropout.p if dropout.training else 0.0


def mixed_dtypes(*modules: nn.Module) -> bool:
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


def any_nested(*tensors: Optional[Tensor]) -> bool:
    return any(isinstance(t, Tensor) and t.is_nested for t in tensors)


def tensor_key(*args: object) -> Optional[tuple]:
    """The facts of a call's arguments its ops' decisions rest on: a tensor's shape, dtype, device and whether it
    requires grad; any other argument itself (None, a bool). A caller passes None for a tensor that is another
    argument (self-attention's key and value) and keys that identity itself. None where a tensor is nested (torch.nn's
    forward takes those): one pass over the arguments for both questions."""
    key = []
    for a in args:
        if isinstance(a, Tensor):
            if a.is_nested:
                return None
            a = (a.shape, a.dtype, a.device, a.requires_grad)
        key.append(a)
    return tuple(key)


class _InsideTorchNN(threading.local):
    depth = 0  # torch.nn forwards of fused modules this thread is inside (the modules' door sent them there)


_INSIDE_TORCH_NN = _InsideTorchNN()


class FusedTwin:
    """What every fused module shares: ``torch.jit.script`` gets the torch.nn module holding the same
    parameters (the fused ``forward`` is plain Python, not TorchScript), and the modules' door
    (``_torch_nn_runs``, ``_first_call``; ``_fused_or_torch_nn`` for a module whose torch.nn forward calls fused
    children)."""

    def _torch_nn_runs(self, key: tuple) -> Optional[bool]:
        """The modules' door: True where torch.nn's forward runs a call of ``key`` (``tensor_key`` of the arguments
        and the module's mode) because the route gave every op of the first such call torch's path
        (``route.torch_nn_runs``), recorded for ``explain()``; False where the fused path runs it (a traced call
        always); None where no call of ``key`` was decided yet (``_first_call`` decides). A fused module that torch.nn's
        forward of another one calls (a layer's attention and norms) is part of that call, which the route gave to
        torch: True, without asking again.

        This is every call's path, so it costs what a dict lookup costs: a 4-token LayerNorm is 7 us in torch.nn. The
        leaves (LayerNorm, MultiheadAttention) branch on it themselves: a frame or a closure is 0.1-0.3 us more."""
        if torch.compiler.is_compiling():
            return False
        if _INSIDE_TORCH_NN.depth:
            return True
        verdict = route.module_verdicts(self.__dict__).get(key + route.module_state())
        if verdict and route._RECORDERS:
            route.ran_elsewhere(type(self).__name__, "module", route.TORCH_NN)
        return verdict

    def _first_call(self, key: tuple, fused: Callable[[], T]) -> T:
        """``fused()``, whose ops the route decides and records; the verdict (``_torch_nn_runs``) kept for ``key``."""
        with route.explain() as decided:
            out = fused()
        route.module_verdicts(self.__dict__)[key + route.module_state()] = route.torch_nn_runs(decided)
        return out

    def _fused_or_torch_nn(self, key: tuple, fused: Callable[[], T], torch_nn: Callable[[], T]) -> T:
        """``fused()`` or ``torch_nn()`` (torch.nn's forward, whose fused children know they are inside it), as
        ``_torch_nn_runs`` says."""
        verdict = self._torch_nn_runs(key)
        if verdict is None:
            return self._first_call(key, fused)
        if not verdict:
            return fused()
        if _INSIDE_TORCH_NN.depth:
            return torch_nn()
        _INSIDE_TORCH_NN.depth += 1
        try:
            return torch_nn()
        finally:
            _INSIDE_TORCH_NN.depth -= 1

    def __prepare_scriptable__(self) -> nn.Module:
        torch_class = next(c for c in type(self).__mro__ if c.__module__.startswith("torch.nn"))
        twin = torch_class.__new__(torch_class)
        # Fresh containers (scripting swaps the children of the twin, not of this module), same tensors.
        # The route's verdicts stay behind: TorchScript cannot type their keys, and the twin runs torch.nn's forward.
        twin.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()
                              if k != "_route_verdicts"})
        return twin


def fused_activation(fn: Callable) -> Optional[str]:
    """The name ``feed_forward`` knows ``fn`` by, or None for an activation it does not fuse."""
    if fn in (F.relu, torch.relu) or type(fn) is nn.ReLU:
        return "relu"
    if fn is F.gelu:
        return "gelu"
    if type(fn) is nn.GELU:
        return "gelu_tanh" if fn.approximate == "tanh" else "gelu"
    return None


def is_causal_mask(mask: Optional[Tensor], is_causal: Optional[bool], size: int) -> bool:
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


def with_fused_children(torch_init: Callable) -> Callable:
    """Wrap a torch.nn ``__init__`` so the sub-modules it builds are swapped for their fused twins."""

    @functools.wraps(torch_init)
    def __init__(self, *args, **kwargs) -> None:
        torch_init(self, *args, **kwargs)
        for child in self.children():
            _swap_classes(child)

    return __init__


def _swap_classes(model: nn.Module) -> Counter:
    """Give every module of ``model`` whose exact type has a fused twin that twin's class; the count per class."""
    swapped: Counter = Counter()
    for module in model.modules():
        twin_class = _FUSED_TWINS.get(type(module))
        if twin_class is not None:
            module.__class__ = twin_class
            swapped[twin_class.__name__] += 1
    return swapped


class FuseSummary(NamedTuple):
    """What ``fuse`` did: modules swapped per class, the transformers attention implementation it set, and the
    modules of a known kind it left as they were (qualified name -> why)."""

    swapped: Dict[str, int]
    attn_implementation: Optional[str] = None
    skipped: Mapping[str, str] = MappingProxyType({})

    def __str__(self) -> str:
        parts = [f"{count} {name}" for name, count in sorted(self.swapped.items())]
        if self.attn_implementation is not None:
            parts.append(f"transformers attn_implementation={self.attn_implementation!r}")
        text = "fused " + ", ".join(parts) if parts else "nothing to fuse"
        if self.skipped:
            text += "; left " + "; ".join(f"{name}: {why}" for name, why in sorted(self.skipped.items()))
        return text


def fuse(model: nn.Module, *, return_summary: bool = False) -> Union[nn.Module, Tuple[nn.Module, FuseSummary]]:
    """Make every ``torch.nn`` Transformer module in ``model`` (itself included) its fused twin, in place, and
    point a Hugging Face transformers model's attention at our kernels.

    The fused classes add no state, so each module keeps its identity: only its class changes. Parameters,
    buffers, hooks, optimizers and every reference the caller holds stay valid. Only exact ``torch.nn`` types
    change: user subclasses keep their own ``forward``. A ``transformers.PreTrainedModel`` gets
    ``set_attn_implementation("fused_transformer")`` (``fused_transformer.integrations.transformers``), and the
    Llama-family models (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3) their RMSNorms and their causal-LM
    loss fused (``fused_transformer.integrations.transformers_models``: what each gets, what is left and why).

    What was done is logged (logger ``fused_transformer``, level INFO); a model with nothing to fuse warns.
    Returns ``model``, or ``(model, FuseSummary)`` with ``return_summary=True`` (its ``skipped``: the modules of a
    known kind left as they were, by qualified name, with why).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse(model) takes a torch.nn.Module, got {type(model).__name__}")
    swapped = _swap_classes(model)
    attn_implementation, skipped = None, {}
    if "transformers" in sys.modules:  # only a model built with transformers can be one of its models
        from ..integrations import transformers as hf
        from ..integrations import transformers_models

        attn_implementation = hf.select(model)
        hf_swapped, skipped = transformers_models.fuse_model(model)
        swapped.update(hf_swapped)
    summary = FuseSummary(dict(swapped), attn_implementation, skipped)
    if not swapped and attn_implementation is None:
        warnings.warn(f"fuse: {type(model).__name__} has no torch.nn Transformer module nor a transformers "
                      "attention to fuse; it runs unchanged", stacklevel=2)
    else:
        logger.info("fuse(%s): %s", type(model).__name__, summary)
    return (model, summary) if return_summary else model
