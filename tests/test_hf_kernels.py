"""Hugging Face ``kernels``' door (``integrations.hf_kernels``): ``kernels.kernelize`` with our mapping swaps
transformers' RMSNorm layers and its ``apply_rotary_pos_emb`` for ours, which ``kernels`` validates, which run
``ft.rms_norm`` and ``ft.apply_rotary_pos_emb`` (``ft.explain``), give the unkernelized model's logits and gradients,
and load nothing from the Hub."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub reads it: no test here may reach the network

import pytest
import torch

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm  # noqa: E402

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


def rotary_records(calls):
    return [record for record in calls if record.op == "apply_rotary_pos_emb"]


@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING"])
def test_kernelized_llama_runs_our_rms_norm_with_the_same_logits(mode):
    model, twin = tiny_llama(), tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 17))
    labels = torch.randint(0, VOCAB, (2, 17))
    reference = twin(ids, labels=labels)
    reference.loss.backward()
    kernelized(model, getattr(kernels.Mode, mode))

    kernelized_ = kernels.get_kernelized_layers(model)
    assert len(kernelized_.layers) == 2 * LAYERS + 1 and all(
        layer.repo == hf_kernels.Repository("RMSNorm") for layer in kernelized_.layers.values())
    assert len(kernelized_.funcs) == LAYERS and all(
        func.repo == hf_kernels.Repository("rotary_pos_emb") for func in kernelized_.funcs.values())
    with use_backend("cpu"), ft.explain() as calls:
        out = model(ids, labels=labels)
        out.loss.backward()
    norms, rotations = norm_records(calls), rotary_records(calls)
    assert len(norms) == 2 * LAYERS + 1 and {record.backend for record in norms} == {"cpu"}, calls
    assert len(rotations) == LAYERS and {record.backend for record in rotations} == {"cpu"}, calls
    with ft.explain() as calls, torch.no_grad():
        twin(ids)
    assert not calls  # kernelize swapped the kernelized model's functions only, not the module-level one
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
    assert len(norm_records(calls)) == 2 * LAYERS + 1 and len(rotary_records(calls)) == LAYERS
    torch.testing.assert_close(logits, twin(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_mapping_without_the_device_keeps_transformers_forward(monkeypatch):
    monkeypatch.setattr(hf_kernels, "DEVICE_TYPES", ("cuda",))
    model = tiny_llama()
    kernelized(model, kernels.Mode.TRAINING, device="cpu")
    assert not kernels.get_kernelized_layers(model).layers and not kernels.get_kernelized_layers(model).funcs
    with ft.explain() as calls, torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 5)))
    assert not calls


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


def test_the_rotary_layer_passes_kernels_validation_and_compiles():
    """The same for ``apply_rotary_pos_emb``, attached to ``LlamaAttention``: a compiled attention module whose
    kernelized function is ours traces it in its graph (``fullgraph=True``), forward and backward."""
    from kernels._internals.layer.layer import _validate_layer

    repo = hf_kernels.Repository("rotary_pos_emb")
    _validate_layer(check_cls=type(modeling_llama.apply_rotary_pos_emb), cls=repo.load(), repo=repo)
    config = tiny_llama().config
    torch.manual_seed(1)
    attention = LlamaAttention(config, 0)
    x = torch.randn(2, 9, config.hidden_size, requires_grad=True)
    positions = torch.arange(9).expand(2, 9)
    cos_sin = modeling_llama.LlamaRotaryEmbedding(config)(x, positions)
    expected = attention(x, cos_sin, None)[0]
    (grad_x,) = torch.autograd.grad(expected.sum(), x)
    kernelized(attention, kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE, inherit_mapping=False)
    assert [func.repo for func in kernels.get_kernelized_layers(attention).funcs.values()] == [repo]
    compiled = torch.compile(attention, fullgraph=True)
    with use_backend("cpu"), ft.explain() as calls:
        y = compiled(x, cos_sin, None)[0]
    assert len(rotary_records(calls)) == 1
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], grad_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["llama", "gpt_oss"])
def test_the_rotary_layer_rotates_as_each_marked_function(model):
    """transformers' functions marked ``rotary_pos_emb`` take cos and sin at the head dim (Llama and 110 more) or,
    gpt-oss's, at half of it for both halves: ours gives each one's result."""
    module = {"llama": modeling_llama, "gpt_oss": modeling_gpt_oss}[model]
    head_dim, width = 16, 16 if model == "llama" else 8
    q, k = torch.randn(2, 4, 7, head_dim), torch.randn(2, 2, 7, head_dim)
    angles = torch.randn(2, 7, width)
    expected = module.apply_rotary_pos_emb(q, k, angles.cos(), angles.sin())
    with use_backend("cpu"), ft.explain() as calls:
        got = hf_kernels.RotaryPosEmb()(q, k, angles.cos(), angles.sin())
    assert len(rotary_records(calls)) == 1
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


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
    with pytest.raises(ValueError, match="layer_name='LayerNorm' is not one of fused_transformer's layers: RMSNorm, "
                                         "rotary_pos_emb"):
        hf_kernels.Repository("LayerNorm")
    assert set(hf_kernels.mapping()) == set(hf_kernels.LAYERS) == {"RMSNorm", "rotary_pos_emb"}
    assert all(set(entry) == {"cpu", "cuda"} for entry in hf_kernels.mapping().values())


def test_from_pretrained_kernelizing_undoes_ours_on_a_mode_change(tmp_path):
    """``from_pretrained``'s default ``use_kernels`` kernelizes again with transformers' mapping whenever the mode
    changes (``model.train()``), which restores transformers' forward on the CPU; ``use_kernels=False`` keeps ours."""
    tiny_llama().save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 6))

    def ours_run(model):
        with ft.explain() as calls, torch.no_grad():
            model(ids)
        return len(norm_records(calls)) + len(rotary_records(calls))

    for use_kernels, kept in ((None, 0), (False, 3 * LAYERS + 1)):
        options = {} if use_kernels is None else {"use_kernels": use_kernels}
        # from_pretrained registers transformers' mapping in the mapping in force: here a copy, dropped on exit
        with kernels.use_kernel_mapping({}):
            model = LlamaForCausalLM.from_pretrained(tmp_path, **options)
            kernelized(model, kernels.Mode.INFERENCE, inherit_mapping=False)
            assert ours_run(model) == 3 * LAYERS + 1
            model.train()
            assert ours_run(model) == kept
