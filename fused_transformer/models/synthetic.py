"""A synthetic sequence task made at run time, and the training loop for ``Seq2SeqTransformer``.

The task: a source of 3..``max_len`` random tokens (padded), and as target the same tokens reversed (or
sorted), as ``BOS ... EOS`` padded. Held-out sequences are drawn once and never appear in training batches.

The loop: AdamW, linear warm-up then inverse-square-root decay, label-smoothed cross-entropy that ignores
padding, gradient-norm clipping, a progress line, and checkpoints that resume exactly where they stopped
(model, optimizer, scheduler, step and both random generators).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Set, TextIO, Tuple

import torch
from torch import Tensor

from .seq2seq import Seq2SeqTransformer

__all__ = [
    "PAD", "BOS", "EOS", "SequenceTask", "TrainConfig", "TrainResult", "train", "exact_match_accuracy",
    "save_checkpoint", "load_checkpoint", "model_from_checkpoint",
]

PAD, BOS, EOS = 0, 1, 2
TASKS = ("reverse", "sort")


class SequenceTask:
    """Reverse (or sort) random token sequences of length ``min_len..max_len``.

    Tokens ``0, 1, 2`` are PAD, BOS, EOS; content tokens are ``3..vocab_size-1``. Sources are ``[B, S]``
    padded to the longest in the batch; targets ``[B, S + 2]`` are ``BOS out EOS`` padded.
    """

    def __init__(self, vocab_size: int = 12, min_len: int = 3, max_len: int = 8, kind: str = "reverse") -> None:
        if kind not in TASKS:
            raise ValueError(f"kind={kind!r} must be one of {TASKS}")
        if vocab_size < 4:
            raise ValueError(f"vocab_size={vocab_size} must be at least 4 (3 special tokens and one content token)")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        self.vocab_size, self.min_len, self.max_len, self.kind = vocab_size, min_len, max_len, kind
        self.held_out: Set[Tuple[int, ...]] = set()

    def __repr__(self) -> str:
        return (f"SequenceTask({self.kind}, {self.min_len}..{self.max_len} tokens of {self.vocab_size - 3} "
                f"kinds, vocab {self.vocab_size})")

    def _draw(self, n: int, generator: torch.Generator) -> List[List[int]]:
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=generator).tolist()
        tokens = torch.randint(3, self.vocab_size, (n, self.max_len), generator=generator).tolist()
        return [row[:length] for row, length in zip(tokens, lengths)]

    def _batch(self, sequences: List[List[int]]) -> Tuple[Tensor, Tensor]:
        width = max(len(s) for s in sequences)
        src = torch.full((len(sequences), width), PAD, dtype=torch.long)
        tgt = torch.full((len(sequences), width + 2), PAD, dtype=torch.long)
        for i, seq in enumerate(sequences):
            out = seq[::-1] if self.kind == "reverse" else sorted(seq)
            src[i, :len(seq)] = torch.tensor(seq)
            tgt[i, :len(seq) + 2] = torch.tensor([BOS, *out, EOS])
        return src, tgt

    def sample(self, n: int, generator: torch.Generator) -> Tuple[Tensor, Tensor]:
        """A training batch ``(src, tgt)`` of ``n`` sequences, none of them held out."""
        sequences: List[List[int]] = []
        while len(sequences) < n:
            sequences += [s for s in self._draw(n - len(sequences), generator) if tuple(s) not in self.held_out]
        return self._batch(sequences)

    def make_held_out(self, n: int, seed: int = 1234) -> Tuple[Tensor, Tensor]:
        """``n`` distinct sequences ``(src, tgt)`` that ``sample`` will never return from now on."""
        if n > self.distinct_sequences() // 2:
            raise ValueError(f"cannot hold out {n} of only {self.distinct_sequences()} distinct sequences")
        generator = torch.Generator().manual_seed(seed)
        chosen: dict = {}
        while len(chosen) < n:
            for s in self._draw(n, generator):
                if len(chosen) < n:
                    chosen.setdefault(tuple(s), s)
        self.held_out.update(chosen)
        return self._batch(list(chosen.values()))

    def distinct_sequences(self) -> int:
        kinds = self.vocab_size - 3
        return sum(kinds ** length for length in range(self.min_len, self.max_len + 1))


# --------------------------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    """Hyper-parameters of ``train``. ``lr`` is the peak, reached linearly after ``warmup_steps``, then
    decayed along a cosine to 0 at ``steps`` (``schedule="cosine"``), or as ``lr * sqrt(warmup_steps / step)``
    (``"inverse_sqrt"``, which does not depend on ``steps``: for runs stopped by a time limit)."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    weight_decay: float = 0.01
    seed: int = 0
    schedule: str = "cosine"


@dataclass
class TrainResult:
    """Where training stopped: ``step`` (total, across resumes), ``losses`` (one per step of this call),
    ``seconds`` and ``tokens`` (target tokens trained on in this call)."""

    step: int
    losses: List[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0


SCHEDULES = ("cosine", "inverse_sqrt")


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The LR multiplier at each step: linear from ``1/warmup`` to 1 over ``warmup_steps``, then a cosine
    down to 0 at ``total_steps``, or ``sqrt(warmup / step)``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    warmup_steps = max(1, warmup_steps)

    def factor(step: int) -> float:
        step += 1
        if step < warmup_steps:
            return step / warmup_steps
        if schedule == "inverse_sqrt":
            return math.sqrt(warmup_steps / step)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class _ProgressLine:
    """One self-rewriting status line (a line per update when the stream is not a terminal)."""

    def __init__(self, stream: Optional[TextIO], total: int, every: int = 10) -> None:
        self.stream, self.total, self.every = stream, total, every
        self.tty = stream is not None and stream.isatty()

    def update(self, step: int, loss: float, lr: float, elapsed: float) -> None:
        if self.stream is None or (step % self.every and step != self.total):
            return
        done = min(1.0, step / self.total) if self.total else 1.0
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        line = f"[{bar}] step {step}/{self.total} loss {loss:.3f} lr {lr:.2e} {elapsed:.0f}s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.tty:
            self.stream.write("\n")


def train(
    model: Seq2SeqTransformer,
    task: SequenceTask,
    config: TrainConfig,
    checkpoint_path: Optional[str] = None,
    resume: bool = False,
    time_limit: Optional[float] = None,
    stop_after: Optional[int] = None,
    progress: Optional[TextIO] = sys.stderr,
    progress_every: int = 10,
) -> TrainResult:
    """Train ``model`` on ``task`` up to ``config.steps`` total steps.

    ``time_limit`` (seconds) or ``stop_after`` (steps) end this call early, leaving the learning-rate
    schedule as planned for ``config.steps``. With ``resume=True`` and an existing ``checkpoint_path``,
    everything restarts from the checkpoint, so an interrupted run continues as if it had not stopped;
    the checkpoint is written at the end. A fresh run seeds torch's generator (dropout) with ``config.seed``.
    """
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config.schedule, config.warmup_steps, config.steps))
    data_generator = torch.Generator().manual_seed(config.seed)
    step = 0
    if resume and checkpoint_path is not None and os.path.exists(checkpoint_path):
        step = load_checkpoint(checkpoint_path, model, optimizer, scheduler, data_generator)
    else:
        torch.manual_seed(config.seed)  # dropout draws
    result = TrainResult(step=step)
    bar = _ProgressLine(progress, config.steps, progress_every)
    model.train()
    start = time.perf_counter()
    last_step = config.steps if stop_after is None else min(config.steps, step + stop_after)
    while step < last_step and (time_limit is None or time.perf_counter() - start < time_limit):
        src, tgt = task.sample(config.batch_size, data_generator)
        src, tgt = src.to(device), tgt.to(device)
        loss = model.loss(src, tgt, label_smoothing=config.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        scheduler.step()
        step += 1
        result.losses.append(loss.item())
        result.tokens += int((tgt[:, 1:] != PAD).sum())
        bar.update(step, result.losses[-1], scheduler.get_last_lr()[0], time.perf_counter() - start)
    bar.close()
    result.step, result.seconds = step, time.perf_counter() - start
    if checkpoint_path is not None:
        save_checkpoint(checkpoint_path, model, optimizer, scheduler, step, data_generator)
    return result


def exact_match_accuracy(
    model: Seq2SeqTransformer, src: Tensor, tgt: Tensor, batch_size: int = 256, use_cache: bool = True,
) -> float:
    """Fraction of sources whose greedy decoding equals ``tgt[:, 1:]`` exactly (up to and including EOS)."""
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, src.shape[0], batch_size):
        source = src[start:start + batch_size].to(device)
        expected = tgt[start:start + batch_size, 1:].to(device)
        predicted = model.greedy_decode(source, max_len=expected.shape[1], use_cache=use_cache)
        predicted = torch.nn.functional.pad(predicted, (0, expected.shape[1] - predicted.shape[1]), value=model.pad_idx)
        correct += int((predicted == expected).all(dim=1).sum())
    return correct / src.shape[0]


# ------------------------------------------------------------------------------------------ checkpoints


def save_checkpoint(
    path: str, model: Seq2SeqTransformer, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, step: int, data_generator: torch.Generator,
) -> None:
    """Write everything ``train`` needs to resume, and the model's constructor arguments."""
    torch.save({
        "model": model.state_dict(), "model_config": dict(model.config), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "step": step, "data_rng": data_generator.get_state(),
        "torch_rng": torch.get_rng_state(),
    }, path)


def load_checkpoint(
    path: str, model: Seq2SeqTransformer, optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
    data_generator: Optional[torch.Generator] = None,
) -> int:
    """Load a checkpoint into ``model`` (fused or torch.nn build, strictly) and whichever of the training
    states are given; returns the step it was saved at."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if data_generator is not None:
        data_generator.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def model_from_checkpoint(path: str, fused: bool = True) -> Seq2SeqTransformer:
    """Rebuild the model saved in ``path``: on the fused modules, or with ``fused=False`` on torch.nn."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = Seq2SeqTransformer(**state["model_config"], fused=fused)
    model.load_state_dict(state["model"], strict=True)
    return model
