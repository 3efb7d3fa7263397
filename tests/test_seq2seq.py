"""The Seq2Seq Transformer on the fused modules: parity with its torch.nn twin, cached decoding, beam search,
checkpoints, the synthetic task, a short training run that must learn it, and the demo end to end."""
import math

import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer.models import (
    Seq2SeqTransformer,
    make_src_mask,
    make_tgt_mask,
    src_mask_to_key_padding,
    tgt_mask_to_torch,
)
from fused_transformer.tools import demo
from fused_transformer.models.synthetic import (
    BOS,
    EOS,
    PAD,
    SequenceTask,
    TrainConfig,
    exact_match_accuracy,
    lr_factor,
    model_from_checkpoint,
    train,
)

VOCAB = 16
SMALL = dict(hid_dim=32, n_layers=2, n_heads=4, ff_dim=64, max_len=24)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small models run fastest, and most predictably on a shared machine, on one thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def small_model(norm_first=False, fused=True, dropout=0.0, seed=0, **overrides):
    torch.manual_seed(seed)
    return Seq2SeqTransformer(VOCAB, VOCAB, dropout=dropout, norm_first=norm_first, fused=fused, **{**SMALL, **overrides})


def padded_batch(seed=0):
    """Sources and teacher-forcing targets with padding of different lengths per row."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, VOCAB, (4, 9), generator=g)
    tgt = torch.randint(3, VOCAB, (4, 7), generator=g)
    tgt[:, 0] = BOS
    src[1, 6:], src[3, 2:] = PAD, PAD
    tgt[2, 4] = EOS
    tgt[2, 5:] = PAD
    return src, tgt


# ------------------------------------------------------------------------------- parity with torch.nn


@pytest.mark.parametrize("norm_first", [False, True])
def test_state_dict_keys_match_the_torch_nn_build(norm_first):
    fused, plain = small_model(norm_first), small_model(norm_first, fused=False)
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert isinstance(fused.decoder.layers[0], ft.TransformerDecoderLayer)
    assert not isinstance(plain.decoder.layers[0], ft.TransformerDecoderLayer)
    # Same seed, same draws: the builds are initialised identically.
    for (name, a), b in zip(fused.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_eval_logits_match_torch_nn_twin(norm_first, backend):
    model = small_model(norm_first).eval()
    twin = Seq2SeqTransformer.torch_nn_twin(model).eval()
    src, tgt = padded_batch()
    with ft.use_backend(backend), torch.no_grad():
        logits = model(src, tgt)
    with torch.no_grad():
        expected = twin(src, tgt)
    real = tgt != PAD  # padded query rows are never read
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_training_loss_and_gradients_match_torch_nn_twin(norm_first):
    model = small_model(norm_first).train()
    twin = Seq2SeqTransformer.torch_nn_twin(model).train()
    src, tgt = padded_batch(1)
    with ft.use_backend("reference"):
        loss = model.loss(src, tgt, label_smoothing=0.1)
        loss.backward()
    expected = twin.loss(src, tgt, label_smoothing=0.1)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_loss_ignores_padding_and_matches_cross_entropy_by_hand():
    model = small_model().eval()
    src, tgt = padded_batch()
    with torch.no_grad():
        logits = model(src, tgt[:, :-1])
        gold = tgt[:, 1:]
        real = gold != PAD
        by_hand = -torch.log_softmax(logits, -1).gather(-1, gold[..., None])[..., 0][real].mean()
        torch.testing.assert_close(model.loss(src, tgt), by_hand)


@pytest.mark.parametrize("fused", [True, False])
def test_last_layer_cross_attention_is_returned(fused):
    model = small_model(fused=fused).eval()
    src, tgt = padded_batch()
    with torch.no_grad():
        logits, attention = model(src, tgt, return_attention=True)
        torch.testing.assert_close(logits, model(src, tgt))
    assert attention.shape == (4, SMALL["n_heads"], tgt.shape[1], src.shape[1])
    torch.testing.assert_close(attention.sum(-1), torch.ones(attention.shape[:-1]))
    assert (attention.masked_select(make_src_mask(src, PAD).logical_not()) == 0).all()
    assert not model.decoder.layers[-1].multihead_attn._forward_hooks  # the capture hook is removed


def test_attention_matches_between_builds():
    model = small_model().eval()
    twin = Seq2SeqTransformer.torch_nn_twin(model).eval()
    src, tgt = padded_batch()
    with ft.use_backend("reference"), torch.no_grad():
        _, attention = model(src, tgt, return_attention=True)
    with torch.no_grad():
        _, expected = twin(src, tgt, return_attention=True)
    torch.testing.assert_close(attention, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ masks


def test_user_masks_convert_to_torch_nn_conventions():
    src, tgt = padded_batch()
    assert torch.equal(src_mask_to_key_padding(make_src_mask(src, PAD)), src == PAD)
    causal, padding = tgt_mask_to_torch(make_tgt_mask(tgt, PAD))
    assert torch.equal(padding, tgt == PAD)
    assert torch.equal(causal, torch.ones(7, 7, dtype=torch.bool).triu(1))
    # The tutorials' attention masks and torch.nn's say the same thing.
    user = make_tgt_mask(tgt, PAD)
    assert torch.equal(user, ~(causal[None, None] | padding[:, None, None, :]))


def test_mask_conversion_rejects_other_masks():
    src, tgt = padded_batch()
    not_causal = make_tgt_mask(tgt, PAD).clone()
    not_causal[..., 0, 1] = True
    with pytest.raises(ValueError, match="pad & tril"):
        tgt_mask_to_torch(not_causal)
    with pytest.raises(ValueError, match=r"\[B, 1, T, T\]"):
        tgt_mask_to_torch(make_src_mask(src, PAD))
    with pytest.raises(ValueError, match=r"\[B, 1, 1, S\]"):
        src_mask_to_key_padding(src != PAD)


# ------------------------------------------------------------------------------------ cached decoding


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_decode_step_equals_the_full_decoder(norm_first, fused):
    model = small_model(norm_first, fused=fused, seed=3).eval()
    src, tgt = padded_batch()
    tgt = tgt[:, :5].clone()
    tgt[tgt == PAD] = 5  # decode_step sees no target padding
    tgt[tgt == EOS] = 5
    with ft.use_backend("reference"), torch.no_grad():
        memory, src_padding = model.encode(src)
        expected = model.decode(tgt, memory, src_padding)
        cache = model.start_cache(memory, src_padding)
        # one token, then three at once (the bottom-right causal mask), then one more
        steps = [model.decode_step(tgt[:, :1], cache), model.decode_step(tgt[:, 1:4], cache),
                 model.decode_step(tgt[:, 4:5], cache)]
    assert cache.length == 5 and cache.keys_values(0)[0].shape == (4, SMALL["n_heads"], 5, 8)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_cached_decoding_runs_attention_with_kvcache(monkeypatch):
    """Without autograd the fused model's self-attention steps go through ``attention_with_kvcache`` (the split-KV
    kernels on a GPU), one call per layer and step; with autograd they keep the differentiable path."""
    model = small_model(False, seed=3).eval()
    src, _ = padded_batch()
    calls = []
    name = "cpu" if ft.backend.cpu_unavailable_reason() is None else "reference"  # a GPU install may lack the C++
    ops = ft.backend.ops(name)
    original = ops.attention_with_kvcache

    def spy(*args):
        calls.append(args[0].shape)
        return original(*args)

    spy.appends_new_keys = getattr(original, "appends_new_keys", False)
    monkeypatch.setattr(ops, "attention_with_kvcache", spy)
    steps = []
    decode_step = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda *args: steps.append(1) or decode_step(*args))
    with ft.use_backend(name), torch.no_grad():
        tokens = model.greedy_decode(src, max_len=6)
    assert steps and len(calls) == len(steps) * SMALL["n_layers"] and all(shape[1] == 1 for shape in calls)
    calls.clear()
    with ft.use_backend(name), torch.enable_grad():
        cache = model.start_cache(*model.encode(src))
        model.decode_step(tokens[:, :1], cache).sum().backward()
    assert calls == []


def test_decoding_cache_refuses_positions_past_its_capacity():
    model = small_model(False, seed=3).eval()
    src, _ = padded_batch()
    with torch.no_grad():
        cache = model.start_cache(*model.encode(src), capacity=2)
        model.decode_step(torch.full((src.shape[0], 2), 5), cache)
        with pytest.raises(ValueError, match="holds 2 positions"):
            model.decode_step(torch.full((src.shape[0], 1), 5), cache)
    with pytest.raises(ValueError, match="capacity"):
        model.start_cache(*model.encode(src), capacity=model.max_len + 1)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_greedy_decoding_gives_the_tokens_of_full_re_decoding(norm_first, fused):
    model = small_model(norm_first, fused=fused, seed=4)
    src = torch.randint(3, VOCAB, (8, 7), generator=torch.Generator().manual_seed(5))
    src[2, 4:] = PAD
    with ft.use_backend("reference"):
        cached = model.greedy_decode(src, max_len=15, use_cache=True)
        full = model.greedy_decode(src, max_len=15, use_cache=False)
    assert cached.shape[0] == 8 and 1 <= cached.shape[1] <= 15
    assert torch.equal(cached, full)
    assert model.training  # greedy_decode restores the training flag


def test_greedy_decoding_on_the_default_backend_matches_reference():
    model = small_model(seed=4)
    src = torch.randint(3, VOCAB, (8, 7), generator=torch.Generator().manual_seed(5))
    with ft.use_backend("reference"):
        expected = model.greedy_decode(src, max_len=15)
    assert torch.equal(model.greedy_decode(src, max_len=15), expected)


# ------------------------------------------------------------------------- training and search on a task


@pytest.fixture(scope="module")
def trained():
    """A tiny model trained to reverse 3..8 tokens (about 15 s on one core); shared by the tests below."""
    task = SequenceTask(vocab_size=12, min_len=3, max_len=8, kind="reverse")
    held_src, held_tgt = task.make_held_out(200, seed=1)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(12, 12, hid_dim=64, n_layers=2, n_heads=4, ff_dim=128, dropout=0.0, max_len=16)
    config = TrainConfig(steps=400, batch_size=64, lr=3e-3, warmup_steps=50, label_smoothing=0.0, seed=0)
    result = train(model, task, config, progress=None)
    return model, task, held_src, held_tgt, result


def test_short_training_run_learns_to_reverse(trained):
    model, _, held_src, held_tgt, result = trained
    assert result.step == 400 and len(result.losses) == 400
    assert sum(result.losses[-20:]) / 20 < 0.1 * sum(result.losses[:20]) / 20
    assert exact_match_accuracy(model, held_src, held_tgt) >= 0.9


def test_cached_and_full_decoding_agree_on_the_trained_model(trained):
    model, _, held_src, held_tgt, _ = trained
    with ft.use_backend("reference"):
        cached = model.greedy_decode(held_src, max_len=held_tgt.shape[1] - 1)
        full = model.greedy_decode(held_src, max_len=held_tgt.shape[1] - 1, use_cache=False)
    assert torch.equal(cached, full)


def assert_ends_at_eos(tokens):
    """Every row: real tokens, exactly one EOS, then only padding."""
    for row in tokens.tolist():
        assert EOS in row, row
        end = row.index(EOS)
        assert PAD not in row[:end] and BOS not in row[:end], row
        assert all(t == PAD for t in row[end + 1:]), row


def test_beam_search_of_width_one_is_greedy(trained):
    model, _, held_src, held_tgt, _ = trained
    greedy = model.greedy_decode(held_src, max_len=held_tgt.shape[1] - 1)
    beam, _ = model.beam_search(held_src, beam_size=1, max_len=held_tgt.shape[1] - 1)
    assert torch.equal(beam, greedy)
    untrained = small_model(seed=7)
    src = torch.randint(3, VOCAB, (6, 5), generator=torch.Generator().manual_seed(8))
    assert torch.equal(untrained.beam_search(src, beam_size=1, max_len=10)[0], untrained.greedy_decode(src, max_len=10))


def test_beam_search_stops_each_sequence_at_its_eos(trained):
    model, _, held_src, held_tgt, _ = trained
    tokens, scores = model.beam_search(held_src, beam_size=4, max_len=held_tgt.shape[1] - 1)
    assert_ends_at_eos(tokens)
    lengths = (tokens != PAD).sum(1)
    assert lengths.min() < lengths.max()  # sources of different lengths end at different steps
    assert (scores <= 0).all()
    correct = (F.pad(tokens, (0, held_tgt.shape[1] - 1 - tokens.shape[1])) == held_tgt[:, 1:]).all(1)
    assert correct.float().mean() >= 0.9


@pytest.mark.parametrize("length_penalty", [0.0, 0.6, 1.0])
def test_beam_scores_are_length_normalised_log_probabilities(length_penalty):
    model = small_model(seed=9)
    with torch.no_grad():
        model.output_projection.bias[EOS] += 2.0  # so that some beams end early
    src = torch.randint(3, VOCAB, (5, 6), generator=torch.Generator().manual_seed(10))
    tokens, scores = model.beam_search(src, beam_size=3, max_len=8, length_penalty=length_penalty)
    model.eval()
    with torch.no_grad():
        prefix = torch.cat([torch.full((5, 1), BOS), tokens[:, :-1]], dim=1)
        logits = model(src, prefix).float()
    logits[..., [PAD, BOS]] = float("-inf")
    token_log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    generated = (tokens != PAD) & (torch.cumsum(tokens == EOS, 1) - (tokens == EOS).long() == 0)
    lengths = generated.sum(1)
    expected = (token_log_probs * generated).sum(1) / ((5 + lengths) / 6) ** length_penalty
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)


def test_decoding_an_empty_batch_gives_empty_results():
    model = small_model()
    src = torch.zeros(0, 5, dtype=torch.long)
    tokens, scores = model.beam_search(src, beam_size=3, max_len=6)
    assert tokens.shape == (0, 0) and tokens.dtype == torch.long
    assert scores.shape == (0,) and scores.dtype == torch.float32
    greedy = model.greedy_decode(src, max_len=6)
    assert greedy.shape == (0, 0) and greedy.dtype == torch.long


# -------------------------------------------------------------------------------------- synthetic task


def test_task_targets_are_reversed_and_held_out_sequences_never_sampled():
    task = SequenceTask(vocab_size=6, min_len=2, max_len=3)
    held_src, held_tgt = task.make_held_out(15, seed=0)
    assert len({tuple(r) for r in held_src.tolist()}) == 15
    src, tgt = task.sample(500, torch.Generator().manual_seed(0))
    for s, t in zip(src.tolist(), tgt.tolist()):
        seq = [x for x in s if x != PAD]
        assert tuple(seq) not in task.held_out and 2 <= len(seq) <= 3
        assert t[:len(seq) + 2] == [BOS, *seq[::-1], EOS] and all(x == PAD for x in t[len(seq) + 2:])
    sort_src, sort_tgt = SequenceTask(kind="sort").sample(8, torch.Generator().manual_seed(1))
    for s, t in zip(sort_src.tolist(), sort_tgt.tolist()):
        seq = [x for x in s if x != PAD]
        assert t[1:len(seq) + 1] == sorted(seq)


# ---------------------------------------------------------------------------------------- checkpoints


def tiny_task_and_model(dropout=0.1):
    task = SequenceTask(vocab_size=VOCAB, min_len=3, max_len=6)
    return task, small_model(dropout=dropout, seed=13)


def test_checkpoint_loads_strictly_into_the_torch_nn_build(tmp_path):
    task, model = tiny_task_and_model()
    path = str(tmp_path / "ckpt.pt")
    train(model, task, TrainConfig(steps=3, batch_size=8), checkpoint_path=path, progress=None)
    plain = model_from_checkpoint(path, fused=False).eval()
    assert not isinstance(plain.encoder, ft.TransformerEncoder)
    fused = model_from_checkpoint(path, fused=True).eval()
    src, tgt = padded_batch()
    with ft.use_backend("reference"), torch.no_grad():
        expected = model.eval()(src, tgt)
        torch.testing.assert_close(fused(src, tgt), expected, rtol=0, atol=0)
    with torch.no_grad():
        real = tgt != PAD
        torch.testing.assert_close(plain(src, tgt)[real], expected[real], rtol=1e-5, atol=1e-5)


def test_resume_continues_exactly_where_training_stopped(tmp_path):
    config = TrainConfig(steps=6, batch_size=8, warmup_steps=2)
    path = str(tmp_path / "ckpt.pt")
    with ft.use_backend("reference"):
        task, straight = tiny_task_and_model()
        straight_result = train(straight, task, config, progress=None)
        task, interrupted = tiny_task_and_model()
        first = train(interrupted, task, config, checkpoint_path=path, stop_after=3, progress=None)
        task, resumed = tiny_task_and_model()
        second = train(resumed, task, config, checkpoint_path=path, resume=True, progress=None)
    assert first.step == 3 and second.step == 6 and len(second.losses) == 3
    assert first.losses + second.losses == straight_result.losses
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_training_schedule_warms_up_then_decays():
    factor = lr_factor("cosine", 4, 10)
    assert [round(factor(s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(9) == pytest.approx(0.0, abs=1e-9) and 0 < factor(6) < 1
    inverse = lr_factor("inverse_sqrt", 4, 10)
    assert inverse(15) == pytest.approx(math.sqrt(4 / 16))
    with pytest.raises(ValueError, match="schedule"):
        lr_factor("linear", 4, 10)


# ---------------------------------------------------------------------------------------- bad input


def test_bad_input_gives_clear_errors():
    model = small_model()
    src, tgt = padded_batch()
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        model(src[0], tgt)
    with pytest.raises(TypeError, match="integer token ids"):
        model(src.float(), tgt)
    with pytest.raises(ValueError, match="outside"):
        model(src, tgt + VOCAB)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.ones(1, SMALL["max_len"] + 1, dtype=torch.long), tgt[:1])
    with pytest.raises(ValueError, match="batch sizes"):
        model(src, tgt[:2])
    with pytest.raises(ValueError, match="beam_size"):
        model.beam_search(src, beam_size=0)
    for penalty in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=f"length_penalty={penalty} must be finite"):
            model.beam_search(src, length_penalty=penalty)
    with pytest.raises(TypeError, match="length_penalty=True must be a real number"):
        model.beam_search(src, length_penalty=True)
    with pytest.raises(ValueError, match="max_len=0"):
        model.beam_search(src, max_len=0)
    with pytest.raises(ValueError, match="max_len"):
        model.greedy_decode(src, max_len=SMALL["max_len"])
    with pytest.raises(ValueError, match="divisible"):
        Seq2SeqTransformer(10, 10, hid_dim=30, n_heads=4)
    with pytest.raises(ValueError, match="activation"):
        Seq2SeqTransformer(10, 10, hid_dim=32, n_heads=4, activation="tanh")
    with pytest.raises(ValueError, match="kind"):
        SequenceTask(kind="shuffle")
    for field, value, expected in [("batch_size", 0, "an int >= 1"), ("steps", 2.5, "an int >= 1"),
                                   ("lr", float("nan"), "a finite number > 0"),
                                   ("label_smoothing", 1.0, r"a finite number in \[0, 1\)"),
                                   ("schedule", "linear", "one of")]:
        with pytest.raises(ValueError, match=f"{field}={value!r} must be {expected}"):
            TrainConfig(**{field: value})


# ------------------------------------------------------------------------------------------------- demo


def test_demo_runs_end_to_end(capsys):
    assert demo.main(["--quick", "--steps", "20", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "trained 20 steps" in out
    assert "held-out exact match, greedy decoding:" in out
    for line in ("training fwd+bwd, target tokens/s", "greedy decoding with KV cache", "without cache"):
        assert line in out
    assert "identical tokens" in out


def test_demo_plans_its_steps_from_a_time_budget(capsys):
    assert demo.main(["--quick", "--minutes", "0.05", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    planned = int(out.split("training ")[1].split(" steps")[0])
    trained = int(out.split("trained ")[1].split(" steps")[0])
    assert planned >= 20 and 1 <= trained <= planned


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["--batch-size", "0"], "argument --batch-size: expected a positive integer, got '0'"),
    (["--batch-size", "-3"], "argument --batch-size: expected a positive integer, got '-3'"),
    (["--threads", "0"], "argument --threads: expected a positive integer, got '0'"),
    (["--minutes", "0"], "argument --minutes: expected a positive number, got '0'"),
    (["--minutes", "nan"], "argument --minutes: expected a positive number, got 'nan'"),
    (["--minutes", "1", "--steps", "5"], "--minutes excludes --steps"),
    (["--save-every", "0"], "argument --save-every: expected a positive integer, got '0'"),
    (["--save-every", "5"], "--save-every and --resume need --checkpoint PATH"),
    (["--resume"], "--save-every and --resume need --checkpoint PATH"),
    (["--device", "gpu"], "argument --device: device 'gpu' is not a torch device"),
])
def test_demo_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_demo_rejects_checkpoint_paths_it_cannot_use(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    missing, under_file = str(tmp_path / "none.pt"), str(tmp_path / "file" / "ckpt.pt")
    for argv, message in [
        (["--checkpoint", missing, "--resume"], f"--resume: there is no checkpoint at --checkpoint {missing}"),
        (["--checkpoint", under_file], f"--checkpoint {under_file}: {tmp_path / 'file'} is a file, not a folder"),
        (["--checkpoint", str(tmp_path)], f"--checkpoint {tmp_path}: is a folder"),
        (["--checkpoint", str(tmp_path / "file"), "--resume"], "cannot be read as a checkpoint"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            demo.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_cli_forwards_demo(monkeypatch):
    from fused_transformer import __main__ as cli

    seen = []
    monkeypatch.setattr(demo, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["demo", "--quick", "--steps", "3"]) == 0
    assert seen == [["--quick", "--steps", "3"]]
