"""``python -m fused_transformer demo``: train the Seq2Seq Transformer on a synthetic reversal task, report
held-out exact-match accuracy, and time the fused model against its torch.nn twin (same weights).

Speeds are measured in this run, alternating the two models, so their ratio is meaningful even on a busy
machine; absolute numbers are not.

Checkpoints: only the fused model is trained (the torch.nn twin is timed on the initial weights and decodes
with the trained ones), so ``--checkpoint PATH`` is one file, the fused model's training state, written
atomically every ``--save-every`` steps, at the end and on Ctrl-C. ``--resume`` continues that run bitwise
where it stopped, with the same options (the step count comes from the checkpoint).
"""
from __future__ import annotations

import argparse
import math
import os
import pickle
import statistics
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch

import fused_transformer as ft

from ..interrupts import Interrupted
from ..models.checkpoint import CheckpointMismatch, check_same_run, read_checkpoint
from ..models.seq2seq import Seq2SeqTransformer
from ..models.synthetic import SequenceTask, TrainConfig, exact_match_accuracy, run_config, train
from . import add_device_option, make_folder

# Model size, task and schedule of the demo and of --quick. The demo's model has the study notes' default sizes;
# both learn their task within the planned steps (seed 0: 100% held-out exact match after 500 of 600 steps,
# and after 500 steps at the quick size). Dropout is off: with fresh data every step there is nothing to
# regularise, and it slows learning down.
FULL = dict(model=dict(hid_dim=256, n_layers=3, n_heads=8, ff_dim=512, dropout=0.0), vocab=12, max_len=8,
            held_out=500, steps=600, lr=1e-3)
QUICK = dict(model=dict(hid_dim=64, n_layers=2, n_heads=4, ff_dim=128, dropout=0.0), vocab=12, max_len=8,
             held_out=300, steps=500, lr=3e-3)
SAVE_EVERY = 100  # steps between checkpoints unless --save-every says otherwise


def _alternated_median(fns: List[Callable[[], object]], rounds: int, repeats: int) -> List[float]:
    """Median seconds per call of each fn, timing them in turn ``rounds`` times (``repeats`` calls each)."""
    times: List[List[float]] = [[] for _ in fns]
    for fn in fns:  # warm-up
        fn()
    for _ in range(rounds):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            bucket.append((time.perf_counter() - start) / repeats)
    return [statistics.median(bucket) for bucket in times]


def training_speed(models: List[Seq2SeqTransformer], src: torch.Tensor, tgt: torch.Tensor,
                   rounds: int = 5, repeats: int = 3) -> List[float]:
    """Target tokens per second of a training forward + backward, for each model, on one batch."""
    def step(model: Seq2SeqTransformer) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            model.loss(src, tgt, label_smoothing=0.1).backward()
        return run

    for model in models:
        model.train()
    tokens = int((tgt[:, 1:] != models[0].pad_idx).sum())
    return [tokens / t for t in _alternated_median([step(m) for m in models], rounds, repeats)]


def decoding_speed(runs: List[Callable[[], torch.Tensor]], rounds: int = 3) -> Tuple[List[float], List[torch.Tensor]]:
    """Generated tokens (up to and including EOS) per second of each greedy-decoding call, and its output."""
    outputs = [run() for run in runs]
    seconds = _alternated_median(runs, rounds, 1)
    return [int((out != 0).sum()) / t for out, t in zip(outputs, seconds)], outputs


def _positive(convert: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An argparse ``type``: ``convert(text)``, which must be finite and above 0."""
    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {text!r}")
        return value

    return parse


def _saved_run(parser: argparse.ArgumentParser, path: str) -> dict:
    """The checkpoint to resume from, or ``parser.error`` naming ``path``."""
    if not os.path.isfile(path):
        parser.error(f"--resume: there is no checkpoint at --checkpoint {path}")
    try:
        return read_checkpoint(path)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        parser.error(f"--resume: --checkpoint {path} cannot be read as a checkpoint ({exc})")


def _train_config(steps: int, batch_size: int, lr: float, seed: int) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=min(100, max(1, steps // 10)), seed=seed)


def main(argv: Optional[List[str]] = None) -> int:
    positive_int = _positive(int, "integer")
    parser = argparse.ArgumentParser(prog="python -m fused_transformer demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a small model (d 64, 2 layers), {QUICK['steps']} steps on one thread: about 30 s")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"training steps (default {FULL['steps']}, or {QUICK['steps']} with --quick)")
    parser.add_argument("--minutes", type=_positive(float, "number"), default=None,
                        help="train for this long instead, the step count planned from the measured speed")
    add_device_option(parser, "trains on")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="sequences per step (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the weights, the task's data and dropout (default %(default)s)")
    parser.add_argument("--checkpoint", metavar="PATH", default=None,
                        help="save the training state here: every --save-every steps, at the end, and on Ctrl-C. It is "
                             "the fused model's (the torch.nn twin is not trained: it takes the trained weights); an "
                             "existing file is replaced unless --resume")
    parser.add_argument("--save-every", type=positive_int, metavar="N", default=None,
                        help=f"steps between checkpoints (default {SAVE_EVERY}); needs --checkpoint")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run saved in --checkpoint (same options; with --minutes, its step count)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none unless stderr is a terminal)")
    args = parser.parse_args(argv)
    if args.minutes is not None and args.steps is not None:
        parser.error("--minutes excludes --steps")
    if args.checkpoint is None and (args.save_every is not None or args.resume):
        parser.error("--save-every and --resume need --checkpoint PATH")
    device = args.device
    saved = _saved_run(parser, args.checkpoint) if args.resume else None
    if args.checkpoint is not None:
        if os.path.isdir(args.checkpoint):
            parser.error(f"--checkpoint {args.checkpoint}: is a folder; give the path of a file")
        make_folder(parser, f"--checkpoint {args.checkpoint}", os.path.dirname(os.path.abspath(args.checkpoint)))
    if args.threads is not None or args.quick:
        # A model this small runs faster on one thread than on several (less OpenMP synchronisation).
        torch.set_num_threads(args.threads or 1)
    setup = QUICK if args.quick else FULL

    task = SequenceTask(vocab_size=setup["vocab"], min_len=3, max_len=setup["max_len"], kind="reverse")
    held_src, held_tgt = task.make_held_out(setup["held_out"], seed=args.seed + 1)
    torch.manual_seed(args.seed)
    model = Seq2SeqTransformer(task.vocab_size, task.vocab_size, max_len=2 * task.max_len,
                               **setup["model"]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"task: {task}, {setup['held_out']} held-out sequences")
    print(f"model: Seq2SeqTransformer {setup['model']} ({n_params / 1e6:.2f}M parameters), device {device}, "
          f"fused backend {ft.current(device)}, {torch.get_num_threads()} threads")

    # The step count: given, kept by the checkpoint, or planned from --minutes once the speed is measured.
    saved_train = ((saved or {}).get("run_config") or {}).get("train", {})
    steps = args.steps if args.steps is not None else saved_train.get("steps")
    if steps is None and args.minutes is None:
        steps = setup["steps"]
    config = None if steps is None else _train_config(steps, args.batch_size, setup["lr"], args.seed)
    if saved is not None:
        try:
            check_same_run(saved, model.config, None if config is None else run_config(config, task), args.checkpoint)
        except CheckpointMismatch as exc:
            parser.error(f"--resume: {exc}")
        print(f"resuming from {args.checkpoint} at step {saved['step']}")

    # Training speed, measured before training (it does not depend on the weights) on copies of the model.
    twin = Seq2SeqTransformer.torch_nn_twin(model)
    timing_model = Seq2SeqTransformer(**model.config).to(device)
    timing_model.load_state_dict(model.state_dict())
    src, tgt = (t.to(device) for t in task.sample(args.batch_size, torch.Generator().manual_seed(args.seed + 2)))
    fused_tps, torch_tps = training_speed([timing_model, twin], src, tgt)
    del timing_model

    if config is None:
        tokens_per_step = int((tgt[:, 1:] != 0).sum())
        # The cosine schedule needs a step count: the time budget at the measured forward + backward speed,
        # leaving ~30% for the optimizer and data.
        steps = max(20, int(0.7 * args.minutes * 60 * fused_tps / tokens_per_step))
        config = _train_config(steps, args.batch_size, setup["lr"], args.seed)
    print(f"training {steps} steps, batch {args.batch_size}, AdamW lr {config.lr} (warm-up {config.warmup_steps}, "
          f"cosine), label smoothing {config.label_smoothing}, clip {config.clip_norm}")
    # The time budget is also a hard limit, in case the machine slows down after the speed was measured.
    time_limit = None if args.minutes is None else args.minutes * 60
    save_every = None if args.checkpoint is None else args.save_every or SAVE_EVERY
    try:
        result = train(model, task, config, checkpoint_path=args.checkpoint, resume=args.resume,
                       time_limit=time_limit, progress=None if args.no_progress else sys.stderr, save_every=save_every)
    except Interrupted as exc:
        raise Interrupted(f"{exc}; the same command with --resume continues it") from None
    earlier = result.step - len(result.losses)
    summary = f"trained {result.step} steps" + (f" ({earlier} before resuming)" if earlier else "")
    summary += f" in {result.seconds:.0f}s"
    if result.losses:
        summary += (f", loss {statistics.mean(result.losses[-20:]):.3f} (mean of the last "
                    f"{min(20, len(result.losses))} steps)")
    print(summary)

    accuracy = exact_match_accuracy(model, held_src, held_tgt)
    print(f"held-out exact match, greedy decoding: {accuracy:.1%} of {held_src.shape[0]} sequences")

    twin.load_state_dict(model.state_dict())
    source = held_src[:128].to(device)
    max_len = held_tgt.shape[1] - 1
    (cached, uncached, nn_cached), outputs = decoding_speed([
        lambda: model.greedy_decode(source, max_len=max_len, use_cache=True),
        lambda: model.greedy_decode(source, max_len=max_len, use_cache=False),
        lambda: twin.greedy_decode(source, max_len=max_len, use_cache=True),
    ])
    same = torch.equal(outputs[0], outputs[1])

    print(f"\nspeed (same weights, alternated timing, median){'':<4}{'torch.nn':>12}{'fused':>12}{'fused/nn':>10}")
    rows = (("training fwd+bwd, target tokens/s", torch_tps, fused_tps),
            ("greedy decoding with KV cache, tokens/s", nn_cached, cached))
    for label, theirs, ours in rows:
        print(f"{label:<50}{theirs:>12.0f}{ours:>12.0f}{ours / theirs:>9.2f}x")
    print(f"{'greedy decoding without cache, tokens/s':<50}{'':>12}{uncached:>12.0f}")
    print(f"KV cache speed-up for greedy decoding: {cached / uncached:.2f}x on {source.shape[0]} sequences of up to "
          f"{max_len} tokens; cached and full re-decoding give {'identical' if same else 'DIFFERENT'} tokens")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
