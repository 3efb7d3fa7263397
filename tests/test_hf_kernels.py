"""Hugging Face ``kernels``' door (``integrations.hf_kernels``): ``kernels.kernelize`` with our mapping swaps
transformers' RMSNorm layers for ours, which ``kernels`` validates, which run ``ft.rms_norm`` (``ft.explain``), give
the unkernelized model's logits and gradients, and load nothing from the Hub."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub reads it: no test here may reach the network

import pytest
import torch

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

import fused_transformer as ft  # noqa: E402
from fused_transformer.backend import use_backend  # noqa: E402
from fused_transformer.integrations import hf_kernels  # noqa: E402

LAYERS = 2
VOCAB = 97


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    """Any repository of ``kernels``' own (Hub, locked or local tree) that a test would load fails it."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(self):
        raise AssertionError(f"kernels loaded {self}")

    for name in ("LayerRepository", "LockedLayerRepository", "LocalLayerRepository"):
        monkeypatch.setattr(getattr(kernels, name), "load", refuse)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LlamaRMSNorm):  # not all ones: a weight the test can see
                module.weight.normal_(1.0, 0.5)
    return model


def kernelized(model, mode, device="cpu", **options):
    with kernels.use_kernel_mapping(hf_kernels.mapping(), **options):
        return kernels.kernelize(model, mode=mode, device=device, use_fallback=True)


def norm_records(calls):
    return [record for record in calls if record.op == "rms_norm"]


@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING"])
def test_kernelized_llama_runs_our_rms_norm_with_the_same_logits(mode):
    model, twin = tiny_llama(), tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 17))
    labels = torch.randint(0, VOCAB, (2, 17))
    reference = twin(ids, labels=labels)
    reference.loss.backward()
    kernelized(model, getattr(kernels.Mode, mode))

    layers = kernels.get_kernelized_layers(model).layers
    assert len(layers) == 2 * LAYERS + 1 and all(
        layer.repo == hf_kernels.Repository("RMSNorm") for layer in layers.values())
    with use_backend("cpu"), ft.explain() as calls:
        out = model(ids, labels=labels)
        out.loss.backward()
    norms = norm_records(calls)
    assert len(norms) == 2 * LAYERS + 1 and {record.backend for record in norms} == {"cpu"}, calls
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_cuda_entry_is_chosen_for_cuda(monkeypatch):
    """kernelize(device="cuda") picks the mapping's CUDA entry (for any compute capability); the model stays on the
    CPU here, where the layers it got run too."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model, twin = tiny_llama(), tiny_llama()
    kernelized(model, kernels.Mode.INFERENCE, device="cuda", inherit_mapping=False)
    ids = torch.randint(0, VOCAB, (2, 9))
    with use_backend("cpu"), ft.explain() as calls, torch.no_grad():
        logits = model(ids).logits
    assert len(norm_records(calls)) == 2 * LAYERS + 1
    torch.testing.assert_close(logits, twin(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_mapping_without_the_device_keeps_transformers_forward(monkeypatch):
    monkeypatch.setattr(hf_kernels, "DEVICE_TYPES", ("cuda",))
    model = tiny_llama()
    kernelized(model, kernels.Mode.TRAINING, device="cpu")
    assert not kernels.get_kernelized_layers(model).layers
    with ft.explain() as calls, torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 5)))
    assert not norm_records(calls)


def test_the_layer_passes_kernels_validation_and_compiles():
    """``kernels`` checks a layer against the one it replaces (no constructor, no members of its own but
    ``can_torch_compile`` / ``has_backward``, the same forward parameters); ours declares torch.compile support,
    and a compiled TRAINING | TORCH_COMPILE kernelized norm runs ours in one graph."""
    from kernels._internals.layer.layer import _validate_layer

    repo = hf_kernels.Repository("RMSNorm")
    _validate_layer(check_cls=LlamaRMSNorm, cls=repo.load(), repo=repo)
    norm = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 48, requires_grad=True)
    expected = norm(x)
    (grad_x,) = torch.autograd.grad(expected.sum(), x)
    kernelized(norm, kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE, inherit_mapping=False)
    assert kernels.get_kernelized_layers(norm).layers[""].repo == repo
    compiled = torch.compile(norm, fullgraph=True)
    with use_backend("cpu"):
        y = compiled(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], grad_x, rtol=1e-5, atol=1e-5)


def test_a_float32_weight_over_bfloat16_activations_gives_transformers_dtype():
    norm = LlamaRMSNorm(64)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 64).to(torch.bfloat16)
    expected = norm(x)
    kernelized(norm, kernels.Mode.INFERENCE, inherit_mapping=False)
    with use_backend("cpu"), ft.explain() as calls:
        y = norm(x)
    assert y.dtype == expected.dtype == torch.float32 and len(norm_records(calls)) == 1
    # both round the normalized input to bfloat16 before the product: at most one bfloat16 step apart
    step = torch.finfo(torch.bfloat16).eps * x.float().div(x.float().pow(2).mean(-1, keepdim=True).sqrt()).abs()
    assert ((y - expected).abs() <= step * norm.weight.abs() + 1e-6).all()


def test_the_repository_names_only_our_layers_and_compares_by_name():
    assert hf_kernels.Repository("RMSNorm") == hf_kernels.Repository("RMSNorm")
    assert len({hf_kernels.Repository("RMSNorm"), hf_kernels.Repository("RMSNorm")}) == 1
    assert hf_kernels.Repository("RMSNorm").load() is hf_kernels.RMSNorm
    with pytest.raises(ValueError, match="layer_name='LayerNorm' is not one of fused_transformer's layers: RMSNorm"):
        hf_kernels.Repository("LayerNorm")
    assert set(hf_kernels.mapping()) == set(hf_kernels.LAYERS)
    assert all(set(entry) == {"cpu", "cuda"} for entry in hf_kernels.mapping().values())


def test_from_pretrained_kernelizing_undoes_ours_on_a_mode_change(tmp_path):
    """``from_pretrained``'s default ``use_kernels`` kernelizes again with transformers' mapping whenever the mode
    changes (``model.train()``), which restores transformers' forward on the CPU; ``use_kernels=False`` keeps ours."""
    tiny_llama().save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 6))

    def norms_run(model):
        with ft.explain() as calls, torch.no_grad():
            model(ids)
        return len(norm_records(calls))

    for use_kernels, kept in ((None, 0), (False, 2 * LAYERS + 1)):
        options = {} if use_kernels is None else {"use_kernels": use_kernels}
        # from_pretrained registers transformers' mapping in the mapping in force: here a copy, dropped on exit
        with kernels.use_kernel_mapping({}):
            model = LlamaForCausalLM.from_pretrained(tmp_path, **options)
            kernelized(model, kernels.Mode.INFERENCE, inherit_mapping=False)
            assert norms_run(model) == 2 * LAYERS + 1
            model.train()
            assert norms_run(model) == kept
