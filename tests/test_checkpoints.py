"""Checkpoints: written atomically (a SIGKILL mid-write leaves the previous one loadable), saved every N steps
and on Ctrl-C, and resumed bitwise; the demo's --checkpoint / --save-every / --resume end to end."""
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fused_transformer as ft
from fused_transformer.models import Seq2SeqTransformer
from fused_transformer.models.checkpoint import CheckpointMismatch, atomic_write, read_checkpoint
from fused_transformer.models.synthetic import SequenceTask, TrainConfig, train
from fused_transformer.interrupts import Interrupted
from fused_transformer.tools import demo


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small models run fastest, and most predictably on a shared machine, on one thread (the demo's --quick
    sets one thread too: this puts the previous count back)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ------------------------------------------------------------------------------------------ atomic writes


def temp_files(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


def test_atomic_write_replaces_the_file_or_leaves_it_as_it_was(tmp_path):
    path = tmp_path / "data.bin"
    atomic_write(str(path), lambda f: f.write(b"first"))
    assert path.read_bytes() == b"first"
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # as open() would make it, not mkstemp's 0o600
    path.chmod(0o640)

    def fails(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(path), fails)
    assert path.read_bytes() == b"first" and temp_files(tmp_path) == []
    atomic_write(str(path), lambda f: f.write(b"second"))
    assert path.read_bytes() == b"second" and path.stat().st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["data.bin"]


def _umask():
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def test_atomic_write_under_a_regular_file_names_the_path(tmp_path):
    (tmp_path / "file").write_text("")
    path = str(tmp_path / "file" / "ckpt.pt")
    with pytest.raises(NotADirectoryError, match=re.escape(path)):
        atomic_write(path, lambda f: f.write(b""))


WRITER = textwrap.dedent("""
    import itertools, sys, torch
    from fused_transformer.models import Seq2SeqTransformer
    from fused_transformer.models.checkpoint import save_checkpoint

    path, first = sys.argv[1], int(sys.argv[2])
    model = Seq2SeqTransformer(16, 16, hid_dim=256, n_layers=3, n_heads=4, ff_dim=1024, max_len=16)  # 22 MB
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for i in itertools.count(first):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(i)
        save_checkpoint(path, model, optimizer, scheduler, i, torch.Generator())
        print(i, flush=True)
""")


def _wait_for_a_write_in_flight(folder, pid, timeout=30.0):
    """Return once process ``pid`` has started filling a temporary checkpoint file in ``folder``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in temp_files(folder):
            if f".{pid}." in name:
                with contextlib.suppress(FileNotFoundError):  # renamed meanwhile: wait for the next one
                    if os.path.getsize(os.path.join(folder, name)) > 0:
                        return
        time.sleep(0.001)
    pytest.fail(f"process {pid} never started a checkpoint write in {timeout} s")


def test_a_checkpoint_killed_mid_write_leaves_the_previous_one(tmp_path):
    """SIGKILL a process saving checkpoints onto one path, alternately at a random moment and while a write is
    in flight: the path must always hold one complete checkpoint, and only the killed process's hidden
    temporary file may be left next to it."""
    path = str(tmp_path / "ckpt.pt")
    rng = random.Random(0)
    first, kills_mid_write = 0, 0
    for attempt in range(6):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, path, str(first)], stdout=subprocess.PIPE, text=True)
        try:
            reported = [int(writer.stdout.readline())]  # one complete save of this process
            if attempt % 2:
                _wait_for_a_write_in_flight(str(tmp_path), writer.pid)
            else:
                time.sleep(rng.uniform(0.0, 0.5))
        finally:
            writer.send_signal(signal.SIGKILL)
            reported += [int(line) for line in writer.communicate()[0].split()]
        saved = read_checkpoint(path)
        step = saved["step"]
        # the last save it reported, or the one in flight if its rename was done
        assert reported[0] == first and reported[-1] <= step <= reported[-1] + 1
        assert all(bool((t == step).all()) for t in saved["model"].values())
        Seq2SeqTransformer(**saved["model_config"]).load_state_dict(saved["model"], strict=True)
        left = temp_files(tmp_path)
        # Earlier processes' temporary files went at this process's first save; its own may remain.
        assert all(re.fullmatch(rf"\.ckpt\.pt\.{writer.pid}\.\w+\.tmp", name) for name in left), left
        assert len(left) <= 1 and sorted(os.listdir(tmp_path)) == sorted(left + ["ckpt.pt"])
        kills_mid_write += len(left)
        first = step + 1
    assert kills_mid_write >= 1  # the kills did land during writes
    atomic_write(path, lambda f: f.write(b"x"))
    assert os.listdir(tmp_path) == ["ckpt.pt"]


# ------------------------------------------------------------------------------- interrupted training

CONFIG = TrainConfig(steps=8, batch_size=8, warmup_steps=2)


def tiny_run(path=None, config=CONFIG, **kwargs):
    """A tiny model with dropout (so torch's generator matters) trained on the reference backend."""
    torch.manual_seed(13)
    task = SequenceTask(vocab_size=16, min_len=3, max_len=6)
    model = Seq2SeqTransformer(16, 16, hid_dim=32, n_layers=2, n_heads=4, ff_dim=64, max_len=24, dropout=0.1)
    with ft.use_backend("reference"):
        result = train(model, task, config, checkpoint_path=path, progress=None, **kwargs)
    return model, result


@pytest.fixture(scope="module")
def uninterrupted():
    return tiny_run()


def interrupt_after(k, path=None):
    """An ``on_step`` that is Ctrl-C right after step ``k`` (and checks the periodic checkpoint before it)."""
    def on_step(step, loss):
        if step == k:
            if path is not None:
                assert read_checkpoint(path)["step"] == k - k % 2  # save_every=2
            raise KeyboardInterrupt
    return on_step


def interrupt_mid_step(monkeypatch, k):
    """Ctrl-C in the forward pass of step ``k + 1``, after its batch was drawn: that step is abandoned."""
    calls = []
    loss = Seq2SeqTransformer.loss

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == k + 1:
            raise KeyboardInterrupt
        return loss(self, *args, **kwargs)

    monkeypatch.setattr(Seq2SeqTransformer, "loss", interrupted)


def interrupt_in_update(monkeypatch, k):
    """A real SIGINT between the optimizer's and the scheduler's step of step ``k``: held back to the step's end."""
    step = torch.optim.lr_scheduler.LambdaLR.step

    def interrupted(self, *args, **kwargs):
        if self.last_epoch == k - 1:
            signal.raise_signal(signal.SIGINT)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", interrupted)


class _SigintOnWrite:
    """A binary file that receives a real SIGINT (Ctrl-C) on its third write if ``now()`` says so."""

    def __init__(self, file, now):
        self.file, self.now, self.writes = file, now, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 3 and self.now():
            signal.raise_signal(signal.SIGINT)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)


def interrupt_in_save(monkeypatch, k):
    """A real SIGINT in the middle of torch.save's write of the checkpoint of step ``k`` (torch's zip writer, cut
    there, raised a RuntimeError from its cleanup instead): held back until the checkpoint is written."""
    fdopen, save = os.fdopen, torch.save
    saving, interrupted = [], []

    def now():  # once: the save that the interrupt then triggers is written undisturbed
        if saving[-1:] == [k] and not interrupted:
            interrupted.append(k)
            return True
        return False

    def save_noting_the_step(obj, f, *args, **kwargs):
        saving.append(obj["step"])
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_noting_the_step)
    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: _SigintOnWrite(fdopen(*args, **kwargs), now))


@pytest.mark.parametrize("where, stop", [("after_step", 3), ("mid_step", 3), ("in_update", 3), ("in_save", 4)])
def test_ctrl_c_saves_the_last_completed_step_and_resuming_is_bitwise(tmp_path, monkeypatch, uninterrupted, where,
                                                                       stop, ctrl_c_raises):
    path = str(tmp_path / "ckpt.pt")
    on_step = None
    with monkeypatch.context() as patch:
        if where == "after_step":
            on_step = interrupt_after(stop, path)
        elif where == "mid_step":
            interrupt_mid_step(patch, stop)
        elif where == "in_update":
            interrupt_in_update(patch, stop)
        else:
            interrupt_in_save(patch, stop)
        with pytest.raises(Interrupted, match=f"step {stop} of 8 is saved in the checkpoint {re.escape(path)}"):
            tiny_run(path, save_every=2, on_step=on_step)
    assert read_checkpoint(path)["step"] == stop
    model, result = tiny_run(path, resume=True)
    expected_model, expected = uninterrupted
    assert result.step == 8 and result.losses == expected.losses[stop:]
    for (name, a), b in zip(model.state_dict().items(), expected_model.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoints_every_n_steps_and_at_the_end(tmp_path, uninterrupted):
    path = str(tmp_path / "ckpt.pt")
    seen = []
    tiny_run(path, save_every=3, on_step=lambda step, loss: seen.append(
        read_checkpoint(path)["step"] if os.path.exists(path) else None))
    assert seen == [None, None, 3, 3, 3, 6, 6, 6] and read_checkpoint(path)["step"] == 8
    model, result = tiny_run(path, resume=True)  # a finished run resumes to no more steps
    assert result.step == 8 and result.losses == []
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), uninterrupted[0].state_dict().values()))


def test_resuming_another_run_is_refused(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    tiny_run(path, stop_after=2)
    other = TrainConfig(steps=8, batch_size=4, warmup_steps=2)
    with pytest.raises(CheckpointMismatch, match=r"run\.train\.batch_size is 4, the checkpoint has 8"):
        tiny_run(path, config=other, resume=True)
    with pytest.raises(ValueError, match="save_every=0"):
        tiny_run(path, save_every=0)
    with pytest.raises(ValueError, match="need a checkpoint_path"):
        tiny_run(None, resume=True)


# ------------------------------------------------------------------------------------------------- demo


def test_demo_resumes_an_interrupted_run_bitwise(tmp_path, monkeypatch, capsys):
    args = ["--quick", "--steps", "12", "--batch-size", "8", "--save-every", "5"]
    straight, resumed = str(tmp_path / "straight.pt"), str(tmp_path / "runs" / "resumed.pt")
    assert demo.main(args + ["--checkpoint", straight]) == 0
    with monkeypatch.context() as patch:
        train_ = demo.train
        patch.setattr(demo, "train", lambda *a, **kw: train_(*a, on_step=interrupt_after(7), **kw))
        with pytest.raises(Interrupted, match="step 7 of 12 .*; the same command with --resume continues it"):
            demo.main(args + ["--checkpoint", resumed])
    assert read_checkpoint(resumed)["step"] == 7
    assert demo.main(args + ["--checkpoint", resumed, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resuming from {resumed} at step 7" in out and "trained 12 steps (7 before resuming)" in out
    expected, got = read_checkpoint(straight), read_checkpoint(resumed)
    assert expected["step"] == got["step"] == 12
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    # Other options than the checkpoint's: a usage error naming them, before any training.
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--quick", "--steps", "12", "--batch-size", "16", "--checkpoint", resumed, "--resume"])
    assert exit_.value.code == 2 and "run.train.batch_size is 16, the checkpoint has 8" in capsys.readouterr().err
