"""A synthetic sequence task made at run time, and the training loop for ``Seq2SeqTransformer``.

The task: a source of 3..``max_len`` random tokens (padded), and as target the same tokens reversed (or
sorted), as ``BOS ... EOS`` padded. Held-out sequences are drawn once and never appear in training batches.

The loop: AdamW, linear warm-up then a cosine (or inverse-square-root) decay, label-smoothed cross-entropy that ignores
padding, gradient-norm clipping, a tqdm progress bar, and checkpoints (``checkpoint.py``) written every N
steps and on Ctrl-C, from which a run resumes bitwise where it stopped.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Set, TextIO, Tuple

import torch
from torch import Tensor
from fused_transformer._progress import tqdm

from ..interrupts import Interrupted, interrupts_held_back
from .checkpoint import load_checkpoint, model_from_checkpoint, rng_states, save_checkpoint
from .seq2seq import Seq2SeqTransformer

__all__ = [
    "PAD", "BOS", "EOS", "SequenceTask", "TrainConfig", "TrainResult", "train", "run_config", "exact_match_accuracy",
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

    @property
    def config(self) -> Dict[str, object]:
        """What decides the training batches: the constructor arguments and the held-out set (as a digest)."""
        held_out = hashlib.sha256(repr(sorted(self.held_out)).encode()).hexdigest()[:16]
        return dict(vocab_size=self.vocab_size, min_len=self.min_len, max_len=self.max_len, kind=self.kind,
                    held_out=len(self.held_out), held_out_digest=held_out)

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

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("batch_size", 1), ("warmup_steps", 0), ("seed", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
                raise ValueError(f"{name}={value!r} must be an int" + ("" if low is None else f" >= {low}"))
        for name, expected, ok in (("lr", "> 0", lambda v: v > 0), ("clip_norm", "> 0", lambda v: v > 0),
                                   ("weight_decay", ">= 0", lambda v: v >= 0),
                                   ("label_smoothing", "in [0, 1)", lambda v: 0 <= v < 1)):
            value = getattr(self, name)
            real = not isinstance(value, bool) and isinstance(value, numbers.Real)
            if not (real and math.isfinite(value) and ok(value)):
                raise ValueError(f"{name}={value!r} must be a finite number {expected}")
            setattr(self, name, float(value))  # a numpy scalar would make the checkpoint unloadable (weights_only)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")


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


def run_config(config: TrainConfig, task: SequenceTask) -> Dict[str, Dict[str, object]]:
    """What a checkpoint records of the run that wrote it, and a run resuming from it must match."""
    return {"train": asdict(config), "task": task.config}


def train(
    model: Seq2SeqTransformer,
    task: SequenceTask,
    config: TrainConfig,
    checkpoint_path: Optional[str] = None,
    resume: bool = False,
    time_limit: Optional[float] = None,
    stop_after: Optional[int] = None,
    progress: Optional[TextIO] = sys.stderr,
    save_every: Optional[int] = None,
    on_step: Optional[Callable[[int, float], None]] = None,
) -> TrainResult:
    """Train ``model`` on ``task`` up to ``config.steps`` total steps.

    ``time_limit`` (seconds) or ``stop_after`` (steps) end this call early, leaving the learning-rate
    schedule as planned for ``config.steps``. A fresh run seeds torch's generator (dropout) with ``config.seed``.

    Checkpoints (``checkpoint_path``): written every ``save_every`` steps, when the call ends, and on
    ``KeyboardInterrupt`` (Ctrl-C), which then becomes ``Interrupted`` (a KeyboardInterrupt saying where the
    checkpoint is). That one holds the last completed step: Ctrl-C during a step's update is held back until
    the update is done, and one during the forward or backward pass abandons that step. With ``resume=True``
    and an existing checkpoint, everything restarts from it (after checking it was saved by the same model,
    ``config`` and task: ``CheckpointMismatch`` otherwise), so the run continues bitwise as if it had not
    stopped; without a file there, training starts afresh.

    ``progress``: a tqdm bar on this stream when it is a terminal; None: none.
    ``on_step(step, loss)`` is called after each completed step (and its checkpoint, if due).
    """
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1):
        raise ValueError(f"save_every={save_every!r} must be a positive int (steps between checkpoints) or None")
    if checkpoint_path is None and (resume or save_every is not None):
        raise ValueError(f"resume={resume} and save_every={save_every} need a checkpoint_path")
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config.schedule, config.warmup_steps, config.steps))
    data_generator = torch.Generator().manual_seed(config.seed)
    run = run_config(config, task)
    step, saved_step = 0, None  # saved_step: the step of the checkpoint file as it is
    if resume and os.path.exists(checkpoint_path):
        step = saved_step = load_checkpoint(checkpoint_path, model, optimizer, scheduler, data_generator, run)
    else:
        torch.manual_seed(config.seed)  # dropout draws

    def save(rng: Optional[Dict[str, Tensor]] = None) -> None:
        nonlocal saved_step
        with interrupts_held_back():  # a Ctrl-C waits for the write (interrupted, torch.save raises RuntimeError)
            save_checkpoint(checkpoint_path, model, optimizer, scheduler, step, data_generator, run, rng)
            saved_step = step

    result = TrainResult(step=step)
    model.train()
    start = time.perf_counter()
    last_step = config.steps if stop_after is None else min(config.steps, step + stop_after)
    # While a step runs: the generators as the last completed step left them (the step draws batch and dropout).
    rng_before_step = None
    bar = tqdm(total=config.steps, initial=step, file=progress, disable=not _is_terminal(progress), unit="step",
               dynamic_ncols=True)
    try:
        while step < last_step and (time_limit is None or time.perf_counter() - start < time_limit):
            rng_before_step = rng_states(data_generator, device)
            src, tgt = task.sample(config.batch_size, data_generator)
            src, tgt = src.to(device), tgt.to(device)
            loss = model.loss(src, tgt, label_smoothing=config.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
            with interrupts_held_back():
                optimizer.step()
                scheduler.step()
                step += 1
                rng_before_step = None
            result.losses.append(loss.item())
            result.tokens += int((tgt[:, 1:] != PAD).sum())
            bar.set_postfix_str(f"loss {result.losses[-1]:.3f} lr {scheduler.get_last_lr()[0]:.2e}", refresh=False)
            bar.update()
            if save_every is not None and step % save_every == 0:
                save()
            if on_step is not None:
                on_step(step, result.losses[-1])
    except KeyboardInterrupt:
        bar.close()
        if checkpoint_path is None:
            raise
        save(rng_before_step)
        raise Interrupted(f"step {step} of {config.steps} is saved in the checkpoint {checkpoint_path}") from None
    bar.close()
    result.step, result.seconds = step, time.perf_counter() - start
    if checkpoint_path is not None and saved_step != step:
        save()
    return result


def _is_terminal(stream: Optional[TextIO]) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


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
