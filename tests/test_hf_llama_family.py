"""``fuse(model)`` on transformers' Llama-family models (``fused_transformer.integrations.transformers_models``): a fused
copy against the same weights unfused and in float64 (logits, every gradient, greedy decoding, the state_dict), the
loss's options, a short training run, torch.compile, kernelize's instance forward, gradient checkpointing, and what
fuse leaves and names. Tiny random-weight models built from configs; float32; the "auto" backend unless named."""
import copy
import io
from types import MethodType

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM, Gemma2Config, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
    Qwen2Config, Qwen3Config,
)

import fused_transformer as ft
from fused_transformer.integrations import transformers_models as hf_models
from numerics import assert_close_to_reference

VOCAB = 128
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
# Gemma's own defaults cap the logits at 30 (2 and 3) and the scores at 50 (2): smaller caps here, so they bite.
FAMILIES = {
    "llama": lambda: LlamaConfig(**TINY),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=5),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16),
    "phi3": lambda: Phi3Config(**TINY),
    "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=20.0,
                                   sliding_window=5),
    "gemma3": lambda: Gemma3TextConfig(**TINY, head_dim=16, final_logit_softcapping=3.0, sliding_window=5),
}
NORMS = {"llama": "LlamaRMSNorm", "mistral": "MistralRMSNorm", "qwen2": "Qwen2RMSNorm", "qwen3": "Qwen3RMSNorm",
         "phi3": "Phi3RMSNorm", "gemma2": "Gemma2RMSNorm", "gemma3": "Gemma3RMSNorm"}


def build(family, **overrides):
    """``(unfused, fused)``: the same random weights (norm weights drawn too, not their ones / zeros)."""
    torch.manual_seed(0)
    cfg = FAMILIES[family]()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    attn = "eager" if family.startswith("gemma") else "sdpa"
    model = (Gemma3ForCausalLM(cfg) if family == "gemma3" else AutoModelForCausalLM.from_config(cfg))
    model.set_attn_implementation(attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0 if family.startswith("gemma") else 1))
    fused = ft.fuse(copy.deepcopy(model))
    return model, fused


def batch(seed=1, batch_size=2, length=11):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch_size, length), generator=generator)


def float64_copy(model):
    return copy.deepcopy(model).double()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_unfused_and_float64(family):
    model, fused = build(family)
    ids = batch()
    norms = sum(type(m).__name__ == NORMS[family] for m in model.modules())
    _, summary = ft.fuse(copy.deepcopy(model), return_summary=True)
    layers = model.config.num_hidden_layers
    assert summary.swapped[NORMS[family]] == norms and summary.swapped[type(model).__name__] == 1
    assert summary.swapped[type(model.model.layers[0].mlp).__name__] == layers
    # Phi-3's rotary is a module-level function with no per-instance copy: left as it is
    assert summary.swapped.get("apply_rotary_pos_emb", 0) == (0 if family == "phi3" else layers)
    assert not summary.skipped

    # logits (eval: the class's own forward around our norms and attention)
    model64 = float64_copy(model)
    model.eval(), fused.eval(), model64.eval()
    with torch.no_grad():
        want64, want32, got = (m(ids).logits for m in (model64, model, fused))
    assert_close_to_reference(got, want64, want32, "logits")

    # greedy decoding
    prompt = ids[:, :5]
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.generate(prompt, **options), model.generate(prompt, **options))

    # the loss with labels (train mode: the fused loss) and every parameter's gradient
    for m in (model, fused, model64):
        m.train()
    labels = ids.clone()
    labels[0, :3] = -100
    with ft.explain() as calls:
        out = fused(ids, labels=labels)
    assert out.logits is None
    ran = {c.op for c in calls}
    assert {"rms_norm", "linear_cross_entropy", "gated_feed_forward"} <= ran, ran
    assert ("apply_rotary_pos_emb" in ran) == (family != "phi3"), ran
    losses = [m(ids, labels=labels).loss for m in (model64, model)]
    assert_close_to_reference(out.loss, *losses, "loss")
    grads = []
    for m, loss in zip((fused, model64, model), (out.loss, *losses)):
        params = [p for _, p in m.named_parameters()]
        grads.append(torch.autograd.grad(loss, params))
    for name, got_grad, want64_grad, want32_grad in zip([n for n, _ in model.named_parameters()], *grads):
        assert_close_to_reference(got_grad, want64_grad, want32_grad, f"grad {name}")


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_state_dict_is_unchanged_and_loads_strictly_both_ways(family):
    model, fused = build(family)
    want, got = model.state_dict(), fused.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh_fused = ft.fuse(copy.deepcopy(model))
    with torch.no_grad():
        for p in fresh_fused.parameters():
            p.add_(1.0)
    fresh_fused.load_state_dict(want, strict=True)  # unfused -> fused
    model.load_state_dict(fresh_fused.state_dict(), strict=True)  # fused -> unfused
    assert all(torch.equal(fresh_fused.state_dict()[k], want[k]) for k in want)
    buffer = io.BytesIO()
    torch.save(fused.state_dict(), buffer)
    buffer.seek(0)
    model.load_state_dict(torch.load(buffer), strict=True)


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_every_fused_op_runs_ours_on_a_named_backend(name):
    """On "auto" a CPU RMSNorm or gated MLP without dropout is torch's ATen ops (the route's choice: nothing to fuse
    there); named, the backend runs ours, within the 2x rule of the float64 model."""
    model, fused = build("qwen3", num_hidden_layers=1)
    model64 = float64_copy(model)
    ids = batch(length=7)
    fused.train(), model.train(), model64.train()
    with ft.use_backend(name), ft.explain() as calls:
        loss = fused(ids, labels=ids).loss
    by_op = {}
    for call in calls:
        by_op.setdefault(call.op, set()).add(call.backend)
    for op in ("rms_norm", "gated_feed_forward", "apply_rotary_pos_emb", "linear_cross_entropy", "attention"):
        assert by_op.get(op) == {name}, (op, by_op)
    # Qwen3: input, post-attention, q and k norms per layer, and the final norm
    assert sum(c.op == "rms_norm" for c in calls) == 4 + 1
    assert_close_to_reference(loss, model64(ids, labels=ids).loss, model(ids, labels=ids).loss, "loss")


def test_an_unfused_model_in_the_same_process_runs_none_of_ours():
    model, fused = build("llama")
    with ft.explain() as calls, torch.no_grad():
        fused.eval()(batch())
        seen = len(calls)
        model.eval()(batch())
    assert seen > 0 and len(calls) == seen


# ------------------------------------------------------------------------------------------------ the loss


def fused_and_unfused_losses(family, overrides=None, **call):
    model, fused = build(family, **(overrides or {}))
    model.train(), fused.train()
    ids = batch(length=9)
    got = fused(ids, **call)
    want = model(ids, **call)
    return got, want


def test_loss_num_items_in_batch_and_ignored_rows():
    labels = batch(seed=2, length=9)
    labels[1, :] = -100
    labels[0, 4:] = -100
    got, want = fused_and_unfused_losses("llama", labels=labels, num_items_in_batch=torch.tensor(7))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_loss_shift_labels():
    shift = batch(seed=3, length=9)
    shift[:, -2:] = -100
    got, want = fused_and_unfused_losses("qwen2", labels=batch(seed=4, length=9), shift_labels=shift)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_loss_gemma2_softcap_bites():
    labels = batch(seed=5, length=9)
    got, want = fused_and_unfused_losses("gemma2", {"final_logit_softcapping": 0.2}, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    uncapped, _ = fused_and_unfused_losses("gemma2", {"final_logit_softcapping": None}, labels=labels)
    assert abs(uncapped.loss.item() - got.loss.item()) > 1e-3


def test_loss_logits_to_keep_slices_the_hidden_states():
    labels = batch(seed=6, length=4)
    got, want = fused_and_unfused_losses("llama", labels=labels, logits_to_keep=4)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_logits_when_asked_and_none_in_training():
    model, fused = build("llama")
    ids = batch()
    fused.eval(), model.eval()
    with torch.no_grad():
        plain = fused(ids)
        with_labels = fused(ids, labels=ids)  # eval with labels: the class's own path, logits and loss
        last = fused(ids, logits_to_keep=1)
        want = model(ids, labels=ids)
    assert plain.loss is None and plain.logits.shape == (2, 11, VOCAB)
    torch.testing.assert_close(with_labels.logits, want.logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(with_labels.loss, want.loss, rtol=0, atol=2e-5)
    torch.testing.assert_close(last.logits, want.logits[:, -1:], rtol=0, atol=2e-5)
    fused.train()
    out = fused(ids, labels=ids, return_dict=False)  # a tuple without its None logits
    assert isinstance(out, tuple) and out[0].ndim == 0


def test_custom_loss_function_runs_the_class_forward():
    model, fused = build("llama")
    fused.train()
    fused.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    out = fused(batch(), labels=batch())
    assert out.logits is not None
    torch.testing.assert_close(out.loss, out.logits.mean())


def test_fifty_training_steps_follow_the_unfused_model():
    model, fused = build("llama")
    losses = []
    for m in (model, fused):
        torch.manual_seed(7)
        m.train()
        optimizer = torch.optim.AdamW(m.parameters(), lr=3e-3)
        run = []
        for step in range(50):
            ids = batch(seed=100 + step % 4, batch_size=2, length=8)  # 4 batches to memorise
            loss = m(ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.append(loss.item())
        losses.append(torch.tensor(run, dtype=torch.float64))
    want, got = losses
    assert want[-1] < want[0] - 0.5  # it learnt something
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


def test_compiled_forward_loss_backward_has_no_graph_break():
    _, fused = build("llama", num_hidden_layers=1)
    fused.train()
    ids = batch(length=8)

    def step(ids):
        return fused(ids, labels=ids).loss

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(ids)
    assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    params = list(fused.parameters())
    loss = compiled(ids)
    grads = torch.autograd.grad(loss, params)
    want = step(ids)
    torch.testing.assert_close(loss, want)
    for got_grad, want_grad in zip(grads, torch.autograd.grad(want, params)):
        torch.testing.assert_close(got_grad, want_grad)


# ------------------------------------------------------------------------------------------------ what fuse matches


def test_kernelize_instance_forward_is_replaced_by_ours():
    """kernels' ``kernelize`` binds a hub layer's forward on each instance (``_replace_forward``); fuse removes it."""
    from kernels._internals.layer.layer import _replace_forward

    model, _ = build("llama")

    class HubRMSNorm(nn.Module):
        def forward(self, hidden_states):
            raise AssertionError("the hub kernel ran")

    class HubRotary(nn.Module):
        def forward(self, q, k, cos, sin, unsqueeze_dim=1):
            raise AssertionError("the hub rotary ran")

    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            _replace_forward(module, HubRMSNorm, repo="kernels-community/test")
        if type(module).__name__ == "LlamaAttention":  # its own copy of apply_rotary_pos_emb
            for func in module._kernel_funcs.values():
                _replace_forward(func, HubRotary, repo="kernels-community/test")
    _, summary = ft.fuse(model, return_summary=True)
    assert summary.swapped["LlamaRMSNorm"] == 5 and summary.swapped["apply_rotary_pos_emb"] == 2
    with ft.explain() as calls, torch.no_grad():
        model.eval()(batch())
    assert sum(c.op == "rms_norm" for c in calls) == 5 and sum(c.op == "apply_rotary_pos_emb" for c in calls) == 2


def test_summary_names_what_it_left():
    class LoraLinear(nn.Module):
        """A PEFT-like adapter around a Linear (``base_layer``)."""

        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    model, _ = build("llama", num_hidden_layers=3)
    model.lm_head = LoraLinear(model.lm_head)
    own = model.model.norm
    own.forward = MethodType(lambda self, x: x, own)
    layers = model.model.layers
    layers[0].mlp.up_proj = LoraLinear(layers[0].mlp.up_proj)
    layers[1].mlp.act_fn = nn.ReLU()  # a gated MLP the op does not compute
    _, summary = ft.fuse(model, return_summary=True)
    skipped = summary.skipped
    assert "LoRA" in skipped["lm_head"] and "instance" in skipped["model.norm"]
    assert "up_proj" in skipped["model.layers.0.mlp"] and "LoRA" in skipped["model.layers.0.mlp"]
    assert "ReLU" in skipped["model.layers.1.mlp"]
    assert "lm_head" in str(summary) and "model.layers.1.mlp" in str(summary)
    assert summary.swapped["LlamaRMSNorm"] == 6 and summary.swapped["LlamaMLP"] == 1
    assert "LlamaForCausalLM" not in summary.swapped
    assert type(model).__mro__[1] is not hf_models.FusedCausalLM
    with ft.explain() as calls, torch.no_grad():
        model.eval()(batch())
    assert sum(c.op == "gated_feed_forward" for c in calls) == 1


def test_mlp_of_another_shape_is_left():
    model, _ = build("llama")
    model.model.layers[0].mlp.down_proj = nn.Linear(80, 64, bias=False)
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 80, bias=False)
    _, summary = ft.fuse(model, return_summary=True)
    assert "shape" in summary.skipped["model.layers.0.mlp"]


def test_user_subclass_is_left_alone():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class MyNorm(LlamaRMSNorm):
        pass

    model, _ = build("llama")
    model.model.norm = MyNorm(64)
    _, summary = ft.fuse(model, return_summary=True)
    assert type(model.model.norm) is MyNorm and summary.swapped["LlamaRMSNorm"] == 4


def test_fuse_twice_changes_nothing_and_keeps_the_class_name():
    model, fused = build("llama")
    _, again = ft.fuse(fused, return_summary=True)
    assert again.swapped == {} and type(fused).__name__ == "LlamaForCausalLM"
    assert type(fused).fused_twin_of is type(model)


def test_gradient_checkpointing_replays_the_attention_dropout():
    _, fused = build("llama", attention_dropout=0.3)
    fused.train()
    ids = batch(length=9)
    grads, attention_calls = [], []
    for checkpointing in (False, True):
        if checkpointing:
            fused.activation_checkpointing_enable()  # gradient_checkpointing_enable's new name
        torch.manual_seed(11)
        with ft.explain() as calls:
            loss = fused(ids, labels=ids).loss
            grads.append(torch.autograd.grad(loss, list(fused.parameters())))
        attention_calls.append(sum(c.op == "attention" for c in calls))
    assert attention_calls == [2, 4]  # the checkpointed layers ran their forward again in the backward
    torch.manual_seed(12)
    other = torch.autograd.grad(fused(ids, labels=ids).loss, list(fused.parameters()))
    assert any(not torch.allclose(a, b) for a, b in zip(grads[1], other))  # the dropout does change them
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_bfloat16_logits_and_loss_within_the_2x_rule(family):
    """Gemma's norm rounds ``normed * (1 + weight)`` once, from float32, as Gemma's own; Llama's rounds once where
    transformers rounds twice (``weight * normed.to(bf16)``): both within 2x of transformers' bfloat16 error."""
    model, _ = build(family)
    model64 = float64_copy(model).eval()
    model16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    fused16 = ft.fuse(copy.deepcopy(model16))
    ids = batch()
    with torch.no_grad():
        want64, want16, got = (m(ids).logits for m in (model64, model16, fused16))
    assert got.dtype == torch.bfloat16
    assert_close_to_reference(got, want64, want16, "bfloat16 logits")


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_bfloat16_loss_alone_within_the_2x_rule(softcap):
    """The loss of the same bfloat16 hidden states (a whole model's loss is one number whose bfloat16 error, about
    1e-4, comes from every layer: too noisy to hold to the rule), against transformers' ``ForCausalLMLoss`` of the
    head's bfloat16 logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    hidden64 = torch.randn(3, 33, 64, dtype=torch.float64)
    weight64 = torch.randn(VOCAB, 64, dtype=torch.float64) * 0.3
    labels = torch.randint(0, VOCAB, (3, 33))
    labels[1, 5:9] = -100

    def transformers_loss(hidden, weight):
        logits = hidden @ weight.T
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return ForCausalLMLoss(logits, labels, VOCAB)

    got = hf_models.causal_lm_loss(hidden64.bfloat16(), weight64.bfloat16(), labels, softcap=softcap)
    want16 = transformers_loss(hidden64.bfloat16(), weight64.bfloat16())
    assert_close_to_reference(got, transformers_loss(hidden64, weight64), want16, "bfloat16 loss")


def test_a_pickled_fused_model_loads_fused():
    model, fused = build("llama")
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False).eval()
    assert type(loaded) is type(fused) and type(loaded.model.norm) is type(fused.model.norm)
    ids = batch()
    with ft.explain() as calls, torch.no_grad():
        got = loaded(ids).logits
    assert sum(c.op == "apply_rotary_pos_emb" for c in calls) == 2
    with torch.no_grad():
        torch.testing.assert_close(got, fused.eval()(ids).logits, rtol=0, atol=0)


def test_the_fused_forward_has_the_class_signature():
    """generate() passes logits_to_keep and the attention mask, and the Trainer keeps dataset columns, by reading it."""
    import inspect

    model, fused = build("gemma2")
    assert inspect.signature(fused.forward) == inspect.signature(model.forward)
    assert fused._supports_logits_to_keep()
    ids = batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    fused.eval(), model.eval()
    want = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(fused.generate(ids, attention_mask=mask, **options), want)
