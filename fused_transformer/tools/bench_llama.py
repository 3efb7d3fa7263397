"""The ``llama`` bench suite: a Llama model of Hugging Face transformers, fused (``ft.fuse`` on a copy) against
transformers' own (``attn_implementation="sdpa"``, no hub kernels), on the same weights.

Two cases a length, both timed with their backward:

- ``decoder layer``: one ``LlamaDecoderLayer`` (the model's first) on ``[B, L, hidden]`` activations, causal, with
  the model's rotary embeddings: its forward and backward;
- ``LM step``: a training step of ``LlamaForCausalLM`` without the optimizer: forward on ``[B, L]`` token ids, the
  loss against labels (transformers' shifted cross-entropy), backward.

The model (``MODELS``): hidden 512, MLP 1408, 4 layers, 8 heads, 2 key-value heads, vocab 32000, untied embeddings
on the CPU; hidden 2048, MLP 5632, 16 heads, 4 key-value heads on CUDA; batch 2. ``ft.fuse`` decides what runs
fused; the rows' note says what it swapped. Time and peak memory are the bench's (``bench_timing``). Without
transformers the suite has no cases, and ``unavailable_reason`` says why.
"""
from __future__ import annotations

import copy
import functools
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

import fused_transformer as ft
from fused_transformer.tools.bench_cases import Built, Case, Setup, _on_backend, _randn

SUITE = "llama"
BASELINE = "transformers"
BATCH = 2
# device type -> LlamaConfig's sizes
MODELS: Dict[str, Dict[str, int]] = {
    "cpu": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=32000),
    "cuda": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000),
}
# device type -> (lengths, --quick lengths)
LENGTHS = {"cpu": ((512,), (128,)), "cuda": ((1024, 2048), (1024,))}


def unavailable_reason() -> Optional[str]:
    """Why the suite cannot run here (transformers missing), or None."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"transformers is not installed ({exc}); pip install \"fused_transformer[hf]\""
    return None


def model_sizes(device: torch.device) -> Dict[str, int]:
    return MODELS["cuda" if device.type == "cuda" else "cpu"]


def llama_model(setup: Setup) -> nn.Module:
    """transformers' ``LlamaForCausalLM`` of ``MODELS``' sizes for the setup's device, random weights (seed 0), on its
    device and dtype, in training mode (dropout 0, transformers' default), ``attn_implementation="sdpa"``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**model_sizes(setup.device), tie_word_embeddings=False, attn_implementation="sdpa")
    with setup.device:  # the weights drawn where they will be used
        model = LlamaForCausalLM(config).to(dtype=setup.dtype).train()
    if model.use_kernels:  # built from its config, nothing kernelizes it: transformers' forward everywhere
        raise RuntimeError("transformers kernelized the baseline model: it would not be transformers' own code")
    return model


def twins(setup: Setup) -> Tuple[Dict[str, nn.Module], str]:
    """``{"transformers": llama_model(setup), "ours": ft.fuse(its deep copy)}``, and what ``ft.fuse`` did, in
    words."""
    theirs = llama_model(setup)
    ours, summary = ft.fuse(copy.deepcopy(theirs), return_summary=True)
    return {BASELINE: theirs, "ours": ours}, f"ft.fuse: {summary}"


def _build(setup: Setup, length: int, whole_model: bool) -> Built:
    models, fused = twins(setup)
    if whole_model:
        vocab = models[BASELINE].config.vocab_size
        ids = torch.randint(vocab, (BATCH, length), device=setup.device)
        labels = torch.randint(vocab, (BATCH, length), device=setup.device)

        def step(model: nn.Module) -> Callable[[], None]:
            return lambda: model(input_ids=ids, labels=labels).loss.backward()

        fns = {name: step(model) for name, model in models.items()}
        leaves = []
    else:
        hidden = models[BASELINE].config.hidden_size
        x = _randn(setup, BATCH, length, hidden, grad=True)
        grad = _randn(setup, BATCH, length, hidden)
        positions = torch.arange(length, device=setup.device).expand(BATCH, length)

        def layer_step(model: nn.Module) -> Callable[[], None]:
            layer, rotary = model.model.layers[0], model.model.rotary_emb
            with torch.no_grad():
                cos_sin = rotary(x, positions)
            return lambda: layer(x, position_ids=positions, position_embeddings=cos_sin).backward(grad)

        fns = {name: layer_step(model) for name, model in models.items()}
        leaves = [x]
    fns["ours"] = _on_backend(setup.backend, fns["ours"])
    notes = {BASELINE: f'attn_implementation="sdpa", no hub kernels; ours: {fused}'}
    return Built(fns, leaves + [p for model in models.values() for p in model.parameters()], notes)


def cases(setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    """The suite's cases at ``lengths``; none without transformers (``unavailable_reason``)."""
    if unavailable_reason() is not None:
        return
    sizes = model_sizes(setup.device)
    heads = sizes["num_attention_heads"]
    for label, whole_model in (("decoder layer", False), ("LM step", True)):
        for length in lengths:
            yield Case(SUITE, label, "train", length, BATCH, (BASELINE, "ours"), heads=heads,
                       head_dim=sizes["hidden_size"] // heads, d_model=sizes["hidden_size"],
                       d_ff=sizes["intermediate_size"], causal=True,
                       build=functools.partial(_build, setup, length, whole_model))


def describe(setup: Setup) -> str:
    sizes = model_sizes(setup.device)
    return (f"LlamaForCausalLM hidden {sizes['hidden_size']}, MLP {sizes['intermediate_size']}, "
            f"{sizes['num_hidden_layers']} layers, {sizes['num_attention_heads']} heads, "
            f"{sizes['num_key_value_heads']} KV heads, vocab {sizes['vocab_size']}, untied, batch {BATCH}: "
            "ft.fuse (a copy) against transformers' sdpa; a decoder layer's forward + backward, a training step "
            "(loss with labels, backward, no optimizer)")


__all__ = ["BASELINE", "LENGTHS", "MODELS", "SUITE", "cases", "describe", "llama_model", "twins",
           "unavailable_reason"]
