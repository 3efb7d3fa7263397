"""transformers models on fused_transformer's kernels (``fused_transformer.integrations.transformers``) against the
same weights on transformers' own "sdpa" / "eager" attention: logits, generated tokens, gradients, packed batches,
attention weights, and a compiled training step. Tiny random-weight models built from configs (nothing is downloaded);
outputs at padded positions are not compared (what a fully masked row gives differs between implementations and
reaches nothing real)."""
import contextlib

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM, BertConfig, BertModel, Gemma2Config, GPT2Config, GptOssConfig, LlamaConfig, MistralConfig,
    T5Config, T5ForConditionalGeneration, ViTConfig, ViTModel, WhisperConfig, WhisperForConditionalGeneration,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

import fused_transformer as ft
from fused_transformer import backend, reference
from fused_transformer.contract import AttentionSpec, ScoreMods
from fused_transformer.integrations.transformers import (
    DEFAULT_NAME, attention_forward, register, select,
)

FP32_TOL = dict(rtol=0, atol=2e-5)
FP64_TOL = dict(rtol=0, atol=1e-12)
VOCAB = 100


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register()


@contextlib.contextmanager
def kernel_calls(monkeypatch, op="attention_fwd", what=AttentionSpec):
    """Record the spec (or another argument of type ``what``) of every call of the cpu backend's ``op`` (the ops call
    the function of this namespace)."""
    specs = []
    ops = backend.ops("cpu")
    original = getattr(ops, op)

    def spy(*args):
        specs.append(next(a for a in args if isinstance(a, what)))
        return original(*args)

    monkeypatch.setattr(ops, op, spy)
    yield specs
    monkeypatch.setattr(ops, op, original)


def llama(**overrides):
    torch.manual_seed(0)
    cfg = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**cfg, **overrides}), attn_implementation="sdpa").eval()


def token_batch(batch=3, length=10, padding="right", seed=1):
    """``(input_ids, attention_mask)``; with padding, row 1 loses 3 tokens and row 2 one, on that side."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padding != "none":
        for row, pad in ((1, 3), (2, 1)):
            span = slice(length - pad, None) if padding == "right" else slice(0, pad)
            mask[row, span] = 0
            ids[row, span] = 0
    return ids, mask


def ours_vs(model, run, baseline="sdpa"):
    """``run(model)`` on ``baseline`` attention, then on ours (same weights)."""
    model.set_attn_implementation(baseline)
    expected = run(model)
    model.set_attn_implementation(DEFAULT_NAME)
    return run(model), expected


# ------------------------------------------------------------------------------------------------- registration


def test_register_is_idempotent_and_selects_our_function():
    assert register() == DEFAULT_NAME and register() == DEFAULT_NAME
    assert transformers.AttentionInterface()[DEFAULT_NAME] is attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[DEFAULT_NAME] is sdpa_mask
    model = llama()
    assert select(model) == DEFAULT_NAME and model.config._attn_implementation == DEFAULT_NAME
    assert select(torch.nn.Linear(2, 2)) is None


def test_each_layer_runs_our_kernel(monkeypatch):
    model = llama()
    select(model)
    ids, mask = token_batch(padding="left")
    with kernel_calls(monkeypatch) as specs, torch.no_grad():
        model(ids, attention_mask=mask)
    assert len(specs) == model.config.num_hidden_layers


def test_fuse_selects_our_attention_on_a_transformers_model(monkeypatch, caplog):
    model = llama()
    with caplog.at_level("INFO", logger="fused_transformer"):
        fused, summary = ft.fuse(model, return_summary=True)
    assert fused is model and summary.attn_implementation == DEFAULT_NAME
    # its RMSNorms and its loss too (tests/test_hf_llama_family.py)
    assert summary.swapped == {"LlamaRMSNorm": 5, "LlamaForCausalLM": 1, "LlamaMLP": 2, "apply_rotary_pos_emb": 2}
    assert summary.skipped == {}
    assert model.config._attn_implementation == DEFAULT_NAME and DEFAULT_NAME in caplog.text
    ids, mask = token_batch(padding="right")
    with kernel_calls(monkeypatch) as specs, torch.no_grad():
        model(ids, attention_mask=mask)
    assert len(specs) == model.config.num_hidden_layers


def gemma2(softcap=2.0):
    """Gemma 2 with query / key weights scaled up so that scores reach the cap (at initialisation they are ~0.01)."""
    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
                       attn_logit_softcapping=softcap, sliding_window=4, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def gpt_oss():
    """gpt-oss with attention sinks far from their near-zero initialisation, so that they matter."""
    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=4, max_position_embeddings=64, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 2)
    return model


@pytest.mark.parametrize("make", [gemma2, gpt_oss], ids=["gemma2_softcap", "gpt_oss_sinks"])
def test_softcap_and_sinks_run_in_our_kernel(make, monkeypatch):
    """Gemma 2's logit softcap and gpt-oss's sinks (``softcap`` / ``s_aux``) reach the kernel and match eager; each
    changes the result (a planted "ignore it" would fail)."""
    model = make()
    ids, mask = token_batch(padding="right")
    valid = mask.bool()
    with torch.no_grad(), kernel_calls(monkeypatch, what=ScoreMods) as calls:
        ours, expected = ours_vs(model, lambda m: m(ids, attention_mask=mask).logits, baseline="eager")
    torch.testing.assert_close(ours[valid], expected[valid], **FP32_TOL)
    assert len(calls) == model.config.num_hidden_layers
    with torch.no_grad():
        if make is gemma2:
            assert calls[0].softcap == model.config.attn_logit_softcapping
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        else:
            for layer in model.model.layers:
                layer.self_attn.sinks.zero_().sub_(float("inf"))  # a sink of -inf takes no weight
        without = model(ids, attention_mask=mask).logits
    assert (without[valid] - ours[valid]).abs().max() > 1e-3


@pytest.mark.parametrize("make", [gemma2, gpt_oss], ids=["gemma2_softcap", "gpt_oss_sinks"])
def test_softcap_and_sinks_attention_weights_match_eager(make):
    model = make()
    ids, mask = token_batch(padding="none")
    with torch.no_grad():
        ours, expected = ours_vs(model, lambda m: m(ids, attention_mask=mask, output_attentions=True).attentions,
                                 baseline="eager")
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, **FP32_TOL)


def test_gpt_oss_training_gradients_reach_the_sinks():
    model = gpt_oss().train()
    ids, mask = token_batch(padding="right")

    def step(m):
        m.zero_grad()
        m(ids, attention_mask=mask, labels=ids).loss.backward()
        return [layer.self_attn.sinks.grad.clone() for layer in m.model.layers] + [
            p.grad.clone() for p in m.model.layers[0].self_attn.parameters() if p.ndim == 2]

    ours, expected = ours_vs(model, step, baseline="eager")
    assert all(g.abs().sum() > 0 for g in ours)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_llama_gqa_logits_match_sdpa(padding):
    model = llama()
    ids, mask = token_batch(padding=padding)
    valid = mask.bool()
    with torch.no_grad():
        ours, expected = ours_vs(model, lambda m: m(ids, attention_mask=mask).logits)
        torch.testing.assert_close(ours[valid], expected[valid], **FP32_TOL)
        model.double()
        with ft.use_backend("cpu"):
            # Llama's RMSNorm rounds to float32 inside, so compare the residual stream after each layer too
            ours, expected = ours_vs(model, lambda m: m(ids, attention_mask=mask, output_hidden_states=True))
    for a, b in zip((*ours.hidden_states[1:-1], ours.logits), (*expected.hidden_states[1:-1], expected.logits)):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a[valid], b[valid], **FP64_TOL)


def test_mistral_sliding_window_shorter_than_the_sequence(monkeypatch):
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids, mask = token_batch(length=12, padding="left")
    valid = mask.bool()
    with torch.no_grad(), kernel_calls(monkeypatch) as specs:
        ours, expected = ours_vs(model, lambda m: m(ids, attention_mask=mask).logits)
        model.config.sliding_window = None
        unwindowed = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(ours[valid], expected[valid], **FP32_TOL)
    assert (unwindowed[valid] - ours[valid]).abs().max() > 1e-3  # the window did change the result
    assert specs[0].window == (3, 0)


def bert_case():
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    ids, mask = token_batch(padding="right")
    return BertModel(cfg), lambda m: m(ids, attention_mask=mask).last_hidden_state, mask.bool()


def gpt2_case():
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    ids, mask = token_batch(padding="right")
    return transformers.GPT2LMHeadModel(cfg), lambda m: m(ids, attention_mask=mask).logits, mask.bool()


def vit_case():
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return ViTModel(cfg), lambda m: m(pixel_values=pixels).last_hidden_state, None


def whisper_case():
    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=16, max_target_positions=32, pad_token_id=0, decoder_start_token_id=1)
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    decoder_ids, decoder_mask = token_batch(batch=2, length=7, padding="none")
    return (WhisperForConditionalGeneration(cfg),
            lambda m: m(input_features=features, decoder_input_ids=decoder_ids).logits, decoder_mask.bool())


def t5(dropout_rate=0.0):
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, dropout_rate=dropout_rate, pad_token_id=0,
                   decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


def t5_case():
    ids, mask = token_batch(padding="right")
    decoder_ids, decoder_mask = token_batch(length=6, padding="right", seed=2)
    return (t5(), lambda m: m(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                              decoder_attention_mask=decoder_mask).logits, decoder_mask.bool())


@pytest.mark.parametrize("case", [bert_case, gpt2_case, vit_case, whisper_case, t5_case],
                         ids=["bert", "gpt2", "vit", "whisper", "t5"])
def test_model_outputs_match_sdpa(case, monkeypatch):
    torch.manual_seed(0)
    model, run, valid = case()
    model.eval()
    # Named: dense calls (ViT, Whisper's encoder) would otherwise follow the route to torch's own SDPA.
    with torch.no_grad(), kernel_calls(monkeypatch) as specs, ft.use_backend("cpu"):
        ours, expected = ours_vs(model, run)
    assert specs, "our kernel never ran"
    if valid is not None:
        ours, expected = ours[valid], expected[valid]
    torch.testing.assert_close(ours, expected, **FP32_TOL)


# ------------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["left", "none"])
def test_greedy_generation_matches_sdpa(cache, padding):
    model = llama()
    ids, mask = token_batch(batch=3 if padding == "left" else 1, padding=padding)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"
    ours, expected = ours_vs(model, lambda m: m.generate(ids, attention_mask=mask, **options))
    assert torch.equal(ours, expected)


# -------------------------------------------------------------------------------------------------- gradients


def gradients(model, run):
    model.zero_grad()
    run(model).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(ours, expected, tol=1e-5):
    assert ours.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(ours[name], expected[name], rtol=0, atol=tol, msg=lambda m: f"{name}: {m}")


def test_llama_training_gradients_match_eager():
    model = llama().train()
    # Right padding, as in training: with left padding the last pad position predicts the first real token, and
    # what a row with no key to attend gives (zeros here, the mean of the values in "eager") reaches the loss.
    ids, mask = token_batch(padding="right")
    labels = ids.masked_fill(mask == 0, -100)
    ours, expected = ours_vs(model, lambda m: gradients(m, lambda m: m(ids, attention_mask=mask, labels=labels).loss),
                             baseline="eager")
    assert_same_gradients(ours, expected)


def test_t5_training_gradients_reach_the_position_bias():
    model = t5().train()
    ids, mask = token_batch(padding="right")
    decoder_ids, decoder_mask = token_batch(length=6, padding="right", seed=2)
    labels = decoder_ids.masked_fill(decoder_mask == 0, -100)

    def loss(m):
        return m(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                 decoder_attention_mask=decoder_mask, labels=labels).loss

    ours, expected = ours_vs(model, lambda m: gradients(m, loss), baseline="eager")
    assert_same_gradients(ours, expected)
    bias_grad = ours["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert bias_grad.abs().max() > 1e-4


@pytest.mark.parametrize("bias_batch", [1, 2])
def test_position_bias_gradient_float64(bias_batch):
    """attention_forward's own bias gradient (kernel with a detached bias + MaskGradient), GQA and a bool mask,
    against autograd through the reference, to float64 round-off."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, generator=generator).requires_grad_()
    k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64, generator=generator).requires_grad_() for _ in range(2))
    bias = torch.randn(bias_batch, 4, 5, 7, dtype=torch.float64, generator=generator).requires_grad_()
    mask = torch.rand(2, 1, 5, 7, generator=generator) > 0.3
    mask[..., 0] = True
    grad = torch.randn(2, 5, 4, 8, dtype=torch.float64, generator=generator)
    module = torch.nn.Module()
    with ft.use_backend("cpu"):
        out, _ = attention_forward(module, q, k, v, mask, scaling=1.0, is_causal=False, position_bias=bias)
    ours = torch.autograd.grad(out, (q, k, v, bias), grad)
    combined = torch.where(mask, bias, torch.finfo(torch.float64).min)
    expected_out = reference.attention(q, k, v, attn_mask=combined, scale=1.0).transpose(1, 2)
    expected = torch.autograd.grad(expected_out, (q, k, v, bias), grad)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, **FP64_TOL)


def test_trainable_bias_with_dropout_runs_on_the_reference(monkeypatch):
    model = t5(dropout_rate=0.1).train()
    model.set_attn_implementation(DEFAULT_NAME)
    ids, mask = token_batch(padding="right")
    with kernel_calls(monkeypatch) as kernel_specs:
        reference_calls = []
        original = backend.ops("reference").attention
        monkeypatch.setattr(backend.ops("reference"), "attention",
                            lambda *args: reference_calls.append(args[4]) or original(*args))
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    relative_bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert reference_calls and all(spec.dropout_p == 0.1 for spec in reference_calls)
    # cross-attention's bias (zeros) needs no gradient: it stays on the kernel, dropout and all
    assert kernel_specs and all(spec.dropout_p == 0.1 for spec in kernel_specs)
    assert torch.isfinite(relative_bias.grad).all() and relative_bias.grad.abs().max() > 0


# -------------------------------------------------------------------------------------- packed batch, weights


def test_packed_batch_matches_each_sequence_alone(monkeypatch):
    model = llama()
    lengths = (5, 3, 4)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_seq_lens = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    packed = dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=5, max_length_k=5)
    model.set_attn_implementation(DEFAULT_NAME)
    with torch.no_grad(), kernel_calls(monkeypatch, "attention_varlen_fwd") as specs:
        ours = model(ids, position_ids=position_ids, **packed).logits[0]
    assert len(specs) == model.config.num_hidden_layers and all(spec.is_causal for spec in specs)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        alone = torch.cat([model(part).logits[0] for part in ids.split(lengths, dim=1)])
    torch.testing.assert_close(ours, alone, **FP32_TOL)


def test_output_attentions_match_eager():
    model = llama()
    ids, mask = token_batch(padding="left")
    valid = mask.bool()
    with torch.no_grad():
        ours, expected = ours_vs(model, lambda m: m(ids, attention_mask=mask, output_attentions=True).attentions,
                                 baseline="eager")
    assert len(ours) == len(expected) == model.config.num_hidden_layers
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.transpose(1, 2)[valid], b.transpose(1, 2)[valid], **FP32_TOL)


# --------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_compiled_padded_training_step_has_no_graph_break_or_recompile():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = llama(num_hidden_layers=1).train()
    model.set_attn_implementation(DEFAULT_NAME)
    graph_code = []

    def inductor_keeping_the_graph(graph_module, example_inputs):
        graph_code.extend(module.code for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule))
        return torch._inductor.compile(graph_module, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=inductor_keeping_the_graph)

    def step(module, seed):
        ids, mask = token_batch(padding="left", seed=seed)
        labels = ids.masked_fill(mask == 0, -100)
        loss = module(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach()

    first = step(compiled, seed=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(compiled, seed=2)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert any("fused_transformer_cpu.attention_fwd" in code for code in graph_code)
    torch.testing.assert_close(first, step(model, seed=1), **FP32_TOL)
